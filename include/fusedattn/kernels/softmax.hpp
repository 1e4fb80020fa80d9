/// @file softmax.hpp
/// The online softmax of the flash loop, one tile row at a time, in base 2 (the scores arrive already
/// multiplied by scale·log2e), and the log-sum-exp merge of partial results. No tiling or masking here.
#pragma once

#include <cmath>
#include <limits>

#include "../core/types.hpp"
#include "../cpu/simd.hpp"
#include "../cpu/x86_kernels.hpp"

namespace fusedattn {
namespace kernels {

/// log2(e): scores are kept in base 2 so the exponential is exp2.
inline constexpr double log2e = 1.4426950408889634074;
/// ln(2): converts a base-2 log-sum-exp back to the natural log.
inline constexpr double ln2 = 0.6931471805599453094;

/// One online-softmax step for one row of a tile.
///   s: the row's raw scores q·k_j, `cols` of them (a multiple of the vector width); keys the mask forbids, and
///      padding columns, hold −inf. On return s holds p_j = 2^(c·s_j − m_new).
///   c: scale·log2e (> 0), so c·s_j is the logit in base 2;
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
  if constexpr (cpu::is_x86_set_v<Arch>) return cpu::x86::online_softmax_row(s, cols, c, m, l);  // the same, 16 lanes
#endif
  using V = cpu::simd<Acc, Arch>;
  using vec = typename V::type;
  constexpr index_t W = V::width;
  constexpr Acc neg_inf = -std::numeric_limits<Acc>::infinity();
  // Row max of the raw scores (c > 0 keeps the order), vectorised; a NaN score is skipped (see above).
  vec vmax = V::broadcast(neg_inf);
  for (index_t j = 0; j < cols; j += W) vmax = V::max(V::load(s + j), vmax);
  const Acc tile_max = V::reduce_max(vmax) * c;
  const Acc m_new = tile_max > m ? tile_max : m;
  if (m_new == neg_inf) {
    bool saw_nan = false;
    for (index_t j = 0; j < cols; ++j) {
      saw_nan |= std::isnan(s[j]);
      s[j] = Acc(0);
    }
    if (saw_nan) l = std::numeric_limits<Acc>::quiet_NaN();
    return Acc(1);
  }
  // p_j = 2^(c·s_j − m_new), fused with the row sum.
  const vec vc = V::broadcast(c);
  const vec neg_m = V::broadcast(-m_new);
  vec vsum = V::broadcast(Acc(0));
  for (index_t j = 0; j < cols; j += W) {
    const vec p = V::exp2(V::fma(V::load(s + j), vc, neg_m));
    V::store(s + j, p);
    vsum = V::add(vsum, p);
  }
  const Acc alpha = std::exp2(m - m_new);  // m = −inf gives 0: nothing accumulated yet
  l = alpha * l + V::reduce_add(vsum);
  m = m_new;
  return alpha;
}

/// 1 / l for the finish O = acc / l: 0 for a row that saw no key (l = 0, acc = 0, so O = 0); NaN for a row that
/// met a NaN (l = NaN), so its whole O row is NaN.
template <class Acc>
inline Acc inverse_row_sum(Acc l) {
  return l == Acc(0) ? Acc(0) : Acc(1) / l;
}

/// lse = m·ln2 + ln l of a finished row: −inf for a row that saw no key (l = 0), NaN for a row that met a NaN.
template <class Acc>
inline float row_lse(Acc m, Acc l) {
  return l == Acc(0) ? -std::numeric_limits<float>::infinity()
                     : static_cast<float>(m * static_cast<Acc>(ln2) + std::log(l));
}

}  // namespace kernels
}  // namespace fusedattn
