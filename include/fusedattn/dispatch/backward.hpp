/// @file backward.hpp
/// `attend_backward`: the public entry point of the backward pass (dQ, dK, dV). It validates the call (the
/// forward's checks plus those of dO, lse and the three gradients), binds the mask and runs the policy's kernel.
/// CPU flash policies and policy::cuda (f16/bf16, backends/cuda/backward.cuh); the others return errc::unsupported.
#pragma once

#include <string>
#include <variant>

#include "../core/problem.hpp"
#include "../core/status.hpp"
#include "../core/tensor.hpp"
#include "../core/validate.hpp"
#include "../kernels/backward.hpp"
#include "../kernels/block_sparse.hpp"
#include "../kernels/mask.hpp"
#include "attend.hpp"
#include "policy.hpp"

#if FUSEDATTN_WITH_CUDA
#include "../backends/cuda/backward.cuh"  // run_backward for policy::cuda
#endif

namespace fusedattn {

/// Checks a backward call: the problem, the eight views (pointers, extents, unit head-dim stride, non-negative
/// strides), the mask and the scale; lse not null and addressable; dQ, dK and dV each with no two rows on the same
/// memory, none overlapping another, an input (q, k, v, o, d_o) or lse. Returns the first failure, naming the
/// field; nothing is read or written.
template <class T, class Mask>
status validate_backward(const problem& p, const tensor_ref<const T>& q, const tensor_ref<const T>& k,
                         const tensor_ref<const T>& v, const tensor_ref<const T>& o,
                         const tensor_ref<const T>& d_o, const float* lse, const tensor_ref<T>& dq,
                         const tensor_ref<T>& dk, const tensor_ref<T>& dv, const Mask& mask) {
  static_assert(is_supported_scalar_v<T>,
                "fusedattn supports float, double, Eigen::half and Eigen::bfloat16 for Q, K, V, O and the gradients");
  if (status st = validate(p); !st) return st;
  const tensor_ref<const T>* in[5] = {&q, &k, &v, &o, &d_o};
  const char* in_name[5] = {"q", "k", "v", "o", "d_o"};
  const dims4 in_dims[5] = {p.q_dims(), p.kv_dims(), p.kv_dims(), p.o_dims(), p.o_dims()};
  for (int i = 0; i < 5; ++i)
    if (status st = detail::check_operand(in_name[i], *in[i], in_dims[i]); !st) return st;
  const tensor_ref<T>* out[3] = {&dq, &dk, &dv};
  const char* out_name[3] = {"dq", "dk", "dv"};
  const dims4 out_dims[3] = {p.q_dims(), p.kv_dims(), p.kv_dims()};
  for (int i = 0; i < 3; ++i)
    if (status st = detail::check_operand(out_name[i], *out[i], out_dims[i]); !st) return st;
  if (status st = detail::check_mask(mask, p); !st) return st;
  if (status st = detail::check_scale<T>(p); !st) return st;
  if (lse == nullptr) return status::invalid("lse is null; the backward pass needs the forward's log-sum-exp");
  const index_t lse_bytes = p.lse_size() * index_t(sizeof(float));  // validate(p) bounds b·h·s_q·d, hence this
  if (!detail::fits_address_space(lse, lse_bytes))
    return status::invalid("lse: " + detail::str(p.lse_size()) + " floats do not fit in the address space");
  index_t out_bytes[3];
  for (int i = 0; i < 3; ++i) {
    switch (detail::rows_disjoint(*out[i])) {
      case detail::rows_overlap::disjoint: break;
      case detail::rows_overlap::shared:
        return status::invalid(std::string(out_name[i]) + ": its strides make distinct rows share memory");
      case detail::rows_overlap::unproven:
        return status::invalid(std::string(out_name[i]) + ": its strides are not nested and its rows are too many "
                               "to prove exactly that none share memory");
    }
    out_bytes[i] = span_elements(*out[i]) * index_t(sizeof(T));
  }
  for (int i = 0; i < 3; ++i) {
    for (int j = i + 1; j < 3; ++j)
      if (detail::overlaps(out[i]->data, out_bytes[i], out[j]->data, out_bytes[j]))
        return status::invalid(std::string(out_name[i]) + " overlaps " + out_name[j] +
                               "; the gradients must not share memory");
    for (int j = 0; j < 5; ++j)
      if (detail::overlaps(out[i]->data, out_bytes[i], in[j]->data, span_elements(*in[j]) * index_t(sizeof(T))))
        return status::invalid(std::string(out_name[i]) + " overlaps " + in_name[j] +
                               "; a gradient must not alias an input");
    if (detail::overlaps(out[i]->data, out_bytes[i], lse, lse_bytes))
      return status::invalid(std::string(out_name[i]) + " overlaps lse; a gradient must not alias an input");
  }
  return {};
}

namespace detail {

template <class Arch, class T, class Bound>
status run_backward(const policy::cpu<Arch>& pol, const problem& p, const tensor_ref<const T>& q,
                    const tensor_ref<const T>& k, const tensor_ref<const T>& v, const tensor_ref<const T>& o,
                    const tensor_ref<const T>& d_o, const float* lse, const tensor_ref<T>& dq,
                    const tensor_ref<T>& dk, const tensor_ref<T>& dv, const Bound& mask) {
  return kernels::flash_backward<T, Arch, Bound>(p, q, k, v, o, d_o, lse, dq, dk, dv, mask, pol.threads, pol.tiles);
}

/// Every other policy (and policy::cuda in a build without CUDA): no backward kernel.
template <class Policy, class T, class Bound>
status run_backward(const Policy&, const problem&, const tensor_ref<const T>&, const tensor_ref<const T>&,
                    const tensor_ref<const T>&, const tensor_ref<const T>&, const tensor_ref<const T>&, const float*,
                    const tensor_ref<T>&, const tensor_ref<T>&, const tensor_ref<T>&, const Bound&) {
  return {errc::unsupported, "attend_backward runs on the CPU flash policy (policy::cpu<Arch>) and, in builds with "
                             "CUDA, on policy::cuda"};
}

}  // namespace detail

/// Backward pass of scaled dot-product attention: given the forward's inputs, its output O, its log-sum-exp and
/// the gradient dO of a loss with respect to O, writes dQ, dK and dV (by recomputation: no S×S matrix is stored).
///
/// @param pol   policy::cpu<Arch>{threads, tiles} (tiles.q / tiles.kv override the backward's tile sizes), or
///              policy::cuda{stream} (device pointers; f16 and bf16, head_dim a multiple of 8 up to 128, 16-byte
///              aligned views; asynchronous on the stream; score modifiers too); other policies return
///              errc::unsupported.
/// @param p     the forward's problem (sizes and scale).
/// @param q, k, v  the forward's inputs; @param o the forward's output; @param d_o dL/dO, shaped like o.
/// @param lse   the forward's log-sum-exp, b·h·seq_q floats laid out [b][h][i] (natural log), not null; a row with
///              lse = −inf (it saw no key) gets dQ = 0 and adds nothing to dK and dV.
/// @param dq, dk, dv  outputs shaped like q, k, v; GQA / MQA sum dK and dV over the query heads of a kv head.
///              They must not overlap each other, an input or lse, and none may have two rows on the same memory.
/// @param mask  the forward's mask: dense{}, causal{align}, window{left, right, align}, block_sparse{layout} or
///              an any_mask, with the forward's score modifiers (`mask | fa::softcap{cap} | fa::alibi{slopes} |
///              fa::sinks{logits, grad}`): softcap and ALiBi are recomputed; with sinks, `grad` (when not null)
///              receives dL/d logits, heads floats, summed over batch and rows in a fixed order.
/// Bitwise identical results for any thread count, and on every run on CUDA unless policy::cuda::deterministic is
/// false (the Hopper kernels then add dQ by atomics). NaN: docs/design.md, "Numerics" (backward).
/// @return ok, or errc::invalid_argument naming the bad field (nothing written), errc::unsupported for a policy
///         without a backward kernel or an arch this CPU lacks, errc::out_of_memory when scratch cannot be
///         allocated (nothing written).
template <class Policy, class T, class Mask = dense>
status attend_backward(const Policy& pol, const problem& p, tensor_ref<const detail::identity_t<T>> q,
                       tensor_ref<const detail::identity_t<T>> k, tensor_ref<const detail::identity_t<T>> v,
                       tensor_ref<const detail::identity_t<T>> o, tensor_ref<const detail::identity_t<T>> d_o,
                       const float* lse, tensor_ref<T> dq, tensor_ref<detail::identity_t<T>> dk,
                       tensor_ref<detail::identity_t<T>> dv, const Mask& mask = {}) {
  if constexpr (detail::is_runtime_mask_v<Mask>) {
    return detail::visit_mask(
        mask, [&](const auto& m) { return attend_backward(pol, p, q, k, v, o, d_o, lse, dq, dk, dv, m); });
  } else {
    if (status st = validate_policy(pol); !st) return st;
    if (status st = validate_backward(p, q, k, v, o, d_o, lse, dq, dk, dv, mask); !st) return st;
    return detail::run_backward(pol, p, q, k, v, o, d_o, lse, dq, dk, dv, bind(mask, p));
  }
}

}  // namespace fusedattn
