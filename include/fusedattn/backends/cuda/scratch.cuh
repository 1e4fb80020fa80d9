/// @file scratch.cuh
/// Stream-ordered scratch memory of the CUDA backend (the split-KV parts of the flash kernels, the naive pipeline's
/// S and P) from a memory pool of fusedattn's own, one per device, that stays mapped between calls; for the
/// application, `cuda::scratch_reserved` (what it holds) and `cuda::trim_scratch` (give it back). No kernels here.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>

#include <cuda_runtime.h>

#include "error.cuh"

namespace fusedattn {
namespace cuda_backend {

/// Bytes of freed scratch that scratch_pool keeps mapped when a stream synchronises (beyond it, the pool gives
/// memory back to the device).
inline constexpr std::uint64_t scratch_pool_keep_bytes = std::uint64_t(256) << 20;

/// The current device's scratch pool, created on first use (with `create` false, `pool` is nullptr until then).
/// fusedattn's own pool, so that the device's default pool and its settings stay the application's; it keeps up to
/// scratch_pool_keep_bytes mapped across synchronisations (cuda::trim_scratch gives them back). A pool with release
/// threshold 0, such as the device's default, maps every call's scratch again after each synchronisation, which
/// costs short calls (decode, split-KV) a large share of their time (docs/design.md, CUDA scratch).
inline status scratch_pool(cudaMemPool_t& pool, bool create = true) {
  static std::mutex guard;
  static cudaMemPool_t pools[max_cached_devices] = {};
  pool = nullptr;
  int device = 0;
  if (status st = from_cuda(cudaGetDevice(&device), "cudaGetDevice"); !st) return st;
  if (device >= max_cached_devices) return {errc::unsupported, "CUDA device index past 63"};
  const std::lock_guard<std::mutex> lock(guard);
  if (pools[device] == nullptr && create) {
    cudaMemPoolProps props{};
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = device;
    cudaMemPool_t fresh = nullptr;
    if (status st = from_cuda(cudaMemPoolCreate(&fresh, &props), "cudaMemPoolCreate(fusedattn scratch)"); !st)
      return st;
    std::uint64_t keep = scratch_pool_keep_bytes;
    if (status st = from_cuda(cudaMemPoolSetAttribute(fresh, cudaMemPoolAttrReleaseThreshold, &keep),
                              "cudaMemPoolSetAttribute(fusedattn scratch)");
        !st) {
      cudaMemPoolDestroy(fresh);
      return st;
    }
    pools[device] = fresh;
  }
  pool = pools[device];
  return {};
}

/// `bytes` of scratch from scratch_pool in stream order (free with cudaFreeAsync on the same stream); `what` names
/// the buffer in the error. While `stream` is being captured into a graph the allocation is the graph's anyway (an
/// allocation node), so it comes from cudaMallocAsync as before the pool, and no pool is created mid-capture.
inline status scratch_allocate(void*& out, std::size_t bytes, cudaStream_t stream, const char* what) {
  out = nullptr;
  bool capturing = false;
  if (status st = stream_capturing(stream, capturing); !st) return st;
  cudaError_t e = cudaSuccess;
  if (capturing) {
    e = cudaMallocAsync(&out, bytes, stream);
  } else {
    cudaMemPool_t pool = nullptr;
    if (status st = scratch_pool(pool); !st) return st;
    e = cudaMallocFromPoolAsync(&out, bytes, pool, stream);
  }
  if (e != cudaSuccess) cudaGetLastError();
  return from_cuda(e, what);
}

}  // namespace cuda_backend

namespace cuda {

/// Device memory that fusedattn's scratch pool holds on the current device (`bytes`): what it has mapped, in use
/// or kept for the next call (0 before the first call that needed scratch). Split-KV calls (decode) and the naive
/// pipeline take their scratch from this pool, which keeps up to 256 MiB mapped between calls.
inline status scratch_reserved(std::size_t& bytes) {
  bytes = 0;
  cudaMemPool_t pool = nullptr;
  if (status st = cuda_backend::scratch_pool(pool, false); !st || pool == nullptr) return st;
  std::uint64_t reserved = 0;
  if (status st = cuda_backend::from_cuda(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &reserved),
                                          "cudaMemPoolGetAttribute(fusedattn scratch)");
      !st)
    return st;
  bytes = static_cast<std::size_t>(reserved);
  return {};
}

/// Gives the scratch that fusedattn's pool keeps mapped on the current device back to the device, down to at most
/// `keep_bytes` (cudaMemPoolTrimTo); scratch still in use by unfinished calls stays. For an application that needs
/// the memory between bursts of calls; the next call that needs scratch maps it again.
inline status trim_scratch(std::size_t keep_bytes = 0) {
  cudaMemPool_t pool = nullptr;
  if (status st = cuda_backend::scratch_pool(pool, false); !st || pool == nullptr) return st;
  return cuda_backend::from_cuda(cudaMemPoolTrimTo(pool, keep_bytes), "cudaMemPoolTrimTo(fusedattn scratch)");
}

}  // namespace cuda
}  // namespace fusedattn
