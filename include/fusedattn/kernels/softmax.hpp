/// @file softmax.hpp
/// The SIMD layer of the CPU online softmax: one tile row at a time, in base 2, around the scalar state of
/// core/online_softmax.hpp; and the score modifiers applied to a row of scores. No tiling or masking here.
#pragma once

#include <cmath>
#include <limits>
#include <type_traits>

#include "../core/online_softmax.hpp"
#include "../core/score_mod.hpp"
#include "../core/types.hpp"
#include "../cpu/simd.hpp"
#include "../cpu/x86_kernels.hpp"

namespace fusedattn {
namespace kernels {

/// The score modifiers a bound mask carries (`mods_of(mask)`), or none for a mask type without them (a rule
/// written for one kernel or test).
template <class Mask>
auto mods_or_none(const Mask& m, int) -> decltype(bound_mods(mods_of(m))) {
  return mods_of(m);
}
template <class Mask>
bound_mods mods_or_none(const Mask&, long) {
  return {};
}

/// Turns one row of raw scores into base-2 logits with the score modifiers applied (core/score_mod.hpp):
///   t_j = log2e · (cap(scale·s_j) + bias(h, i, key0 + j)),  j in [0, cols)  (cols a multiple of the vector width),
/// where cap(x) = softcap·tanh(x / softcap) and bias = −slope_h·|key0 + j − (i + alibi_offset)|. The caller then runs
/// online_softmax_row with c = 1. Keys the mask forbids are set to −inf after this step (a modifier never unmasks).
/// Only called on rows whose call has mods.changes_scores(); the test is the caller's, once per tile.
/// `cap_grad`, when not null (the backward pass), receives d cap(x)/dx = 1 − tanh²(x / softcap) per column (1 without
/// softcap): the factor of softcap's chain rule.
/// NaN in s stays NaN (tanh(NaN) = NaN); ±inf is capped to ±softcap when softcap is on.
template <class Acc, class Arch>
inline void modify_row(Acc* s, index_t cols, Acc scale, const bound_mods& mods, index_t h, index_t i, index_t key0,
                       Acc* cap_grad = nullptr) {
  using VA = cpu::xsimd_arch_t<Arch>;  // fusedattn's own arch tags compute this step on the compiled xsimd arch
  using V = cpu::simd<Acc, VA>;
  using vec = typename V::type;
  constexpr index_t W = V::width;
  const bool capped = mods.softcap != 0.f;
  const Acc cap = static_cast<Acc>(mods.softcap);
  const Acc in_scale = capped ? scale / cap : scale;
  const Acc out_scale = static_cast<Acc>(log2e) * (capped ? cap : Acc(1));
  // ALiBi: −slope·|key0 + j − (i + offset)| = −slope·|base + j|.
  const Acc slope2 = mods.alibi_slopes ? -static_cast<Acc>(mods.alibi_slopes[h]) * static_cast<Acc>(log2e) : Acc(0);
  const Acc base = static_cast<Acc>(key0 - (i + mods.alibi_offset));
  Acc lane[W];
  for (index_t x = 0; x < W; ++x) lane[x] = static_cast<Acc>(x);
  const vec iota = V::load(lane);
  const auto tanh_v = [](const vec& x) {
    if constexpr (std::is_same<VA, scalar_arch>::value) return std::tanh(x);
    else return xsimd::tanh(x);
  };
  const auto abs_v = [](const vec& x) {
    if constexpr (std::is_same<VA, scalar_arch>::value) return std::abs(x);
    else return xsimd::abs(x);
  };
  const auto run = [&](auto cap_on, auto alibi_on) {
    const vec vin = V::broadcast(in_scale), vout = V::broadcast(out_scale), vslope = V::broadcast(slope2);
    const vec one = V::broadcast(Acc(1));
    for (index_t j = 0; j < cols; j += W) {
      vec x = V::mul(V::load(s + j), vin);
      if constexpr (decltype(cap_on)::value) {
        x = tanh_v(x);
        if (cap_grad) V::store(cap_grad + j, V::sub(one, V::mul(x, x)));  // a pointer test, hoisted by the compiler
      } else if (cap_grad) {
        V::store(cap_grad + j, one);
      }
      x = V::mul(x, vout);
      if constexpr (decltype(alibi_on)::value)
        x = V::fma(abs_v(V::add(iota, V::broadcast(base + static_cast<Acc>(j)))), vslope, x);
      V::store(s + j, x);
    }
  };
  using on = std::true_type;
  using off = std::false_type;
  if (capped && mods.alibi_slopes) run(on{}, on{});
  else if (capped) run(on{}, off{});
  else run(off{}, on{});
}

/// online_softmax_row around its two vector passes, which differ per SIMD layer: row_max(s, cols) = max_j s_j (a
/// NaN skipped) and exp2_row_sum(s, cols, c, m_new), which sets s_j = 2^(c·s_j − m_new) and returns Σ_j s_j. The
/// state arithmetic is core/online_softmax.hpp's (new_max, update); the all-masked tile is handled here.
template <class Acc, class RowMax, class ExpSum>
inline Acc online_softmax_step(Acc* s, index_t cols, Acc c, Acc& m, Acc& l, RowMax&& row_max, ExpSum&& exp2_row_sum) {
  const Acc m_new = online::new_max(m, row_max(s, cols) * c);
  if (m_new == -std::numeric_limits<Acc>::infinity()) {
    bool saw_nan = false;
    for (index_t j = 0; j < cols; ++j) {
      saw_nan |= std::isnan(s[j]);
      s[j] = Acc(0);
    }
    if (saw_nan) l = std::numeric_limits<Acc>::quiet_NaN();
    return Acc(1);
  }
  // α = 0 when m = −inf: nothing accumulated yet
  return online::update(m, l, m_new, exp2_row_sum(s, cols, c, m_new));
}

/// One online-softmax step for one row of a tile (the state update is online::update).
///   s: the row's raw scores q·k_j, `cols` of them (a multiple of the vector width); keys the mask forbids, and
///      padding columns, hold −inf. On return s holds p_j = 2^(c·s_j − m_new).
///   c: scale·log2e (> 0), so c·s_j is the logit in base 2; or 1 when modify_row already made s base-2 logits;
///   m, l: the row's running max (base 2) and sum (in/out).
/// Math: m_new = max(m, c·max_j s_j); α = 2^(m − m_new); p_j = 2^(c·s_j − m_new) with c·s_j − m_new formed by one
/// FMA (no rounding of the large logit itself); l = α·l + Σ_j p_j; returns α, by which the caller rescales the
/// row's accumulator. While every key seen so far is masked (m_new = −inf) p = 0, α = 1 and l stays 0.
/// NaN (docs/design.md, Numerics): a row that meets a NaN logit gets l = NaN, which no later step can clear
/// (α·NaN, NaN + Σ p), and finish_row turns into O = lse = NaN. The max ignores NaN (V::max(x, vmax) returns
/// vmax when x is NaN), so m_new is the max of the other logits and every p_j <= 1; the NaN logit itself gives
/// p_j = NaN through exp2, which propagates NaN (simd.hpp), and so l = NaN. Only a tile whose logits are all
/// NaN or −inf leaves m_new = −inf: that branch scans the row, once, and sets l = NaN if it finds a NaN.
/// A +inf logit makes m_new = +inf and its p_j = 2^(inf − inf) = NaN: the row is NaN, as in the naive kernel.
template <class Acc, class Arch>
inline Acc online_softmax_row(Acc* s, index_t cols, Acc c, Acc& m, Acc& l) {
#if FUSEDATTN_X86_KERNELS
  if constexpr (cpu::is_x86_set_v<Arch>)  // the same two passes on 16 lanes, compiled for AVX-512; the bf16-pair
    return online_softmax_step(s, cols, c, m, l, cpu::x86::row_max,  // sets round P to bf16: the short exp2
                               cpu::x86::exp2_row_sum<cpu::packs_bf16_pairs_v<Arch>>);
#endif
  using V = cpu::simd<Acc, Arch>;
  using vec = typename V::type;
  constexpr index_t W = V::width;
  // Row max of the raw scores (c > 0 keeps the order), vectorised; a NaN score is skipped (see above).
  const auto row_max = [](const Acc* x, index_t n) {
    vec vmax = V::broadcast(-std::numeric_limits<Acc>::infinity());
    for (index_t j = 0; j < n; j += W) vmax = V::max(V::load(x + j), vmax);
    return V::reduce_max(vmax);
  };
  // p_j = 2^(c·s_j − m_new), fused with the row sum.
  const auto exp2_row_sum = [](Acc* x, index_t n, Acc c_, Acc m_new) {
    const vec vc = V::broadcast(c_);
    const vec neg_m = V::broadcast(-m_new);
    vec vsum = V::broadcast(Acc(0));
    for (index_t j = 0; j < n; j += W) {
      const vec p = V::exp2(V::fma(V::load(x + j), vc, neg_m));
      V::store(x + j, p);
      vsum = V::add(vsum, p);
    }
    return V::reduce_add(vsum);
  };
  return online_softmax_step(s, cols, c, m, l, row_max, exp2_row_sum);
}

}  // namespace kernels
}  // namespace fusedattn
