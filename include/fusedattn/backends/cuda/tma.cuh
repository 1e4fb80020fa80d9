/// @file tma.cuh
/// Hopper's tensor memory accelerator for the tiles of flash_hopper.cuh: a tensor map per operand (made on the host
/// through the driver's cuTensorMapEncodeTiled, reached via the runtime's entry-point query, so nothing links
/// libcuda), the tile copies cp.async.bulk.tensor that one thread issues (loads of Q, K and V completing on a
/// shared-memory mbarrier; stores of O as a bulk group), and the mbarrier itself. Thin wrappers only; the device
/// functions compile to nothing useful outside sm_90a (callers guard with FUSEDATTN_WGMMA_COMPILED).
#pragma once

#include <algorithm>
#include <cstdint>

#include <cuda.h>
#include <cuda_runtime.h>

#include "../../core/problem.hpp"
#include "mma.cuh"
#include "wgmma.cuh"

namespace fusedattn {
namespace cuda_backend {

/// Initialises an mbarrier in shared memory that completes a phase after `arrivals` arrivals (plus, for a copy's
/// barrier, its expected bytes).
__device__ __forceinline__ void mbarrier_init(std::uint64_t* bar, std::uint32_t arrivals = 1) {
#if FUSEDATTN_WGMMA_COMPILED
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_address(bar)), "r"(arrivals));
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#else
  (void)bar, (void)arrivals;
#endif
}
/// One arrival on `bar` (release: this thread's earlier shared-memory reads and writes happen before the phase
/// completes for a waiter).
__device__ __forceinline__ void mbarrier_arrive(std::uint64_t* bar) {
#if FUSEDATTN_WGMMA_COMPILED
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_address(bar)) : "memory");
#else
  (void)bar;
#endif
}
/// The one arrival of this phase, announcing `bytes` that copies will complete on it.
__device__ __forceinline__ void mbarrier_expect_bytes(std::uint64_t* bar, std::uint32_t bytes) {
#if FUSEDATTN_WGMMA_COMPILED
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_address(bar)), "r"(bytes)
               : "memory");
#else
  (void)bar, (void)bytes;
#endif
}
/// Waits until the phase of parity `parity` has completed.
__device__ __forceinline__ void mbarrier_wait(std::uint64_t* bar, std::uint32_t parity) {
#if FUSEDATTN_WGMMA_COMPILED
  asm volatile(
      "{\n.reg .pred done;\nwait_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_%=;\n}\n" ::"r"(smem_address(bar)),
      "r"(parity)
      : "memory");
#else
  (void)bar, (void)parity;
#endif
}
/// Copies the box at element coordinates (c0, c1, c2, c3) of `map` to `smem`, completing its bytes on `bar`.
__device__ __forceinline__ void tma_load_4d(void* smem, const CUtensorMap* map, int c0, int c1, int c2, int c3,
                                            std::uint64_t* bar) {
#if FUSEDATTN_WGMMA_COMPILED
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, "
      "%5}], [%6];\n" ::"r"(smem_address(smem)),
      "l"(reinterpret_cast<std::uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_address(bar))
      : "memory");
#else
  (void)smem, (void)map, (void)c0, (void)c1, (void)c2, (void)c3, (void)bar;
#endif
}

/// Copies `smem` to the box at element coordinates (c0, c1, c2, c3) of `map` (elements outside the tensor are not
/// written), as a bulk group of this thread; commit with bulk_commit, wait for its reads with bulk_wait_read.
__device__ __forceinline__ void tma_store_4d(const CUtensorMap* map, const void* smem, int c0, int c1, int c2, int c3) {
#if FUSEDATTN_WGMMA_COMPILED
  asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
                   reinterpret_cast<std::uint64_t>(map)),
               "r"(smem_address(smem)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
               : "memory");
#else
  (void)map, (void)smem, (void)c0, (void)c1, (void)c2, (void)c3;
#endif
}
/// Closes this thread's bulk group of tma_store_4d copies.
__device__ __forceinline__ void bulk_commit() {
#if FUSEDATTN_WGMMA_COMPILED
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
#endif
}
/// Waits until at most `Pending` of this thread's bulk groups still read their shared-memory source.
template <int Pending>
__device__ __forceinline__ void bulk_wait_read() {
#if FUSEDATTN_WGMMA_COMPILED
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(Pending) : "memory");
#endif
}

/// Gives this warpgroup `Regs` registers a thread (setmaxnreg; every thread of the warpgroup executes it): a
/// producer warpgroup hands registers back, the consumers take them. Needs __launch_bounds__ with min blocks.
template <int Regs>
__device__ __forceinline__ void warpgroup_registers_dec() {
#if FUSEDATTN_WGMMA_COMPILED
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(Regs));
#endif
}
template <int Regs>
__device__ __forceinline__ void warpgroup_registers_inc() {
#if FUSEDATTN_WGMMA_COMPILED
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(Regs));
#endif
}
/// Barrier `id` (1..15; 0 is __syncthreads) over `threads` threads (a multiple of 32) of the block.
__device__ __forceinline__ void named_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
/// Arrives at barrier `id` without waiting: counts towards the `threads` that a named_barrier(id, threads) waits for.
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

/// The tensor map of a Q, K, V or O operand for tiles of `rows` rows × 64 columns in 128-byte swizzled atoms (the
/// panel layout of flash_hopper.cuh): dims (head_dim, seq, heads, batch), the outer three ordered by stride so that
/// any layout with 16-byte multiple strides has a valid map; `order[i]` is the problem dimension (1 seq, 2 head,
/// 3 batch) of map dimension i + 1, for the kernel's coordinates. Rows past `seq` read as zeros and are not
/// written. False when the driver has no cuTensorMapEncodeTiled or refuses the operand (the call then runs the
/// portable kernel).
inline bool make_tile_map(CUtensorMap& map, int (&order)[3], const void* base, bool bf16, index_t head_dim, index_t seq,
                        index_t heads, index_t batch, const strides4& stride, int rows) {
  using encode_t = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
  static const encode_t encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
#if CUDART_VERSION >= 12050
    const cudaError_t asked =
        cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found);
#else
    const cudaError_t asked = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &fn, cudaEnableDefault, &found);
#endif
    if (asked != cudaSuccess || found != cudaDriverEntryPointSuccess) fn = nullptr;
    cudaGetLastError();
    return reinterpret_cast<encode_t>(fn);
  }();
  if (encode == nullptr) return false;
  const index_t extent[4] = {head_dim, seq, heads, batch};
  const index_t step[4] = {1, stride.s, stride.h, stride.b};
  int dims[3] = {1, 2, 3};
  std::sort(dims, dims + 3, [&](int a, int b) { return step[a] < step[b] || (step[a] == step[b] && a < b); });
  cuuint64_t global_dim[4] = {cuuint64_t(head_dim), 0, 0, 0};
  cuuint64_t global_stride[3];
  cuuint32_t box[4] = {64, 1, 1, 1};
  const cuuint32_t element_stride[4] = {1, 1, 1, 1};
  for (int i = 0; i < 3; ++i) {
    order[i] = dims[i];
    global_dim[i + 1] = cuuint64_t(extent[dims[i]]);
    global_stride[i] = cuuint64_t(step[dims[i]]) * 2;
    if (dims[i] == 1) box[i + 1] = cuuint32_t(rows);
  }
  return encode(&map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4,
                const_cast<void*>(base), global_dim, global_stride, box, element_stride, CU_TENSOR_MAP_INTERLEAVE_NONE,
                CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace cuda_backend
}  // namespace fusedattn
