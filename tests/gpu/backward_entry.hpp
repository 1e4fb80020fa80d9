/// @file backward_entry.hpp
/// The bridge of the GPU backward tests: attend_backward(policy::cuda{...}) compiled by nvcc in backward_entry.cu,
/// callable from the Catch2 file that g++ compiles. Not part of the library.
#pragma once

#include <fusedattn/fusedattn.hpp>

namespace fusedattn::testing::gpu {

/// attend_backward(policy::cuda{}, ...) on device pointers (lse too); returns the launch status (no synchronisation).
/// `deterministic` is policy::cuda::deterministic (false: the atomic-dQ Hopper path where it applies).
template <class T>
status attend_backward_cuda(const problem& p, tensor_ref<const T> q, tensor_ref<const T> k, tensor_ref<const T> v,
                            tensor_ref<const T> o, tensor_ref<const T> d_o, const float* lse, tensor_ref<T> dq,
                            tensor_ref<T> dk, tensor_ref<T> dv, const any_mask& mask, bool deterministic = true);

/// attend_backward(policy::cuda{}, ...) with score modifiers (their arrays in device memory); no synchronisation.
template <class T>
status attend_backward_cuda_mods(const problem& p, tensor_ref<const T> q, tensor_ref<const T> k, tensor_ref<const T> v,
                                 tensor_ref<const T> o, tensor_ref<const T> d_o, const float* lse, tensor_ref<T> dq,
                                 tensor_ref<T> dk, tensor_ref<T> dv, const modified<any_mask>& mask,
                                 bool deterministic = true);

/// The same call with block_sparse's layout uploaded first (cuda::upload) and passed as cuda::device_block_sparse;
/// synchronises before the device layout is freed. Returns the first failing status.
template <class T>
status attend_backward_cuda_uploaded(const problem& p, tensor_ref<const T> q, tensor_ref<const T> k,
                                     tensor_ref<const T> v, tensor_ref<const T> o, tensor_ref<const T> d_o,
                                     const float* lse, tensor_ref<T> dq, tensor_ref<T> dk, tensor_ref<T> dv,
                                     const block_sparse& mask, bool deterministic = true);

}  // namespace fusedattn::testing::gpu
