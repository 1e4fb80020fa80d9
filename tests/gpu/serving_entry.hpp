/// @file serving_entry.hpp
/// The GPU serving tests' bridge: attend_paged, attend_ragged and decode-shaped attend on policy::cuda, compiled by
/// nvcc in serving_entry.cu and callable from the Catch2 file g++ compiles. Not part of the library.
#pragma once

#include <cstdint>
#include <variant>

#include <fusedattn/fusedattn.hpp>

namespace fusedattn::testing::gpu {

/// The masks a serving call takes (causal with score modifiers: attend_paged and attend_ragged only).
using serving_mask = std::variant<dense, causal, window, modified<causal>>;

/// attend_paged(policy::cuda{}, ...) on device pointers (q, o, lse, pools, block table, lengths); synchronises.
template <class T>
status attend_paged_cuda(const problem& p, tensor_ref<const T> q, const paged_kv<const T>& kv, tensor_ref<T> o,
                         const serving_mask& mask, float* lse);

/// attend_ragged(policy::cuda{}, ...) on device pointers (offsets too); synchronises.
template <class T>
status attend_ragged_cuda(const problem& p, const ragged_batch& rb, tensor_ref<const T> q, tensor_ref<const T> k,
                          tensor_ref<const T> v, tensor_ref<T> o, const serving_mask& mask, float* lse);

/// attend_paged(policy::cuda{stream}, ...) on `stream` (a cudaStream_t), without synchronising: the call's status
/// (e.g. a stream being captured into a CUDA graph).
template <class T>
status attend_paged_cuda_on(void* stream, const problem& p, tensor_ref<const T> q, const paged_kv<const T>& kv,
                            tensor_ref<T> o, const serving_mask& mask, float* lse);

/// attend_ragged(policy::cuda{stream}, ...) on `stream`, without synchronising.
template <class T>
status attend_ragged_cuda_on(void* stream, const problem& p, const ragged_batch& rb, tensor_ref<const T> q,
                             tensor_ref<const T> k, tensor_ref<const T> v, tensor_ref<T> o, const serving_mask& mask,
                             float* lse);

/// attend(policy::cuda{}, ...) (the automatic kernel) on device pointers; synchronises.
template <class T>
status attend_decode_cuda(const problem& p, tensor_ref<const T> q, tensor_ref<const T> k, tensor_ref<const T> v,
                          tensor_ref<T> o, const serving_mask& mask, float* lse);

/// fa::plan of that call.
template <class T>
kernel_plan plan_decode_cuda(const problem& p, tensor_ref<const T> q, tensor_ref<const T> k, tensor_ref<const T> v,
                             tensor_ref<T> o, const serving_mask& mask, float* lse);

}  // namespace fusedattn::testing::gpu
