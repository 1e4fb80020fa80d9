/// @file kv_storage.hpp
/// Mixed storage (the KV-cache case): `attend` and `plan` overloads for f32 Q and O with K and V in f16 or bf16.
/// The CPU flash kernel widens K and V to f32 as it packs them and computes as for all-f32 storage.
#pragma once

#include <string>
#include <type_traits>

#include "../core/problem.hpp"
#include "../core/status.hpp"
#include "../core/tensor.hpp"
#include "../core/validate.hpp"
#include "../kernels/flash.hpp"
#include "../kernels/kv_source.hpp"
#include "../kernels/modifiers.hpp"
#include "../kernels/no_keys.hpp"
#include "plan.hpp"
#include "policy.hpp"

namespace fusedattn {

/// True for the K/V storage types of mixed storage: Eigen::half and Eigen::bfloat16.
template <class KV>
inline constexpr bool is_half_kv_v =
    std::is_same<KV, Eigen::half>::value || std::is_same<KV, Eigen::bfloat16>::value;

namespace detail {

template <class Policy>
struct is_cpu_flash_policy : std::false_type {};
template <class Arch>
struct is_cpu_flash_policy<policy::cpu<Arch>> : std::true_type {};

/// attend's checks (validate) for f32 Q and O with K and V of type KV: problem, the four views, the mask, the
/// scale, lse, O's rows, no output overlapping an input, the sequence lengths.
template <class KV, class Mask>
status validate_mixed(const problem& p, const tensor_ref<const float>& q, const tensor_ref<const KV>& k,
                      const tensor_ref<const KV>& v, const tensor_ref<float>& o, const Mask& mask, const float* lse) {
  if (status st = validate(p); !st) return st;
  if (status st = check_operand("q", q, p.q_dims()); !st) return st;
  if (status st = check_operand("k", k, p.kv_dims()); !st) return st;
  if (status st = check_operand("v", v, p.kv_dims()); !st) return st;
  if (status st = check_operand("o", o, p.o_dims()); !st) return st;
  if (status st = check_mask(mask, p); !st) return st;
  if (status st = check_scale<float>(p); !st) return st;
  const index_t lse_bytes = p.lse_size() * index_t(sizeof(float));
  if (lse && !fits_address_space(lse, lse_bytes))
    return status::invalid("lse: " + str(p.lse_size()) + " floats do not fit in the address space");
  switch (rows_disjoint(o)) {
    case rows_overlap::disjoint: break;
    case rows_overlap::shared: return status::invalid("o: its strides make distinct rows share memory");
    case rows_overlap::unproven:
      return status::invalid("o: its strides are not nested and its rows are too many to prove that none share "
                             "memory");
  }
  const index_t bytes_o = span_elements(o) * index_t(sizeof(float));
  const std::pair<const void*, index_t> in[3] = {{q.data, span_elements(q) * index_t(sizeof(float))},
                                                 {k.data, span_elements(k) * index_t(sizeof(KV))},
                                                 {v.data, span_elements(v) * index_t(sizeof(KV))}};
  const char* in_name[3] = {"q", "k", "v"};
  for (int i = 0; i < 3; ++i) {
    if (overlaps(o.data, bytes_o, in[i].first, in[i].second))
      return status::invalid(std::string("o overlaps ") + in_name[i] + "; the output must not alias an input");
    if (lse && overlaps(lse, lse_bytes, in[i].first, in[i].second))
      return status::invalid(std::string("lse overlaps ") + in_name[i]);
  }
  if (lse && overlaps(lse, lse_bytes, o.data, bytes_o)) return status::invalid("lse overlaps o");
  if (p.seq_q > max_seq_len) return status::invalid("problem.seq_q is " + str(p.seq_q) + "; the longest supported is 2^48");
  if (p.seq_kv > max_seq_len)
    return status::invalid("problem.seq_kv is " + str(p.seq_kv) + "; the longest supported is 2^48");
  return {};
}

inline status mixed_unsupported() {
  return {errc::unsupported, "mixed storage (f32 Q and O with f16 or bf16 K and V) runs on policy::cpu<Arch> only"};
}

}  // namespace detail

/// attend() for mixed storage: Q and O in f32, K and V in Eigen::half or Eigen::bfloat16 (a KV cache kept in 16
/// bits beside f32 activations). Same parameters, checks and numerical contract as attend(); the CPU flash kernel
/// widens K and V to f32 exactly as it packs them, so the result is the all-f32 computation on the widened K and V
/// (error <= 2x a plain f32 implementation on the same inputs, tests/test_lowp.cpp).
/// @return ok; errc::invalid_argument naming the bad field (nothing written); errc::unsupported for any policy but
///         policy::cpu<Arch> (cpu_naive, cuda, ascend) or a CPU without Arch; errc::out_of_memory.
template <class Policy, class KV, class Mask = dense, std::enable_if_t<is_half_kv_v<KV>, int> = 0>
status attend(const Policy& pol, const problem& p, tensor_ref<const float> q, tensor_ref<const KV> k,
              tensor_ref<const KV> v, tensor_ref<float> o, const Mask& mask = {}, float* lse = nullptr) {
  if constexpr (detail::is_runtime_mask_v<Mask>) {
    return detail::visit_mask(mask, [&](const auto& m) { return attend(pol, p, q, k, v, o, m, lse); });
  } else {
    if (status st = validate_policy(pol); !st) return st;
    if (status st = detail::validate_mixed(p, q, k, v, o, mask, lse); !st) return st;
    if constexpr (!detail::is_cpu_flash_policy<Policy>::value) {
      return detail::mixed_unsupported();
    } else {
      // The checks of the all-f32 call's plan (policy, what the kernel supports, scratch sizes); K and V are only
      // described to it, never read.
      const auto bound = bind(mask, p);
      const tensor_ref<const float> k32{nullptr, k.dims, k.stride}, v32{nullptr, v.dims, v.stride};
      if (status st = detail::plan_run(pol, p, q, k32, v32, o, bound, lse).st; !st) return st;
      if (detail::nothing_to_compute(p)) return {};
      if (p.seq_kv == 0) return kernels::no_key_rows(p, o, lse, mods_of(bound));
      return kernels::flash_attention_kv<float, typename Policy::arch>(p, q, kernels::strided_kv<KV>{k, v}, o, bound,
                                                                       lse, pol.threads, pol.tiles);
    }
  }
}

/// plan() for mixed storage (see the attend overload above): the kernel and its scratch, without running it.
template <class Policy, class KV, class Mask = dense, std::enable_if_t<is_half_kv_v<KV>, int> = 0>
kernel_plan plan(const Policy& pol, const problem& p, tensor_ref<const float> q, tensor_ref<const KV> k,
                 tensor_ref<const KV> v, tensor_ref<float> o, const Mask& mask = {}, const float* lse = nullptr) {
  if constexpr (detail::is_runtime_mask_v<Mask>) {
    return detail::visit_mask(mask, [&](const auto& m) { return plan(pol, p, q, k, v, o, m, lse); });
  } else {
    if (status st = validate_policy(pol); !st) return detail::failed_plan(st);
    if (status st = detail::validate_mixed(p, q, k, v, o, mask, lse); !st) return detail::failed_plan(st);
    if constexpr (!detail::is_cpu_flash_policy<Policy>::value) {
      return detail::failed_plan(detail::mixed_unsupported());
    } else {
      // The f32 plan of the same call: K and V are packed as f32, so kernel and scratch are the all-f32 ones.
      const tensor_ref<const float> k32{nullptr, k.dims, k.stride}, v32{nullptr, v.dims, v.stride};
      return detail::plan_run(pol, p, q, k32, v32, o, bind(mask, p), lse);
    }
  }
}

}  // namespace fusedattn
