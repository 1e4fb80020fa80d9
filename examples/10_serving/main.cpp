// Example 10: a small serving loop on the CPU. Three prompts of different lengths arrive together: one ragged
// prefill call attends all of them at once (packed end to end, located by cumulative offsets, each causal over
// its own tokens). Their keys and values then go into a paged KV cache (pages of 16 tokens handed out from a free
// list, addressed per sequence by a block table, as vLLM does), and generation runs token by token: each step
// appends one key/value row per sequence and calls attend_paged with one query row per sequence and head.
// Every call is checked against a float64 loop; exits non-zero on a mismatch.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include <fusedattn/fusedattn.hpp>
#include <fusedattn/dispatch/serving.hpp>

namespace fa = fusedattn;

namespace {

constexpr fa::index_t heads = 8, heads_kv = 2, d = 64, group = heads / heads_kv;

/// Float64 attention of `nq` query rows (q: [token][head][d]) against the first `nk` keys of one sequence
/// (k, v: [token][kv_head][d]), causal with the queries at the end (bottom-right); returns the largest |o − ref|.
double check(const float* q, const float* o, const float* k, const float* v, fa::index_t nq, fa::index_t nk) {
  double worst = 0;
  const double scale = 1.0 / std::sqrt(double(d));
  std::vector<double> s(static_cast<std::size_t>(nk)), acc(static_cast<std::size_t>(d));
  for (fa::index_t i = 0; i < nq; ++i)
    for (fa::index_t h = 0; h < heads; ++h) {
      const fa::index_t g = h / group, last = nk - nq + i;  // query i sees keys 0..last
      double m = -INFINITY, l = 0;
      for (fa::index_t j = 0; j <= last; ++j) {
        double dot = 0;
        for (fa::index_t c = 0; c < d; ++c) dot += double(q[(i * heads + h) * d + c]) * k[(j * heads_kv + g) * d + c];
        s[static_cast<std::size_t>(j)] = scale * dot;
        m = std::max(m, s[static_cast<std::size_t>(j)]);
      }
      std::fill(acc.begin(), acc.end(), 0.0);
      for (fa::index_t j = 0; j <= last; ++j) {
        const double e = std::exp(s[static_cast<std::size_t>(j)] - m);
        l += e;
        for (fa::index_t c = 0; c < d; ++c) acc[static_cast<std::size_t>(c)] += e * v[(j * heads_kv + g) * d + c];
      }
      for (fa::index_t c = 0; c < d; ++c)
        worst = std::max(worst, std::abs(acc[static_cast<std::size_t>(c)] / l - o[(i * heads + h) * d + c]));
    }
  return worst;
}

}  // namespace

int main() {
  const std::vector<std::int32_t> prompt = {37, 120, 5};
  const auto sequences = static_cast<fa::index_t>(prompt.size());
  const fa::index_t steps = 64, page_size = 16, max_len = 256;
  const fa::index_t blocks_per_seq = max_len / page_size, pages = sequences * blocks_per_seq;
  std::mt19937 rng(10);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  auto random = [&](std::size_t n) {
    std::vector<float> x(n);
    for (float& e : x) e = u(rng);
    return x;
  };
  double worst = 0;

  // 1. Ragged prefill: Q, K, V of every prompt packed end to end, [token][head][d] (what a fused QKV projection of
  //    the concatenated prompts gives); cu_seqlens locate the prompts.
  std::vector<std::int32_t> cu{0};
  for (std::int32_t n : prompt) cu.push_back(cu.back() + n);
  const fa::index_t total = cu.back();
  const std::vector<float> q = random(std::size_t(total * heads * d)), k = random(std::size_t(total * heads_kv * d)),
                           v = random(std::size_t(total * heads_kv * d));
  std::vector<float> o(q.size());
  const fa::problem pp{/*batch*/ 1, heads, heads_kv, /*seq_q*/ total, /*seq_kv*/ total, d};
  const fa::ragged_batch rb{sequences, cu.data(), cu.data()};
  fa::status st = fa::attend_ragged(fa::policy::cpu<>{}, pp, rb, fa::bshd(q.data(), pp.q_dims()),
                                    fa::bshd(k.data(), pp.kv_dims()), fa::bshd(v.data(), pp.kv_dims()),
                                    fa::bshd(o.data(), pp.o_dims()), fa::causal{fa::align::bottom_right});
  if (!st) return std::fprintf(stderr, "prefill: %s\n", st.what()), 1;
  for (fa::index_t b = 0; b < sequences; ++b) {
    const fa::index_t t0 = cu[std::size_t(b)], n = prompt[std::size_t(b)];
    worst = std::max(worst, check(&q[t0 * heads * d], &o[t0 * heads * d], &k[t0 * heads_kv * d], &v[t0 * heads_kv * d],
                                  n, n));
  }
  std::printf("ragged prefill of %lld prompts (%d, %d, %d tokens): max |error| %.2e\n", (long long)sequences,
              prompt[0], prompt[1], prompt[2], worst);

  // 2. The paged cache, [page][token][kv_head][d], pages handed out from a free list (in scrambled order, as a
  //    long-running server's would be); a mirror of each sequence's keys in order serves the float64 check.
  const fa::page_strides ps = fa::page_strides_of(fa::page_layout::nhd, page_size, heads_kv, d);
  std::vector<float> k_pool(std::size_t(pages * ps.page)), v_pool(k_pool.size());
  std::vector<std::int32_t> free_pages(static_cast<std::size_t>(pages));
  for (fa::index_t i = 0; i < pages; ++i) free_pages[std::size_t(i)] = std::int32_t((i * 7) % pages);
  std::vector<std::int32_t> table(std::size_t(sequences * blocks_per_seq), -1), lens(std::size_t(sequences), 0);
  std::vector<std::vector<float>> k_seq(static_cast<std::size_t>(sequences)), v_seq(static_cast<std::size_t>(sequences));
  auto append = [&](fa::index_t b, const float* k_row, const float* v_row) {  // one token: heads_kv × d values
    std::int32_t& len = lens[std::size_t(b)];
    std::int32_t& page = table[std::size_t(b * blocks_per_seq + len / page_size)];
    if (len % page_size == 0) {
      page = free_pages.back();
      free_pages.pop_back();
    }
    const fa::index_t at = page * ps.page + (len % page_size) * ps.token;
    std::copy(k_row, k_row + heads_kv * d, &k_pool[std::size_t(at)]);
    std::copy(v_row, v_row + heads_kv * d, &v_pool[std::size_t(at)]);
    k_seq[std::size_t(b)].insert(k_seq[std::size_t(b)].end(), k_row, k_row + heads_kv * d);
    v_seq[std::size_t(b)].insert(v_seq[std::size_t(b)].end(), v_row, v_row + heads_kv * d);
    ++len;
  };
  for (fa::index_t b = 0; b < sequences; ++b)
    for (fa::index_t t = cu[std::size_t(b)]; t < cu[std::size_t(b) + 1]; ++t)
      append(b, &k[t * heads_kv * d], &v[t * heads_kv * d]);

  // 3. Decode: every step each sequence gets one new token; its query row attends the whole cache.
  double seconds = 0, bytes = 0, worst_decode = 0;
  std::vector<float> qd(std::size_t(sequences * heads * d)), od(qd.size());
  for (fa::index_t step = 0; step < steps; ++step) {
    for (fa::index_t b = 0; b < sequences; ++b) {
      const std::vector<float> kr = random(std::size_t(heads_kv * d)), vr = random(std::size_t(heads_kv * d));
      append(b, kr.data(), vr.data());
    }
    for (float& x : qd) x = u(rng);
    const fa::index_t longest = *std::max_element(lens.begin(), lens.end());
    const fa::problem pd{sequences, heads, heads_kv, /*seq_q*/ 1, /*seq_kv: the longest*/ longest, d};
    const auto cache = fa::paged<const float>(k_pool.data(), v_pool.data(), pages, page_size, heads_kv, d,
                                              fa::page_layout::nhd, table.data(), blocks_per_seq, lens.data());
    const auto t0 = std::chrono::steady_clock::now();
    st = fa::attend_paged(fa::policy::cpu<>{}, pd, fa::bhsd<const float>(qd.data(), pd.q_dims()), cache,
                          fa::bhsd(od.data(), pd.o_dims()), fa::causal{fa::align::bottom_right});
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!st) return std::fprintf(stderr, "decode: %s\n", st.what()), 1;
    for (fa::index_t b = 0; b < sequences; ++b) {
      const fa::index_t n = lens[std::size_t(b)];
      bytes += 2.0 * double(n * heads_kv * d) * sizeof(float);
      // bhsd with seq_q = 1 is [b][h][d], the same as [token][head][d] for one token.
      worst_decode = std::max(worst_decode, check(&qd[std::size_t(b * heads * d)], &od[std::size_t(b * heads * d)],
                                                  k_seq[std::size_t(b)].data(), v_seq[std::size_t(b)].data(), 1, n));
    }
  }
  std::printf("paged decode, %lld steps of %lld sequences (pages of %lld tokens, final lengths %d, %d, %d): "
              "max |error| %.2e, %.3f ms per step, %.2f GB/s of K+V\n",
              (long long)steps, (long long)sequences, (long long)page_size, lens[0], lens[1], lens[2], worst_decode,
              1e3 * seconds / double(steps), bytes / seconds / 1e9);
  worst = std::max(worst, worst_decode);
  const double tolerance = 1e-4;
  if (!(worst <= tolerance)) {
    std::fprintf(stderr, "MISMATCH: max |error| %.3e > %.1e\n", worst, tolerance);
    return 1;
  }
  std::printf("ok\n");
  return 0;
}
