// Example 03: masks, cross-attention and grouped-query attention.
//   A. causal self-attention (each token sees itself and the past);
//   B. cross-attention with seq_q != seq_kv, where the causal ALIGNMENT matters:
//        top_left     (PyTorch SDPA's is_causal):  query i sees keys j <= i
//        bottom_right (FlashAttention, KV caches): query i sees keys j <= i + seq_kv - seq_q,
//                     i.e. the queries are the LAST seq_q positions of the key sequence;
//   C. GQA: 8 query heads share 2 key/value heads (heads_kv = 2), read by indexing, never copied.
// Every result is checked against a float64 loop; exits non-zero on a mismatch.
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include <fusedattn/fusedattn.hpp>

namespace fa = fusedattn;

namespace {

std::vector<float> random_tensor(std::size_t n, std::mt19937& rng) {
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  std::vector<float> t(n);
  for (float& x : t) x = u(rng);
  return t;
}

/// Float64 attention over contiguous [b][h][s][d] buffers, using only the mask's per-element rule.
template <class Mask>
double max_error_vs_float64(const fa::problem& p, const Mask& mask, const std::vector<float>& q,
                            const std::vector<float>& k, const std::vector<float>& v, const std::vector<float>& o) {
  const fa::band_mask rule = fa::bind(mask, p);
  const fa::index_t d = p.head_dim;
  double err = 0;
  for (fa::index_t h = 0; h < p.heads; ++h)
    for (fa::index_t i = 0; i < p.seq_q; ++i) {
      const float* qi = &q[static_cast<std::size_t>((h * p.seq_q + i) * d)];
      const fa::index_t g = p.kv_head(h);  // the key/value head this query head reads
      std::vector<double> w(static_cast<std::size_t>(p.seq_kv), 0.0);
      double m = -INFINITY, l = 0;
      for (fa::index_t j = 0; j < p.seq_kv; ++j) {
        if (!rule.allowed(i, j)) continue;
        double dot = 0;
        for (fa::index_t c = 0; c < d; ++c) dot += double(qi[c]) * k[static_cast<std::size_t>((g * p.seq_kv + j) * d + c)];
        w[static_cast<std::size_t>(j)] = dot * p.softmax_scale();
        m = std::max(m, w[static_cast<std::size_t>(j)]);
      }
      for (fa::index_t j = 0; j < p.seq_kv; ++j)
        if (rule.allowed(i, j)) l += (w[static_cast<std::size_t>(j)] = std::exp(w[static_cast<std::size_t>(j)] - m));
      for (fa::index_t c = 0; c < d; ++c) {
        double ref = 0;
        for (fa::index_t j = 0; j < p.seq_kv; ++j)
          if (rule.allowed(i, j)) ref += w[static_cast<std::size_t>(j)] / l * v[static_cast<std::size_t>((g * p.seq_kv + j) * d + c)];
        err = std::max(err, std::abs(ref - o[static_cast<std::size_t>((h * p.seq_q + i) * d + c)]));
      }
    }
  return err;
}

/// Runs flash attention on the CPU for contiguous B·H·S·D buffers and checks it; returns true when it matches.
template <class Mask>
bool run_and_check(const char* what, const fa::problem& p, const Mask& mask, std::mt19937& rng) {
  const std::size_t nq = static_cast<std::size_t>(p.heads * p.seq_q * p.head_dim);
  const std::size_t nkv = static_cast<std::size_t>(p.heads_kv * p.seq_kv * p.head_dim);
  const auto q = random_tensor(nq, rng), k = random_tensor(nkv, rng), v = random_tensor(nkv, rng);
  std::vector<float> o(nq);
  std::printf("  plan: %s\n", fa::to_string(fa::plan(fa::policy::cpu<>{}, p, fa::bhsd(q.data(), p.q_dims()),
                                                      fa::bhsd(k.data(), p.kv_dims()), fa::bhsd(v.data(), p.kv_dims()),
                                                      fa::bhsd(o.data(), p.o_dims()), mask))
                                       .c_str());
  const fa::status st = fa::attend(fa::policy::cpu<>{}, p, fa::bhsd(q.data(), p.q_dims()),
                                   fa::bhsd(k.data(), p.kv_dims()), fa::bhsd(v.data(), p.kv_dims()),
                                   fa::bhsd(o.data(), p.o_dims()), mask);
  if (!st) {
    std::fprintf(stderr, "fusedattn: %s\n", st.what());
    return false;
  }
  const double err = max_error_vs_float64(p, mask, q, k, v, o);
  std::printf("  %-44s max error %.2g  %s\n", what, err, err < 1e-5 ? "OK" : "MISMATCH");
  return err < 1e-5;
}

}  // namespace

int main() {
  std::mt19937 rng(3);
  bool ok = true;

  std::printf("A. causal self-attention\n");
  ok &= run_and_check("(1,4,256,64) causal", {1, 4, 4, 256, 256, 64}, fa::causal{}, rng);

  std::printf("B. cross-attention, seq_q = 100 queries over seq_kv = 300 keys\n");
  const fa::problem cross{1, 2, 2, 100, 300, 64};
  for (fa::align a : {fa::align::top_left, fa::align::bottom_right}) {
    const fa::band_mask rule = fa::bind(fa::causal{a}, cross);
    const fa::kv_span first = rule.row_range(0), last = rule.row_range(cross.seq_q - 1);
    std::printf("  %s: query 0 sees keys [%lld, %lld), query 99 sees keys [%lld, %lld)\n",
                a == fa::align::top_left ? "top_left    " : "bottom_right", (long long)first.begin,
                (long long)first.end, (long long)last.begin, (long long)last.end);
    ok &= run_and_check(a == fa::align::top_left ? "causal top_left" : "causal bottom_right", cross, fa::causal{a}, rng);
  }
  ok &= run_and_check("no mask (plain cross-attention)", cross, fa::dense{}, rng);
  ok &= run_and_check("sliding window: 32 keys back, bottom_right", cross, fa::window{32, 0, fa::align::bottom_right},
                      rng);

  std::printf("C. grouped-query attention: 8 query heads, 2 key/value heads\n");
  ok &= run_and_check("(1,8 q heads / 2 kv heads,512,64) causal", {1, 8, 2, 512, 512, 64}, fa::causal{}, rng);
  ok &= run_and_check("MQA: 8 q heads / 1 kv head", {1, 8, 1, 200, 200, 64}, fa::dense{}, rng);

  std::printf("%s\n", ok ? "OK" : "MISMATCH");
  return ok ? 0 : 1;
}
