// Reliability: hostile inputs beyond the foundation's checks, numerical extremes (logits of ±1e4, fully masked
// rows, NaN propagation, a row of 2^20 keys), bitwise determinism across runs and thread counts, and bounded
// memory at a long sequence under a capped address space. Every test runs every policy of
// test_reliability_support.hpp. docs/design.md ("Numerics") is the specification these tests check.
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <ctime>
#include <fstream>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "support/check.hpp"
#include "test_reliability_support.hpp"

#if defined(__SSE3__)
#include <pmmintrin.h>
#elif defined(__SSE__)
#include <xmmintrin.h>
#endif

#if defined(__SANITIZE_ADDRESS__)
#define FUSEDATTN_TEST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define FUSEDATTN_TEST_ASAN 1
#endif
#endif
#ifndef FUSEDATTN_TEST_ASAN
#define FUSEDATTN_TEST_ASAN 0
#endif

using namespace fusedattn;
using namespace fusedattn::testing;

namespace {

constexpr float inf_f = std::numeric_limits<float>::infinity();

/// Bitwise equality of two buffers (NaN == NaN when the bits match).
template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

/// Fills every element of the view (not the gaps between rows) with uniform values in [lo, hi].
template <class T>
void fill_view(const tensor_ref<T>& t, std::mt19937_64& rng, double lo, double hi) {
  std::uniform_real_distribution<double> u(lo, hi);
  for (index_t b = 0; b < t.dims.b; ++b)
    for (index_t h = 0; h < t.dims.h; ++h)
      for (index_t i = 0; i < t.dims.s; ++i)
        for (index_t c = 0; c < t.dims.d; ++c) t.row(b, h, i)[c] = static_cast<T>(u(rng));
}

/// Runs `pol` on `c` and checks every O element and lse value against the float64 oracle: finite rows within
/// the tolerance of check.hpp (widened by the logit rounding `widen` allows, when given), rows that see no key
/// exactly 0 with lse = −inf.
template <class T, class Policy, class Mask>
void check_finite_against_oracle(const Policy& pol, attention_case<T>& c, const Mask& mask, const std::string& what,
                                 std::optional<logit_rounding> widen = {}) {
  INFO(policy_name<Policy>() << " " << scalar_name<T>() << " " << describe(c.p) << " " << mask_name(mask) << " "
                             << what);
  std::vector<float> lse(static_cast<std::size_t>(c.p.lse_size()), 123.0f);
  const status st = attend(pol, c.p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.view, mask, lse.data());
  INFO(st.what());
  REQUIRE(st.ok());
  expected e = expect(c, bind(mask, c.p));
  if (widen) {
    const rounding_bounds r = measure_rounding_bounds(c.p, c.q.cview(), c.k.cview(), c.v.cview(), bind(mask, c.p));
    std::tie(e.tolerance, e.lse_tolerance) =
        widen_tolerances<accum_t<T>>(e.tolerance, e.lse_tolerance, r, *widen, c.p.head_dim);
  }
  const problem& p = c.p;
  double err = 0, lse_err = 0;
  bool all_finite = true, empty_rows_exact = true;
  for (index_t b = 0; b < p.batch; ++b)
    for (index_t h = 0; h < p.heads; ++h)
      for (index_t i = 0; i < p.seq_q; ++i) {
        const std::size_t row = static_cast<std::size_t>((b * p.heads + h) * p.seq_q + i);
        const bool empty = std::isinf(e.ref.lse[row]);
        if (empty) empty_rows_exact &= lse[row] == -inf_f;
        else {
          all_finite &= std::isfinite(lse[row]);
          lse_err = std::max(lse_err, std::abs(static_cast<double>(lse[row]) - e.ref.lse[row]));
        }
        for (index_t col = 0; col < p.head_dim; ++col) {
          const double x = static_cast<double>(c.o.view.row(b, h, i)[col]);
          if (empty) empty_rows_exact &= x == 0.0;
          all_finite &= std::isfinite(x);
          err = std::max(err, std::abs(x - e.ref.o[row * static_cast<std::size_t>(p.head_dim) + col]));
        }
      }
  INFO("max error " << err << " tolerance " << e.tolerance << "; lse error " << lse_err << " tolerance "
                    << e.lse_tolerance);
  CHECK(all_finite);
  CHECK(empty_rows_exact);
  CHECK(err <= e.tolerance);
  CHECK(lse_err <= e.lse_tolerance);
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------------
// Validation: the checks that go beyond test_core.cpp. All operands live in one arena so that "nothing written"
// means the whole arena (inputs, output and lse) is bitwise unchanged.
// ---------------------------------------------------------------------------------------------------------------

TEMPLATE_LIST_TEST_CASE("reliability: hostile inputs are rejected with a reason and nothing written",
                        "[reliability][validate]", cpu_policies) {
  const TestType pol = make_policy<TestType>(2);
  const problem p{2, 4, 2, 5, 6, 8};
  // Arena offsets (floats): q [0, 320), k [400, 592), v [700, 892), o [1000, 1320), lse [1400, 1440).
  std::vector<float> arena(1500);
  std::mt19937_64 rng(fresh_seed());
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (float& x : arena) x = u(rng);
  const std::vector<float> before = arena;
  float* base = arena.data();
  const tensor_ref<const float> q = bhsd<const float>(base, p.q_dims());
  const tensor_ref<const float> k = bhsd<const float>(base + 400, p.kv_dims());
  const tensor_ref<const float> v = bhsd<const float>(base + 700, p.kv_dims());
  const tensor_ref<float> o = bhsd(base + 1000, p.o_dims());
  float* const lse = base + 1400;
  REQUIRE(validate(p, q, k, v, o, dense{}, lse).ok());
  REQUIRE(validate_policy(pol).ok());

  auto rejected = [&](const auto& pl, const problem& pr, tensor_ref<const float> qq, tensor_ref<const float> kk,
                      tensor_ref<const float> vv, tensor_ref<float> oo, float* ll, const std::string& fragment) {
    const status st = attend(pl, pr, qq, kk, vv, oo, dense{}, ll);
    INFO(policy_name<TestType>() << ": " << st.what());
    CHECK(st.code() == errc::invalid_argument);
    CHECK(st.message().find(fragment) != std::string::npos);
    CHECK(same_bits(arena, before));
  };

  SECTION("o overlapping part of q, k or v") {
    auto ob = o;
    ob.data = base + 100;  // [100, 420): the tail of q (and the head of k; q is reported first)
    rejected(pol, p, q, k, v, ob, lse, "o overlaps q");
    ob.data = base + 350;  // [350, 670): k only
    rejected(pol, p, q, k, v, ob, lse, "o overlaps k");
    ob.data = base + 680;  // [680, 1000): v only
    rejected(pol, p, q, k, v, ob, lse, "o overlaps v");
  }
  SECTION("lse overlapping q, k, v or o") {
    rejected(pol, p, q, k, v, o, base + 10, "lse overlaps q");
    rejected(pol, p, q, k, v, o, base + 590, "lse overlaps k");
    rejected(pol, p, q, k, v, o, base + 890, "lse overlaps v");
    rejected(pol, p, q, k, v, o, base + 1319, "lse overlaps o");
  }
  SECTION("o strides that make rows overlap") {
    auto ob = o;
    ob.stride.h = 0;  // every head on the same rows
    rejected(pol, p, q, k, v, ob, lse, "share memory");
    ob = o;
    ob.stride.s = 7;  // rows of 8 elements, 7 apart
    rejected(pol, p, q, k, v, ob, lse, "share memory");
    ob = o;
    ob.stride.b = 80;  // batch 1 starts inside batch 0's heads (4 heads × 40)
    rejected(pol, p, q, k, v, ob, lse, "share memory");
    // Control: the same memory as [b][s][h][d] is a valid permutation.
    REQUIRE(validate(p, q, k, v, bshd(base + 1000, p.o_dims()), dense{}, lse).ok());
  }
  SECTION("element offsets beyond 2^63") {
    auto kb = k;
    kb.stride.b = INT64_MAX - 4;
    rejected(pol, p, q, kb, v, o, lse, "beyond 2^63 elements");
    problem big = p;
    big.seq_kv = index_t(1) << 62;
    big.heads_kv = 4;
    rejected(pol, big, q, k, v, o, lse, "overflows 64 bits");
  }
  SECTION("byte spans beyond 2^63") {
    auto vb = v;
    vb.stride.s = index_t(1) << 60;  // 5 · 2^60 elements fit in int64, 4 bytes each do not
    rejected(pol, p, q, k, vb, o, lse, "v: the extents and strides span");
  }
  SECTION("views that wrap around the end of the address space") {
    auto vb = v;
    vb.data = reinterpret_cast<const float*>(std::numeric_limits<std::uintptr_t>::max() - 255);
    rejected(pol, p, q, k, vb, o, lse, "v: the view runs past the end of the address space");
    float* lse_top = reinterpret_cast<float*>(std::numeric_limits<std::uintptr_t>::max() - 63);
    rejected(pol, p, q, k, v, o, lse_top, "lse: 40 floats do not fit in the address space");
  }
  SECTION("a scale that is not a finite positive number in the accumulation type") {
    for (double s : {1e300, 1e-60, 1e-40}) {  // 1e-40: a subnormal f32, which the kernels would flush to 0
      problem bad = p;
      bad.scale = s;
      rejected(pol, bad, q, k, v, o, lse, "problem.scale is " + detail::str_double(s) + "; it is not a finite positive normal f32");
    }
    problem fine = p;
    fine.scale = 1e300;  // representable when the accumulation type is double
    const std::vector<double> qd(320, 0.5), kd(192, 0.5), vd(192, 0.5);
    std::vector<double> od(320);
    CHECK(validate(fine, bhsd(qd.data(), p.q_dims()), bhsd(kd.data(), p.kv_dims()), bhsd(vd.data(), p.kv_dims()),
                   bhsd(od.data(), p.o_dims()), dense{}, lse)
              .ok());
  }
  SECTION("thread counts <= 0") {
    for (int n : {0, -1, INT_MIN}) rejected(make_policy<TestType>(n), p, q, k, v, o, lse, "policy.threads is " + std::to_string(n));
  }
}

TEMPLATE_LIST_TEST_CASE("reliability: an lse whose byte count overflows 64 bits is rejected", "[reliability][validate]",
                        cpu_policies) {
  // f16 with head_dim 1: O's 2^61 + 1 elements take 2^62 + 2 bytes, but the same number of float lse values
  // takes more than 2^63. Q, K and V broadcast one element (stride 0), so no memory of that size exists.
  const problem p{1, 1, 1, (index_t(1) << 61) + 1, 1, 1};
  std::vector<Eigen::half> buf(8, Eigen::half(0.5f));
  const std::vector<Eigen::half> before = buf;
  std::vector<float> lse(4, 5.0f);
  const tensor_ref<const Eigen::half> in = strided<const Eigen::half>(buf.data(), p.q_dims(), {0, 0, 0, 1});
  const tensor_ref<const Eigen::half> kv = strided<const Eigen::half>(buf.data(), p.kv_dims(), {0, 0, 0, 1});
  const tensor_ref<Eigen::half> o = strided(buf.data() + 4, p.o_dims(), {0, 0, 1, 1});
  const status st = attend(make_policy<TestType>(1), p, in, kv, kv, o, dense{}, lse.data());
  INFO(st.what());
  CHECK(st.code() == errc::invalid_argument);
  CHECK(st.message().find("lse: 2305843009213693953 floats do not fit") != std::string::npos);
  CHECK(unchanged(buf, before));
  CHECK(lse == std::vector<float>(4, 5.0f));
}

// ---------------------------------------------------------------------------------------------------------------
// Numerics
// ---------------------------------------------------------------------------------------------------------------

namespace {
/// Rounds every element of the view down in magnitude to a multiple of `step`.
template <class T>
void snap_to_grid(const tensor_ref<T>& t, double step) {
  for (index_t b = 0; b < t.dims.b; ++b)
    for (index_t h = 0; h < t.dims.h; ++h)
      for (index_t i = 0; i < t.dims.s; ++i)
        for (index_t c = 0; c < t.dims.d; ++c) {
          T& x = t.row(b, h, i)[c];
          x = static_cast<T>(std::trunc(static_cast<double>(x) / step) * step);
        }
}

/// Q and K in [−a, a] with scale · head_dim · a² = 1e4, so |logit| <= 1e4; query row 0 of every head meets one
/// key at about +1e4 and one at about −1e4 (rows of all +a against all +a and all −a). Q and K sit on a grid of
/// 6 significant bits so every partial dot product is exact in float and the logits carry only the kernel's
/// own rounding (the tolerance allows a few roundings of each logit).
template <class T, class Policy>
void large_logits(const Policy& pol, problem p, std::optional<double> scale) {
  p.scale = scale;
  const double a_exact = std::sqrt(1e4 / (p.softmax_scale() * static_cast<double>(p.head_dim)));
  const double step = std::ldexp(1.0, static_cast<int>(std::floor(std::log2(a_exact))) - 5);
  const double a = std::floor(a_exact / step) * step;
  for (const any_mask& m : all_masks()) {
    const std::uint64_t seed = fresh_seed();
    std::mt19937_64 rng(seed);
    attention_case<T> c(p, layout::bhsd, rng);
    fill_view(c.q.view, rng, -a, a);
    fill_view(c.k.view, rng, -a, a);
    snap_to_grid(c.q.view, step);
    snap_to_grid(c.k.view, step);
    for (index_t b = 0; b < p.batch; ++b)
      for (index_t g = 0; g < p.heads_kv; ++g)
        for (index_t col = 0; col < p.head_dim; ++col) {
          c.k.view.row(b, g, 1)[col] = static_cast<T>(a);
          c.k.view.row(b, g, 2)[col] = static_cast<T>(-a);
        }
    for (index_t b = 0; b < p.batch; ++b)
      for (index_t h = 0; h < p.heads; ++h)
        for (index_t col = 0; col < p.head_dim; ++col) c.q.view.row(b, h, 0)[col] = static_cast<T>(a);
    std::visit([&](const auto& mask) { check_finite_against_oracle(pol, c, mask, "seed=" + std::to_string(seed), logit_rounding::exact_dots); },
               m);
  }
}
}  // namespace

TEMPLATE_LIST_TEST_CASE("reliability: logits up to +-1e4 and scale up to 1e3 stay finite and match the oracle",
                        "[reliability][numerics]", cpu_policies) {
  const TestType pol = make_policy<TestType>(2);
  struct config {
    problem p;
    std::optional<double> scale;  // empty: 1/sqrt(head_dim)
  };
  const config configs[] = {{{1, 2, 1, 33, 47, 16}, 1e3}, {{1, 2, 1, 33, 47, 16}, {}}, {{2, 1, 1, 7, 130, 32}, 1e3},
                            {{2, 1, 1, 7, 130, 64}, {}}};
  for (const config& cf : configs) {
    large_logits<float>(pol, cf.p, cf.scale);
    large_logits<double>(pol, cf.p, cf.scale);
    large_logits<Eigen::half>(pol, cf.p, cf.scale);
    large_logits<Eigen::bfloat16>(pol, cf.p, cf.scale);
  }
}

TEMPLATE_LIST_TEST_CASE("reliability: rows that see no key give O = 0 and lse = -inf, the others match",
                        "[reliability][numerics]", cpu_policies) {
  const TestType pol = make_policy<TestType>(2);
  const problem p{1, 3, 3, 20, 6, 8};  // seq_q > seq_kv: many rows see nothing under these masks
  const any_mask masks[] = {causal{align::bottom_right}, window{0, 2, align::top_left},
                            window{1, 1, align::bottom_right}};
  for (const any_mask& m : masks) {
    std::mt19937_64 rng(fresh_seed());
    attention_case<float> c(p, layout::padded, rng);
    std::visit([&](const auto& mask) { check_finite_against_oracle(pol, c, mask, ""); }, m);
    attention_case<double> cd(p, layout::bshd, rng);
    std::visit([&](const auto& mask) { check_finite_against_oracle(pol, cd, mask, ""); }, m);
  }
}

namespace {
enum class nan_in { q, k, v };

/// Where nan_propagation puts its NaN: q(b, h, i, c), or k / v(b, g, j, c).
struct nan_site {
  index_t b, h, i, g, j, c;
};

/// Puts one NaN into Q, K or V and checks that exactly the affected outputs are NaN (docs/design.md, Numerics):
///   q(b, h, i, ·)  → the whole O row (b, h, i) and lse(b, h, i);
///   k(b, g, j, ·)  → the whole O row and lse of every (b, h, i) with kv_head(h) = g and allowed(i, j);
///   v(b, g, j, c)  → element c of the O row of every such (b, h, i); lse untouched.
/// Every other output is finite and within the oracle tolerance. `tiles` go to the flash policies (small tiles
/// put the NaN in partial tiles next to rows that skip its key; kv_split > 1 runs the decode split's merge).
template <class T, class Policy, class Mask>
void nan_propagation(Policy pol, nan_in where, const Mask& mask, layout l, const problem& p, const nan_site& at,
                     tile_sizes tiles = {}) {
  set_tiles(pol, tiles);
  const std::uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  attention_case<T> c(p, l, rng);
  const T nan = static_cast<T>(std::numeric_limits<float>::quiet_NaN());
  if (where == nan_in::q) c.q.view.row(at.b, at.h, at.i)[at.c] = nan;
  if (where == nan_in::k) c.k.view.row(at.b, at.g, at.j)[at.c] = nan;
  if (where == nan_in::v) c.v.view.row(at.b, at.g, at.j)[at.c] = nan;
  const auto bound = bind(mask, p);
  const char* names[] = {"q", "k", "v"};
  INFO(policy_name<Policy>() << " " << scalar_name<T>() << " NaN in " << names[static_cast<int>(where)] << " "
                             << describe(p) << " " << mask_name(mask) << " " << layout_name(l) << " tiles "
                             << tiles.q << "/" << tiles.kv << "/" << tiles.kv_split << " seed=" << seed);

  std::vector<float> lse(static_cast<std::size_t>(p.lse_size()), 123.0f);
  const status st = attend(pol, p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.view, mask, lse.data());
  INFO(st.what());
  REQUIRE(st.ok());
  const expected e = expect(c, bound);

  auto row_affected = [&](index_t b, index_t h, index_t i) {
    if (where == nan_in::q) return b == at.b && h == at.h && i == at.i;
    return b == at.b && p.kv_head(h) == at.g && for_head(bound, b, h).allowed(i, at.j);
  };
  index_t affected_rows = 0, wrong_nan = 0, missing_nan = 0, wrong_lse = 0;
  double missing_example = 0, lse_example = 0;
  double err = 0, lse_err = 0;
  for (index_t b = 0; b < p.batch; ++b)
    for (index_t h = 0; h < p.heads; ++h)
      for (index_t i = 0; i < p.seq_q; ++i) {
        const bool hit = row_affected(b, h, i);
        affected_rows += hit;
        const std::size_t row = static_cast<std::size_t>((b * p.heads + h) * p.seq_q + i);
        const bool lse_hit = hit && where != nan_in::v;
        const bool lse_ok = lse_hit                       ? std::isnan(lse[row])
                            : std::isinf(e.ref.lse[row]) ? lse[row] == -inf_f
                                                         : std::isfinite(lse[row]);
        if (!lse_ok) {
          ++wrong_lse;
          lse_example = lse[row];
        } else if (!lse_hit && std::isfinite(lse[row])) {
          lse_err = std::max(lse_err, std::abs(lse[row] - e.ref.lse[row]));
        }
        for (index_t col = 0; col < p.head_dim; ++col) {
          const double x = static_cast<double>(c.o.view.row(b, h, i)[col]);
          const bool elem_hit = hit && (where != nan_in::v || col == at.c);
          if (elem_hit) {
            if (!std::isnan(x)) {
              ++missing_nan;
              missing_example = x;
            }
          }
          else if (!std::isfinite(x)) ++wrong_nan;
          else err = std::max(err, std::abs(x - e.ref.o[row * static_cast<std::size_t>(p.head_dim) + col]));
        }
      }
  INFO("affected rows " << affected_rows << "; outputs that should be NaN but are not: " << missing_nan
                        << " (e.g. " << missing_example << "); non-finite outputs that should be finite: " << wrong_nan
                        << "; wrong lse: " << wrong_lse << " (e.g. " << lse_example << "); max error " << err
                        << " tolerance " << e.tolerance << "; lse error " << lse_err);
  CHECK(affected_rows > 0);
  if (nan_propagation_known_gap<Policy>) {
    WARN("known gap (test_reliability_support.hpp, nan_propagation_known_gap): reported, not failing");
    CHECK_NOFAIL(missing_nan == 0);
    CHECK_NOFAIL(wrong_nan == 0);
    CHECK_NOFAIL(wrong_lse == 0);
  } else {
    CHECK(missing_nan == 0);
    CHECK(wrong_nan == 0);
    CHECK(wrong_lse == 0);
  }
  CHECK(err <= e.tolerance);
  CHECK(lse_err <= e.lse_tolerance);
}
}  // namespace

TEMPLATE_LIST_TEST_CASE("reliability: a NaN reaches only the outputs that depend on it", "[reliability][numerics]",
                        cpu_policies) {
  const TestType pol = make_policy<TestType>(2);
  const problem p{2, 4, 2, 9, 11, 19};
  const nan_site at{1, 2, 4, 1, 5, 7};
  // Decode: one query row over 1100 keys, which the heuristic splits into chunks merged by log-sum-exp; the NaN
  // sits in the second chunk.
  const problem decode{1, 2, 1, 1, 1100, 16};
  const nan_site at_decode{0, 1, 0, 0, 700, 9};
  // Per-(batch, head) block patterns of 2 × 3 blocks, intersected with an element rule.
  const block_layout layout = random_layout(block_geometry{p.seq_q, p.seq_kv, 2, 3, p.batch, p.heads}, 0.3, 5);
  for (nan_in where : {nan_in::q, nan_in::k, nan_in::v}) {
    nan_propagation<float>(pol, where, dense{}, layout::bhsd, p, at);
    nan_propagation<float>(pol, where, causal{}, layout::bshd, p, at);
    nan_propagation<float>(pol, where, window{2, 1}, layout::padded, p, at);
    nan_propagation<float>(pol, where, causal{align::bottom_right}, layout::bhsd, p, at);
    // Every scalar type, with tiles of 4 × 4 keys (the NaN's key in a partial tile of rows that skip it).
    nan_propagation<double>(pol, where, causal{}, layout::bhsd, p, at, {4, 4, 0});
    nan_propagation<Eigen::half>(pol, where, window{2, 1}, layout::bshd, p, at, {4, 4, 0});
    nan_propagation<Eigen::bfloat16>(pol, where, causal{align::bottom_right}, layout::padded, p, at, {4, 4, 0});
    // The decode split and its merge: forced on the small problem (3 chunks of 4 keys), and by the heuristic.
    nan_propagation<float>(pol, where, window{3, 0}, layout::bhsd, p, at, {4, 4, 3});
    nan_propagation<double>(pol, where, causal{}, layout::bshd, p, at, {0, 0, 3});
    nan_propagation<float>(pol, where, dense{}, layout::bhsd, decode, at_decode);
    nan_propagation<float>(pol, where, window{500, 0, align::bottom_right}, layout::bshd, decode, at_decode);
    // Block-sparse masks.
    nan_propagation<float>(pol, where, block_sparse{layout, causal{}}, layout::bhsd, p, at, {4, 4, 0});
    nan_propagation<Eigen::half>(pol, where, block_sparse{layout, dense{}}, layout::padded, p, at);
    // More threads (5) than kv heads (4): flash packs K/V once for all threads, and a thread's per-panel flags
    // must still follow the kv head it works on.
    nan_propagation<float>(make_policy<TestType>(5), where, window{2, 1}, layout::bhsd, p, at, {4, 4, 0});
  }
}

TEMPLATE_LIST_TEST_CASE("reliability: NaN outside the views (gaps between rows, O's prior content) changes nothing",
                        "[reliability][numerics]", cpu_policies) {
  const TestType pol = make_policy<TestType>(2);
  const problem p{2, 2, 1, 13, 17, 24};
  std::mt19937_64 rng(fresh_seed());
  attention_case<float> c(p, layout::padded, rng);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (auto* op : {&c.q, &c.k, &c.v, &c.o}) std::fill(op->buf.begin(), op->buf.end(), nan);
  fill_view(c.q.view, rng, -1, 1);
  fill_view(c.k.view, rng, -1, 1);
  fill_view(c.v.view, rng, -1, 1);
  check_finite_against_oracle(pol, c, window{4, 4}, "NaN gaps");
  // The gaps of O are still NaN: nothing outside the view was written.
  index_t in_view = 0, nan_left = 0;
  for (float x : c.o.buf) nan_left += std::isnan(x);
  in_view = p.batch * p.heads * p.seq_q * p.head_dim;
  CHECK(nan_left == static_cast<index_t>(c.o.buf.size()) - in_view);
}

TEMPLATE_LIST_TEST_CASE("reliability: one query over 2^20 keys stays within the oracle tolerance",
                        "[reliability][numerics][long]", cpu_policies) {
  const TestType pol = make_policy<TestType>(2);
  const problem p{1, 1, 1, 1, index_t(1) << 20, 4};
  std::mt19937_64 rng(fresh_seed());
  attention_case<float> c(p, layout::bhsd, rng);
  check_finite_against_oracle(pol, c, dense{}, "long row");
  // Keys with large logits spread over the row: the running maximum moves late in the sequence.
  fill_view(c.q.view, rng, 2, 3);
  fill_view(c.k.view, rng, -3, 3);
  check_finite_against_oracle(pol, c, causal{align::bottom_right}, "long row, large logits");
}

TEMPLATE_LIST_TEST_CASE("reliability: subnormal inputs count as 0, within the oracle tolerance, FP mode restored",
                        "[reliability][numerics][subnormal_mode]", cpu_policies) {
  // Every value of an operand in ±1e-39 (below FLT_MIN = 1.18e-38: all subnormal) or ±1e-310 (f64).
  const problem p{2, 3, 3, 21, 34, 24};
  for (int threads : {1, 2}) {
    const TestType pol = make_policy<TestType>(threads);
    for (const char* which : {"q", "k", "v"}) {
      std::mt19937_64 rng(fresh_seed());
      attention_case<float> c(p, layout::bshd, rng);
      attention_case<double> cd(p, layout::bhsd, rng);
      if (which[0] == 'q') fill_view(c.q.view, rng, -1e-39, 1e-39), fill_view(cd.q.view, rng, -1e-310, 1e-310);
      if (which[0] == 'k') fill_view(c.k.view, rng, -1e-39, 1e-39), fill_view(cd.k.view, rng, -1e-310, 1e-310);
      if (which[0] == 'v') fill_view(c.v.view, rng, -1e-39, 1e-39), fill_view(cd.v.view, rng, -1e-310, 1e-310);
#if defined(__SSE__)
      const unsigned csr_before = _mm_getcsr();
#endif
      check_finite_against_oracle(pol, c, causal{}, std::string("subnormal ") + which);
      check_finite_against_oracle(pol, cd, window{5, 2}, std::string("subnormal ") + which);
#if defined(__SSE__)
      CHECK(_mm_getcsr() == csr_before);  // the calling thread's mode (no FTZ/DAZ) is back
#endif
      if (which[0] != 'v') continue;
#if defined(__SSE__) || (defined(__aarch64__) && defined(__GNUC__))
      // Flushed in every thread: P·V reads each subnormal v as 0, so every O element is exactly 0.
      index_t nonzero = 0;
      for (index_t b = 0; b < p.batch; ++b)
        for (index_t h = 0; h < p.heads; ++h)
          for (index_t i = 0; i < p.seq_q; ++i)
            for (index_t col = 0; col < p.head_dim; ++col) nonzero += c.o.view.row(b, h, i)[col] != 0.0f;
      INFO(policy_name<TestType>() << " threads " << threads << ": " << nonzero << " nonzero O elements");
      CHECK(nonzero == 0);
#endif
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Determinism
// ---------------------------------------------------------------------------------------------------------------

namespace {
template <class T, class Policy>
void bitwise_deterministic(const problem& p, const any_mask& mask) {
  std::mt19937_64 rng(fresh_seed());
  attention_case<T> c(p, layout::bshd, rng);
  std::vector<T> o_first;
  std::vector<float> lse_first;
  for (int run = 0; run < 2; ++run)
    for (int threads : {1, 2, 3, 8}) {
      INFO(policy_name<Policy>() << " " << scalar_name<T>() << " " << describe(p) << " " << describe(mask)
                                 << " run " << run << " threads " << threads);
      std::fill(c.o.buf.begin(), c.o.buf.end(), T(7.0f));
      std::vector<float> lse(static_cast<std::size_t>(p.lse_size()), 5.0f);
      REQUIRE(attend(make_policy<Policy>(threads), p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.view, mask,
                     lse.data())
                  .ok());
      if (o_first.empty()) {
        o_first = c.o.buf;
        lse_first = lse;
        continue;
      }
      CHECK(same_bits(c.o.buf, o_first));
      CHECK(same_bits(lse, lse_first));
    }
}
}  // namespace

TEMPLATE_LIST_TEST_CASE("reliability: bitwise the same output across runs and thread counts",
                        "[reliability][determinism]", cpu_policies) {
  const problem shapes[] = {{2, 3, 3, 77, 130, 40}, {1, 4, 2, 130, 77, 64}};
  for (const problem& p : shapes)
    for (const any_mask& m : {any_mask(dense{}), any_mask(causal{align::bottom_right}), any_mask(window{9, 3})}) {
      bitwise_deterministic<float, TestType>(p, m);
      bitwise_deterministic<Eigen::half, TestType>(p, m);
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Memory: a long sequence under a capped address space
// ---------------------------------------------------------------------------------------------------------------

namespace {
/// Exit codes of the capped child.
enum capped_result : int {
  capped_ok = 0,            ///< succeeded, sampled rows match the oracle
  capped_oom_clean = 10,    ///< out_of_memory, nothing written
  capped_oom_written = 11,  ///< out_of_memory, but O or lse changed
  capped_other_error = 20,  ///< another error status
  capped_wrong = 30,        ///< succeeded with wrong rows
  capped_no_limit = 40,     ///< setrlimit failed
};

/// Virtual memory of this process in bytes (/proc/self/statm, first field, in pages).
index_t virtual_memory_bytes() {
  std::ifstream statm("/proc/self/statm");
  index_t pages = 0;
  statm >> pages;
  return pages * static_cast<index_t>(sysconf(_SC_PAGESIZE));
}

/// Max |o − oracle| of query row i under window{left, 0} (top-left), from the oracle on that row's keys alone.
double window_row_error(const problem& p, const attention_case<float>& c, index_t i, index_t left) {
  const index_t j0 = std::max<index_t>(0, i - left);
  const problem sub{1, 1, 1, 1, i - j0 + 1, p.head_dim};
  const tensor_ref<const float> q{c.q.view.row(0, 0, i), sub.q_dims(), c.q.view.stride};
  const tensor_ref<const float> k{c.k.view.row(0, 0, j0), sub.kv_dims(), c.k.view.stride};
  const tensor_ref<const float> v{c.v.view.row(0, 0, j0), sub.kv_dims(), c.v.view.stride};
  const reference ref = reference_attention<double>(sub, q, k, v, bind(dense{}, sub));
  double err = 0;
  for (index_t col = 0; col < p.head_dim; ++col)
    err = std::max(err, std::abs(static_cast<double>(c.o.view.row(0, 0, i)[col]) - ref.o[static_cast<std::size_t>(col)]));
  return err;
}
}  // namespace

TEMPLATE_LIST_TEST_CASE("reliability: a long sequence under a capped address space allocates no O(S^2) memory",
                        "[reliability][memory]", cpu_policies) {
  if (FUSEDATTN_TEST_ASAN) {
    WARN("skipped: AddressSanitizer reserves terabytes of address space, so RLIMIT_AS cannot cap it");
    return;
  }
  // S = 2^16, window of 64 keys: the work is O(S·64·d), the naive score matrix S² floats = 16 GiB.
  const index_t s = index_t(1) << 16, left = 64;
  const problem p{1, 1, 1, s, s, 16};
  std::mt19937_64 rng(fresh_seed());
  attention_case<float> c(p, layout::bhsd, rng);
  const index_t headroom = index_t(512) << 20;

  const pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    // Child: copy O for the "nothing written" check, cap the address space, run on one thread.
    const std::vector<float> o_before = c.o.buf;
    std::vector<float> lse(static_cast<std::size_t>(p.lse_size()), 5.0f);
    const std::vector<float> lse_before = lse;
    const rlimit cap{static_cast<rlim_t>(virtual_memory_bytes() + headroom),
                     static_cast<rlim_t>(virtual_memory_bytes() + headroom)};
    if (setrlimit(RLIMIT_AS, &cap) != 0) _exit(capped_no_limit);
    const status st = attend(make_policy<TestType>(1), p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.view,
                             window{left, 0}, lse.data());
    if (st.code() == errc::out_of_memory)
      _exit(same_bits(c.o.buf, o_before) && same_bits(lse, lse_before) ? capped_oom_clean : capped_oom_written);
    if (!st.ok()) _exit(capped_other_error);
    for (index_t i : {index_t(0), index_t(1), left, left + 1, s / 2 + 3, s - 1})
      if (!(window_row_error(p, c, i, left) <= 1e-5)) _exit(capped_wrong);
    _exit(capped_ok);
  }
  int wstatus = 0;
  REQUIRE(waitpid(pid, &wstatus, 0) == pid);
  INFO(policy_name<TestType>() << ": child " << (WIFEXITED(wstatus) ? "exited with " : "killed by signal ")
                               << (WIFEXITED(wstatus) ? WEXITSTATUS(wstatus) : WTERMSIG(wstatus)));
  REQUIRE(WIFEXITED(wstatus));
  if (linear_memory<TestType>)
    CHECK(WEXITSTATUS(wstatus) == capped_ok);
  else
    CHECK(WEXITSTATUS(wstatus) == capped_oom_clean);
}

// ---------------------------------------------------------------------------------------------------------------
// Benchmark (hidden; run by hand): subnormal inputs against normal ones, one thread. Not a timed test: it prints
// the median CPU time of the calling thread (the kernels run on it when threads = 1) and the wall time.
//   ./build/rel/tests/test_reliability "[subnormal]"
// ---------------------------------------------------------------------------------------------------------------

namespace {
double thread_cpu_ms() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) * 1e3 + static_cast<double>(ts.tv_nsec) * 1e-6;
}
}  // namespace

TEMPLATE_LIST_TEST_CASE("reliability bench: subnormal inputs", "[.][bench][subnormal]", cpu_policies) {
  const problem p{1, 4, 4, 512, 512, 64};
  const TestType pol = make_policy<TestType>(1);
  const double tiny = 1e-39;  // below FLT_MIN = 1.18e-38: every scaled value is a float subnormal
  struct config {
    const char* name;
    double q, k, v;
    bool ftz;
  };
  const config configs[] = {{"normal", 1, 1, 1, false},         {"q,k subnormal", tiny, tiny, 1, false},
                            {"v subnormal", 1, 1, tiny, false},    {"q,k,v subnormal", tiny, tiny, tiny, false},
                            {"q,k,v subnormal, FTZ+DAZ", tiny, tiny, tiny, true}};
  constexpr int reps = 9;
  double normal_cpu = 0;
  for (const config& cf : configs) {
#if defined(__SSE3__)
    // The caller's remedy: flush-to-zero and denormals-are-zero in this thread's MXCSR (the kernels run on the
    // calling thread when threads = 1); restored after the timing.
    const unsigned csr = _mm_getcsr();
    if (cf.ftz) _mm_setcsr(csr | _MM_FLUSH_ZERO_ON | _MM_DENORMALS_ZERO_ON);
#else
    if (cf.ftz) continue;
#endif
    std::mt19937_64 rng(42);
    attention_case<float> c(p, layout::bhsd, rng);
    fill_view(c.q.view, rng, -cf.q, cf.q);
    fill_view(c.k.view, rng, -cf.k, cf.k);
    fill_view(c.v.view, rng, -cf.v, cf.v);
    REQUIRE(attend(pol, p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.view, dense{}).ok());  // warm-up
    std::vector<double> cpu, wall;
    for (int rep = 0; rep < reps; ++rep) {
      const double c0 = thread_cpu_ms();
      const auto t0 = std::chrono::steady_clock::now();
      REQUIRE(attend(pol, p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.view, dense{}).ok());
      wall.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
      cpu.push_back(thread_cpu_ms() - c0);
    }
    std::sort(cpu.begin(), cpu.end());
    std::sort(wall.begin(), wall.end());
    const double med_cpu = cpu[reps / 2], med_wall = wall[reps / 2];
    if (normal_cpu == 0) normal_cpu = med_cpu;
    WARN(policy_name<TestType>() << " " << describe(p) << " f32 dense 1 thread, " << cf.name << ": median of "
                                 << reps << " CPU " << med_cpu << " ms (" << med_cpu / normal_cpu
                                 << "x normal), wall " << med_wall << " ms");
#if defined(__SSE3__)
    _mm_setcsr(csr);
#endif
  }
}
