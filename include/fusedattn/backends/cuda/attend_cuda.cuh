/// @file attend_cuda.cuh
/// The CUDA side of `attend`: checks that every pointer is device memory, picks flash or the naive pipeline for
/// policy::cuda's `kernel`, and runs it on the policy's stream. Included by dispatch/attend.hpp when
/// FUSEDATTN_WITH_CUDA is 1; a translation unit that sees it must be compiled by nvcc (a .cu file).
#pragma once

#if !defined(__CUDACC__)
#error "fusedattn's CUDA backend must be compiled by nvcc: include fusedattn with FUSEDATTN_WITH_CUDA=1 only in .cu files (the fusedattn::cuda CMake target sets it for CUDA sources only)"
#endif

#include <string>
#include <type_traits>

#include <cuda_runtime.h>

#include "../../core/problem.hpp"
#include "../../core/status.hpp"
#include "../../core/tensor.hpp"
#include "../../dispatch/policy.hpp"
#include "../../kernels/mask.hpp"
#include "device_types.cuh"
#include "error.cuh"
#include "flash.cuh"
#include "naive.cuh"

namespace fusedattn {
namespace cuda_backend {

/// Compute capability major of the current device (0 when it cannot be read).
inline int device_major() {
  int device = 0, major = 0;
  if (cudaGetDevice(&device) != cudaSuccess || cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return major;
}

/// ok when the flash kernel applies to this call, else errc::unsupported saying why.
template <class T>
status flash_applies(const problem& p, const tensor_ref<const T>& q, const tensor_ref<const T>& k,
                     const tensor_ref<const T>& v, const tensor_ref<T>& o) {
  using E = device_t<T>;
  constexpr int min_major = 8;  // mma.sync m16n8k16 with bf16, ldmatrix, cp.async: sm_80
  if (!std::is_same_v<E, __half> && !std::is_same_v<E, __nv_bfloat16>)
    return {errc::unsupported, std::string("CUDA flash takes f16 and bf16; this call is ") + scalar_name<T>() +
                                   " (policy::cuda{.kernel = automatic} runs it on the naive pipeline)"};
  if (p.head_dim != 64 && p.head_dim != 128)
    return {errc::unsupported, "problem.head_dim is " + std::to_string(p.head_dim) + "; CUDA flash takes 64 and 128"};
  if (!flash_aligned(q) || !flash_aligned(k) || !flash_aligned(v) || !flash_aligned(o))
    return {errc::unsupported,
            "CUDA flash needs 16-byte aligned data and row/head/batch strides that are multiples of 8 elements"};
  if (device_major() < min_major) return {errc::unsupported, "CUDA flash needs compute capability 8.0 or newer"};
  return flash_grid_fits(p);
}

/// Runs the flash kernel (flash_applies must have said ok).
template <class T>
status run_flash(const problem& p, const tensor_ref<const T>& q, const tensor_ref<const T>& k,
                 const tensor_ref<const T>& v, const tensor_ref<T>& o, const band_mask& mask, float* lse,
                 cudaStream_t stream) {
  using E = device_t<T>;
  if constexpr (std::is_same_v<E, __half> || std::is_same_v<E, __nv_bfloat16>) {
    constexpr double log2e = 1.4426950408889634;
    const flash_params fp{q.data, k.data, v.data, o.data, lse, q.stride, k.stride, v.stride, o.stride,
                          int(p.batch), int(p.heads), int(p.group_size()), int(p.seq_q), int(p.seq_kv),
                          static_cast<float>(p.softmax_scale() * log2e), mask, 1, nullptr, nullptr};
    if (p.head_dim == 64) return launch_flash<E, typename flash_default_tile<64>::type>(fp, stream);
    return launch_flash<E, typename flash_default_tile<128>::type>(fp, stream);
  } else {
    return flash_applies(p, q, k, v, o);  // says why not
  }
}

/// policy::cuda's attend after validation: device-pointer checks, kernel choice, launch. Asynchronous: an error of
/// the kernels themselves shows at the next synchronisation of the stream.
template <class T>
status attend(const policy::cuda& pol, const problem& p, const tensor_ref<const T>& q, const tensor_ref<const T>& k,
              const tensor_ref<const T>& v, const tensor_ref<T>& o, const band_mask& mask, float* lse) {
  const void* ptrs[5] = {q.data, k.data, v.data, o.data, lse};
  const char* names[5] = {"q", "k", "v", "o", "lse"};
  for (int i = 0; i < 5; ++i)
    if (ptrs[i] != nullptr)
      if (status st = check_device_pointer(ptrs[i], names[i]); !st) return st;
  const auto stream = static_cast<cudaStream_t>(pol.stream);
  switch (pol.kernel) {
    case policy::cuda_kernel::naive: return naive_attention(p, q, k, v, o, mask, lse, stream);
    case policy::cuda_kernel::flash:
      if (status st = flash_applies(p, q, k, v, o); !st) return st;
      return run_flash(p, q, k, v, o, mask, lse, stream);
    case policy::cuda_kernel::automatic:
      if (flash_applies(p, q, k, v, o)) return run_flash(p, q, k, v, o, mask, lse, stream);
      return naive_attention(p, q, k, v, o, mask, lse, stream);
  }
  return status::invalid("policy.kernel is not a valid fusedattn::policy::cuda_kernel value");
}

}  // namespace cuda_backend

namespace detail {
/// policy::cuda with a mask the GPU kernels do not take yet (block_sparse): errc::unsupported, nothing written.
template <class T, class Bound>
status run(const policy::cuda&, const problem&, const tensor_ref<const T>&, const tensor_ref<const T>&,
           const tensor_ref<const T>&, const tensor_ref<T>&, const Bound&, float*) {
  return {errc::unsupported, "the CUDA backend does not run block_sparse masks yet (use a CPU policy)"};
}
/// policy::cuda: see cuda_backend::attend.
template <class T>
status run(const policy::cuda& pol, const problem& p, const tensor_ref<const T>& q, const tensor_ref<const T>& k,
           const tensor_ref<const T>& v, const tensor_ref<T>& o, const band_mask& mask, float* lse) {
  return cuda_backend::attend(pol, p, q, k, v, o, mask, lse);
}
}  // namespace detail
}  // namespace fusedattn
