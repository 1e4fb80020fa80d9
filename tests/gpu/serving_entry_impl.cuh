/// @file serving_entry_impl.cuh
/// The GPU serving tests' bridge (serving_entry.hpp) as templates and the macro that instantiates it for one storage
/// type, each type in a translation unit of its own (serving_entry_f16.cu, serving_entry_bf16.cu). Not part of the library.
#pragma once

#include <type_traits>

#include "serving_entry.hpp"

namespace fusedattn::testing::gpu {

inline status synced(status st) {
  const cudaError_t e = cudaDeviceSynchronize();
  if (!st) return st;
  return cuda_backend::from_cuda(e == cudaSuccess ? cudaGetLastError() : e, "a serving kernel");
}

template <class T>
status attend_paged_cuda(const problem& p, tensor_ref<const T> q, const paged_kv<const T>& kv, tensor_ref<T> o,
                         const serving_mask& mask, float* lse) {
  return synced(std::visit([&](const auto& m) { return attend_paged(policy::cuda{}, p, q, kv, o, m, lse); }, mask));
}

template <class T>
status attend_ragged_cuda(const problem& p, const ragged_batch& rb, tensor_ref<const T> q, tensor_ref<const T> k,
                          tensor_ref<const T> v, tensor_ref<T> o, const serving_mask& mask, float* lse) {
  return synced(
      std::visit([&](const auto& m) { return attend_ragged(policy::cuda{}, p, rb, q, k, v, o, m, lse); }, mask));
}

template <class T>
status attend_paged_cuda_on(void* stream, const problem& p, tensor_ref<const T> q, const paged_kv<const T>& kv,
                            tensor_ref<T> o, const serving_mask& mask, float* lse) {
  return std::visit([&](const auto& m) { return attend_paged(policy::cuda{stream}, p, q, kv, o, m, lse); }, mask);
}

template <class T>
status attend_ragged_cuda_on(void* stream, const problem& p, const ragged_batch& rb, tensor_ref<const T> q,
                             tensor_ref<const T> k, tensor_ref<const T> v, tensor_ref<T> o, const serving_mask& mask,
                             float* lse) {
  return std::visit(
      [&](const auto& m) { return attend_ragged(policy::cuda{stream}, p, rb, q, k, v, o, m, lse); }, mask);
}

template <class T>
status attend_decode_cuda(const problem& p, tensor_ref<const T> q, tensor_ref<const T> k, tensor_ref<const T> v,
                          tensor_ref<T> o, const serving_mask& mask, float* lse) {
  return synced(std::visit(
      [&](const auto& m) -> status {
        if constexpr (fusedattn::detail::is_modified_v<std::decay_t<decltype(m)>>)
          return {errc::unsupported, "attend_decode_cuda: plain masks only"};
        else
          return attend(policy::cuda{}, p, q, k, v, o, m, lse);
      },
      mask));
}

template <class T>
kernel_plan plan_decode_cuda(const problem& p, tensor_ref<const T> q, tensor_ref<const T> k, tensor_ref<const T> v,
                             tensor_ref<T> o, const serving_mask& mask, float* lse) {
  return std::visit(
      [&](const auto& m) -> kernel_plan {
        if constexpr (fusedattn::detail::is_modified_v<std::decay_t<decltype(m)>>) {
          return detail::failed_plan(status{errc::unsupported, "plan_decode_cuda: plain masks only"});
        } else {
          return plan(policy::cuda{}, p, q, k, v, o, m, lse);
        }
      },
      mask);
}

#define FUSEDATTN_SERVING_ENTRY(T)                                                                                   \
  template status attend_paged_cuda<T>(const problem&, tensor_ref<const T>, const paged_kv<const T>&, tensor_ref<T>, \
                                       const serving_mask&, float*);                                                 \
  template status attend_ragged_cuda<T>(const problem&, const ragged_batch&, tensor_ref<const T>,                    \
                                        tensor_ref<const T>, tensor_ref<const T>, tensor_ref<T>, const serving_mask&, \
                                        float*);                                                                     \
  template status attend_paged_cuda_on<T>(void*, const problem&, tensor_ref<const T>, const paged_kv<const T>&,      \
                                          tensor_ref<T>, const serving_mask&, float*);                               \
  template status attend_ragged_cuda_on<T>(void*, const problem&, const ragged_batch&, tensor_ref<const T>,          \
                                           tensor_ref<const T>, tensor_ref<const T>, tensor_ref<T>,                  \
                                           const serving_mask&, float*);                                             \
  template status attend_decode_cuda<T>(const problem&, tensor_ref<const T>, tensor_ref<const T>,                    \
                                        tensor_ref<const T>, tensor_ref<T>, const serving_mask&, float*);            \
  template kernel_plan plan_decode_cuda<T>(const problem&, tensor_ref<const T>, tensor_ref<const T>,                 \
                                           tensor_ref<const T>, tensor_ref<T>, const serving_mask&, float*);

}  // namespace fusedattn::testing::gpu
