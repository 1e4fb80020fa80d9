/// @file error.cuh
/// CUDA and cuBLAS results turned into fusedattn statuses carrying the driver's text, and the device-pointer
/// check of the CUDA policy. No kernels here.
#pragma once

#include <string>

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "../../core/status.hpp"

namespace fusedattn {
namespace cuda_backend {

/// Devices the backend's per-device caches hold (hopper_flash_ready's answers, scratch_pool's pools): device
/// indices 0 to 63.
inline constexpr int max_cached_devices = 64;

/// ok, or errc::backend_error (errc::out_of_memory for cudaErrorMemoryAllocation) naming the failed call.
inline status from_cuda(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return {};
  const errc code = e == cudaErrorMemoryAllocation ? errc::out_of_memory : errc::backend_error;
  return {code, std::string(what) + " failed: " + cudaGetErrorName(e) + ": " + cudaGetErrorString(e)};
}

/// ok, or errc::backend_error (errc::out_of_memory for CUBLAS_STATUS_ALLOC_FAILED) naming the failed call.
inline status from_cublas(cublasStatus_t e, const char* what) {
  if (e == CUBLAS_STATUS_SUCCESS) return {};
  const errc code = e == CUBLAS_STATUS_ALLOC_FAILED ? errc::out_of_memory : errc::backend_error;
  return {code, std::string(what) + " failed: " + cublasGetStatusString(e)};
}

/// Whether `stream` is being captured into a CUDA graph (`capturing`; false when the runtime cannot tell, which the
/// status then says). The backend asks before what a capture cannot hold: creating a memory pool, a synchronous
/// probe, a copy from a buffer the call frees.
inline status stream_capturing(cudaStream_t stream, bool& capturing) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  const cudaError_t e = cudaStreamIsCapturing(stream, &capture);
  capturing = e == cudaSuccess && capture != cudaStreamCaptureStatusNone;
  return from_cuda(e, "cudaStreamIsCapturing");
}

/// The error of the last kernel launch on this thread (cudaGetLastError clears it), as a status.
inline status last_launch(const char* kernel) { return from_cuda(cudaGetLastError(), kernel); }

/// ok when `ptr` is memory the device can address as device or managed memory; errc::invalid_argument naming
/// `name` for host memory (pageable or pinned), errc::backend_error when the runtime cannot tell.
inline status check_device_pointer(const void* ptr, const char* name) {
  cudaPointerAttributes attr{};
  const cudaError_t e = cudaPointerGetAttributes(&attr, ptr);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return from_cuda(e, (std::string("cudaPointerGetAttributes(") + name + ")").c_str());
  }
  if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged)
    return status::invalid(std::string(name) +
                           ".data is not device memory; policy::cuda takes pointers from cudaMalloc (or managed memory)");
  return {};
}

/// The reverse check, for the CPU policies in a translation unit built with the backend: errc::invalid_argument
/// naming `name` when `ptr` is device memory (the host cannot read it). Host, pinned and managed memory, a
/// pointer the runtime does not know, and a machine without a usable device are all ok: nothing to detect.
inline status check_host_pointer(const void* ptr, const char* name) {
  if (ptr == nullptr) return {};
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, ptr) != cudaSuccess) {
    cudaGetLastError();
    return {};
  }
  if (attr.type == cudaMemoryTypeDevice)
    return status::invalid(std::string(name) +
                           ".data is device memory; the CPU policies take host pointers (policy::cuda runs on it)");
  return {};
}

}  // namespace cuda_backend
}  // namespace fusedattn
