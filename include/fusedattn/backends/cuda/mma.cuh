/// @file mma.cuh
/// The warp-level tensor-core primitives the flash kernel is written in (sm_80 and newer): cp.async 16-byte copies,
/// ldmatrix (plain and transposed), mma.sync m16n8k16 with f32 accumulation for f16 and bf16, and packing.
/// Thin PTX wrappers only; the kernel's tiling lives in flash.cuh.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace fusedattn {
namespace cuda_backend {

/// Shared-memory address of a generic pointer, as PTX wants it.
__device__ __forceinline__ std::uint32_t smem_address(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}

/// The L2 prefetch size a cp.async asks for: `none` leaves it to the hardware; `line128` (`.L2::128B`) makes L2
/// fetch the whole 128-byte line on a miss, not only the sectors asked for, so a stream read once 16 bytes a lane
/// (cuda.decode's K/V tiles) finds the line's other sectors there (docs/design.md, `cuda.decode`).
enum class l2_prefetch { none, line128 };

/// Copies 16 bytes global → shared without going through registers; when `valid` is false the 16 bytes are
/// zero-filled and nothing is read. `cp_async_16(smem, g, ok)` issues plain `cp.async.cg`;
/// `cp_async_16<l2_prefetch::line128>(smem, g, ok)` adds the `.L2::128B` prefetch size.
template <l2_prefetch Prefetch = l2_prefetch::none>
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  if constexpr (Prefetch == l2_prefetch::line128)
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(smem_address(smem)), "l"(gmem),
                 "r"(src_bytes));
  else
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_address(smem)), "l"(gmem),
                 "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
/// Waits until at most `Pending` committed groups of this thread are still in flight.
template <int Pending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(Pending));
}

/// Four 8×8 b16 matrices from shared memory; lane l gives the address of row l % 8 of matrix l / 8.
/// Lane l receives, of matrix i, row l / 4 and columns 2·(l % 4), 2·(l % 4) + 1 in r[i].
__device__ __forceinline__ void ldmatrix_x4(std::uint32_t (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(smem)));
}
/// As ldmatrix_x4 but each matrix transposed: lane l receives rows 2·(l % 4), 2·(l % 4) + 1 of column l / 4.
__device__ __forceinline__ void ldmatrix_x4_trans(std::uint32_t (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(smem)));
}

/// 2^x by the special-function unit (ex2.approx, flush-to-zero: results below 2^-126 become 0, which the
/// softmax cannot tell from the underflow it already has); relative error about 2^-22.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

/// The 16-bit input types of the tensor cores: the PTX type name and the packing of two floats.
template <class E>
struct mma_type;
template <>
struct mma_type<__half> {
  __device__ __forceinline__ static std::uint32_t pack(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const std::uint32_t*>(&h);
  }
  /// The value `hi` (0: the low half, 1: the high half) of a pair packed by pack.
  __device__ __forceinline__ static float unpack(std::uint32_t x, int hi) {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(hi ? x >> 16 : x & 0xffffu)));
  }
};
template <>
struct mma_type<__nv_bfloat16> {
  __device__ __forceinline__ static std::uint32_t pack(float lo, float hi) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const std::uint32_t*>(&h);
  }
  /// The value `hi` (0: the low half, 1: the high half) of a pair packed by pack (bf16 is f32's upper half).
  __device__ __forceinline__ static float unpack(std::uint32_t x, int hi) {
    return __uint_as_float(hi ? x & 0xffff0000u : x << 16);
  }
};

/// c += a·b for one m16n8k16 tile of element type `E`: a 16×16 (row-major fragment, 4 registers), b 16×8 (column
/// fragment, 2 registers), c 16×8 in f32 (4 registers: rows l/4 and l/4 + 8, columns 2·(l%4) and 2·(l%4) + 1).
template <class E>
__device__ __forceinline__ void mma_16816(float (&c)[4], const std::uint32_t (&a)[4], std::uint32_t b0,
                                          std::uint32_t b1) {
  if constexpr (std::is_same_v<E, __half>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    static_assert(std::is_same_v<E, __nv_bfloat16>, "mma_16816 takes __half or __nv_bfloat16");
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

}  // namespace cuda_backend
}  // namespace fusedattn
