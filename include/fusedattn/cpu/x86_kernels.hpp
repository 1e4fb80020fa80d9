/// @file x86_kernels.hpp
/// fusedattn's own AVX-512 kernels of the tile loop (Q·Kᵀ, the online-softmax row, P·V; f32 FMAs or vdpbf16ps on
/// bf16 pairs) and the bf16-pair packing. Every function carries its instruction set in a target attribute (the
/// pragmas below), so they compile without -m flags; callers run them only where CPUID allows (arch_x86.hpp).
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>

#include "../core/online_softmax.hpp"
#include "../core/types.hpp"
#include "arch_x86.hpp"

#if FUSEDATTN_X86_KERNELS
#include <immintrin.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx2,fma,f16c"))), \
                             apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx2,fma,f16c")
// GCC 12's AVX-512 intrinsics start from _mm512_undefined_ps(), which -Wuninitialized reports once they are
// inlined into a function whose instruction set comes from a target pragma.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace fusedattn {
namespace cpu {
namespace x86 {

using shape = x86_shape;
constexpr index_t W = shape::width;

#if defined(__clang__)
#define FUSEDATTN_X86_UNROLL _Pragma("unroll")
#else
#define FUSEDATTN_X86_UNROLL _Pragma("GCC unroll 32")
#endif

/// Keeps a loaded vector in a register (micro_kernels.hpp's pin_register: without it GCC folds the load into
/// every FMA that uses the vector).
template <class Vec>
inline void pin(Vec& x) {
  asm volatile("" : "+v"(x));
}
/// One float-sized slot broadcast to 16 lanes, bit for bit (a bf16 pair is not a float value to convert).
inline __m512 broadcast_slot(const float* x) {
  std::int32_t w = 0;
  std::memcpy(&w, x, sizeof(w));
  return _mm512_castsi512_ps(_mm512_set1_epi32(w));
}

/// Calls f(std::integral_constant<index_t, n>{}) for a run-time n in [1, N] (micro_kernels.hpp's with_count,
/// compiled for this instruction set).
template <index_t N, class F>
inline void with_n(index_t n, F&& f) {
  if constexpr (N >= 1) {
    if (n == N) f(std::integral_constant<index_t, N>{});
    else with_n<N - 1>(n, std::forward<F>(f));
  }
}

/// The 32-bit word holding bf16 values lo (bits 0-15, the even element) and hi (bits 16-31, the odd element).
inline std::uint32_t bf16_pair(std::uint16_t lo, std::uint16_t hi) {
  return static_cast<std::uint32_t>(lo) | (static_cast<std::uint32_t>(hi) << 16);
}
/// The bits of a bfloat16.
inline std::uint16_t bits(Eigen::bfloat16 x) {
  std::uint16_t b = 0;
  std::memcpy(&b, &x, sizeof(b));
  return b;
}
/// Stores a 32-bit word into slot `i` of a float buffer (the packed buffers keep bf16 pairs in float-sized slots).
inline void put(float* base, index_t i, std::uint32_t w) { std::memcpy(base + i, &w, sizeof(w)); }

// ---- f32 kernels: the layouts of micro_kernels.hpp (packed Kᵀ panels d × 64, packed V chunks keys × 32) ----

/// One MR × 64 block of S = Q·Kᵀ: s[r][j] = Σ_c q[r][c] · kt[c][j] (kt: a d × 64 panel).
template <index_t MR>
__attribute__((noinline)) void qk_block_f32(const float* q, index_t ldq, const float* kt, index_t d, float* s,
                                            index_t lds) {
  __m512 acc[MR][4];
  FUSEDATTN_X86_UNROLL for (index_t r = 0; r < MR; ++r)
    FUSEDATTN_X86_UNROLL for (index_t n = 0; n < 4; ++n) acc[r][n] = _mm512_setzero_ps();
  for (index_t c = 0; c < d; ++c) {
    const float* k = kt + c * shape::cols;
    __m512 k0 = _mm512_loadu_ps(k), k1 = _mm512_loadu_ps(k + 16), k2 = _mm512_loadu_ps(k + 32),
                 k3 = _mm512_loadu_ps(k + 48);
    pin(k0), pin(k1), pin(k2), pin(k3);
    FUSEDATTN_X86_UNROLL for (index_t r = 0; r < MR; ++r) {
      const __m512 q_rc = _mm512_set1_ps(q[r * ldq + c]);
      acc[r][0] = _mm512_fmadd_ps(q_rc, k0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(q_rc, k1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(q_rc, k2, acc[r][2]);
      acc[r][3] = _mm512_fmadd_ps(q_rc, k3, acc[r][3]);
    }
  }
  FUSEDATTN_X86_UNROLL for (index_t r = 0; r < MR; ++r)
    FUSEDATTN_X86_UNROLL for (index_t n = 0; n < 4; ++n) _mm512_storeu_ps(s + r * lds + n * W, acc[r][n]);
}

/// S = Q·Kᵀ for a tile (micro_kernels.hpp's qk_tile): panels outer, rows 4 at a time, the rest as one block.
inline void qk_tile_f32(const float* q, index_t ldq, const float* kt, index_t d, index_t rows, index_t cols, float* s,
                        index_t lds) {
  constexpr index_t MR = shape::qk_mr, C = shape::cols;
  const index_t full = rows / MR * MR;
  for (index_t j = 0; j < cols; j += C) {
    for (index_t i = 0; i < full; i += MR) qk_block_f32<MR>(q + i * ldq, ldq, kt + j * d, d, s + i * lds + j, lds);
    with_n<MR - 1>(rows - full, [&](auto rest) {
      qk_block_f32<decltype(rest)::value>(q + full * ldq, ldq, kt + j * d, d, s + full * lds + j, lds);
    });
  }
}

/// One MR × (NV·16) block of acc = α·acc + P·V (v: keys × 32 packed chunk rows).
template <index_t MR, index_t NV>
__attribute__((noinline)) void pv_block_f32(const float* p, index_t ldp, const float* v, index_t keys,
                                            const float* alpha, float* acc, index_t lda) {
  __m512 o[MR][NV];
  FUSEDATTN_X86_UNROLL for (index_t r = 0; r < MR; ++r) {
    const __m512 a = _mm512_set1_ps(alpha[r]);
    FUSEDATTN_X86_UNROLL for (index_t n = 0; n < NV; ++n) o[r][n] = _mm512_mul_ps(a, _mm512_loadu_ps(acc + r * lda + n * W));
  }
  for (index_t j = 0; j < keys; ++j) {
    __m512 v_j[NV];
    FUSEDATTN_X86_UNROLL for (index_t n = 0; n < NV; ++n) {
      v_j[n] = _mm512_loadu_ps(v + j * shape::vw + n * W);
      pin(v_j[n]);
    }
    FUSEDATTN_X86_UNROLL for (index_t r = 0; r < MR; ++r) {
      const __m512 p_rj = _mm512_set1_ps(p[r * ldp + j]);
      FUSEDATTN_X86_UNROLL for (index_t n = 0; n < NV; ++n) o[r][n] = _mm512_fmadd_ps(p_rj, v_j[n], o[r][n]);
    }
  }
  FUSEDATTN_X86_UNROLL for (index_t r = 0; r < MR; ++r)
    FUSEDATTN_X86_UNROLL for (index_t n = 0; n < NV; ++n) _mm512_storeu_ps(acc + r * lda + n * W, o[r][n]);
}

/// Rows of one chunk of NV vectors for a P·V block kernel `block<MR, NV>`: 12 rows at a time, the rest as one block.
template <index_t NV, class Block>
inline void pv_rows(index_t rows, Block&& block) {
  constexpr index_t MR = shape::pv_mr;
  const index_t full = rows / MR * MR;
  for (index_t i = 0; i < full; i += MR) block(i, std::integral_constant<index_t, MR>{});
  with_n<MR - 1>(rows - full, [&](auto rest) { block(full, rest); });
}

/// acc = diag(α)·acc + P·V for a tile (micro_kernels.hpp's pv_tile, f32 packed V chunks).
inline void pv_tile_f32(const float* p, index_t ldp, const float* v, index_t chunk_stride, index_t keys, index_t dp,
                        const float* alpha, float* acc, index_t lda, index_t rows) {
  index_t c = 0;
  for (; c < dp; c += shape::vw, v += chunk_stride) {
    const auto chunk = [&](auto nv) {
      constexpr index_t NV = decltype(nv)::value;
      pv_rows<NV>(rows, [&](index_t i, auto mr) {
        pv_block_f32<decltype(mr)::value, NV>(p + i * ldp, ldp, v, keys, alpha + i, acc + i * lda + c, lda);
      });
    };
    if (c + shape::vw <= dp) chunk(std::integral_constant<index_t, 2>{});
    else chunk(std::integral_constant<index_t, 1>{});
  }
}

// ---- bf16 pairs: vdpbf16ps computes, per f32 lane i, acc_i += a_2i·b_2i + a_2i+1·b_2i+1 (products exact) ----
// Packed layouts, in the float-sized slots of the tile loop's f32 buffers (each slot one pair, even element low):
//   Q tile row i:    slot c2 = (q[i][2c2], q[i][2c2+1]), ceil(d/2) slots from the row's start (0 past d);
//   Kᵀ panel:        slot [c2][j] at c2·64 + j = (k[j][2c2], k[j][2c2+1]) (0 past d and past seq_kv);
//   V chunk row k:   slot x = (v[k][c], v[k+1][c]) for column c = chunk·32 + x (0 past d and for k + 1 = seq_kv):
//                    every key starts a pair, so a tile may start at any key and reads every other row.

/// One MR × 64 block of S = Q·Kᵀ on bf16 pairs: s[r][j] = Σ_c2 q2[r][c2] · kt2[c2][j] (each a two-term dot).
template <index_t MR>
__attribute__((noinline)) void qk_block_bf16(const float* q, index_t ldq, const float* kt, index_t d2, float* s,
                                             index_t lds) {
  __m512 acc[MR][4];
  FUSEDATTN_X86_UNROLL for (index_t r = 0; r < MR; ++r)
    FUSEDATTN_X86_UNROLL for (index_t n = 0; n < 4; ++n) acc[r][n] = _mm512_setzero_ps();
  for (index_t c = 0; c < d2; ++c) {
    const float* k = kt + c * shape::cols;
    __m512bh k0 = (__m512bh)_mm512_loadu_ps(k), k1 = (__m512bh)_mm512_loadu_ps(k + 16),
             k2 = (__m512bh)_mm512_loadu_ps(k + 32), k3 = (__m512bh)_mm512_loadu_ps(k + 48);
    pin(k0), pin(k1), pin(k2), pin(k3);
    FUSEDATTN_X86_UNROLL for (index_t r = 0; r < MR; ++r) {
      const __m512bh q_rc = (__m512bh)broadcast_slot(q + r * ldq + c);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], q_rc, k0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], q_rc, k1);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], q_rc, k2);
      acc[r][3] = _mm512_dpbf16_ps(acc[r][3], q_rc, k3);
    }
  }
  FUSEDATTN_X86_UNROLL for (index_t r = 0; r < MR; ++r)
    FUSEDATTN_X86_UNROLL for (index_t n = 0; n < 4; ++n) _mm512_storeu_ps(s + r * lds + n * W, acc[r][n]);
}

/// S = Q·Kᵀ for a tile on bf16 pairs: q holds the tile's Q rows as pairs (prepare_q_pairs), kt the packed panels
/// (panel stride d·64 slots, as the f32 layout).
inline void qk_tile_bf16(const float* q, index_t ldq, const float* kt, index_t d, index_t rows, index_t cols, float* s,
                         index_t lds) {
  constexpr index_t MR = shape::qk_mr, C = shape::cols;
  const index_t d2 = (d + 1) / 2, full = rows / MR * MR;
  for (index_t j = 0; j < cols; j += C) {
    for (index_t i = 0; i < full; i += MR) qk_block_bf16<MR>(q + i * ldq, ldq, kt + j * d, d2, s + i * lds + j, lds);
    with_n<MR - 1>(rows - full, [&](auto rest) {
      qk_block_bf16<decltype(rest)::value>(q + full * ldq, ldq, kt + j * d, d2, s + full * lds + j, lds);
    });
  }
}

/// One MR × (NV·16) block of acc = α·acc + P·V on bf16 pairs of keys: p2 holds each row's P as pairs (row stride
/// ldp slots), v the packed chunk rows at the tile's first key. With an odd key count the last pair's second key
/// (outside the tile) has its V half zeroed, so a non-finite value there never meets its P of 0.
template <index_t MR, index_t NV>
__attribute__((noinline)) void pv_block_bf16(const float* p2, index_t ldp, const float* v, index_t keys,
                                             const float* alpha, float* acc, index_t lda) {
  __m512 o[MR][NV];
  FUSEDATTN_X86_UNROLL for (index_t r = 0; r < MR; ++r) {
    const __m512 a = _mm512_set1_ps(alpha[r]);
    FUSEDATTN_X86_UNROLL for (index_t n = 0; n < NV; ++n) o[r][n] = _mm512_mul_ps(a, _mm512_loadu_ps(acc + r * lda + n * W));
  }
  const index_t pairs = keys / 2;
  const auto step = [&](index_t t, const __m512bh* v_t) {
    FUSEDATTN_X86_UNROLL for (index_t r = 0; r < MR; ++r) {
      const __m512bh p_rt = (__m512bh)broadcast_slot(p2 + r * ldp + t);
      FUSEDATTN_X86_UNROLL for (index_t n = 0; n < NV; ++n) o[r][n] = _mm512_dpbf16_ps(o[r][n], p_rt, v_t[n]);
    }
  };
  for (index_t t = 0; t < pairs; ++t) {
    __m512bh v_t[NV];
    FUSEDATTN_X86_UNROLL for (index_t n = 0; n < NV; ++n) {
      v_t[n] = (__m512bh)_mm512_loadu_ps(v + 2 * t * shape::vw + n * W);
      pin(v_t[n]);
    }
    step(t, v_t);
  }
  if (keys % 2) {
    constexpr __mmask32 even = 0x55555555u;  // the bf16 elements of key 2t; key 2t + 1 is outside the tile
    __m512bh v_t[NV];
    for (index_t n = 0; n < NV; ++n)
      v_t[n] = (__m512bh)_mm512_maskz_mov_epi16(even, _mm512_castps_si512(
                                                          _mm512_loadu_ps(v + 2 * pairs * shape::vw + n * W)));
    step(pairs, v_t);
  }
  FUSEDATTN_X86_UNROLL for (index_t r = 0; r < MR; ++r)
    FUSEDATTN_X86_UNROLL for (index_t n = 0; n < NV; ++n) _mm512_storeu_ps(acc + r * lda + n * W, o[r][n]);
}

/// Rounds rows × keys of P (f32, row stride ldp) to bf16 pairs in place: row r's slot t becomes
/// (p[r][2t], p[r][2t+1]) rounded to nearest even, the second 0 past `keys`. Each step loads its 32 floats before
/// it stores their 16 slots, so the in-place rewrite never reads a slot it already wrote.
inline void round_p_to_pairs(float* p, index_t ldp, index_t keys, index_t rows) {
  for (index_t r = 0; r < rows; ++r) {
    float* row = p + r * ldp;
    for (index_t j = 0; j < keys; j += 32) {
      const index_t n = keys - j < 32 ? keys - j : 32;
      const __mmask16 lo_mask = static_cast<__mmask16>(n >= 16 ? 0xffffu : (1u << n) - 1u);
      const __mmask16 hi_mask = static_cast<__mmask16>(n >= 32 ? 0xffffu : n > 16 ? (1u << (n - 16)) - 1u : 0u);
      const __m512 lo = _mm512_maskz_loadu_ps(lo_mask, row + j), hi = _mm512_maskz_loadu_ps(hi_mask, row + j + 16);
      const __m512bh packed = _mm512_cvtne2ps_pbh(hi, lo);  // bf16 elements 0-15 from lo, 16-31 from hi
      const index_t slots = (n + 1) / 2;
      const __mmask16 store_mask = static_cast<__mmask16>(slots >= 16 ? 0xffffu : (1u << slots) - 1u);
      _mm512_mask_storeu_ps(row + j / 2, store_mask, (__m512)packed);
    }
  }
}

/// acc = diag(α)·acc + P·V for a tile on bf16 pairs (the pv_tile contract; P is rounded to bf16 pairs in place
/// first and is not needed afterwards). v: the packed chunk rows at the tile's first key.
inline void pv_tile_bf16(float* p, index_t ldp, const float* v, index_t chunk_stride, index_t keys, index_t dp,
                         const float* alpha, float* acc, index_t lda, index_t rows) {
  round_p_to_pairs(p, ldp, keys, rows);
  index_t c = 0;
  for (; c < dp; c += shape::vw, v += chunk_stride) {
    const auto chunk = [&](auto nv) {
      constexpr index_t NV = decltype(nv)::value;
      pv_rows<NV>(rows, [&](index_t i, auto mr) {
        pv_block_bf16<decltype(mr)::value, NV>(p + i * ldp, ldp, v, keys, alpha + i, acc + i * lda + c, lda);
      });
    };
    if (c + shape::vw <= dp) chunk(std::integral_constant<index_t, 2>{});
    else chunk(std::integral_constant<index_t, 1>{});
  }
}

/// The Q tile (rows × d floats, row stride d, each value a bf16 widened exactly) as bf16 pairs in place: row i's
/// slot c2 = (q[i][2c2], q[i][2c2+1]), 0 past d. Slot c2 is written after elements 2c2 and 2c2 + 1 are read.
inline void prepare_q_pairs(float* q, index_t rows, index_t d) {
  for (index_t i = 0; i < rows; ++i) {
    float* row = q + i * d;
    for (index_t c2 = 0; c2 < (d + 1) / 2; ++c2) {
      const Eigen::bfloat16 lo(row[2 * c2]), hi(2 * c2 + 1 < d ? row[2 * c2 + 1] : 0.f);
      put(row, c2, bf16_pair(bits(lo), bits(hi)));
    }
  }
}

/// Packs the Kᵀ panel of keys [k0, k0 + kn) (kn <= 64) as bf16 pairs at `kt` (layout above); `row(j)` gives the
/// bf16 K row of key k0 + j.
template <class RowOf>
void pack_k_pairs(RowOf&& row, index_t kn, index_t d, float* kt) {
  const index_t d2 = (d + 1) / 2;
  for (index_t j = 0; j < shape::cols; ++j) {
    const Eigen::bfloat16* kr = j < kn ? row(j) : nullptr;
    for (index_t c2 = 0; c2 < d2; ++c2) {
      const std::uint16_t lo = kr ? bits(kr[2 * c2]) : 0, hi = kr && 2 * c2 + 1 < d ? bits(kr[2 * c2 + 1]) : 0;
      put(kt, c2 * shape::cols + j, bf16_pair(lo, hi));
    }
  }
}

/// Packs V row pairs (key k, key k + 1) of one chunk row: slot x = (v[k][c0 + x], v_next[c0 + x]), 0 past d and
/// where v_next is null (k + 1 = seq_kv).
inline void pack_v_pair_row(const Eigen::bfloat16* vk, const Eigen::bfloat16* v_next, index_t c0, index_t d,
                            float* dst) {
  for (index_t x = 0; x < shape::vw; ++x) {
    const index_t c = c0 + x;
    const std::uint16_t lo = c < d ? bits(vk[c]) : 0, hi = c < d && v_next ? bits(v_next[c]) : 0;
    put(dst, x, bf16_pair(lo, hi));
  }
}

// ---- the online-softmax row (kernels/softmax.hpp's online_softmax_row, on 16 lanes) ----

/// Horizontal max and sum of 16 lanes by in-register shuffles (halves, quarters, pairs, lanes). The zero-masked
/// forms with a full mask are the plain shuffles (GCC's unmasked ones start from an undefined register, which its
/// -Wuninitialized reports).
inline __m512 swap_lanes(__m512 x, int level) {
  constexpr __mmask16 all = 0xffff;
  switch (level) {
    case 0: return _mm512_maskz_shuffle_f32x4(all, x, x, _MM_SHUFFLE(1, 0, 3, 2));
    case 1: return _mm512_maskz_shuffle_f32x4(all, x, x, _MM_SHUFFLE(2, 3, 0, 1));
    case 2: return _mm512_maskz_permute_ps(all, x, _MM_SHUFFLE(1, 0, 3, 2));
    default: return _mm512_maskz_permute_ps(all, x, _MM_SHUFFLE(2, 3, 0, 1));
  }
}
inline float reduce_max(__m512 x) {
  for (int level = 0; level < 4; ++level) x = _mm512_max_ps(x, swap_lanes(x, level));
  return _mm512_cvtss_f32(x);
}
inline float reduce_add(__m512 x) {
  for (int level = 0; level < 4; ++level) x = _mm512_add_ps(x, swap_lanes(x, level));
  return _mm512_cvtss_f32(x);
}

/// 2^x for x <= 0 (cpu::exp2_nonpositive, the same polynomial and constants), 16 lanes.
inline __m512 exp2_nonpositive(__m512 x) {
  constexpr float min_exponent = -127.0f;
  constexpr int exponent_bias = 127, mantissa_bits = 23;
  constexpr float shifter = 12582912.0f + exponent_bias;
  constexpr float c6 = 1.5403530393381609e-4f, c5 = 1.3333558146428443e-3f, c4 = 9.6181291076284772e-3f,
                  c3 = 5.5504108664821580e-2f, c2 = 2.4022650695910071e-1f, c1 = 6.9314718055994531e-1f;
  x = _mm512_max_ps(_mm512_set1_ps(min_exponent), x);  // returns x when x is NaN
  const __m512 shifted = _mm512_add_ps(x, _mm512_set1_ps(shifter));
  const __m512 n = _mm512_sub_ps(shifted, _mm512_set1_ps(shifter));
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(c6), f, _mm512_set1_ps(c5));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c4));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c3));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c2));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c1));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(_mm512_castps_si512(shifted), mantissa_bits);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

/// One online-softmax step of a row (the contract of kernels::online_softmax_row; cols a multiple of 16).
inline float online_softmax_row(float* s, index_t cols, float c, float& m, float& l) {
  constexpr float neg_inf = -std::numeric_limits<float>::infinity();
  __m512 vmax = _mm512_set1_ps(neg_inf);
  for (index_t j = 0; j < cols; j += W) vmax = _mm512_max_ps(_mm512_loadu_ps(s + j), vmax);  // skips a NaN score
  const float tile_max = reduce_max(vmax) * c;
  const float m_new = online::new_max(m, tile_max);
  if (m_new == neg_inf) {
    bool saw_nan = false;
    for (index_t j = 0; j < cols; ++j) {
      saw_nan |= std::isnan(s[j]);
      s[j] = 0.f;
    }
    if (saw_nan) l = std::numeric_limits<float>::quiet_NaN();
    return 1.f;
  }
  const __m512 vc = _mm512_set1_ps(c), neg_m = _mm512_set1_ps(-m_new);
  __m512 vsum = _mm512_setzero_ps();
  for (index_t j = 0; j < cols; j += W) {
    const __m512 p = exp2_nonpositive(_mm512_fmadd_ps(_mm512_loadu_ps(s + j), vc, neg_m));
    _mm512_storeu_ps(s + j, p);
    vsum = _mm512_add_ps(vsum, p);
  }
  return online::update(m, l, m_new, reduce_add(vsum));  // α = 0 when m = −inf: nothing accumulated yet
}

/// The bf16 dot-product peak probe of the bench's ceilings: `iters` rounds of 24 independent vdpbf16ps chains
/// (64 FLOPs each: 16 lanes × 2 products × multiply-add). Returns a value that depends on every chain.
__attribute__((noinline)) inline float dpbf16_chains(std::int64_t iters, float seed) {
  __m512 acc[24];
  FUSEDATTN_X86_UNROLL for (int i = 0; i < 24; ++i) acc[i] = _mm512_set1_ps(seed * static_cast<float>(i));
  const __m512bh a = _mm512_cvtne2ps_pbh(_mm512_set1_ps(seed), _mm512_set1_ps(1.0f - seed));
  const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_set1_ps(0.5f), _mm512_set1_ps(seed * 0.25f));
  for (std::int64_t it = 0; it < iters; ++it)
    FUSEDATTN_X86_UNROLL for (int i = 0; i < 24; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
  __m512 sum = acc[0];
  FUSEDATTN_X86_UNROLL for (int i = 1; i < 24; ++i) sum = _mm512_add_ps(sum, acc[i]);
  return reduce_add(sum);
}

/// The f32 counterpart of dpbf16_chains: 24 independent FMA chains (32 FLOPs each), for bf16_dot_pays.
__attribute__((noinline)) inline float fma_chains(std::int64_t iters, float seed) {
  __m512 acc[24];
  FUSEDATTN_X86_UNROLL for (int i = 0; i < 24; ++i) acc[i] = _mm512_set1_ps(seed * static_cast<float>(i));
  const __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(seed * 1e-3f);
  for (std::int64_t it = 0; it < iters; ++it)
    FUSEDATTN_X86_UNROLL for (int i = 0; i < 24; ++i) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
  __m512 sum = acc[0];
  FUSEDATTN_X86_UNROLL for (int i = 1; i < 24; ++i) sum = _mm512_add_ps(sum, acc[i]);
  return reduce_add(sum);
}

}  // namespace x86
}  // namespace cpu
}  // namespace fusedattn

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif

namespace fusedattn {
namespace cpu {
namespace x86 {

/// Whether vdpbf16ps beats f32 FMAs on this CPU: its FLOP rate (64 per instruction) at least 1.25x that of the
/// FMA (32 per instruction), both timed once per process on 24 independent register chains, best of 5 short runs
/// (about a millisecond in all). Cores differ by 4x here: Zen 4/5 issue two vdpbf16ps a cycle, Sapphire Rapids
/// class Xeons one every other cycle (half their FMA rate), where the widening f32 kernels are the faster ones.
inline bool bf16_dot_pays() {
  static const bool pays = [] {
    if (!avx512bf16::available()) return false;
    using clock = std::chrono::steady_clock;
    constexpr std::int64_t iters = 4096;
    const auto best_seconds = [&](auto&& run) {
      double best = 1e30;
      for (int r = 0; r < 5; ++r) {
        const auto t0 = clock::now();
        volatile float keep = run();
        (void)keep;
        best = std::min(best, std::chrono::duration<double>(clock::now() - t0).count());
      }
      return best;
    };
    const double dot = best_seconds([] { return dpbf16_chains(iters, 0.5f); });
    const double fma = best_seconds([] { return fma_chains(iters, 0.5f); });
    // FLOP rates: dot does 64 FLOPs an instruction, fma 32, over the same instruction count.
    return 64.0 / dot >= 1.25 * 32.0 / fma;
  }();
  return pays;
}

}  // namespace x86
}  // namespace cpu
}  // namespace fusedattn

#endif  // FUSEDATTN_X86_KERNELS

namespace fusedattn {
namespace cpu {

/// Calls f(arch) with the tag of the best kernel set the running CPU supports (cpu::best's choice) and returns
/// what f returns: avx512bf16 where vdpbf16ps outruns the FMAs (x86::bf16_dot_pays), else avx512 (bf16 and f16
/// widened to f32), else compiled_arch where the CPU has it, else scalar_arch.
template <class F>
decltype(auto) with_best_arch(F&& f) {
#if FUSEDATTN_X86_KERNELS
  if (avx512bf16::available() && x86::bf16_dot_pays()) return f(avx512bf16{});
  if (avx512::available()) return f(avx512{});
#endif
  if (xsimd::available_architectures().best >= compiled_arch::version()) return f(compiled_arch{});
  return f(scalar_arch{});
}

}  // namespace cpu
}  // namespace fusedattn
