/// @file backward_kernels.hpp
/// Register-blocked micro-kernels of the CPU backward pass on `cpu::simd<Acc, Arch>`: C = A·Bᵀ over a packed Bᵀ
/// (S = Q·Kᵀ, dP = dO·Vᵀ) and C += A·B with A read row- or column-wise (dV += Pᵀ·dO, dK += dSᵀ·Q, dQ += dS·K).
/// Tiles, masks and the softmax gradient are in kernels/backward.hpp.
#pragma once

#include <type_traits>

#include "../config.hpp"
#include "../core/types.hpp"
#include "micro_kernels.hpp"
#include "simd.hpp"

namespace fusedattn {
namespace cpu {

/// Register blocking of the backward micro-kernels: `mr` rows × `nr` vectors of accumulators.
/// 32-register arches (AVX-512, AArch64 NEON): 6 × 4 (24 accumulators, 4 streamed B vectors, 1 broadcast);
/// 16-register arches: 4 × 2; the scalar path 4 × 4 scalars.
template <class Acc, class Arch>
struct backward_shape {
  static constexpr index_t width = simd<Acc, Arch>::width;
  static constexpr bool wide = has_32_registers<Arch>();
  static constexpr bool scalar = std::is_same<Arch, scalar_arch>::value;
  static constexpr index_t mr = wide ? 6 : 4;
  static constexpr index_t nr = (wide || scalar) ? 4 : 2;
};

/// C = A·Bᵀ for a whole tile: rows [0, rows), columns [0, vecs·W).
///   a: rows × d, row stride lda; bt: d × (vecs·W), row stride ldb; c: rows × (vecs·W), row stride ldc.
/// Column blocks are the outer loop so a d × (nr·W) slice of Bᵀ stays in L1 while every row block uses it; each
/// block is micro_kernels.hpp's qk_block (the forward's S = Q·Kᵀ block) at this file's register blocking.
template <class Acc, class Arch>
inline void abt_tile(const Acc* a, index_t lda, const Acc* bt, index_t ldb, index_t d, index_t rows, index_t vecs,
                     Acc* c, index_t ldc) {
  using shape = backward_shape<Acc, Arch>;
  constexpr index_t MR = shape::mr, NR = shape::nr, W = shape::width;
  const index_t full_rows = rows / MR * MR;
  const auto columns = [&](index_t j, auto nv) {
    constexpr index_t NV = decltype(nv)::value;
    for (index_t i = 0; i < full_rows; i += MR)
      qk_block<Acc, Arch, MR, NV>(a + i * lda, lda, bt + j * W, ldb, d, c + i * ldc + j * W, ldc);
    with_count<MR - 1>(rows - full_rows, [&](auto rest) {
      qk_block<Acc, Arch, decltype(rest)::value, NV>(a + full_rows * lda, lda, bt + j * W, ldb, d,
                                                     c + full_rows * ldc + j * W, ldc);
    });
  };
  index_t j = 0;
  for (; j + NR <= vecs; j += NR) columns(j, std::integral_constant<index_t, NR>{});
  with_count<NR - 1>(vecs - j, [&](auto nv) { columns(j, nv); });
}

/// One MR × (NV·W) block of C += A·B, A addressed by strides so that it is read row-wise (A·B) or column-wise
/// (Aᵀ·B) by the same code.
///   a: a[r·ars + x·axs] is element (r, x) of the MR × k operand; b: k rows of NV·W, row stride ldb;
///   c: in/out, row stride ldc, shape MR × (NV·W).
/// Math: c[r][col] += Σ_x a(r, x) · b[x][col] (micro_kernels.hpp, fma_rows).
template <class Acc, class Arch, index_t MR, index_t NV>
FUSEDATTN_NOINLINE void acc_block(const Acc* a, index_t ars, index_t axs, const Acc* b, index_t ldb, index_t k,
                                  Acc* c, index_t ldc) {
  using V = simd<Acc, Arch>;
  using vec = typename V::type;
  constexpr index_t W = V::width;
  vec acc[MR][NV];
  FUSEDATTN_UNROLL for (index_t r = 0; r < MR; ++r)
    FUSEDATTN_UNROLL for (index_t n = 0; n < NV; ++n) acc[r][n] = V::load(c + r * ldc + n * W);
  fma_rows<Acc, Arch, MR, NV>(acc, a, ars, axs, b, ldb, k);
  FUSEDATTN_UNROLL for (index_t r = 0; r < MR; ++r)
    FUSEDATTN_UNROLL for (index_t n = 0; n < NV; ++n) V::store(c + r * ldc + n * W, acc[r][n]);
}

/// C += A·B for a whole tile: rows [0, rows), columns [0, vecs·W), summing over x in [0, k).
///   a(r, x) = a[r·ars + x·axs]; b: k × (vecs·W), row stride ldb; c: rows × (vecs·W), row stride ldc.
/// Each element of C is summed in ascending x, so the result depends on the operands only.
template <class Acc, class Arch>
inline void acc_tile(const Acc* a, index_t ars, index_t axs, const Acc* b, index_t ldb, index_t k, index_t rows,
                     index_t vecs, Acc* c, index_t ldc) {
  using shape = backward_shape<Acc, Arch>;
  constexpr index_t MR = shape::mr, NR = shape::nr, W = shape::width;
  const index_t full_rows = rows / MR * MR;
  const auto columns = [&](index_t j, auto nv) {
    constexpr index_t NV = decltype(nv)::value;
    for (index_t i = 0; i < full_rows; i += MR)
      acc_block<Acc, Arch, MR, NV>(a + i * ars, ars, axs, b + j * W, ldb, k, c + i * ldc + j * W, ldc);
    with_count<MR - 1>(rows - full_rows, [&](auto rest) {
      acc_block<Acc, Arch, decltype(rest)::value, NV>(a + full_rows * ars, ars, axs, b + j * W, ldb, k,
                                                      c + full_rows * ldc + j * W, ldc);
    });
  };
  index_t j = 0;
  for (; j + NR <= vecs; j += NR) columns(j, std::integral_constant<index_t, NR>{});
  with_count<NR - 1>(vecs - j, [&](auto nv) { columns(j, nv); });
}

}  // namespace cpu
}  // namespace fusedattn
