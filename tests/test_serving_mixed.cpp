// attend_paged and attend_ragged with mixed storage (f32 Q and O, K and V in Eigen::half or Eigen::bfloat16): the
// result agrees with the float64 oracle on the widened K/V as an f32 computation does, is bitwise the single-type
// f32 call's on the widened cache (16-bit values are exact in f32), and bad input is refused with nothing written.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <variant>
#include <vector>

#include <catch2/catch.hpp>

#include <fusedattn/dispatch/serving.hpp>

#include "support/check.hpp"
#include "support/data.hpp"
#include "support/lowp_check.hpp"
#include "support/oracle.hpp"
#include "support/ragged.hpp"

using namespace fusedattn;
using namespace fusedattn::testing;

namespace {

using band_choice = std::variant<dense, causal, window>;

/// The masks the cases cycle through: dense, causal in both alignments, a window.
band_choice mask_number(int i) {
  switch (i % 4) {
    case 0: return dense{};
    case 1: return causal{align::bottom_right};
    case 2: return causal{align::top_left};
    default: return window{19, 3, align::bottom_right};
  }
}

/// The values of a 16-bit buffer widened to f32 (exact).
template <class KV>
std::vector<float> widen(const std::vector<KV>& x) {
  std::vector<float> out(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) out[i] = static_cast<float>(x[i]);
  return out;
}

/// Max |O − oracle| must be at most 2× a plain f32 implementation's on the same widened inputs plus 8 f32 ulps;
/// lse as attend's tests hold it (2× the plain lse error plus 64 ulps).
template <class Mask>
void check_oracle(const problem& p, const tensor_ref<const float>& q, const tensor_ref<const float>& k,
                  const tensor_ref<const float>& v, const tensor_ref<float>& o, const float* lse, const Mask& mask) {
  const auto bound = bind(mask, p);
  const reference exact = reference_attention<double>(p, q, k, v, bound);
  const reference plain = reference_attention<float>(p, q, k, v, bound);
  const double err = max_abs_error(o, exact.o), plain_err = plain_error<float>(plain, exact);
  INFO("error " << err << ", plain f32 error " << plain_err);
  CHECK(err <= output_tolerance<float>(plain_err));
  const std::vector<float> got_lse(lse, lse + p.lse_size());
  CHECK(max_lse_error(got_lse, exact.lse) <=
        2.0 * plain_lse_error(plain, exact) + 64.0 * static_cast<double>(Eigen::NumTraits<float>::epsilon()));
}

/// A paged cache of 16-bit K and V (random values, pages in random order, NaN in every element no sequence owns)
/// with f32 queries; o and lse start as sentinels.
template <class KV>
struct mixed_paged_case {
  problem p;
  index_t page_size;
  page_layout layout;
  std::vector<std::int32_t> lens, table;
  index_t blocks_per_seq = 0, pages = 0;
  std::vector<KV> k, v;
  std::vector<float> q, o, lse;

  mixed_paged_case(const problem& pr, index_t ps, page_layout l, std::vector<std::int32_t> seq_lens,
                   std::mt19937_64& rng)
      : p(pr), page_size(ps), layout(l), lens(std::move(seq_lens)) {
    index_t longest = 1;
    for (auto x : lens) longest = std::max<index_t>(longest, x);
    p.batch = static_cast<index_t>(lens.size());
    p.seq_kv = longest;
    blocks_per_seq = (p.seq_kv + ps - 1) / ps + 1;
    pages = p.batch * blocks_per_seq + 2;
    std::vector<std::int32_t> ids(static_cast<std::size_t>(pages));
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    table.assign(ids.begin(), ids.begin() + p.batch * blocks_per_seq);
    const auto pool = static_cast<std::size_t>(pages * ps * p.heads_kv * p.head_dim);
    k.assign(pool, KV(std::numeric_limits<float>::quiet_NaN()));
    v.assign(pool, KV(std::numeric_limits<float>::quiet_NaN()));
    std::uniform_real_distribution<double> u(-1.0, 1.0);
    for (index_t b = 0; b < p.batch; ++b)
      for (index_t h = 0; h < p.heads_kv; ++h)
        for (index_t j = 0; j < lens[static_cast<std::size_t>(b)]; ++j)
          for (index_t c = 0; c < p.head_dim; ++c) {
            const auto at = static_cast<std::size_t>(offset(b, h, j) + c);
            k[at] = static_cast<KV>(2.0 * u(rng));
            v[at] = static_cast<KV>(u(rng));
          }
    q.resize(static_cast<std::size_t>(p.batch * p.heads * p.seq_q * p.head_dim));
    for (auto& x : q) x = static_cast<float>(u(rng));
    o.assign(q.size(), 7.0f);
    lse.assign(static_cast<std::size_t>(p.lse_size()), 123.0f);
  }
  index_t offset(index_t b, index_t h, index_t j) const {
    const page_strides st = page_strides_of(layout, page_size, p.heads_kv, p.head_dim);
    return table[static_cast<std::size_t>(b * blocks_per_seq + j / page_size)] * st.page + h * st.head +
           (j % page_size) * st.token;
  }
  template <class T>
  paged_kv<const T> view(const std::vector<T>& kp, const std::vector<T>& vp) const {
    return paged<const T>(kp.data(), vp.data(), pages, page_size, p.heads_kv, p.head_dim, layout, table.data(),
                          blocks_per_seq, lens.data());
  }
  /// Sequence b's rows of a pool gathered into a contiguous (1, heads_kv, len, d) f32 buffer.
  template <class T>
  std::vector<float> gather(const std::vector<T>& pool, index_t b) const {
    const index_t len = lens[static_cast<std::size_t>(b)];
    std::vector<float> out(static_cast<std::size_t>(p.heads_kv * len * p.head_dim));
    for (index_t h = 0; h < p.heads_kv; ++h)
      for (index_t j = 0; j < len; ++j)
        for (index_t c = 0; c < p.head_dim; ++c)
          out[static_cast<std::size_t>((h * len + j) * p.head_dim + c)] =
              static_cast<float>(pool[static_cast<std::size_t>(offset(b, h, j) + c)]);
    return out;
  }
};

/// Runs the mixed attend_paged, then: the f32 attend_paged on the widened pools gives the same bits (O and lse);
/// each sequence agrees with the oracle on its widened K/V; a sequence without keys has O = 0, lse = −inf.
template <class KV, class Mask>
void check_paged_mixed(mixed_paged_case<KV>& c, const Mask& mask, int threads) {
  const problem& p = c.p;
  const status st = attend_paged(policy::cpu<>{threads}, p, bhsd<const float>(c.q.data(), p.q_dims()),
                                 c.view(c.k, c.v), bhsd(c.o.data(), p.o_dims()), mask, c.lse.data());
  INFO(st.what());
  REQUIRE(st.ok());
  const std::vector<float> k32 = widen(c.k), v32 = widen(c.v);
  std::vector<float> o32(c.o.size(), -3.0f), lse32(c.lse.size(), -5.0f);
  REQUIRE(attend_paged(policy::cpu<>{threads}, p, bhsd<const float>(c.q.data(), p.q_dims()), c.view(k32, v32),
                       bhsd(o32.data(), p.o_dims()), mask, lse32.data())
              .ok());
  CHECK(std::memcmp(o32.data(), c.o.data(), c.o.size() * sizeof(float)) == 0);
  CHECK(std::memcmp(lse32.data(), c.lse.data(), c.lse.size() * sizeof(float)) == 0);
  const index_t rows = p.heads * p.seq_q * p.head_dim;
  for (index_t b = 0; b < p.batch; ++b) {
    const index_t len = c.lens[static_cast<std::size_t>(b)];
    INFO("sequence " << b << " of " << len << " keys");
    float* ob = c.o.data() + b * rows;
    const float* lb = c.lse.data() + b * p.heads * p.seq_q;
    if (len == 0) {
      CHECK(std::all_of(ob, ob + rows, [](float x) { return x == 0.0f; }));
      const float neg_inf = -std::numeric_limits<float>::infinity();
      CHECK(std::all_of(lb, lb + p.heads * p.seq_q, [&](float x) { return x == neg_inf; }));
      continue;
    }
    problem pb = p;
    pb.batch = 1;
    pb.seq_kv = len;
    const std::vector<float> kb = c.gather(c.k, b), vb = c.gather(c.v, b);
    check_oracle(pb, bhsd<const float>(c.q.data() + b * rows, pb.q_dims()), bhsd<const float>(kb.data(), pb.kv_dims()),
                 bhsd<const float>(vb.data(), pb.kv_dims()), bhsd(ob, pb.o_dims()), lb, mask);
  }
}

/// Packed [token][head][d] f32 Q and O with 16-bit K and V of a ragged batch.
template <class KV>
struct mixed_ragged_case : ragged_offsets {
  std::vector<float> q, o, lse;
  std::vector<KV> k, v;

  mixed_ragged_case(index_t heads, index_t heads_kv, index_t d, const std::vector<std::int32_t>& len_q,
                    const std::vector<std::int32_t>& len_kv, std::mt19937_64& rng)
      : ragged_offsets(heads, heads_kv, d, len_q, len_kv) {
    std::uniform_real_distribution<double> u(-1.0, 1.0);
    q.resize(static_cast<std::size_t>(p.seq_q * heads * d));
    for (auto& x : q) x = static_cast<float>(u(rng));
    k.resize(static_cast<std::size_t>(p.seq_kv * heads_kv * d));
    v.resize(k.size());
    for (auto& x : k) x = static_cast<KV>(2.0 * u(rng));
    for (auto& x : v) x = static_cast<KV>(u(rng));
    o.assign(q.size(), 7.0f);
    lse.assign(static_cast<std::size_t>(p.lse_size()), 123.0f);
  }
};

/// Runs the mixed attend_ragged, then: the f32 attend_ragged on the widened K/V gives the same bits; every sequence
/// agrees with the oracle on its widened K/V.
template <class KV, class Mask>
void check_ragged_mixed(mixed_ragged_case<KV>& c, const Mask& mask, int threads) {
  const problem& p = c.p;
  const status st =
      attend_ragged(policy::cpu<>{threads}, p, c.batch(), bshd<const float>(c.q.data(), p.q_dims()),
                    bshd<const KV>(c.k.data(), p.kv_dims()), bshd<const KV>(c.v.data(), p.kv_dims()),
                    bshd(c.o.data(), p.o_dims()), mask, c.lse.data());
  INFO(st.what());
  REQUIRE(st.ok());
  const std::vector<float> k32 = widen(c.k), v32 = widen(c.v);
  std::vector<float> o32(c.o.size(), -3.0f), lse32(c.lse.size(), -5.0f);
  REQUIRE(attend_ragged(policy::cpu<>{threads}, p, c.batch(), bshd<const float>(c.q.data(), p.q_dims()),
                        bshd<const float>(k32.data(), p.kv_dims()), bshd<const float>(v32.data(), p.kv_dims()),
                        bshd(o32.data(), p.o_dims()), mask, lse32.data())
              .ok());
  CHECK(std::memcmp(o32.data(), c.o.data(), c.o.size() * sizeof(float)) == 0);
  CHECK(std::memcmp(lse32.data(), c.lse.data(), c.lse.size() * sizeof(float)) == 0);
  const index_t hd = p.heads * p.head_dim, hkd = p.heads_kv * p.head_dim;
  for (std::size_t b = 0; b + 1 < c.cu_q.size(); ++b) {
    const index_t q0 = c.cu_q[b], nq = c.cu_q[b + 1] - q0, k0 = c.cu_kv[b], nk = c.cu_kv[b + 1] - k0;
    INFO("sequence " << b << ": " << nq << " queries, " << nk << " keys");
    const problem pb{1, p.heads, p.heads_kv, nq, nk, p.head_dim};
    std::vector<float> lb(static_cast<std::size_t>(p.heads * nq));
    for (index_t h = 0; h < p.heads; ++h)
      for (index_t i = 0; i < nq; ++i)
        lb[static_cast<std::size_t>(h * nq + i)] = c.lse[static_cast<std::size_t>(h * p.seq_q + q0 + i)];
    // The sequence's rows of the packed buffers, as (1, heads, n, d) views with the packed strides.
    const tensor_ref<const float> qs{c.q.data() + q0 * hd, pb.q_dims(), {0, p.head_dim, hd, 1}};
    const tensor_ref<const float> ks{k32.data() + k0 * hkd, pb.kv_dims(), {0, p.head_dim, hkd, 1}};
    const tensor_ref<const float> vs{v32.data() + k0 * hkd, pb.kv_dims(), {0, p.head_dim, hkd, 1}};
    const tensor_ref<float> os{c.o.data() + q0 * hd, pb.o_dims(), {0, p.head_dim, hd, 1}};
    check_oracle(pb, qs, ks, vs, os, lb.data(), mask);
  }
}

/// Random sequence lengths in [lo, hi], with those that are multiples of `avoid` moved off them.
std::vector<std::int32_t> lengths(std::mt19937_64& rng, std::size_t n, int lo, int hi, int avoid) {
  std::uniform_int_distribution<int> len(lo, hi);
  std::vector<std::int32_t> out(n);
  for (auto& x : out) {
    x = len(rng);
    if (avoid > 0 && x % avoid == 0) ++x;
  }
  return out;
}

// FUSEDATTN_TEST_SUBSET (CI's sanitizer stage): the ragged and modifier cases on bf16 K/V only (the paged case keeps
// both 16-bit types).
#if FUSEDATTN_TEST_SUBSET
#define SERVING_SUBSET_TYPES Eigen::bfloat16
#else
#define SERVING_SUBSET_TYPES Eigen::half, Eigen::bfloat16
#endif

}  // namespace

TEMPLATE_TEST_CASE("serving mixed: paged f32 Q/O with 16-bit K/V, every page size, layout and group", "[serving_mixed]",
                   Eigen::half, Eigen::bfloat16) {
  const auto seed = fresh_seed();
  CAPTURE(seed);
  std::mt19937_64 rng(seed);
  const index_t groups[3] = {1, 4, 8};
  const index_t seq_qs[3] = {1, 2, 37};  // decode, a decode-kernel block (group 1 and 4 only), chunked prefill
  int n = 0;
  for (index_t ps : {8, 16, 64})
    for (page_layout l : {page_layout::hnd, page_layout::nhd})
      for (index_t g : groups)
        for (index_t sq : seq_qs) {
          ++n;
          if ((n + static_cast<int>(ps)) % 3 == 0) continue;  // two thirds of the product keep the run short
          const index_t hkv = g == 8 ? 1 : 2, d = n % 2 ? 64 : 40;
          CAPTURE(ps, l == page_layout::hnd ? "hnd" : "nhd", g, sq, d);
          // Lengths not multiples of the page; one empty sequence; at least seq_q keys for causal bottom-right.
          std::vector<std::int32_t> lens = lengths(rng, 3, static_cast<int>(sq), 150, static_cast<int>(ps));
          if (n % 5 == 0) lens.push_back(0);
          mixed_paged_case<TestType> c({1, hkv * g, hkv, sq, 1, d}, ps, l, lens, rng);
          std::visit([&](const auto& m) { check_paged_mixed(c, m, 1 + n % 3); }, mask_number(n));
        }
}

TEMPLATE_TEST_CASE("serving mixed: ragged prefill and decode, own lengths, causal both alignments, GQA",
                   "[serving_mixed]", SERVING_SUBSET_TYPES) {
  const auto seed = fresh_seed();
  CAPTURE(seed);
  std::mt19937_64 rng(seed);
  int n = 0;
  for (index_t g : {1, 4, 8})
    for (bool decode : {false, true})
      for (int mi = 0; mi < 4; ++mi) {
        ++n;
        const index_t hkv = 2, d = n % 2 ? 64 : 24;
        const std::size_t seqs = 4;
        std::vector<std::int32_t> lq = decode ? std::vector<std::int32_t>(seqs, 1) : lengths(rng, seqs, 1, 45, 16);
        std::vector<std::int32_t> lk = lengths(rng, seqs, 1, 130, 16);
        for (std::size_t b = 0; b < seqs; ++b) lk[b] = std::max(lk[b], lq[b]);  // bottom-right rows see a key
        CAPTURE(g, decode, d, mi);
        mixed_ragged_case<TestType> c(hkv * g, hkv, d, lq, lk, rng);
        std::visit([&](const auto& m) { check_ragged_mixed(c, m, 1 + n % 2); }, mask_number(mi));
      }
}

TEMPLATE_TEST_CASE("serving mixed: score modifiers on paged and ragged calls", "[serving_mixed]",
                   SERVING_SUBSET_TYPES) {
  const auto seed = fresh_seed();
  CAPTURE(seed);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (index_t sq : {1, 29}) {
    CAPTURE(sq);
    const index_t g = 4, hkv = 2, heads = g * hkv;
    std::vector<float> slopes(static_cast<std::size_t>(heads)), sink(static_cast<std::size_t>(heads));
    for (std::size_t h = 0; h < slopes.size(); ++h) {
      slopes[h] = 0.05f * static_cast<float>(h + 1);
      sink[h] = 2.0f * u(rng);
    }
    const auto mask = causal{align::bottom_right} | softcap{4.0f} | alibi{slopes.data(), align::bottom_right} |
                      sinks{sink.data()};
    mixed_paged_case<TestType> pc({1, heads, hkv, sq, 1, 64}, 16, page_layout::nhd,
                                  lengths(rng, 3, static_cast<int>(sq), 120, 16), rng);
    check_paged_mixed(pc, mask, 2);
    std::vector<std::int32_t> lq(3, static_cast<std::int32_t>(sq)), lk = lengths(rng, 3, static_cast<int>(sq), 120, 16);
    mixed_ragged_case<TestType> rc(heads, hkv, 64, lq, lk, rng);
    check_ragged_mixed(rc, mask, 2);
  }
}

TEST_CASE("serving mixed: bad input is refused by name, nothing written", "[serving_mixed]") {
  const auto seed = fresh_seed();
  CAPTURE(seed);
  std::mt19937_64 rng(seed);
  using KV = Eigen::bfloat16;
  mixed_paged_case<KV> c({1, 4, 2, 1, 1, 16}, 8, page_layout::hnd, {20, 5}, rng);
  const std::vector<float> o0 = c.o, lse0 = c.lse;
  const auto call = [&](const auto& pol, const paged_kv<const KV>& kv, const problem& p) {
    return attend_paged(pol, p, bhsd<const float>(c.q.data(), p.q_dims()), kv, bhsd(c.o.data(), p.o_dims()),
                        causal{align::bottom_right}, c.lse.data());
  };
  const auto refused = [&](const status& st, errc code, const std::string& field) {
    INFO(st.what());
    CHECK(st.code() == code);
    CHECK(st.message().find(field) != std::string::npos);
    CHECK(c.o == o0);
    CHECK(c.lse == lse0);
  };
  {  // a page id out of range, then a negative one
    std::vector<std::int32_t> table = c.table;
    auto kv = c.view(c.k, c.v);
    kv.block_table = table.data();
    table[static_cast<std::size_t>(c.blocks_per_seq)] = static_cast<std::int32_t>(c.pages);
    refused(call(policy::cpu<>{2}, kv, c.p), errc::invalid_argument,
            "kv.block_table[1][0] is " + std::to_string(c.pages));
    table[static_cast<std::size_t>(c.blocks_per_seq)] = -1;
    refused(call(policy::cpu<>{2}, kv, c.p), errc::invalid_argument, "kv.block_table[1][0] is -1");
  }
  {  // a length beyond the sequence's pages, beyond seq_kv
    std::vector<std::int32_t> lens = c.lens;
    auto kv = c.view(c.k, c.v);
    kv.seq_lens = lens.data();
    lens[1] = static_cast<std::int32_t>(c.blocks_per_seq * c.page_size + 1);
    refused(call(policy::cpu<>{2}, kv, c.p), errc::invalid_argument, "kv.seq_lens[1] is " + std::to_string(lens[1]));
    lens[1] = 21;
    refused(call(policy::cpu<>{2}, kv, c.p), errc::invalid_argument, "beyond problem.seq_kv");
  }
  {  // null pools, page size, q of the wrong shape
    auto kv = c.view(c.k, c.v);
    kv.k = nullptr;
    refused(call(policy::cpu<>{2}, kv, c.p), errc::invalid_argument, "kv.k is null");
    kv = c.view(c.k, c.v);
    kv.page_size = 12;
    refused(call(policy::cpu<>{2}, kv, c.p), errc::invalid_argument, "kv.page_size is 12");
    problem wrong = c.p;
    wrong.head_dim = 0;
    refused(call(policy::cpu<>{2}, c.view(c.k, c.v), wrong), errc::invalid_argument, "head_dim");
  }
  {  // o inside the K pool (bytes of the 16-bit pool)
    const problem& p = c.p;
    const status st = attend_paged(policy::cpu<>{2}, p, bhsd<const float>(c.q.data(), p.q_dims()), c.view(c.k, c.v),
                                   bhsd(reinterpret_cast<float*>(c.k.data()) + 4, p.o_dims()), dense{}, c.lse.data());
    INFO(st.what());
    CHECK(st.code() == errc::invalid_argument);
    CHECK(st.message().find("o overlaps kv.k") != std::string::npos);
    CHECK(c.lse == lse0);
  }
  // Other policies: mixed storage is the CPU flash policies' only.
  refused(call(policy::cpu_naive{2}, c.view(c.k, c.v), c.p), errc::unsupported, "mixed storage");
  refused(call(policy::cuda{}, c.view(c.k, c.v), c.p), errc::unsupported, "mixed storage");

  // Ragged: decreasing offsets, a total that does not match, K of the wrong extent, other policies.
  mixed_ragged_case<KV> r(4, 2, 16, {3, 1, 5}, {9, 4, 12}, rng);
  const std::vector<float> ro0 = r.o, rl0 = r.lse;
  const auto rcall = [&](const auto& pol, const ragged_batch& rb, const problem& p) {
    return attend_ragged(pol, p, rb, bshd<const float>(r.q.data(), p.q_dims()),
                         bshd<const KV>(r.k.data(), p.kv_dims()), bshd<const KV>(r.v.data(), p.kv_dims()),
                         bshd(r.o.data(), p.o_dims()), causal{}, r.lse.data());
  };
  const auto rrefused = [&](const status& st, errc code, const std::string& field) {
    INFO(st.what());
    CHECK(st.code() == code);
    CHECK(st.message().find(field) != std::string::npos);
    CHECK(r.o == ro0);
    CHECK(r.lse == rl0);
  };
  {
    std::vector<std::int32_t> cu = r.cu_kv;
    cu[2] = cu[1] - 1;
    rrefused(rcall(policy::cpu<>{2}, {3, r.cu_q.data(), cu.data()}, r.p), errc::invalid_argument,
             "ragged.cu_seqlens_kv[2] is " + std::to_string(cu[2]));
    std::vector<std::int32_t> cq = r.cu_q;
    cq[3] += 1;
    rrefused(rcall(policy::cpu<>{2}, {3, cq.data(), r.cu_kv.data()}, r.p), errc::invalid_argument,
             "ragged.cu_seqlens_q[3] is " + std::to_string(cq[3]));
    problem two = r.p;
    two.batch = 2;
    rrefused(rcall(policy::cpu<>{2}, r.batch(), two), errc::invalid_argument, "problem.batch is 2");
  }
  rrefused(rcall(policy::cpu_naive{2}, r.batch(), r.p), errc::unsupported, "mixed storage");
  rrefused(rcall(policy::cuda{}, r.batch(), r.p), errc::unsupported, "mixed storage");
}
