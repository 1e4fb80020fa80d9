/// @file arm_kernels.hpp
/// fusedattn's Arm bf16 kernel set (`cpu::neon_bf16`): Q·Kᵀ and P·V of the tile loop on BFDOT (vbfdotq_f32: bf16
/// pairs, f32 accumulation; P rounded to bf16), the softmax on the NEON f32 code. Compiled where the target has
/// FEAT_BF16 (__ARM_FEATURE_BF16_VECTOR_ARITHMETIC, e.g. -march=armv8.6-a or -march=armv8.2-a+bf16); chosen only
/// where the kernel reports the feature (Linux: getauxval(AT_HWCAP2) & HWCAP2_BF16).
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include <xsimd/xsimd.hpp>

#include "../core/types.hpp"
#include "arch_x86.hpp"
#include "simd.hpp"

#if defined(__aarch64__) && defined(__ARM_FEATURE_BF16_VECTOR_ARITHMETIC) && XSIMD_WITH_NEON64 && \
    (defined(__GNUC__) || defined(__clang__)) && !defined(__CUDACC__)
/// 1 where fusedattn compiles its Arm bf16 kernel set: AArch64 with FEAT_BF16 in the target (the program's -march).
#define FUSEDATTN_ARM_BF16_KERNELS 1
#include <arm_neon.h>
#if defined(__linux__)
#include <sys/auxv.h>
#endif
#else
#define FUSEDATTN_ARM_BF16_KERNELS 0
#endif

namespace fusedattn {
namespace cpu {

/// Whether the running CPU executes FEAT_BF16 instructions (BFDOT, BFCVTN): Linux's HWCAP2_BF16 (bit 14 of
/// AT_HWCAP2); false where the set is not compiled. Read once.
inline bool arm_cpu_has_bf16() {
#if FUSEDATTN_ARM_BF16_KERNELS && defined(__linux__)
  static const bool has = [] {
    constexpr unsigned long hwcap2_bf16 = 1ul << 14;  // <asm/hwcap.h>, HWCAP2_BF16
    return (getauxval(AT_HWCAP2) & hwcap2_bf16) != 0;
  }();
  return has;
#elif FUSEDATTN_ARM_BF16_KERNELS
  return true;  // compiled for FEAT_BF16 and no OS query: the target's promise
#else
  return false;
#endif
}

/// Flash on NEON with Arm's bf16 dot products: with bf16 Q, K, V and O, Q·Kᵀ and P·V run on BFDOT (bf16 pairs,
/// f32 accumulation; P rounded to bf16), the softmax on the NEON f32 code; every other storage type runs the NEON
/// kernels of the compiled arch. Supported where the program targets FEAT_BF16, available where the kernel
/// reports it.
struct neon_bf16 {
  static constexpr bool runtime_checked = true;
  static constexpr bool supported() noexcept { return FUSEDATTN_ARM_BF16_KERNELS == 1; }
  static bool available() noexcept { return supported() && arm_cpu_has_bf16(); }
  static constexpr const char* name() noexcept { return "neon_bf16"; }
};

namespace detail {
/// The internal kernel set of the tile loop for all-bf16 storage under cpu::neon_bf16: the bf16-pair layouts on
/// BFDOT, with the compiled NEON arch's register blocking.
struct arm_bf16_set {
  static constexpr bool runtime_checked = true;
  static constexpr bool supported() noexcept { return FUSEDATTN_ARM_BF16_KERNELS == 1; }
  static bool available() noexcept { return neon_bf16::available(); }
  static constexpr const char* name() noexcept { return "neon_bf16"; }
};
}  // namespace detail

/// Whether the tile loop under `Arch` runs the Arm bf16 set (bf16 pairs on BFDOT).
template <class Arch>
inline constexpr bool is_arm_bf16_set_v =
    FUSEDATTN_ARM_BF16_KERNELS == 1 && std::is_same<Arch, detail::arm_bf16_set>::value;

/// neon_bf16 → the Arm bf16 set for all-bf16 storage, else the compiled arch.
template <class T, class TKV>
struct tile_arch<T, TKV, neon_bf16> {
  using type = std::conditional_t<FUSEDATTN_ARM_BF16_KERNELS == 1 &&
                                      std::is_same<std::remove_cv_t<T>, Eigen::bfloat16>::value &&
                                      std::is_same<std::remove_cv_t<TKV>, Eigen::bfloat16>::value,
                                  detail::arm_bf16_set, compiled_arch>;
};

// Both tags read as the compiled arch to the code without kernels of their own for them (the softmax, the score
// modifiers, decode, backward); the Arm set's register blocking is the compiled NEON arch's.
template <class Acc>
struct simd<Acc, neon_bf16> : simd<Acc, compiled_arch> {};
template <class Acc>
struct simd<Acc, detail::arm_bf16_set> : simd<Acc, compiled_arch> {};
template <class Acc>
struct kernel_shape<Acc, neon_bf16> : kernel_shape<Acc, compiled_arch> {};
template <class Acc>
struct kernel_shape<Acc, detail::arm_bf16_set> : kernel_shape<Acc, compiled_arch> {};

}  // namespace cpu
}  // namespace fusedattn

#if FUSEDATTN_ARM_BF16_KERNELS

namespace fusedattn {
namespace cpu {
namespace arm {

/// The Arm set's blocking (the NEON arch's kernel_shape: 4 lanes, Q·Kᵀ 4 rows × 4 vectors = 16-key panels, P·V
/// 12 rows × 2 vectors = 8-column chunks).
using shape = kernel_shape<float, compiled_arch>;
constexpr index_t W = 4;
static_assert(shape::width == W, "fusedattn: the Arm bf16 set expects 4-float NEON vectors");

#if defined(__clang__)
#define FUSEDATTN_ARM_UNROLL _Pragma("unroll")
#else
#define FUSEDATTN_ARM_UNROLL _Pragma("GCC unroll 16")
#endif

/// Keeps a loaded vector in a register (the x86 set's pin: without it GCC folds the load into every use).
template <class Vec>
inline void pin(Vec& x) {
  asm volatile("" : "+w"(x));
}

// Packed layouts (the x86 bf16 set's, with the NEON blocking), in the float-sized slots of the tile loop's f32
// buffers, each slot one bf16 pair with the even element in the low half:
//   Q tile row i:  slot c2 = (q[i][2c2], q[i][2c2+1]), ceil(d/2) slots from the row's start (0 past d);
//   Kᵀ panel:      slot [c2][j] at c2·16 + j = (k[j][2c2], k[j][2c2+1]) (0 past d and past seq_kv);
//   V chunk row k: slot x = (v[k][c], v[k+1][c]) for column c = chunk·8 + x (0 past d and for k + 1 = seq_kv):
//                  every key starts a pair, so a tile may start at any key and reads every other row.
// BFDOT computes, per f32 lane i, acc_i += a_2i·b_2i + a_2i+1·b_2i+1: with a the broadcast pair of one Q row (or
// one P row) and b four slots of a panel (or chunk) row, lane i accumulates key (column) i's two-term dot.

/// The bits of a bfloat16.
inline std::uint16_t bits(Eigen::bfloat16 x) {
  std::uint16_t b = 0;
  std::memcpy(&b, &x, sizeof(b));
  return b;
}
/// Stores bf16 values lo (even element) and hi (odd element) as one pair into slot `i` of a float buffer.
inline void put_pair(float* base, index_t i, std::uint16_t lo, std::uint16_t hi) {
  const std::uint32_t w = static_cast<std::uint32_t>(lo) | (static_cast<std::uint32_t>(hi) << 16);
  std::memcpy(base + i, &w, sizeof(w));
}

/// Four slots as 8 bf16 lanes.
inline bfloat16x8_t load_pairs(const float* x) { return vreinterpretq_bf16_f32(vld1q_f32(x)); }
/// One slot (a bf16 pair) broadcast to the 4 pair positions, bit for bit (LD1R moves bits, converts nothing).
inline bfloat16x8_t broadcast_pair(const float* x) { return vreinterpretq_bf16_f32(vld1q_dup_f32(x)); }

/// One MR × 16 block of S = Q·Kᵀ over `steps` pair slots: s[r][j] = Σ_c q[r][c] · kt[c][j] (kt: a panel of
/// 16-slot rows).
template <index_t MR>
__attribute__((noinline)) void qk_block(const float* q, index_t ldq, const float* kt, index_t steps, float* s,
                                        index_t lds) {
  float32x4_t acc[MR][4];
  FUSEDATTN_ARM_UNROLL for (index_t r = 0; r < MR; ++r)
    FUSEDATTN_ARM_UNROLL for (index_t n = 0; n < 4; ++n) acc[r][n] = vdupq_n_f32(0.f);
  for (index_t c = 0; c < steps; ++c) {
    const float* k = kt + c * shape::cols;
    bfloat16x8_t k0 = load_pairs(k), k1 = load_pairs(k + 4), k2 = load_pairs(k + 8), k3 = load_pairs(k + 12);
    pin(k0), pin(k1), pin(k2), pin(k3);
    FUSEDATTN_ARM_UNROLL for (index_t r = 0; r < MR; ++r) {
      const bfloat16x8_t q_rc = broadcast_pair(q + r * ldq + c);
      acc[r][0] = vbfdotq_f32(acc[r][0], q_rc, k0);
      acc[r][1] = vbfdotq_f32(acc[r][1], q_rc, k1);
      acc[r][2] = vbfdotq_f32(acc[r][2], q_rc, k2);
      acc[r][3] = vbfdotq_f32(acc[r][3], q_rc, k3);
    }
  }
  FUSEDATTN_ARM_UNROLL for (index_t r = 0; r < MR; ++r)
    FUSEDATTN_ARM_UNROLL for (index_t n = 0; n < 4; ++n) vst1q_f32(s + r * lds + n * W, acc[r][n]);
}

/// Calls f(std::integral_constant<index_t, n>{}) for a run-time n in [1, N].
template <index_t N, class F>
inline void with_n(index_t n, F&& f) {
  if constexpr (N >= 1) {
    if (n == N) f(std::integral_constant<index_t, N>{});
    else with_n<N - 1>(n, std::forward<F>(f));
  }
}

/// S = Q·Kᵀ for a tile (micro_kernels.hpp's qk_tile contract) on the pair layouts: panels outer (panel stride
/// d·16 slots), rows 4 at a time, the rest as one block.
inline void qk_tile(const float* q, index_t ldq, const float* kt, index_t d, index_t rows, index_t cols, float* s,
                    index_t lds) {
  constexpr index_t MR = shape::qk_mr, C = shape::cols;
  static_assert(C == 16, "fusedattn: the Arm bf16 Q·Kᵀ block covers 4 vectors of 4 keys");
  const index_t steps = (d + 1) / 2, full = rows / MR * MR;
  for (index_t j = 0; j < cols; j += C) {
    for (index_t i = 0; i < full; i += MR) qk_block<MR>(q + i * ldq, ldq, kt + j * d, steps, s + i * lds + j, lds);
    with_n<MR - 1>(rows - full, [&](auto rest) {
      qk_block<decltype(rest)::value>(q + full * ldq, ldq, kt + j * d, steps, s + full * lds + j, lds);
    });
  }
}

/// One MR × (NV·4) block of acc = α·acc + P·V: p holds each row's P as bf16 pairs (row stride ldp slots), v the
/// packed chunk rows at the block's first key (a step advances 2 keys). With an odd key count the last pair's
/// second key (outside the tile) has its V half zeroed, so a non-finite value there never meets its P of 0.
template <index_t MR, index_t NV>
__attribute__((noinline)) void pv_block(const float* p, index_t ldp, const float* v, index_t keys, const float* alpha,
                                        float* acc, index_t lda) {
  float32x4_t o[MR][NV];
  FUSEDATTN_ARM_UNROLL for (index_t r = 0; r < MR; ++r) {
    const float32x4_t a = vdupq_n_f32(alpha[r]);
    FUSEDATTN_ARM_UNROLL for (index_t n = 0; n < NV; ++n) o[r][n] = vmulq_f32(a, vld1q_f32(acc + r * lda + n * W));
  }
  const auto step = [&](index_t t, const bfloat16x8_t* v_t) {
    FUSEDATTN_ARM_UNROLL for (index_t r = 0; r < MR; ++r) {
      const bfloat16x8_t p_rt = broadcast_pair(p + r * ldp + t);
      FUSEDATTN_ARM_UNROLL for (index_t n = 0; n < NV; ++n) o[r][n] = vbfdotq_f32(o[r][n], p_rt, v_t[n]);
    }
  };
  const index_t steps = keys / 2;
  for (index_t t = 0; t < steps; ++t) {
    bfloat16x8_t v_t[NV];
    FUSEDATTN_ARM_UNROLL for (index_t n = 0; n < NV; ++n) {
      v_t[n] = load_pairs(v + 2 * t * shape::vw + n * W);
      pin(v_t[n]);
    }
    step(t, v_t);
  }
  if (keys % 2) {
    const uint32x4_t even = vdupq_n_u32(0x0000ffffu);  // key 2t's bf16 halves; key 2t + 1 is outside the tile
    bfloat16x8_t v_t[NV];
    for (index_t n = 0; n < NV; ++n)
      v_t[n] = vreinterpretq_bf16_u32(
          vandq_u32(vreinterpretq_u32_f32(vld1q_f32(v + 2 * steps * shape::vw + n * W)), even));
    step(steps, v_t);
  }
  FUSEDATTN_ARM_UNROLL for (index_t r = 0; r < MR; ++r)
    FUSEDATTN_ARM_UNROLL for (index_t n = 0; n < NV; ++n) vst1q_f32(acc + r * lda + n * W, o[r][n]);
}

/// Rounds rows × keys of P (f32, row stride ldp) to bf16 pairs in place by BFCVTN (to nearest even): row r's slot
/// t becomes (p[r][2t], p[r][2t+1]), the second 0 past `keys`. Each step loads its 8 floats before it stores their
/// 4 slots, so the in-place rewrite never reads a slot it already wrote.
inline void round_p_to_pairs(float* p, index_t ldp, index_t keys, index_t rows) {
  for (index_t r = 0; r < rows; ++r) {
    float* row = p + r * ldp;
    index_t j = 0;
    for (; j + 8 <= keys; j += 8) {
      const float32x4_t lo = vld1q_f32(row + j), hi = vld1q_f32(row + j + 4);
      vst1q_f32(row + j / 2, vreinterpretq_f32_bf16(vcvtq_high_bf16_f32(vcvtq_low_bf16_f32(lo), hi)));
    }
    if (j < keys) {
      const index_t n = keys - j;
      float in[8] = {}, out[4];
      std::memcpy(in, row + j, static_cast<std::size_t>(n) * sizeof(float));
      vst1q_f32(out, vreinterpretq_f32_bf16(vcvtq_high_bf16_f32(vcvtq_low_bf16_f32(vld1q_f32(in)),
                                                                vld1q_f32(in + 4))));
      std::memcpy(row + j / 2, out, static_cast<std::size_t>((n + 1) / 2) * sizeof(float));
    }
  }
}

/// acc = diag(α)·acc + P·V for a tile (micro_kernels.hpp's pv_tile contract): P rounded to bf16 pairs in place
/// first (P is dead after this step), then chunks outer, rows 12 at a time and the rest as one block; the last
/// chunk takes 1 vector when dp is not a multiple of 8. v: the packed chunk rows at the tile's first key.
inline void pv_tile(float* p, index_t ldp, const float* v, index_t chunk_stride, index_t keys, index_t dp,
                    const float* alpha, float* acc, index_t lda, index_t rows) {
  constexpr index_t MR = shape::pv_mr;
  static_assert(shape::vw == 2 * W, "fusedattn: the Arm bf16 P·V block covers 2 vectors of columns");
  round_p_to_pairs(p, ldp, keys, rows);
  const index_t full = rows / MR * MR;
  for (index_t c = 0; c < dp; c += shape::vw, v += chunk_stride) {
    const auto chunk = [&](auto nv) {
      constexpr index_t NV = decltype(nv)::value;
      for (index_t i = 0; i < full; i += MR)
        pv_block<MR, NV>(p + i * ldp, ldp, v, keys, alpha + i, acc + i * lda + c, lda);
      with_n<MR - 1>(rows - full, [&](auto rest) {
        pv_block<decltype(rest)::value, NV>(p + full * ldp, ldp, v, keys, alpha + full, acc + full * lda + c, lda);
      });
    };
    if (c + shape::vw <= dp) chunk(std::integral_constant<index_t, 2>{});
    else chunk(std::integral_constant<index_t, 1>{});
  }
}

/// The Arm set's packing of Q, K and V in the layouts above (simd.hpp's pair_packers, for the tile loop).
struct pair_packing {
  static constexpr bool pairs = true;

  /// The Q tile (rows × d floats, row stride d, each value a bf16 widened exactly) as bf16 pairs in place: row i's
  /// slot c2 = (q[i][2c2], q[i][2c2+1]), 0 past d. Slot c2 is written after elements 2c2 and 2c2 + 1 are read.
  static void prepare_q_pairs(float* q, index_t rows, index_t d) {
    for (index_t i = 0; i < rows; ++i) {
      float* row = q + i * d;
      for (index_t c2 = 0; c2 < (d + 1) / 2; ++c2) {
        const Eigen::bfloat16 lo(row[2 * c2]), hi(2 * c2 + 1 < d ? row[2 * c2 + 1] : 0.f);
        put_pair(row, c2, bits(lo), bits(hi));
      }
    }
  }

  /// Packs the Kᵀ panel of keys [k0, k0 + kn) (kn <= 16) as bf16 pairs at `kt` (layout above); `row(j)` gives the
  /// bf16 K row of key k0 + j.
  /// Defined below the class: a definition in it would declare it inline, which changes GCC's inlining of the
  /// tile loop.
  template <class RowOf>
  static void pack_k_pairs(RowOf&& row, index_t kn, index_t d, float* kt);

  /// Packs one V chunk row of the pair (key k, key k + 1): slot x = (v[k][c0 + x], v_next[c0 + x]), 0 past d and
  /// where v_next is null (k + 1 = seq_kv).
  static void pack_v_pair_row(const Eigen::bfloat16* vk, const Eigen::bfloat16* v_next, index_t c0, index_t d,
                              float* dst) {
    for (index_t x = 0; x < shape::vw; ++x) {
      const index_t c = c0 + x;
      put_pair(dst, x, c < d ? bits(vk[c]) : 0, c < d && v_next ? bits(v_next[c]) : 0);
    }
  }
};

template <class RowOf>
void pair_packing::pack_k_pairs(RowOf&& row, index_t kn, index_t d, float* kt) {
  const index_t d2 = (d + 1) / 2;
  for (index_t j = 0; j < shape::cols; ++j) {
    const Eigen::bfloat16* kr = j < kn ? row(j) : nullptr;
    for (index_t c2 = 0; c2 < d2; ++c2)
      put_pair(kt, c2 * shape::cols + j, kr ? bits(kr[2 * c2]) : 0, kr && 2 * c2 + 1 < d ? bits(kr[2 * c2 + 1]) : 0);
  }
}

#undef FUSEDATTN_ARM_UNROLL

}  // namespace arm

/// The Arm bf16 set packs Q, K and V for the tile loop as bf16 pairs.
template <>
struct pair_packers<detail::arm_bf16_set> : arm::pair_packing {};

}  // namespace cpu
}  // namespace fusedattn

#endif  // FUSEDATTN_ARM_BF16_KERNELS
