/// @file wgmma.cuh
/// Hopper's warpgroup tensor-core primitives (sm_90a only): shared-memory matrix descriptors for 128-byte swizzled
/// tiles, wgmma.mma_async m64nNk16 (N = 64 to 128, f16/bf16 in, f32 accumulators) with A from shared memory or from
/// registers, its fence / commit / wait, the proxy fence that makes cp.async data visible to it, and stmatrix (the
/// epilogue's stores of O into its staging tile).
/// Thin PTX wrappers only; the kernel that uses them is flash_hopper.cuh. Every function here compiles to nothing
/// useful on other targets: callers guard their bodies with FUSEDATTN_WGMMA_COMPILED.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "mma.cuh"

/// 1 in the device pass for the sm_90a target (wgmma exists), else 0.
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FUSEDATTN_WGMMA_COMPILED 1
#else
#define FUSEDATTN_WGMMA_COMPILED 0
#endif

namespace fusedattn {
namespace cuda_backend {

/// Descriptor of a tile in shared memory laid out in 128-byte swizzled atoms: rows of 64 16-bit elements (128 bytes),
/// 8 rows an atom (1024 bytes, 1024-aligned), chunk c of row r stored at chunk c ^ (r mod 8).
///   K-major operand (Q or K: the reduction dimension contiguous): `stride` = bytes from one 8-row group to the
///   next (1024 when rows are dense); `leading` is unused.
///   MN-major operand (V for P·V, trans-b = 1: the output dimension contiguous): `leading` = bytes from one 64-column
///   panel to the next, `stride` = bytes from one 8-row (8-key) group to the next.
/// Bits: [0,14) start address >> 4, [16,30) leading byte offset >> 4, [32,46) stride byte offset >> 4,
/// [62,64) layout 1 = 128-byte swizzle.
__device__ __forceinline__ std::uint64_t swizzled_descriptor(const void* smem, std::uint32_t leading,
                                                             std::uint32_t stride) {
  constexpr std::uint64_t swizzle_128b = 1;
  const std::uint64_t address = smem_address(smem);
  return ((address & 0x3FFFF) >> 4) | (std::uint64_t((leading >> 4) & 0x3FFF) << 16) |
         (std::uint64_t((stride >> 4) & 0x3FFF) << 32) | (swizzle_128b << 62);
}

/// Orders this thread's earlier register and shared-memory accesses before the wgmma operations that follow.
__device__ __forceinline__ void wgmma_fence() {
#if FUSEDATTN_WGMMA_COMPILED
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
/// Closes the group of wgmma operations issued since the last commit.
__device__ __forceinline__ void wgmma_commit() {
#if FUSEDATTN_WGMMA_COMPILED
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
/// Waits until at most `Pending` committed wgmma groups are still running.
template <int Pending>
__device__ __forceinline__ void wgmma_wait() {
#if FUSEDATTN_WGMMA_COMPILED
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(Pending) : "memory");
#endif
}
/// Shared memory written through the generic proxy (cp.async, plain stores) becomes visible to the async proxy
/// (wgmma's operand reads) once each writing thread has run this and a barrier follows.
__device__ __forceinline__ void fence_proxy_async() {
#if FUSEDATTN_WGMMA_COMPILED
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
/// Stores four 8 × 8 matrices of 16-bit pairs from the warp's registers (stmatrix, sm_90): register i of lane l holds
/// row l / 4, columns 2·(l % 4) and 2·(l % 4) + 1 of matrix i (the layout of an accumulator's 8 × 8 piece), and lanes
/// 8i … 8i + 7 give the shared-memory addresses (smem_address) of matrix i's rows 0 … 7, 16 bytes each.
__device__ __forceinline__ void stmatrix_x4(std::uint32_t smem, std::uint32_t r0, std::uint32_t r1, std::uint32_t r2,
                                            std::uint32_t r3) {
#if FUSEDATTN_WGMMA_COMPILED
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(smem), "r"(r0),
               "r"(r1), "r"(r2), "r"(r3)
               : "memory");
#else
  (void)smem, (void)r0, (void)r1, (void)r2, (void)r3;
#endif
}
/// Pins accumulator registers in program order around asynchronous wgmma: the compiler may not move their reads or
/// writes across this point (it cannot see that a wgmma in flight owns them).
template <int Tiles>
__device__ __forceinline__ void fence_operands(float (&d)[Tiles][4]) {
#pragma unroll
  for (int i = 0; i < Tiles; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[i][e])::"memory");
}

// Operand lists of the accumulators: d[i][0..3] for each 8-column tile i (the m16n8 accumulator layout, per warp).
#define FUSEDATTN_WGMMA_ACC4(d, i) "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3])
#define FUSEDATTN_WGMMA_ACC32(d)                                                                              \
  FUSEDATTN_WGMMA_ACC4(d, 0), FUSEDATTN_WGMMA_ACC4(d, 1), FUSEDATTN_WGMMA_ACC4(d, 2), FUSEDATTN_WGMMA_ACC4(d, 3), \
      FUSEDATTN_WGMMA_ACC4(d, 4), FUSEDATTN_WGMMA_ACC4(d, 5), FUSEDATTN_WGMMA_ACC4(d, 6), FUSEDATTN_WGMMA_ACC4(d, 7)
#define FUSEDATTN_WGMMA_ACC40(d) FUSEDATTN_WGMMA_ACC32(d), FUSEDATTN_WGMMA_ACC4(d, 8), FUSEDATTN_WGMMA_ACC4(d, 9)
#define FUSEDATTN_WGMMA_ACC48(d) \
  FUSEDATTN_WGMMA_ACC40(d), FUSEDATTN_WGMMA_ACC4(d, 10), FUSEDATTN_WGMMA_ACC4(d, 11)
#define FUSEDATTN_WGMMA_ACC56(d) \
  FUSEDATTN_WGMMA_ACC48(d), FUSEDATTN_WGMMA_ACC4(d, 12), FUSEDATTN_WGMMA_ACC4(d, 13)
#define FUSEDATTN_WGMMA_ACC64(d)                                                                                   \
  FUSEDATTN_WGMMA_ACC32(d), FUSEDATTN_WGMMA_ACC4(d, 8), FUSEDATTN_WGMMA_ACC4(d, 9), FUSEDATTN_WGMMA_ACC4(d, 10),   \
      FUSEDATTN_WGMMA_ACC4(d, 11), FUSEDATTN_WGMMA_ACC4(d, 12), FUSEDATTN_WGMMA_ACC4(d, 13),                       \
      FUSEDATTN_WGMMA_ACC4(d, 14), FUSEDATTN_WGMMA_ACC4(d, 15)
#define FUSEDATTN_WGMMA_D32                                                                                      \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, " \
  "%24, %25, %26, %27, %28, %29, %30, %31}"
#define FUSEDATTN_WGMMA_D40                                                                                      \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, " \
  "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39}"
#define FUSEDATTN_WGMMA_D48                                                                                      \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, " \
  "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, "  \
  "%46, %47}"
#define FUSEDATTN_WGMMA_D56                                                                                      \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, " \
  "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, "  \
  "%46, %47, %48, %49, %50, %51, %52, %53, %54, %55}"
#define FUSEDATTN_WGMMA_D64                                                                                      \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, " \
  "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, "  \
  "%46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"

// D (64 × N, f32) = A·B (+ D when the predicate operand is non-zero); A and B from shared memory, K-major
// (TRANS "0, 0") or both MN-major (TRANS "1, 1"). Operands after the accumulators: %N/2 = A descriptor, + 1 = B
// descriptor, + 2 = accumulate flag.
#define FUSEDATTN_WGMMA_SS_T(N, TYPE, DREGS, ACC, A, B, SCALE, TRANS)                                      \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #SCALE ", 0;\n"                                          \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." TYPE " " DREGS ", %" #A ", %" #B \
               ", p, 1, 1, " TRANS ";\n}\n"                                                                \
               : ACC(d)                                                                                     \
               : "l"(a_desc), "l"(b_desc), "r"(int(accumulate)))
#define FUSEDATTN_WGMMA_SS(N, TYPE, DREGS, ACC, A, B, SCALE) \
  FUSEDATTN_WGMMA_SS_T(N, TYPE, DREGS, ACC, A, B, SCALE, "0, 0")
// D (64 × N, f32) += A·B; A from registers (four 32-bit registers of 16-bit pairs, the m16n8k16 A fragment of this
// warp's 16 rows), B from shared memory N-major (transposed: trans-b = 1).
#define FUSEDATTN_WGMMA_RS(N, TYPE, DREGS, ACC, A0, A1, A2, A3, B)                                          \
  asm volatile("wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." TYPE " " DREGS ", {%" #A0 ", %" #A1 \
               ", %" #A2 ", %" #A3 "}, %" #B ", 1, 1, 1, 1;\n"                                                  \
               : ACC(d)                                                                                     \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc))

/// d (64 × N per warpgroup; this thread's part as N/8 tiles of the m16n8 layout) = A·B, or += when `accumulate`.
/// A: 64 × 16 at `a_desc`, B: 16 × N at `b_desc` (N rows of 16 reduction elements), both K-major descriptors.
template <class E, int N>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 8][4], std::uint64_t a_desc, std::uint64_t b_desc,
                                         bool accumulate) {
  static_assert(N == 64 || N == 80 || N == 96 || N == 112 || N == 128,
                "wgmma_ss is written for N = 64, 80, 96, 112 and 128");
  static_assert(std::is_same_v<E, __half> || std::is_same_v<E, __nv_bfloat16>, "wgmma_ss takes __half or __nv_bfloat16");
#if FUSEDATTN_WGMMA_COMPILED
  if constexpr (N == 64 && std::is_same_v<E, __half>) {
    FUSEDATTN_WGMMA_SS(64, "f16", FUSEDATTN_WGMMA_D32, FUSEDATTN_WGMMA_ACC32, 32, 33, 34);
  } else if constexpr (N == 64) {
    FUSEDATTN_WGMMA_SS(64, "bf16", FUSEDATTN_WGMMA_D32, FUSEDATTN_WGMMA_ACC32, 32, 33, 34);
  } else if constexpr (N == 80 && std::is_same_v<E, __half>) {
    FUSEDATTN_WGMMA_SS(80, "f16", FUSEDATTN_WGMMA_D40, FUSEDATTN_WGMMA_ACC40, 40, 41, 42);
  } else if constexpr (N == 80) {
    FUSEDATTN_WGMMA_SS(80, "bf16", FUSEDATTN_WGMMA_D40, FUSEDATTN_WGMMA_ACC40, 40, 41, 42);
  } else if constexpr (N == 96 && std::is_same_v<E, __half>) {
    FUSEDATTN_WGMMA_SS(96, "f16", FUSEDATTN_WGMMA_D48, FUSEDATTN_WGMMA_ACC48, 48, 49, 50);
  } else if constexpr (N == 96) {
    FUSEDATTN_WGMMA_SS(96, "bf16", FUSEDATTN_WGMMA_D48, FUSEDATTN_WGMMA_ACC48, 48, 49, 50);
  } else if constexpr (N == 112 && std::is_same_v<E, __half>) {
    FUSEDATTN_WGMMA_SS(112, "f16", FUSEDATTN_WGMMA_D56, FUSEDATTN_WGMMA_ACC56, 56, 57, 58);
  } else if constexpr (N == 112) {
    FUSEDATTN_WGMMA_SS(112, "bf16", FUSEDATTN_WGMMA_D56, FUSEDATTN_WGMMA_ACC56, 56, 57, 58);
  } else if constexpr (std::is_same_v<E, __half>) {
    FUSEDATTN_WGMMA_SS(128, "f16", FUSEDATTN_WGMMA_D64, FUSEDATTN_WGMMA_ACC64, 64, 65, 66);
  } else {
    FUSEDATTN_WGMMA_SS(128, "bf16", FUSEDATTN_WGMMA_D64, FUSEDATTN_WGMMA_ACC64, 64, 65, 66);
  }
#else
  (void)d, (void)a_desc, (void)b_desc, (void)accumulate;
#endif
}

/// d (64 × 64 per warpgroup) = A·B, or += when `accumulate`, with A (64 × 16) and B (16 × 64) from shared memory, both
/// MN-major (trans-a = trans-b = 1: the 64 output rows, or columns, contiguous; 16 rows of the reduction at the
/// descriptor), as the atomic-dQ backward kernel reads dS and K.
template <class E>
__device__ __forceinline__ void wgmma_ss_mn(float (&d)[8][4], std::uint64_t a_desc, std::uint64_t b_desc,
                                            bool accumulate) {
  static_assert(std::is_same_v<E, __half> || std::is_same_v<E, __nv_bfloat16>,
                "wgmma_ss_mn takes __half or __nv_bfloat16");
#if FUSEDATTN_WGMMA_COMPILED
  if constexpr (std::is_same_v<E, __half>) {
    FUSEDATTN_WGMMA_SS_T(64, "f16", FUSEDATTN_WGMMA_D32, FUSEDATTN_WGMMA_ACC32, 32, 33, 34, "1, 1");
  } else {
    FUSEDATTN_WGMMA_SS_T(64, "bf16", FUSEDATTN_WGMMA_D32, FUSEDATTN_WGMMA_ACC32, 32, 33, 34, "1, 1");
  }
#else
  (void)d, (void)a_desc, (void)b_desc, (void)accumulate;
#endif
}

/// d (64 × N per warpgroup) += A·B with A (64 × 16) from registers: `a` is this warp's m16n8k16 A fragment (rows
/// 16·warp .. +16 of the warpgroup's 64); B (16 × N) at `b_desc`, an N-major (transposed) descriptor.
template <class E, int N>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 8][4], const std::uint32_t (&a)[4], std::uint64_t b_desc) {
  static_assert(N == 64 || N == 128, "wgmma_rs is written for N = 64 and 128");
  static_assert(std::is_same_v<E, __half> || std::is_same_v<E, __nv_bfloat16>, "wgmma_rs takes __half or __nv_bfloat16");
#if FUSEDATTN_WGMMA_COMPILED
  if constexpr (N == 64 && std::is_same_v<E, __half>) {
    FUSEDATTN_WGMMA_RS(64, "f16", FUSEDATTN_WGMMA_D32, FUSEDATTN_WGMMA_ACC32, 32, 33, 34, 35, 36);
  } else if constexpr (N == 64) {
    FUSEDATTN_WGMMA_RS(64, "bf16", FUSEDATTN_WGMMA_D32, FUSEDATTN_WGMMA_ACC32, 32, 33, 34, 35, 36);
  } else if constexpr (std::is_same_v<E, __half>) {
    FUSEDATTN_WGMMA_RS(128, "f16", FUSEDATTN_WGMMA_D64, FUSEDATTN_WGMMA_ACC64, 64, 65, 66, 67, 68);
  } else {
    FUSEDATTN_WGMMA_RS(128, "bf16", FUSEDATTN_WGMMA_D64, FUSEDATTN_WGMMA_ACC64, 64, 65, 66, 67, 68);
  }
#else
  (void)d, (void)a, (void)b_desc;
#endif
}

#undef FUSEDATTN_WGMMA_RS
#undef FUSEDATTN_WGMMA_SS
#undef FUSEDATTN_WGMMA_SS_T
#undef FUSEDATTN_WGMMA_D64
#undef FUSEDATTN_WGMMA_D56
#undef FUSEDATTN_WGMMA_D48
#undef FUSEDATTN_WGMMA_D40
#undef FUSEDATTN_WGMMA_D32
#undef FUSEDATTN_WGMMA_ACC64
#undef FUSEDATTN_WGMMA_ACC56
#undef FUSEDATTN_WGMMA_ACC48
#undef FUSEDATTN_WGMMA_ACC40
#undef FUSEDATTN_WGMMA_ACC32
#undef FUSEDATTN_WGMMA_ACC4

}  // namespace cuda_backend
}  // namespace fusedattn
