/// @file online_softmax.hpp
/// The scalar online-softmax state of one query row, host/device-clean: its update by a tile, its finish (with an
/// optional sink logit), its log-sum-exp, and the merge of partial results. The CPU SIMD layer (kernels/softmax.hpp)
/// and the CUDA epilogues wrap these functions; none of them rewrites the arithmetic.
#pragma once

#include <cmath>
#include <limits>

#include "../config.hpp"

namespace fusedattn {

/// log2(e): the kernels keep logits in base 2 so the exponential is exp2.
inline constexpr double log2e = 1.4426950408889634074;
/// ln(2): converts a base-2 log-sum-exp back to the natural log.
inline constexpr double ln2 = 0.6931471805599453094;

/// The state of one row, in base 2: m = the largest logit seen (−inf before any key), l = Σ_j 2^(t_j − m).
/// Every function below keeps the NaN rule of docs/design.md (Numerics): a NaN in l is never cleared.
namespace online {

/// The running max after a tile whose largest base-2 logit is `tile_max`. The comparison skips a NaN tile_max
/// (the NaN reaches l through the tile's own exp2 instead).
template <class A>
FUSEDATTN_HOST_DEVICE inline A new_max(A m, A tile_max) {
  return tile_max > m ? tile_max : m;
}

/// The rescale factor α = 2^(m_old − m_new) of the accumulator and of l; 0 while nothing was accumulated
/// (m_old = −inf and m_new finite).
template <class A>
FUSEDATTN_HOST_DEVICE inline A rescale(A m_old, A m_new) {
  return std::exp2(m_old - m_new);
}

/// One update of the state by a tile: l = α·l + tile_sum with α = 2^(m − m_new), m = m_new, where tile_sum =
/// Σ_j 2^(t_j − m_new) over the tile. Returns α (the caller rescales the row's accumulator by it).
/// Precondition: m_new = new_max(m, tile max) and m_new > −inf.
template <class A>
FUSEDATTN_HOST_DEVICE inline A update(A& m, A& l, A m_new, A tile_sum) {
  const A alpha = rescale(m, m_new);
  l = alpha * l + tile_sum;
  m = m_new;
  return alpha;
}

/// Finishes a row with an attention sink: the base-2 logit `sink2` joins the denominator only (no value row).
/// m_new = max(m, sink2); l = 2^(m − m_new)·l + 2^(sink2 − m_new). Returns the factor by which the accumulator must
/// be rescaled to the new m. A sink of −inf (sinks off) changes nothing and returns 1; a row that saw no key
/// (m = −inf, l = 0) gets l = 1, m = sink2, factor 0: O = 0 and lse = the sink's logit. NaN in l stays NaN.
template <class A>
FUSEDATTN_HOST_DEVICE inline A add_sink(A& m, A& l, A sink2) {
  if (sink2 == -std::numeric_limits<A>::infinity()) return A(1);
  const A m_new = sink2 > m ? sink2 : m;
  const A alpha = rescale(m, m_new);
  l = alpha * l + std::exp2(sink2 - m_new);
  m = m_new;
  return alpha;
}

/// 1 / l for the finish O = acc / l: 0 for a row that saw no key (l = 0, acc = 0, so O = 0); NaN for a row that
/// met a NaN (l = NaN), so its whole O row is NaN.
template <class A>
FUSEDATTN_HOST_DEVICE inline A inverse_sum(A l) {
  return l == A(0) ? A(0) : A(1) / l;
}

/// lse = m·ln2 + ln l (natural log) of a finished row: −inf for a row that saw no key (l = 0), NaN for a row that
/// met a NaN.
template <class A>
FUSEDATTN_HOST_DEVICE inline float lse(A m, A l) {
  return l == A(0) ? -std::numeric_limits<float>::infinity()
                   : static_cast<float>(m * static_cast<A>(ln2) + std::log(l));
}

/// The weight 2^(m_part − m_total) of one partial (m, l, acc) in a merge whose total max is m_total (the max of
/// the parts' m): L = Σ w_c·l_c, acc = Σ w_c·acc_c. A part with l = 0 saw no key and is left out (weight 0,
/// its acc not read); the caller handles a part with l = NaN (the merged row is NaN).
template <class A>
FUSEDATTN_HOST_DEVICE inline A part_weight(A m_part, A l_part, A m_total) {
  return l_part > A(0) ? std::exp2(m_part - m_total) : A(0);
}

}  // namespace online

/// The weights of one row's merge of two partial results given as (O, lse) (natural log). la, lb: the two parts'
/// lse; on return lse is the union's and the row's O is wa·O_a + wb·O_b, where a part with use_x = false is left
/// out (not multiplied: its O is not read).
/// Math: lse = max(la, lb) + log1p(exp(−|la − lb|)); wa = exp(la − lse), wb = exp(lb − lse), so wa + wb = 1.
/// Rules: a part with lse = −inf saw no key and contributes nothing (both −inf: O = 0, lse = −inf); a NaN lse makes
/// the row NaN (weights NaN, both parts read); a +inf lse gives NaN weights as well (inf − inf).
template <class W>
struct merge_row_weights {
  W wa = 0, wb = 0;
  W lse = 0;
  bool use_a = false, use_b = false;
};
template <class W>
FUSEDATTN_HOST_DEVICE inline merge_row_weights<W> merge_weights(float la, float lb) {
  const W neg_inf = -std::numeric_limits<W>::infinity();
  merge_row_weights<W> r;
  const W a = static_cast<W>(la), b = static_cast<W>(lb);
  if (a != a || b != b) {  // NaN: it reaches the whole row
    r.wa = r.wb = r.lse = std::numeric_limits<W>::quiet_NaN();
    r.use_a = r.use_b = true;
    return r;
  }
  r.use_a = a != neg_inf;
  r.use_b = b != neg_inf;
  if (!r.use_a && !r.use_b) {
    r.lse = neg_inf;
    return r;
  }
  if (!r.use_b) {
    r.wa = W(1);
    r.lse = a;
    return r;
  }
  if (!r.use_a) {
    r.wb = W(1);
    r.lse = b;
    return r;
  }
  const W m = a > b ? a : b;
  const W diff = a > b ? a - b : b - a;
  r.lse = m + log1p(exp(-diff));
  r.wa = exp(a - r.lse);
  r.wb = exp(b - r.lse);
  return r;
}

}  // namespace fusedattn
