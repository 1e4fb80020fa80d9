/// @file cuda.cuh
/// dist::attend and dist::attend_backward with policy::cuda: the schedules of dist/attend.hpp and dist/backward.hpp
/// on device memory (buffers from a memory pool of fusedattn/dist's own, copies, sums and merges as kernels on the
/// policy's stream). Include from a .cu file (nvcc) instead of those two; pair it with a stream-ordered engine.
#pragma once

#if !defined(__CUDACC__)
#error "fusedattn/dist/cuda.cuh must be compiled by nvcc (a .cu file)"
#endif

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "../backends/cuda/device_types.cuh"
#include "../backends/cuda/error.cuh"
#include "attend.hpp"
#include "backward.hpp"
#include "merge.cuh"

namespace fusedattn {
namespace dist {

/// The current device's pool for dist::attend's buffers (accumulator, parts, the K/V shards in flight), created on
/// first use. It keeps freed memory mapped (a model calls the same shapes layer after layer); trim_device_buffers
/// gives it back.
inline status device_pool(cudaMemPool_t& pool) {
  static std::mutex guard;
  static cudaMemPool_t pools[cuda_backend::max_cached_devices] = {};
  int device = 0;
  if (status st = cuda_backend::from_cuda(cudaGetDevice(&device), "cudaGetDevice"); !st) return st;
  if (device >= cuda_backend::max_cached_devices) return {errc::unsupported, "CUDA device index past 63"};
  const std::lock_guard<std::mutex> lock(guard);
  if (pools[device] == nullptr) {
    cudaMemPoolProps props{};
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = device;
    cudaMemPool_t fresh = nullptr;
    if (status st = cuda_backend::from_cuda(cudaMemPoolCreate(&fresh, &props), "cudaMemPoolCreate"); !st) return st;
    std::uint64_t keep = UINT64_MAX;
    if (status st = cuda_backend::from_cuda(cudaMemPoolSetAttribute(fresh, cudaMemPoolAttrReleaseThreshold, &keep),
                                            "cudaMemPoolSetAttribute");
        !st)
      return st;
    pools[device] = fresh;
  }
  pool = pools[device];
  return {};
}

/// Gives the current device's dist buffers that no call holds back to the device.
inline status trim_device_buffers() {
  cudaMemPool_t pool = nullptr;
  if (status st = device_pool(pool); !st) return st;
  return cuda_backend::from_cuda(cudaMemPoolTrimTo(pool, 0), "cudaMemPoolTrimTo");
}

namespace detail {

/// Rows a block of rows_kernel walks at once: one warp per row.
constexpr int rows_per_block = 8;

/// The element operations of rows_kernel: dst = src, converted; dst += src, summed in dst's type.
struct assign_op {
  template <class D, class S>
  __device__ __forceinline__ void operator()(D& o, const S& a) const {
    o = cuda_backend::narrow<D>(cuda_backend::widen(a));
  }
};
struct add_op {
  template <class D, class S>
  __device__ __forceinline__ void operator()(D& o, const S& a) const {
    o = cuda_backend::narrow<D>(cuda_backend::widen(o) + cuda_backend::widen(a));
  }
};

/// op(dst element, src element) over two views of the same extents: one warp per row (lanes over the row's
/// elements, so a row of 128 half values is one 256-byte transaction), the blocks striding over rows (a K/V shard
/// has millions of short rows).
template <class S, class D, class Op>
__global__ void rows_kernel(tensor_ref<const S> src, tensor_ref<D> dst, Op op) {
  const index_t rows = src.dims.b * src.dims.h * src.dims.s;
  const int lane = threadIdx.x % 32;
  for (index_t row = index_t(blockIdx.x) * rows_per_block + threadIdx.x / 32; row < rows;
       row += index_t(gridDim.x) * rows_per_block) {
    const index_t i = row % src.dims.s, h = row / src.dims.s % src.dims.h, b = row / src.dims.s / src.dims.h;
    const S* a = src.row(b, h, i);
    D* o = dst.row(b, h, i);
    for (index_t c = lane; c < src.dims.d; c += 32) op(o[c], a[c]);
  }
}

__global__ inline void fill_kernel(float* p, index_t n, float value) {
  for (index_t i = index_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += index_t(gridDim.x) * blockDim.x)
    p[i] = value;
}

/// Device memory, policy::cuda: the operations the schedule asks of its memory, on the policy's stream.
class cuda_exec {
 public:
  explicit cuda_exec(void* stream) : stream_(static_cast<cudaStream_t>(stream)) {}
  cuda_exec(const cuda_exec&) = delete;
  cuda_exec& operator=(const cuda_exec&) = delete;
  cuda_exec(cuda_exec&& other) noexcept : stream_(other.stream_), blocks_(std::move(other.blocks_)) {}
  ~cuda_exec() {
    for (void* p : blocks_) cudaFreeAsync(p, stream_);
  }

  void* stream() const { return stream_; }

  template <class U>
  status allocate(U*& out, index_t n) {
    cudaMemPool_t pool = nullptr;
    if (status st = device_pool(pool); !st) return st;
    void* p = nullptr;
    const std::size_t bytes = static_cast<std::size_t>(n) * sizeof(U);
    const cudaError_t e = cudaMallocFromPoolAsync(&p, bytes > 0 ? bytes : 1, pool, stream_);
    if (e == cudaErrorMemoryAllocation) {
      cudaGetLastError();
      return {errc::out_of_memory, "dist::attend: " + std::to_string(bytes) + " bytes of device memory"};
    }
    if (status st = cuda_backend::from_cuda(e, "cudaMallocFromPoolAsync"); !st) return st;
    blocks_.push_back(p);
    out = static_cast<U*>(p);
    return {};
  }

  /// dst = src element by element, converted; both views have the same extents.
  template <class S, class D>
  status copy(const tensor_ref<S>& src, const tensor_ref<D>& dst) {
    return each_element(src, dst, assign_op{}, "fusedattn::dist copy");
  }

  /// dst += src element by element, summed in dst's type; both views have the same extents.
  template <class S, class D>
  status add(const tensor_ref<S>& src, const tensor_ref<D>& dst) {
    return each_element(src, dst, add_op{}, "fusedattn::dist add");
  }

  template <class U>
  status zero(U* p, index_t n) {
    if (n == 0) return {};
    return cuda_backend::from_cuda(cudaMemsetAsync(p, 0, static_cast<std::size_t>(n) * sizeof(U), stream_),
                                   "cudaMemsetAsync");
  }

  status fill(float* p, index_t n, float value) {
    if (n == 0) return {};
    const index_t blocks = (n + 255) / 256 < 4096 ? (n + 255) / 256 : 4096;
    fill_kernel<<<static_cast<unsigned>(blocks), 256, 0, stream_>>>(p, n, value);
    return cuda_backend::last_launch("fusedattn::dist fill");
  }

  status copy_floats(const float* src, float* dst, index_t n) {
    return cuda_backend::from_cuda(
        cudaMemcpyAsync(dst, src, static_cast<std::size_t>(n) * sizeof(float), cudaMemcpyDeviceToDevice, stream_),
        "cudaMemcpyAsync(lse)");
  }

  template <class TA, class TB, class TO>
  status merge(const tensor_ref<TA>& o_a, const lse_ref<const float>& lse_a, const tensor_ref<TB>& o_b,
               const lse_ref<const float>& lse_b, const tensor_ref<TO>& o, const lse_ref<float>& lse) {
    return cuda::merge_partials(o_a, lse_a, o_b, lse_b, o, lse, stream_);
  }

  /// The union of `count` partial results in one pass (cuda::detail::merge_parts, host_exec::merge_parts' layout).
  template <class P, class TO>
  status merge_parts(const P* parts, const float* lses, int count, const tensor_ref<TO>& o, float* lse) {
    return cuda::detail::merge_parts(parts, lses, count, o, lse, stream_);
  }

  status synchronize() { return cuda_backend::from_cuda(cudaStreamSynchronize(stream_), "cudaStreamSynchronize"); }

 private:
  /// rows_kernel with `op` on the stream; `what` names the launch in its error.
  template <class S, class D, class Op>
  status each_element(const tensor_ref<S>& src, const tensor_ref<D>& dst, Op op, const char* what) {
    using ES = cuda_backend::device_t<S>;
    using ED = cuda_backend::device_t<D>;
    const index_t rows = src.dims.b * src.dims.h * src.dims.s;
    if (rows == 0) return {};
    const tensor_ref<const ES> s{reinterpret_cast<const ES*>(src.data), src.dims, src.stride};
    const tensor_ref<ED> d{reinterpret_cast<ED*>(dst.data), dst.dims, dst.stride};
    const index_t blocks = std::min<index_t>((rows + rows_per_block - 1) / rows_per_block, index_t(1) << 20);
    rows_kernel<ES, ED><<<static_cast<unsigned>(blocks), 32 * rows_per_block, 0, stream_>>>(s, d, op);
    return cuda_backend::last_launch(what);
  }

  cudaStream_t stream_;
  std::vector<void*> blocks_;
};

template <>
struct exec_for<policy::cuda> {
  static constexpr bool available = true;
  using type = cuda_exec;
  static type make(const policy::cuda& p) { return cuda_exec(p.stream); }
};

}  // namespace detail
}  // namespace dist
}  // namespace fusedattn
