// The CPU flash kernel (one tile loop, every mask, every scalar type, every SIMD backend the machine runs)
// against the float64 oracle, the naive kernel, the scalar path and itself (threads, decode split, GQA, tiles).
#include <cstring>

#include "support/check.hpp"

using namespace fusedattn;
using namespace fusedattn::testing;

namespace {

/// A bound mask given by an explicit allowed-matrix, offered through the tile-loop interface as one segment of
/// every key with every tile partial: the loop must take all its masking from allowed().
struct explicit_mask {
  index_t seq_q = 0, seq_kv = 0;
  std::vector<unsigned char> ok;
  bool allowed(index_t i, index_t j) const { return ok[static_cast<std::size_t>(i * seq_kv + j)] != 0; }
  index_t q_granule() const { return 0; }
  span_segments segments(index_t, index_t, kv_span keys) const { return span_segments(intersect({0, seq_kv}, keys)); }
  bool is_partial(index_t, index_t, index_t, index_t) const { return true; }
};

/// A block-structured bound mask like a block-sparse layout: q blocks of `bq` rows (q_granule), each visiting a
/// random ascending subset of kv blocks of `bk` keys, one segment per block; tiles are partial only at the
/// sequence end. Exercises q_granule and several segments per q-tile.
struct blocky_mask {
  index_t seq_q = 0, seq_kv = 0, bq = 1, bk = 1;
  std::vector<std::vector<index_t>> blocks;  // per q block, ascending kv block indices
  const std::vector<index_t>& row(index_t q0) const { return blocks[static_cast<std::size_t>(q0 / bq)]; }
  bool allowed(index_t i, index_t j) const {
    const auto& r = row(i);
    return j < seq_kv && std::find(r.begin(), r.end(), j / bk) != r.end();
  }
  index_t q_granule() const { return bq; }
  /// One segment per listed block, cut to `keys`.
  struct block_segments {
    const blocky_mask* m;
    const std::vector<index_t>* blocks;
    std::size_t r;
    kv_span keys;
    bool next(kv_span& s) {
      while (r < blocks->size()) {
        const index_t blk = (*blocks)[r++];
        s = intersect({blk * m->bk, std::min(m->seq_kv, (blk + 1) * m->bk)}, keys);
        if (!s.empty()) return true;
      }
      return false;
    }
  };
  block_segments segments(index_t q0, index_t, kv_span keys) const { return {this, &row(q0), 0, keys}; }
  bool is_partial(index_t, index_t, index_t, index_t) const { return false; }
};

/// Runs flash with `pol` on case `c` and returns the status.
template <class T, class Policy, class Mask>
status run_flash(const Policy& pol, attention_case<T>& c, const Mask& mask, std::vector<float>* lse = nullptr) {
  if (lse) lse->assign(static_cast<std::size_t>(c.p.lse_size()), 0.0f);
  return attend(pol, c.p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.view, mask, lse ? lse->data() : nullptr);
}

/// Runs the tile loop directly with a bound mask (the path block-sparse masks take).
template <class Arch, class T, class Mask>
status run_bound(attention_case<T>& c, const Mask& mask, std::vector<float>& lse, int threads = 1,
                 tile_sizes tiles = {}) {
  lse.assign(static_cast<std::size_t>(c.p.lse_size()), 0.0f);
  return kernels::flash_attention<T, Arch>(c.p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.view, mask, lse.data(),
                                           threads, tiles);
}

/// Checks O and lse of case `c` against the oracle for a bound mask. `floor` raises the output tolerance where
/// the plain implementation's error is not a fair yardstick (huge logits amplify the dot product's rounding by
/// the scale, and a different summation order can lose or win by luck).
template <class T, class Mask>
void check_case(const attention_case<T>& c, const Mask& bound, const std::vector<float>& lse, double floor = 0) {
  expected e = expect(c, bound);
  e.tolerance = std::max(e.tolerance, floor);
  e.lse_tolerance = std::max(e.lse_tolerance, floor);  // lse = m + log l carries the logits' own rounding too
  check_outputs(c, e, lse);
}

/// Max |a − b| over two outputs of the same shape and layout.
template <class T>
double max_diff(const operand<T>& a, const operand<T>& b) {
  double d = 0;
  for (std::size_t i = 0; i < a.buf.size(); ++i)
    d = std::max(d, std::abs(static_cast<double>(a.buf[i]) - static_cast<double>(b.buf[i])));
  return d;
}

/// Calls f(policy, name) for every SIMD backend this build targets and this CPU runs (under FUSEDATTN_TEST_SUBSET,
/// avx2 only where avx512f is not compiled in).
template <class F>
void for_each_backend(F&& f) {
  f(policy::cpu<>{1}, "default");
#if XSIMD_WITH_SSE4_2
  if (cpu::arch_available<xsimd::sse4_2>()) f(policy::cpu_sse4_2{1}, "sse4_2");
#endif
#if XSIMD_WITH_FMA3_AVX2 && !(FUSEDATTN_TEST_SUBSET && XSIMD_WITH_AVX512F)
  if (cpu::arch_available<xsimd::fma3<xsimd::avx2>>()) f(policy::cpu_avx2{1}, "avx2");
#endif
#if XSIMD_WITH_AVX512F
  if (cpu::arch_available<xsimd::avx512f>()) f(policy::cpu_avx512{1}, "avx512f");
#endif
#if XSIMD_WITH_NEON64
  f(policy::cpu_neon{1}, "neon64");
#endif
}

// The scalar types of the typed cases; FUSEDATTN_TEST_SUBSET (CI's sanitizer stage) keeps float and a 16-bit type.
#if FUSEDATTN_TEST_SUBSET
#define FLASH_ORACLE_TYPES float, Eigen::bfloat16
#define FLASH_BACKEND_TYPES float, Eigen::half
#else
#define FLASH_ORACLE_TYPES float, double, Eigen::half, Eigen::bfloat16
#define FLASH_BACKEND_TYPES float, double, Eigen::half
#endif

}  // namespace

TEMPLATE_TEST_CASE("flash matches the float64 oracle", "[flash]", FLASH_ORACLE_TYPES) {
  const auto shapes = tail_shapes();
  const auto masks = all_masks();
  const layout layouts[] = {layout::bhsd, layout::bshd, layout::padded};
  const std::size_t shape_index = GENERATE(range<std::size_t>(0, 10));
  REQUIRE(shape_index < shapes.size());
  for (std::size_t m = 0; m < masks.size(); ++m)
    check_against_oracle<TestType>(policy::cpu<>{2}, shapes[shape_index], layouts[(shape_index + m) % 3], masks[m]);
}

TEMPLATE_TEST_CASE("flash scalar path matches the float64 oracle", "[flash]", float, double) {
  const auto shapes = tail_shapes();
  const auto masks = all_masks();
  for (std::size_t s = 0; s < shapes.size(); ++s)
    check_against_oracle<TestType>(policy::cpu_scalar{1}, shapes[s], layout::padded, masks[s % masks.size()]);
}

TEMPLATE_TEST_CASE("flash: every SIMD backend agrees with the scalar path", "[flash]", FLASH_BACKEND_TYPES) {
  const problem p{1, 3, 1, 77, 133, 40};
  std::mt19937_64 rng(fresh_seed());
  for (const any_mask& mask : all_masks()) {
    attention_case<TestType> c(p, layout::bshd, rng);
    std::vector<float> lse_ref, lse;
    REQUIRE(run_flash(policy::cpu_scalar{1}, c, mask, &lse_ref).ok());
    operand<TestType> ref(p.o_dims(), layout::bshd);
    ref.buf = c.o.buf;
    const band_mask bound = bind_band(mask, p);
    const double tol = expect(c, bound).tolerance;
    for_each_backend([&](const auto& pol, const char* name) {
      INFO(name << " " << describe(mask));
      REQUIRE(run_flash(pol, c, mask, &lse).ok());
      CHECK(max_diff(c.o, ref) <= tol);
      CHECK(max_lse_error(lse, std::vector<double>(lse_ref.begin(), lse_ref.end())) <= 1e-4);
    });
  }
}

TEST_CASE("flash agrees with the naive kernel", "[flash]") {
  const problem shapes[] = {{2, 2, 1, 200, 333, 64}, {1, 4, 4, 65, 65, 128}};
  std::mt19937_64 rng(fresh_seed());
  for (const problem& p : shapes)
    for (const any_mask& mask : all_masks()) {
      INFO(describe(p) << " " << describe(mask));
      attention_case<float> c(p, layout::bhsd, rng);
      operand<float> o_naive(p.o_dims(), layout::bhsd);
      REQUIRE(attend(policy::cpu_naive{1}, p, c.q.cview(), c.k.cview(), c.v.cview(), o_naive.view, mask).ok());
      REQUIRE(run_flash(policy::cpu<>{1}, c, mask).ok());
      const band_mask bound = bind_band(mask, p);
      CHECK(max_diff(c.o, o_naive) <= 2 * expect(c, bound).tolerance);
    }
}

TEST_CASE("flash: causal and window equal dense attention with an explicit mask", "[flash]") {
  const problem p{1, 2, 2, 150, 211, 32};
  std::mt19937_64 rng(fresh_seed());
  const any_mask masks[] = {causal{align::top_left}, causal{align::bottom_right}, window{20, 7, align::top_left}};
  for (const any_mask& mask : masks) {
    INFO(describe(mask));
    attention_case<float> c(p, layout::bhsd, rng);
    std::vector<float> lse_band, lse_explicit;
    REQUIRE(run_flash(policy::cpu<>{1}, c, mask, &lse_band).ok());
    operand<float> o_band(p.o_dims(), layout::bhsd);
    o_band.buf = c.o.buf;
    const band_mask bound = bind_band(mask, p);
    explicit_mask ex{p.seq_q, p.seq_kv, {}};
    for (index_t i = 0; i < p.seq_q; ++i)
      for (index_t j = 0; j < p.seq_kv; ++j) ex.ok.push_back(bound.allowed(i, j) ? 1 : 0);
    REQUIRE(run_bound<xsimd::default_arch>(c, ex, lse_explicit).ok());
    const double tol = expect(c, bound).tolerance;
    CHECK(max_diff(c.o, o_band) <= tol);
    CHECK(max_lse_error(lse_explicit, std::vector<double>(lse_band.begin(), lse_band.end())) <= 1e-5);
    check_case(c, ex, lse_explicit);
  }
}

TEST_CASE("flash: a block-structured mask with q_granule and many segments", "[flash]") {
  const problem p{1, 2, 1, 200, 300, 48};
  std::mt19937_64 rng(fresh_seed());
  blocky_mask mask{p.seq_q, p.seq_kv, 48, 40, {}};
  const index_t kv_blocks = (p.seq_kv + mask.bk - 1) / mask.bk;
  for (index_t qb = 0; qb < (p.seq_q + mask.bq - 1) / mask.bq; ++qb) {
    std::vector<index_t> r;
    for (index_t kb = 0; kb < kv_blocks; ++kb)
      if (rng() % 3 != 0 || qb == 1) r.push_back(kb);
    if (qb == 2) r.clear();  // a q block that sees nothing
    mask.blocks.push_back(r);
  }
  const tile_sizes tiles[] = {{}, {32, 16, 0}, {7, 25, 3}};
  for (const tile_sizes& t : tiles) {
    INFO("tiles " << t.q << " " << t.kv << " " << t.kv_split);
    attention_case<float> c(p, layout::padded, rng);
    std::vector<float> lse;
    REQUIRE(run_bound<xsimd::default_arch>(c, mask, lse, 2, t).ok());
    check_case(c, mask, lse);
    REQUIRE(run_bound<scalar_arch>(c, mask, lse, 1, t).ok());
    check_case(c, mask, lse);
  }
}

TEST_CASE("flash: GQA equals the same problem with K/V heads repeated", "[flash]") {
  const problem p{2, 6, 2, 70, 90, 24};
  problem rep = p;
  rep.heads_kv = p.heads;
  std::mt19937_64 rng(fresh_seed());
  attention_case<float> c(p, layout::bhsd, rng);
  attention_case<float> r(rep, layout::bhsd, rng);
  r.q.buf = c.q.buf;
  for (index_t b = 0; b < p.batch; ++b)
    for (index_t h = 0; h < p.heads; ++h)
      for (index_t s = 0; s < p.seq_kv; ++s)
        for (index_t d = 0; d < p.head_dim; ++d) {
          r.k.view.row(b, h, s)[d] = c.k.view.row(b, p.kv_head(h), s)[d];
          r.v.view.row(b, h, s)[d] = c.v.view.row(b, p.kv_head(h), s)[d];
        }
  REQUIRE(run_flash(policy::cpu<>{2}, c, causal{}).ok());
  REQUIRE(run_flash(policy::cpu<>{2}, r, causal{}).ok());
  CHECK(c.o.buf == r.o.buf);
}

TEST_CASE("flash: decode split matches the unsplit loop, and threads never change a bit", "[flash]") {
  const problem shapes[] = {{1, 2, 1, 1, 5000, 64}, {1, 1, 1, 4, 3000, 128}, {2, 2, 2, 100, 700, 32}};
  std::mt19937_64 rng(fresh_seed());
  for (const problem& p : shapes)
    for (const any_mask& mask : {any_mask{dense{}}, any_mask{causal{align::bottom_right}},
                                 any_mask{window{300, 0, align::bottom_right}}}) {
      INFO(describe(p) << " " << describe(mask));
      attention_case<float> c(p, layout::bhsd, rng);
      std::vector<float> lse_split, lse_one, lse_n;
      policy::cpu<> split{1};
      split.tiles.kv_split = 5;
      REQUIRE(run_flash(split, c, mask, &lse_split).ok());
      const std::vector<float> o_split = c.o.buf;
      const band_mask bound = bind_band(mask, p);
      check_case(c, bound, lse_split);
      split.threads = 3;
      REQUIRE(run_flash(split, c, mask, &lse_n).ok());
      CHECK(c.o.buf == o_split);
      CHECK(lse_n == lse_split);
      // The heuristic (decode split for the first two shapes), 1 thread vs 2 threads, bitwise.
      REQUIRE(run_flash(policy::cpu<>{1}, c, mask, &lse_one).ok());
      const std::vector<float> o_one = c.o.buf;
      check_case(c, bound, lse_one);
      REQUIRE(run_flash(policy::cpu<>{2}, c, mask, &lse_n).ok());
      CHECK(c.o.buf == o_one);
      CHECK(lse_n == lse_one);
      // More threads than kv heads: one shared packed K/V instead of per-thread caches; still the same bits.
      REQUIRE(run_flash(policy::cpu<>{7}, c, mask, &lse_n).ok());
      CHECK(c.o.buf == o_one);
      CHECK(lse_n == lse_one);
      // No split at all.
      policy::cpu<> whole{2};
      whole.tiles.kv_split = 1;
      REQUIRE(run_flash(whole, c, mask, &lse_n).ok());
      double d = 0;
      for (std::size_t i = 0; i < o_split.size(); ++i) d = std::max(d, double(std::abs(c.o.buf[i] - o_split[i])));
      CHECK(d <= expect(c, bound).tolerance);
    }
}

TEST_CASE("flash: odd tile sizes give the same answer", "[flash]") {
  const problem p{1, 2, 1, 61, 97, 37};
  const tile_sizes tiles[] = {{1, 1, 0}, {5, 7, 0}, {13, 33, 3}, {1000, 1000, 1000}, {3, 97, 1}};
  std::mt19937_64 rng(fresh_seed());
  for (const tile_sizes& t : tiles)
    for (const any_mask& mask : all_masks()) {
      INFO("tiles " << t.q << " " << t.kv << " " << t.kv_split << " " << describe(mask));
      attention_case<double> c(p, layout::bshd, rng);
      std::vector<float> lse;
      policy::cpu<> pol{1};
      pol.tiles = t;
      REQUIRE(run_flash(pol, c, mask, &lse).ok());
      check_case(c, bind_band(mask, p), lse);
    }
}

TEST_CASE("flash: logits as large as 1e4 give no inf or NaN", "[flash]") {
  problem p{1, 2, 2, 40, 70, 16};
  p.scale = 1000.0;
  std::mt19937_64 rng(fresh_seed());
  for (const any_mask& mask : all_masks()) {
    attention_case<float> c(p, layout::bhsd, rng);
    c.q.fill(rng, -3.0, 3.0);
    std::vector<float> lse;
    REQUIRE(run_flash(policy::cpu<>{1}, c, mask, &lse).ok());
    for (float x : c.o.buf) REQUIRE(std::isfinite(x));
    const band_mask bound = bind_band(mask, p);
    for (index_t i = 0; i < p.lse_size(); ++i)
      if (bound.row_range(i % p.seq_q).empty()) CHECK(std::isinf(lse[static_cast<std::size_t>(i)]));
      else CHECK(std::isfinite(lse[static_cast<std::size_t>(i)]));
    // A logit of size L carries an absolute rounding error of about L·eps from the float dot product, which the
    // softmax passes on to the weights: the output is only defined to ~L·eps, so that is the fair floor.
    double max_logit = 0;
    for (index_t h = 0; h < p.heads; ++h)
      for (index_t i = 0; i < p.seq_q; ++i)
        for (index_t j = 0; j < p.seq_kv; ++j) {
          double dot = 0;
          for (index_t d = 0; d < p.head_dim; ++d)
            dot += double(c.q.view.row(0, h, i)[d]) * double(c.k.view.row(0, p.kv_head(h), j)[d]);
          max_logit = std::max(max_logit, std::abs(dot) * *p.scale);
        }
    INFO("max |logit| " << max_logit);
    CHECK(max_logit > 1e3);
    check_case(c, bound, lse, 8.0 * max_logit * epsilon<float>());
  }
}

TEST_CASE("flash: bad policy values are reported and nothing is written", "[flash]") {
  const problem p{1, 1, 1, 9, 9, 8};
  std::mt19937_64 rng(fresh_seed());
  attention_case<float> c(p, layout::bhsd, rng);
  const std::vector<float> before = c.o.buf;
  policy::cpu<> pol{0};
  status st = run_flash(pol, c, dense{});
  CHECK(st.code() == errc::invalid_argument);
  CHECK(st.message().find("policy.threads") != std::string::npos);
  pol.threads = 1;
  pol.tiles.kv = -4;
  st = run_flash(pol, c, dense{});
  CHECK(st.code() == errc::invalid_argument);
  CHECK(st.message().find("policy.tiles.kv") != std::string::npos);
  CHECK(c.o.buf == before);
}

TEST_CASE("flash: scratch bytes do not grow with seq_q", "[flash]") {
  const problem a{1, 1, 1, 4096, 4096, 128}, b{1, 1, 1, 65536, 4096, 128};
  const index_t sa = kernels::flash_scratch_bytes<float>(a, bind(dense{}, a));
  CHECK(sa == kernels::flash_scratch_bytes<float>(b, bind(dense{}, b)));
  CHECK(sa < index_t(4096) * 128 * 4 * 3);
}
