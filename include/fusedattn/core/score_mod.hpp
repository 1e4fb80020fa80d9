/// @file score_mod.hpp
/// Score modifiers as a bound, host/device-clean rule: softcap, ALiBi and attention sinks, the scalar arithmetic
/// every kernel (CPU and CUDA, forward and backward) and the float64 test oracle apply. The user-facing spelling
/// (`fa::softcap`, `fa::alibi`, `fa::sinks` combined with a mask by `|`) is in kernels/modifiers.hpp.
#pragma once

#include <cmath>

#include "../config.hpp"
#include "types.hpp"

namespace fusedattn {

/// The score modifiers of one call, bound to its problem. Every bound mask carries one (`mods_of(mask)`); all
/// fields zero / null means "no modifier", the case every kernel must keep exactly as fast as before.
///
/// For query row i, key j, head h and the scaled score s = scale · q_i·k_j, the modified score is
///   s' = softcap(s) + alibi(h, i, j),   softcap(s) = cap · tanh(s / cap)          (cap > 0; off when cap == 0)
///                                       alibi(h, i, j) = −slope[h] · |j − (i + alibi_offset)|   (off when null)
/// and the row's softmax runs over the allowed keys' s' plus, when sinks are on, one extra logit sink[h] that
/// has no value row:  O_i = Σ_j e^{s'_ij} v_j / (e^{sink[h]} + Σ_j e^{s'_ij}),  lse_i = log(e^{sink[h]} + Σ_j e^{s'_ij}).
/// A row that sees no key then gives O = 0 and lse = sink[h]. Masking is decided before the modifiers: a masked
/// key stays masked whatever its modified score.
/// Pointers are in the memory of the policy that runs the call (host for CPU policies, device for CUDA) and
/// hold `heads` floats (query heads).
struct bound_mods {
  float softcap = 0.f;                   ///< cap of the tanh soft-capping; 0: off
  const float* alibi_slopes = nullptr;   ///< per query head; null: no ALiBi bias
  index_t alibi_offset = 0;              ///< query row i sits at key position i + alibi_offset
  const float* sink_logits = nullptr;    ///< per query head; null: no sink
  float* sink_grad = nullptr;            ///< attend_backward writes dL/d sink_logits here when not null

  /// Whether any modifier is on.
  FUSEDATTN_HOST_DEVICE bool any() const { return softcap != 0.f || alibi_slopes || sink_logits; }
  /// Whether the scores themselves change (softcap or ALiBi); sinks only touch the denominator.
  FUSEDATTN_HOST_DEVICE bool changes_scores() const { return softcap != 0.f || alibi_slopes; }

  /// softcap(s) (identity when off). Accumulation type A: float, or double in the oracle.
  template <class A>
  FUSEDATTN_HOST_DEVICE A cap(A s) const {
    if (softcap == 0.f) return s;
    const A c = static_cast<A>(softcap);
    return c * std::tanh(s / c);
  }
  /// d softcap(s) / ds written with the capped value sc = softcap(s): 1 − (sc / cap)² (1 when off).
  template <class A>
  FUSEDATTN_HOST_DEVICE A cap_grad(A sc) const {
    if (softcap == 0.f) return A(1);
    const A t = sc / static_cast<A>(softcap);
    return A(1) - t * t;
  }
  /// The ALiBi bias of head h, row i, key j (0 when off).
  template <class A>
  FUSEDATTN_HOST_DEVICE A bias(index_t h, index_t i, index_t j) const {
    if (!alibi_slopes) return A(0);
    index_t d = j - (i + alibi_offset);
    if (d < 0) d = -d;
    return -static_cast<A>(alibi_slopes[h]) * static_cast<A>(d);
  }
  /// s' from the scaled score s.
  template <class A>
  FUSEDATTN_HOST_DEVICE A apply(A s, index_t h, index_t i, index_t j) const {
    return cap(s) + bias<A>(h, i, j);
  }
  /// The sink logit of head h, or −inf when sinks are off (e^{−inf} = 0 adds nothing to the denominator).
  template <class A>
  FUSEDATTN_HOST_DEVICE A sink(index_t h) const {
    return sink_logits ? static_cast<A>(sink_logits[h]) : -static_cast<A>(INFINITY);
  }
};

}  // namespace fusedattn
