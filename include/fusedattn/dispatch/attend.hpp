/// @file attend.hpp
/// `attend`: the one public entry point. It validates, binds the mask to the problem and hands the call to
/// the policy's kernel. Runtime mask choices (`any_mask`) become types here, once, with std::visit.
#pragma once

#include <utility>
#include <variant>

#include "../core/problem.hpp"
#include "../core/status.hpp"
#include "../core/tensor.hpp"
#include "../core/validate.hpp"
#include "../kernels/block_sparse.hpp"
#include "../kernels/mask.hpp"
#include "../kernels/modifiers.hpp"
#include "../kernels/flash.hpp"
#include "../kernels/naive.hpp"
#include "../kernels/no_keys.hpp"
#include "plan.hpp"
#include "policy.hpp"

#if FUSEDATTN_WITH_CUDA
#include "../backends/cuda/attend_cuda.cuh"
#endif
#if FUSEDATTN_WITH_ASCEND
#include "../backends/ascend/attend_ascend.hpp"
#endif

namespace fusedattn {

namespace detail {

template <class T, class Bound>
status run(const policy::cpu_naive& pol, const problem& p, const tensor_ref<const T>& q,
           const tensor_ref<const T>& k, const tensor_ref<const T>& v, const tensor_ref<T>& o, const Bound& mask,
           float* lse) {
  // The plan's checks are attend's (host memory, absurd scratch sizes); zero extents run no kernel.
  if (status st = plan_run(pol, p, q, k, v, o, mask, lse).st; !st) return st;
  if (nothing_to_compute(p)) return {};
  if (p.seq_kv == 0) return kernels::no_key_rows(p, o, lse, mods_of(mask));
  return kernels::naive_attention(p, q, k, v, o, mask, lse, pol.threads);
}

template <class Arch, class T, class Bound>
status run(const policy::cpu<Arch>& pol, const problem& p, const tensor_ref<const T>& q,
           const tensor_ref<const T>& k, const tensor_ref<const T>& v, const tensor_ref<T>& o, const Bound& mask,
           float* lse) {
  if (status st = plan_run(pol, p, q, k, v, o, mask, lse).st; !st) return st;
  if (nothing_to_compute(p)) return {};
  if (p.seq_kv == 0) return kernels::no_key_rows(p, o, lse, mods_of(mask));
  return kernels::flash_attention<T, Arch>(p, q, k, v, o, mask, lse, pol.threads, pol.tiles);
}

#if !FUSEDATTN_WITH_CUDA
// Its own inline namespace, so a program that mixes translation units with and without the backend has two
// distinct functions instead of one name with two bodies.
inline namespace cuda_off {
template <class T, class Bound>
status run(const policy::cuda&, const problem&, const tensor_ref<const T>&, const tensor_ref<const T>&,
           const tensor_ref<const T>&, const tensor_ref<T>&, const Bound&, float*) {
  return {errc::unsupported, "fusedattn was built without CUDA support (FUSEDATTN_WITH_CUDA is off)"};
}
}  // namespace cuda_off
#endif

#if !FUSEDATTN_WITH_ASCEND
// Its own inline namespace, as the CUDA stub: translation units with and without the backend may share a program.
inline namespace ascend_off {
template <class T, class Bound>
status run(const policy::ascend&, const problem&, const tensor_ref<const T>&, const tensor_ref<const T>&,
           const tensor_ref<const T>&, const tensor_ref<T>&, const Bound&, float*) {
  return {errc::unsupported, "fusedattn was built without Ascend support (FUSEDATTN_WITH_ASCEND is off)"};
}
}  // namespace ascend_off
#endif

}  // namespace detail

/// Scaled dot-product attention: O = softmax(scale · Q·Kᵀ + mask) · V, and optionally lse = max + log(sum)
/// per (batch, head, query row).
///
/// @param pol   where to run: policy::cpu_naive{}, policy::cpu<Arch>{}, policy::cuda{stream}, ...
/// @param p     sizes and scale; heads must be a multiple of heads_kv (GQA / MQA). batch, heads, seq_q and seq_kv
///              may be 0: with batch, heads or seq_q 0 there is nothing to write (ok, nothing written; the views
///              of no element may be null); with seq_kv 0 every row sees no key (below).
/// @param q     (batch, heads, seq_q, head_dim) view; k, v: (batch, heads_kv, seq_kv, head_dim) views.
///              Any non-negative strides; the head_dim stride must be 1.
/// @param o     (batch, heads, seq_q, head_dim) output view; must not overlap q, k, v or itself (rows may
///              interleave as long as no element is shared).
/// @param mask  dense{}, causal{align}, window{left, right, align}, block_sparse{layout} or an any_mask, each
///              optionally combined with score modifiers: `mask | fa::softcap{cap} | fa::alibi{slopes} |
///              fa::sinks{logits}` (kernels/modifiers.hpp; the arithmetic in core/score_mod.hpp).
/// @param lse   optional output of batch·heads·seq_q floats laid out [b][h][i], natural log; nullptr for none.
///
/// The numerical contract, the same on every backend and kernel (docs/design.md, "Numerics"):
///   - NaN and ±inf in an input reach only the outputs that depend on it: a key j that query row i may not see
///     (masked, or outside the causal / window band, or in an unlisted block) never touches row i's O or lse;
///   - masked probabilities never multiply V: an infinite or NaN V row reaches only the rows that see its key
///     (element c of V row j reaches element c of those rows' O; their lse is unaffected);
///   - a row that sees no key gives O = 0 and lse = −inf (never NaN), or lse = the head's sink logit with sinks;
///   - a NaN in a row's logits (from its Q row or from the K row of a key it sees) makes that row's O and lse NaN.
/// The CPU kernels run with subnormals flushed to zero (the caller's floating-point mode is restored).
/// `fa::plan` with the same arguments tells which kernel this call runs and its scratch memory, without running it.
/// @return ok, or errc::invalid_argument naming the bad field (nothing written), errc::unsupported for a
///         backend not compiled in, errc::out_of_memory when scratch cannot be allocated (nothing written).
template <class Policy, class T, class Mask = dense>
status attend(const Policy& pol, const problem& p, tensor_ref<const detail::identity_t<T>> q,
              tensor_ref<const detail::identity_t<T>> k, tensor_ref<const detail::identity_t<T>> v, tensor_ref<T> o,
              const Mask& mask = {}, float* lse = nullptr) {
  if constexpr (detail::is_runtime_mask_v<Mask>) {
    return detail::visit_mask(mask, [&](const auto& m) { return attend(pol, p, q, k, v, o, m, lse); });
  } else {
    if (status st = validate_policy(pol); !st) return st;
    if (status st = validate(p, q, k, v, o, mask, lse); !st) return st;
    return detail::run(pol, p, q, k, v, o, bind(mask, p), lse);
  }
}

}  // namespace fusedattn
