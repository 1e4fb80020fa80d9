/// @file lowp_check.hpp
/// The low-precision checks shared by test_lowp, test_amx and test_arm_bf16: operands converted between storage
/// types, the 2x-plain accuracy rule (a plain f32 implementation's O and lse error against float64, the bf16 half-ulp
/// floor), the bf16 sets' score-modifier check, and the check that keys outside a bf16-pair tile never reach a row.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <type_traits>
#include <vector>

#include "check.hpp"

namespace fusedattn {
namespace testing {

/// Writes the values of `from` into `to` (an operand of the same dims) as To: exact when To is wider, rounded when
/// it is narrower.
template <class To, class From>
void convert(const operand<From>& from, operand<To>& to) {
  const dims4 d = from.view.dims;
  for (index_t b = 0; b < d.b; ++b)
    for (index_t h = 0; h < d.h; ++h)
      for (index_t i = 0; i < d.s; ++i)
        for (index_t c = 0; c < d.d; ++c) to.view.row(b, h, i)[c] = static_cast<To>(from.view.row(b, h, i)[c]);
}

/// Max |o − ref| of a plain f32 implementation on the same inputs, its output rounded to `Out`.
template <class Out>
double plain_error(const reference& plain, const reference& exact) {
  double err = 0;
  for (std::size_t i = 0; i < plain.o.size(); ++i)
    err = std::max(err, std::abs(static_cast<double>(static_cast<Out>(plain.o[i])) - exact.o[i]));
  return err;
}

/// Max lse error of a plain f32 implementation against float64.
inline double plain_lse_error(const reference& plain, const reference& exact) {
  std::vector<float> lse(plain.lse.begin(), plain.lse.end());
  return max_lse_error(lse, exact.lse);
}

/// Half an ulp of bf16 at the largest |O| of the float64 result: what rounding alone may cost a plain implementation
/// whose output is bf16. The kernels that round P to bf16 (vdpbf16ps, AMX) may land one such rounding on the other
/// side of a midpoint; the 2x rule counts from at least this floor.
inline double bf16_half_ulp(const reference& exact) {
  double big = 0;
  for (double x : exact.o) big = std::max(big, std::abs(x));
  return big > 0 ? std::ldexp(1.0, std::ilogb(big) - 8) : 0.0;
}

/// The error the rule counts from for kernels that feed P to bf16 dot products: the largest of a plain f32
/// implementation's error, that of the same implementation with each probability rounded to bf16 before P·V (the
/// same-precision plain implementation, as PyTorch's bf16 math path), both with the output rounded to bf16, and
/// bf16_half_ulp. q, k, v, mask: the inputs the kernel read, in any storage type.
template <class T, class Mask>
double bf16_plain_error(const problem& p, const tensor_ref<const T>& q, const tensor_ref<const T>& k,
                        const tensor_ref<const T>& v, const Mask& mask, const reference& plain,
                        const reference& exact) {
  const reference rounded_p = reference_attention<float, Eigen::bfloat16>(p, q, k, v, mask);
  return std::max({plain_error<Eigen::bfloat16>(plain, exact), plain_error<Eigen::bfloat16>(rounded_p, exact),
                   bf16_half_ulp(exact)});
}

/// The rule on O alone: max |o − exact| within 2x `plain_err` + 1e-7 (a NaN anywhere in O is an infinite error).
template <class Out>
void check_lowp_output(const tensor_ref<Out>& o, const reference& exact, double plain_err) {
  const double err = max_abs_error(o, exact.o);
  INFO("max error " << err << ", plain implementation rounded to the output type " << plain_err);
  CHECK(err <= 2.0 * plain_err + 1e-7);
}

/// The low-precision rule on one call's outputs: O (`o`, a view of Out) within 2x the error of a plain f32
/// implementation rounded to Out (for bf16 output at least `bf16_err`, bf16_plain_error's value) + 1e-7, and lse
/// within 2x the plain lse error + lse_floor. exact / plain: the float64 and f32 references on the inputs the kernel
/// read.
template <class Out>
void check_lowp_rule(const tensor_ref<Out>& o, const std::vector<float>& lse, const reference& exact,
                     const reference& plain, double lse_floor, double bf16_err = 0) {
  double plain_err = plain_error<Out>(plain, exact);
  if (std::is_same<Out, Eigen::bfloat16>::value) plain_err = std::max(plain_err, bf16_err);
  check_lowp_output(o, exact, plain_err);
  const double lse_err = max_lse_error(lse, exact.lse), plain_lse = plain_lse_error(plain, exact);
  INFO("lse error " << lse_err << ", plain " << plain_lse);
  CHECK(lse_err <= 2.0 * plain_lse + lse_floor);
}

/// A range [lo, hi) a per-head parameter is drawn from.
struct draw_range {
  float lo = 0, hi = 0;
};

/// A bf16 kernel set's score modifiers against float64: fresh bf16 inputs (bhsd, Q and K in [-2, 2]) under
/// `base | softcap{cap} | alibi{slopes, base.alignment} | sinks{logits}`, each head's slope and sink logit drawn
/// from `slopes` and `logits`; `pol` runs it (O and lse) and check_lowp_rule holds both to the bf16 rule with
/// `lse_floor`.
template <class Policy, class Base>
void check_bf16_modifiers(const Policy& pol, const problem& p, const Base& base, float cap, draw_range slopes,
                          draw_range logits, double lse_floor) {
  const std::uint64_t seed = fresh_seed();
  CAPTURE(seed, describe(p), base.alignment == align::top_left);
  std::mt19937_64 rng(seed);
  attention_case<Eigen::bfloat16> c(p, layout::bhsd, rng);
  c.q.fill(rng, -2.0, 2.0);
  c.k.fill(rng, -2.0, 2.0);
  std::uniform_real_distribution<float> slope(slopes.lo, slopes.hi), logit(logits.lo, logits.hi);
  std::vector<float> slope_of, logit_of;
  for (index_t h = 0; h < p.heads; ++h) {
    slope_of.push_back(slope(rng));
    logit_of.push_back(logit(rng));
  }
  const auto mask = base | softcap{cap} | alibi{slope_of.data(), base.alignment} | sinks{logit_of.data()};
  std::vector<float> lse(static_cast<std::size_t>(p.lse_size()));
  REQUIRE(attend(pol, p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.view, mask, lse.data()).ok());
  const auto bound = bind(mask, p);
  const reference exact = reference_attention<double>(p, c.q.cview(), c.k.cview(), c.v.cview(), bound);
  const reference plain = reference_attention<float>(p, c.q.cview(), c.k.cview(), c.v.cview(), bound);
  check_lowp_rule(c.o.view, lse, exact, plain, lse_floor,
                  bf16_plain_error(p, c.q.cview(), c.k.cview(), c.v.cview(), bound, plain, exact));
}

/// One round's shape for check_unseen_keys_stay_out: the problem and the key count of its layout's kv blocks.
struct sparse_shape {
  problem p;
  index_t block_kv = 0;
};

/// Kernels that read keys in bf16 pairs must not let a key outside a tile reach a row: block-sparse tiles are not
/// partial, so a tile of an odd key count pairs its last key with the next one, which the tile's rows may not see.
/// Each of `rounds` rounds draws a fresh seed, a random block-sparse layout of shape_of(round) (4-row q blocks,
/// kv blocks of block_kv keys, density 0.6) and fresh bf16 inputs (bhsd), puts NaN in every V row that no query of
/// any head sees, runs `pol` (O and lse) and holds O to the bf16 rule (check_lowp_output at bf16_plain_error). A
/// layout that leaves no key unseen runs nothing. Returns the rounds that held a NaN key.
template <class Policy, class ShapeOf>
int check_unseen_keys_stay_out(const Policy& pol, int rounds, ShapeOf&& shape_of) {
  using bf16 = Eigen::bfloat16;
  int poisoned_rounds = 0;
  for (int round = 0; round < rounds; ++round) {
    const std::uint64_t seed = fresh_seed();
    CAPTURE(seed, round);
    std::mt19937_64 rng(seed);
    const sparse_shape shape = shape_of(round);
    const problem& p = shape.p;
    const block_layout blocks = random_layout(block_geometry{p.seq_q, p.seq_kv, 4, shape.block_kv}, 0.6, seed);
    const block_sparse mask{blocks};
    const auto bound = bind(mask, p);
    attention_case<bf16> c(p, layout::bhsd, rng);
    int poisoned = 0;
    for (index_t j = 0; j < p.seq_kv; ++j) {
      bool seen = false;
      for (index_t h = 0; h < p.heads; ++h)
        for (index_t i = 0; i < p.seq_q; ++i) seen |= for_head(bound, 0, h).allowed(i, j);
      if (seen) continue;
      ++poisoned;
      for (index_t x = 0; x < p.head_dim; ++x) c.v.view.row(0, 0, j)[x] = std::numeric_limits<bf16>::quiet_NaN();
    }
    if (poisoned == 0) continue;
    ++poisoned_rounds;
    std::vector<float> lse(static_cast<std::size_t>(p.lse_size()));
    REQUIRE(attend(pol, p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.view, mask, lse.data()).ok());
    const reference exact = reference_attention<double>(p, c.q.cview(), c.k.cview(), c.v.cview(), bound);
    const reference plain = reference_attention<float>(p, c.q.cview(), c.k.cview(), c.v.cview(), bound);
    INFO("keys holding NaN " << poisoned);
    check_lowp_output(c.o.view, exact,
                      bf16_plain_error(p, c.q.cview(), c.k.cview(), c.v.cview(), bound, plain, exact));
  }
  return poisoned_rounds;
}

}  // namespace testing
}  // namespace fusedattn
