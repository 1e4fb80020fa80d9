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

// ---- the two dot products of the micro-kernels: one reduction step per slot of the packed layouts ----
// f32 (the layouts of micro_kernels.hpp: packed Kᵀ panels d × 64, packed V chunks keys × 32): a slot is one float.
// bf16 pairs: vdpbf16ps computes, per f32 lane i, acc_i += a_2i·b_2i + a_2i+1·b_2i+1 (products exact). Packed
// layouts, in the float-sized slots of the tile loop's f32 buffers (each slot one pair, even element low):
//   Q tile row i:    slot c2 = (q[i][2c2], q[i][2c2+1]), ceil(d/2) slots from the row's start (0 past d);
//   Kᵀ panel:        slot [c2][j] at c2·64 + j = (k[j][2c2], k[j][2c2+1]) (0 past d and past seq_kv);
//   V chunk row k:   slot x = (v[k][c], v[k+1][c]) for column c = chunk·32 + x (0 past d and for k + 1 = seq_kv):
//                    every key starts a pair, so a tile may start at any key and reads every other row.

/// f32 FMAs: acc += a·b per lane, one float a slot.
struct f32_fma {
  using vec = __m512;
  static constexpr index_t per_slot = 1;  ///< head_dim elements, or keys, one slot holds
  static vec load(const float* x) { return _mm512_loadu_ps(x); }
  static vec broadcast(const float* x) { return _mm512_set1_ps(*x); }
  static __m512 madd(__m512 acc, vec a, vec b) { return _mm512_fmadd_ps(a, b, acc); }
};
/// vdpbf16ps: acc += the two-term dot of a bf16 pair of a and of b per lane, one pair a slot.
struct bf16_dot {
  using vec = __m512bh;
  static constexpr index_t per_slot = 2;
  static vec load(const float* x) { return (__m512bh)_mm512_loadu_ps(x); }
  static vec broadcast(const float* x) { return (__m512bh)broadcast_slot(x); }
  static __m512 madd(__m512 acc, vec a, vec b) { return _mm512_dpbf16_ps(acc, a, b); }
};

/// One MR × 64 block of S = Q·Kᵀ over slots [c0, steps): s[r][j] (+)= Σ_c q[r][c] · kt[c][j] (kt: a panel of
/// 64-slot rows). Accumulate: s holds a partial sum to add to (the AMX set's head_dim tail), else it is overwritten.
template <index_t MR, class Dot, bool Accumulate = false>
__attribute__((noinline)) void qk_block(const float* q, index_t ldq, const float* kt, index_t c0, index_t steps,
                                        float* s, index_t lds) {
  __m512 acc[MR][4];
  FUSEDATTN_X86_UNROLL for (index_t r = 0; r < MR; ++r)
    FUSEDATTN_X86_UNROLL for (index_t n = 0; n < 4; ++n)
      acc[r][n] = Accumulate ? _mm512_loadu_ps(s + r * lds + n * W) : _mm512_setzero_ps();
  for (index_t c = c0; c < steps; ++c) {
    const float* k = kt + c * shape::cols;
    typename Dot::vec k0 = Dot::load(k), k1 = Dot::load(k + 16), k2 = Dot::load(k + 32), k3 = Dot::load(k + 48);
    pin(k0), pin(k1), pin(k2), pin(k3);
    FUSEDATTN_X86_UNROLL for (index_t r = 0; r < MR; ++r) {
      const typename Dot::vec q_rc = Dot::broadcast(q + r * ldq + c);
      acc[r][0] = Dot::madd(acc[r][0], q_rc, k0);
      acc[r][1] = Dot::madd(acc[r][1], q_rc, k1);
      acc[r][2] = Dot::madd(acc[r][2], q_rc, k2);
      acc[r][3] = Dot::madd(acc[r][3], q_rc, k3);
    }
  }
  FUSEDATTN_X86_UNROLL for (index_t r = 0; r < MR; ++r)
    FUSEDATTN_X86_UNROLL for (index_t n = 0; n < 4; ++n) _mm512_storeu_ps(s + r * lds + n * W, acc[r][n]);
}

/// S = Q·Kᵀ for a tile over slots [c0, ceil(d / per_slot)) (micro_kernels.hpp's qk_tile): panels outer (panel
/// stride d·64 slots for both layouts), rows 4 at a time, the rest as one block. q: the tile's Q rows (f32, or
/// pairs by prepare_q_pairs).
template <class Dot, bool Accumulate = false>
inline void qk_rows(const float* q, index_t ldq, const float* kt, index_t d, index_t rows, index_t cols, float* s,
                    index_t lds, index_t c0 = 0) {
  constexpr index_t MR = shape::qk_mr, C = shape::cols;
  const index_t steps = (d + Dot::per_slot - 1) / Dot::per_slot, full = rows / MR * MR;
  for (index_t j = 0; j < cols; j += C) {
    for (index_t i = 0; i < full; i += MR)
      qk_block<MR, Dot, Accumulate>(q + i * ldq, ldq, kt + j * d, c0, steps, s + i * lds + j, lds);
    with_n<MR - 1>(rows - full, [&](auto rest) {
      qk_block<decltype(rest)::value, Dot, Accumulate>(q + full * ldq, ldq, kt + j * d, c0, steps,
                                                       s + full * lds + j, lds);
    });
  }
}

/// One MR × (NV·16) block of acc = α·acc + P·V: p holds each row's P (row stride ldp slots), v the packed chunk
/// rows at the block's first key (a step advances per_slot keys). With bf16 pairs and an odd key count the last
/// pair's second key (outside the tile) has its V half zeroed, so a non-finite value there never meets its P of 0.
template <index_t MR, index_t NV, class Dot>
__attribute__((noinline)) void pv_block(const float* p, index_t ldp, const float* v, index_t keys, const float* alpha,
                                        float* acc, index_t lda) {
  using vec = typename Dot::vec;
  constexpr index_t K = Dot::per_slot;
  __m512 o[MR][NV];
  FUSEDATTN_X86_UNROLL for (index_t r = 0; r < MR; ++r) {
    const __m512 a = _mm512_set1_ps(alpha[r]);
    FUSEDATTN_X86_UNROLL for (index_t n = 0; n < NV; ++n)
      o[r][n] = _mm512_mul_ps(a, _mm512_loadu_ps(acc + r * lda + n * W));
  }
  const auto step = [&](index_t t, const vec* v_t) {
    FUSEDATTN_X86_UNROLL for (index_t r = 0; r < MR; ++r) {
      const vec p_rt = Dot::broadcast(p + r * ldp + t);
      FUSEDATTN_X86_UNROLL for (index_t n = 0; n < NV; ++n) o[r][n] = Dot::madd(o[r][n], p_rt, v_t[n]);
    }
  };
  const index_t steps = keys / K;
  for (index_t t = 0; t < steps; ++t) {
    vec v_t[NV];
    FUSEDATTN_X86_UNROLL for (index_t n = 0; n < NV; ++n) {
      v_t[n] = Dot::load(v + K * t * shape::vw + n * W);
      pin(v_t[n]);
    }
    step(t, v_t);
  }
  if constexpr (K == 2) {
    if (keys % 2) {
      constexpr __mmask32 even = 0x55555555u;  // the bf16 elements of key 2t; key 2t + 1 is outside the tile
      vec v_t[NV];
      for (index_t n = 0; n < NV; ++n)
        v_t[n] = (vec)_mm512_maskz_mov_epi16(
            even, _mm512_castps_si512(_mm512_loadu_ps(v + 2 * steps * shape::vw + n * W)));
      step(steps, v_t);
    }
  }
  FUSEDATTN_X86_UNROLL for (index_t r = 0; r < MR; ++r)
    FUSEDATTN_X86_UNROLL for (index_t n = 0; n < NV; ++n) _mm512_storeu_ps(acc + r * lda + n * W, o[r][n]);
}

/// acc = diag(α)·acc + P·V for a tile (micro_kernels.hpp's pv_tile contract): chunks outer, rows 12 at a time and
/// the rest as one block; the last chunk takes 1 vector when dp is not a multiple of 32. p: P at the tile's first
/// key (as bf16 pairs for bf16_dot, round_p_to_pairs), v: the packed chunk rows at the tile's first key.
template <class Dot>
inline void pv_rows(const float* p, index_t ldp, const float* v, index_t chunk_stride, index_t keys, index_t dp,
                    const float* alpha, float* acc, index_t lda, index_t rows) {
  constexpr index_t MR = shape::pv_mr;
  const index_t full = rows / MR * MR;
  for (index_t c = 0; c < dp; c += shape::vw, v += chunk_stride) {
    const auto chunk = [&](auto nv) {
      constexpr index_t NV = decltype(nv)::value;
      for (index_t i = 0; i < full; i += MR)
        pv_block<MR, NV, Dot>(p + i * ldp, ldp, v, keys, alpha + i, acc + i * lda + c, lda);
      with_n<MR - 1>(rows - full, [&](auto rest) {
        pv_block<decltype(rest)::value, NV, Dot>(p + full * ldp, ldp, v, keys, alpha + full, acc + full * lda + c, lda);
      });
    };
    if (c + shape::vw <= dp) chunk(std::integral_constant<index_t, 2>{});
    else chunk(std::integral_constant<index_t, 1>{});
  }
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

/// The bf16-pair sets' packing of Q, K and V in the layouts above (simd.hpp's pair_packers, for the tile loop).
struct pair_packing {
  static constexpr bool pairs = true;

  /// The Q tile (rows × d floats, row stride d, each value a bf16 widened exactly) as bf16 pairs in place: row i's
  /// slot c2 = (q[i][2c2], q[i][2c2+1]), 0 past d. Slot c2 is written after elements 2c2 and 2c2 + 1 are read.
  static void prepare_q_pairs(float* q, index_t rows, index_t d) {
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
  /// Defined below the class: a definition in it would declare it inline, which changes GCC's inlining of the
  /// tile loop.
  template <class RowOf>
  static void pack_k_pairs(RowOf&& row, index_t kn, index_t d, float* kt);

  /// Packs V row pairs (key k, key k + 1) of one chunk row: slot x = (v[k][c0 + x], v_next[c0 + x]), 0 past d and
  /// where v_next is null (k + 1 = seq_kv).
  static void pack_v_pair_row(const Eigen::bfloat16* vk, const Eigen::bfloat16* v_next, index_t c0, index_t d,
                              float* dst) {
    for (index_t x = 0; x < shape::vw; ++x) {
      const index_t c = c0 + x;
      const std::uint16_t lo = c < d ? bits(vk[c]) : 0, hi = c < d && v_next ? bits(v_next[c]) : 0;
      put(dst, x, bf16_pair(lo, hi));
    }
  }
};

template <class RowOf>
void pair_packing::pack_k_pairs(RowOf&& row, index_t kn, index_t d, float* kt) {
  const index_t d2 = (d + 1) / 2;
  for (index_t j = 0; j < shape::cols; ++j) {
    const Eigen::bfloat16* kr = j < kn ? row(j) : nullptr;
    for (index_t c2 = 0; c2 < d2; ++c2) {
      const std::uint16_t lo = kr ? bits(kr[2 * c2]) : 0, hi = kr && 2 * c2 + 1 < d ? bits(kr[2 * c2 + 1]) : 0;
      put(kt, c2 * shape::cols + j, bf16_pair(lo, hi));
    }
  }
}

// ---- the online-softmax row's vector passes (kernels/softmax.hpp's online_softmax_row, on 16 lanes) ----

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

/// 2^x for x <= 0 (cpu::exp2_nonpositive, the same polynomial and constants), 16 lanes. `Short`: a degree-4
/// polynomial (interpolating 2^f at the Chebyshev nodes of [−1/2, 1/2]; relative error below 3.6e-6, which keeps
/// lse within the low-precision rule) for the bf16-pair sets, whose P is rounded to bf16 (relative step 2^-9) before
/// P·V; the same range reduction, so x ≤ −127 still gives exactly 0.
template <bool Short = false>
inline __m512 exp2_nonpositive(__m512 x) {
  constexpr float min_exponent = -127.0f;
  constexpr int exponent_bias = 127, mantissa_bits = 23;
  constexpr float shifter = 12582912.0f + exponent_bias;
  x = _mm512_max_ps(_mm512_set1_ps(min_exponent), x);  // returns x when x is NaN
  const __m512 shifted = _mm512_add_ps(x, _mm512_set1_ps(shifter));
  const __m512 n = _mm512_sub_ps(shifted, _mm512_set1_ps(shifter));
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p;
  if constexpr (Short) {
    constexpr float c4 = 9.666368515387469e-3f, c3 = 5.5921975842256264e-2f, c2 = 2.4022349038020335e-1f,
                    c1 = 6.93121045203427e-1f;
    p = _mm512_fmadd_ps(_mm512_set1_ps(c4), f, _mm512_set1_ps(c3));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c2));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c1));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  } else {
    constexpr float c6 = 1.5403530393381609e-4f, c5 = 1.3333558146428443e-3f, c4 = 9.6181291076284772e-3f,
                    c3 = 5.5504108664821580e-2f, c2 = 2.4022650695910071e-1f, c1 = 6.9314718055994531e-1f;
    p = _mm512_fmadd_ps(_mm512_set1_ps(c6), f, _mm512_set1_ps(c5));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c4));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c3));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c2));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c1));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  }
  const __m512i e = _mm512_slli_epi32(_mm512_castps_si512(shifted), mantissa_bits);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

/// The two vector passes of kernels::online_softmax_row on 16 lanes (the state arithmetic around them is
/// online_softmax_step's): the row max of the raw scores (a NaN score skipped), cols a multiple of 16.
inline float row_max(const float* s, index_t cols) {
  __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (index_t j = 0; j < cols; j += W) vmax = _mm512_max_ps(_mm512_loadu_ps(s + j), vmax);  // skips a NaN score
  return reduce_max(vmax);
}
/// s_j = 2^(c·s_j − m_new), the logit formed by one FMA; returns Σ_j s_j. `Short`: exp2_nonpositive<true>.
template <bool Short = false>
inline float exp2_row_sum(float* s, index_t cols, float c, float m_new) {
  const __m512 vc = _mm512_set1_ps(c), neg_m = _mm512_set1_ps(-m_new);
  __m512 vsum = _mm512_setzero_ps();
  for (index_t j = 0; j < cols; j += W) {
    const __m512 p = exp2_nonpositive<Short>(_mm512_fmadd_ps(_mm512_loadu_ps(s + j), vc, neg_m));
    _mm512_storeu_ps(s + j, p);
    vsum = _mm512_add_ps(vsum, p);
  }
  return reduce_add(vsum);
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

// ---- AMX (cpu::amx): Q·Kᵀ and P·V on bf16 tiles, TDPBF16PS with f32 accumulation, on the bf16-pair layouts ----
#if defined(__clang__)
#pragma clang attribute push(                                                                                  \
    __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx2,fma,f16c"))), \
    apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx2,fma,f16c")
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace fusedattn {
namespace cpu {
namespace x86 {

/// The 64-byte tile configuration of LDTILECFG (palette 1) the AMX kernels use: tiles 0-7 all 16 rows × 64 bytes.
/// Tiles 0-3 hold C (16 × 16 f32), 4-5 A (16 rows × 16 bf16 pairs), 6-7 B (16 pair rows × 16 columns of pairs).
struct alignas(64) tile_config {
  std::uint8_t palette = 1;
  std::uint8_t start_row = 0;
  std::uint8_t reserved[14] = {};
  std::uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  std::uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};
static_assert(sizeof(tile_config) == 64, "fusedattn: LDTILECFG reads 64 bytes");

#if defined(FUSEDATTN_AMX_EMULATE)
/// Test builds without AMX hardware: the tile instructions the kernels use, in scalar C++ on per-thread tile
/// registers (TDPBF16PS: per C element, the sum over the 16 pair slots of both bf16 products, in f32).
struct amx_emulated {
  float t[8][16][16];
  static amx_emulated& regs() {
    static thread_local amx_emulated r;
    return r;
  }
  static float lo(float slot) {
    std::uint32_t w = 0;
    std::memcpy(&w, &slot, sizeof(w));
    w <<= 16;
    float x = 0;
    std::memcpy(&x, &w, sizeof(x));
    return x;
  }
  static float hi(float slot) {
    std::uint32_t w = 0;
    std::memcpy(&w, &slot, sizeof(w));
    w &= 0xffff0000u;
    float x = 0;
    std::memcpy(&x, &w, sizeof(x));
    return x;
  }
  static void load(int tile, const void* base, long stride) {
    for (int i = 0; i < 16; ++i)
      std::memcpy(regs().t[tile][i], static_cast<const char*>(base) + i * stride, sizeof(regs().t[tile][i]));
  }
  static void store(int tile, void* base, long stride) {
    for (int i = 0; i < 16; ++i)
      std::memcpy(static_cast<char*>(base) + i * stride, regs().t[tile][i], sizeof(regs().t[tile][i]));
  }
  static void zero(int tile) { std::memset(regs().t[tile], 0, sizeof(regs().t[tile])); }
  static void dot(int c, int a, int b) {
    amx_emulated& r = regs();
    for (int m = 0; m < 16; ++m)
      for (int n = 0; n < 16; ++n) {
        float sum = r.t[c][m][n];
        for (int k = 0; k < 16; ++k)
          sum += lo(r.t[a][m][k]) * lo(r.t[b][k][n]) + hi(r.t[a][m][k]) * hi(r.t[b][k][n]);
        r.t[c][m][n] = sum;
      }
  }
};
#define FUSEDATTN_TILE_CONFIG(cfg) (void)(cfg)
#define FUSEDATTN_TILE_RELEASE() (void)0
#define FUSEDATTN_TILE_ZERO(t) amx_emulated::zero(t)
#define FUSEDATTN_TILE_LOAD(t, base, stride) amx_emulated::load(t, base, stride)
#define FUSEDATTN_TILE_STORE(t, base, stride) amx_emulated::store(t, base, stride)
#define FUSEDATTN_TILE_DOT(c, a, b) amx_emulated::dot(c, a, b)
#else
#define FUSEDATTN_TILE_CONFIG(cfg) _tile_loadconfig(cfg)
#define FUSEDATTN_TILE_RELEASE() _tile_release()
#define FUSEDATTN_TILE_ZERO(t) _tile_zero(t)
#define FUSEDATTN_TILE_LOAD(t, base, stride) _tile_loadd(t, base, stride)
#define FUSEDATTN_TILE_STORE(t, base, stride) _tile_stored(t, base, stride)
#define FUSEDATTN_TILE_DOT(c, a, b) _tile_dpbf16ps(c, a, b)
#endif

/// A block of RB × NB tiles of 16 × 16 (RB, NB in {1, 2}): C (+)= A·B over `slots` pair slots (a multiple of 16).
///   a: the first A row, ldA slots a row (bf16 pairs along the reduction);
///   b: the first B row, 64 slots a pair row (Kᵀ panel rows, or V chunk rows of every other key);
///   c: the first C row, ldC floats a row. LoadC: start from C's values, else from 0.
/// Math: c[m][n] = Σ_t Σ_{e=0,1} a[m][t]_e · b[t][n]_e; tile (i, k) of C is rows 16i.., columns 16k.. .
template <int RB, int NB, bool LoadC>
inline void amx_block(const float* a, index_t lda, const float* b, index_t slots, float* c, index_t ldc) {
  constexpr index_t b_row = 64;  // slots per B row: a Kᵀ panel row, or two V chunk rows (a key pair)
  const long sa = static_cast<long>(lda * 4), sb = static_cast<long>(b_row * 4), sc = static_cast<long>(ldc * 4);
  float* c1 = c + 16 * ldc;
  if constexpr (LoadC) {
    FUSEDATTN_TILE_LOAD(0, c, sc);
    if constexpr (NB == 2) FUSEDATTN_TILE_LOAD(1, c + 16, sc);
    if constexpr (RB == 2) FUSEDATTN_TILE_LOAD(2, c1, sc);
    if constexpr (RB == 2 && NB == 2) FUSEDATTN_TILE_LOAD(3, c1 + 16, sc);
  } else {
    FUSEDATTN_TILE_ZERO(0);
    if constexpr (NB == 2) FUSEDATTN_TILE_ZERO(1);
    if constexpr (RB == 2) FUSEDATTN_TILE_ZERO(2);
    if constexpr (RB == 2 && NB == 2) FUSEDATTN_TILE_ZERO(3);
  }
  for (index_t t = 0; t < slots; t += 16) {
    const float* bt = b + t * b_row;
    FUSEDATTN_TILE_LOAD(4, a + t, sa);
    FUSEDATTN_TILE_LOAD(6, bt, sb);
    if constexpr (NB == 2) FUSEDATTN_TILE_LOAD(7, bt + 16, sb);
    if constexpr (RB == 2) FUSEDATTN_TILE_LOAD(5, a + 16 * lda + t, sa);
    FUSEDATTN_TILE_DOT(0, 4, 6);
    if constexpr (NB == 2) FUSEDATTN_TILE_DOT(1, 4, 7);
    if constexpr (RB == 2) FUSEDATTN_TILE_DOT(2, 5, 6);
    if constexpr (RB == 2 && NB == 2) FUSEDATTN_TILE_DOT(3, 5, 7);
  }
  FUSEDATTN_TILE_STORE(0, c, sc);
  if constexpr (NB == 2) FUSEDATTN_TILE_STORE(1, c + 16, sc);
  if constexpr (RB == 2) FUSEDATTN_TILE_STORE(2, c1, sc);
  if constexpr (RB == 2 && NB == 2) FUSEDATTN_TILE_STORE(3, c1 + 16, sc);
}

/// amx_block over every 16-row block of `rows` (two at a time), rows past `rows` up to the next multiple of 16
/// included: they belong to the tile loop's padded scratch (bq_pad is a multiple of 16 under this set) and hold
/// values no one reads.
template <int NB, bool LoadC>
inline void amx_rows(const float* a, index_t lda, const float* b, index_t slots, float* c, index_t ldc, index_t rows) {
  const index_t blocks = (rows + 15) / 16;
  index_t i = 0;
  for (; i + 2 <= blocks; i += 2) amx_block<2, NB, LoadC>(a + i * 16 * lda, lda, b, slots, c + i * 16 * ldc, ldc);
  if (i < blocks) amx_block<1, NB, LoadC>(a + i * 16 * lda, lda, b, slots, c + i * 16 * ldc, ldc);
}

/// S = Q·Kᵀ for a tile on AMX (the qk_tile contract; q as bf16 pairs by prepare_q_pairs, kt the bf16-pair Kᵀ
/// panels): the first ⌊ceil(d/2) / 16⌋·16 pair slots of head_dim on tiles, 32 keys at a time, the remaining slots
/// added on vdpbf16ps.
inline void qk_tile_amx(const float* q, index_t ldq, const float* kt, index_t d, index_t rows, index_t cols, float* s,
                        index_t lds) {
  const index_t d2 = (d + 1) / 2, on_tiles = d2 / 16 * 16;
  if (on_tiles > 0) {
    static const tile_config config;
    FUSEDATTN_TILE_CONFIG(&config);
    for (index_t j = 0; j < cols; j += shape::cols)
      for (index_t n0 = 0; n0 < shape::cols; n0 += 32)
        amx_rows<2, false>(q, ldq, kt + j * d + n0, on_tiles, s + j + n0, lds, rows);
    FUSEDATTN_TILE_RELEASE();
  }
  if (on_tiles == 0) qk_rows<bf16_dot>(q, ldq, kt, d, rows, cols, s, lds);
  else if (on_tiles < d2) qk_rows<bf16_dot, true>(q, ldq, kt, d, rows, cols, s, lds, on_tiles);
}

/// acc = diag(α)·acc + P·V for a tile on AMX (the pv_tile contract; P rounded to bf16 pairs in place first, v the
/// bf16-pair V chunk rows at the tile's first key): the last keys % 32 keys and the rescale by α on vdpbf16ps, then
/// the first ⌊keys / 32⌋·32 keys on tiles, 16 or 32 accumulator columns at a time.
inline void pv_tile_amx(float* p, index_t ldp, const float* v, index_t chunk_stride, index_t keys, index_t dp,
                        const float* alpha, float* acc, index_t lda, index_t rows) {
  round_p_to_pairs(p, ldp, keys, rows);
  const index_t on_tiles = keys / 32 * 16;  // pair slots
  pv_rows<bf16_dot>(p + on_tiles, ldp, v + 2 * on_tiles * shape::vw, chunk_stride, keys - 2 * on_tiles, dp, alpha,
                    acc, lda, rows);
  if (on_tiles == 0) return;
  static const tile_config config;
  FUSEDATTN_TILE_CONFIG(&config);
  for (index_t c = 0; c < dp; c += shape::vw, v += chunk_stride) {
    if (c + shape::vw <= dp) amx_rows<2, true>(p, ldp, v, on_tiles, acc + c, lda, rows);
    else amx_rows<1, true>(p, ldp, v, on_tiles, acc + c, lda, rows);
  }
  FUSEDATTN_TILE_RELEASE();
}

#undef FUSEDATTN_TILE_CONFIG
#undef FUSEDATTN_TILE_RELEASE
#undef FUSEDATTN_TILE_ZERO
#undef FUSEDATTN_TILE_LOAD
#undef FUSEDATTN_TILE_STORE
#undef FUSEDATTN_TILE_DOT

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

/// S = Q·Kᵀ for a tile under one of fusedattn's x86 kernel sets (micro_kernels.hpp's qk_tile contract).
template <class Set>
inline void qk_tile(const float* q, index_t ldq, const float* kt, index_t d, index_t rows, index_t cols, float* s,
                    index_t lds) {
  if constexpr (std::is_same<Set, detail::x86_amx_set>::value) qk_tile_amx(q, ldq, kt, d, rows, cols, s, lds);
  else if constexpr (packs_bf16_pairs_v<Set>) qk_rows<bf16_dot>(q, ldq, kt, d, rows, cols, s, lds);
  else qk_rows<f32_fma>(q, ldq, kt, d, rows, cols, s, lds);
}

/// acc = diag(α)·acc + P·V for a tile under one of fusedattn's x86 kernel sets (micro_kernels.hpp's pv_tile
/// contract); the bf16-pair sets round P to bf16 pairs in place first (P is dead after this step).
template <class Set>
inline void pv_tile(float* p, index_t ldp, const float* v, index_t chunk_stride, index_t keys, index_t dp,
                    const float* alpha, float* acc, index_t lda, index_t rows) {
  if constexpr (std::is_same<Set, detail::x86_amx_set>::value) {
    pv_tile_amx(p, ldp, v, chunk_stride, keys, dp, alpha, acc, lda, rows);
  } else if constexpr (packs_bf16_pairs_v<Set>) {
    round_p_to_pairs(p, ldp, keys, rows);
    pv_rows<bf16_dot>(p, ldp, v, chunk_stride, keys, dp, alpha, acc, lda, rows);
  } else {
    pv_rows<f32_fma>(p, ldp, v, chunk_stride, keys, dp, alpha, acc, lda, rows);
  }
}

}  // namespace x86

/// The vdpbf16ps and AMX sets pack Q, K and V for the tile loop as bf16 pairs.
template <>
struct pair_packers<detail::x86_bf16_set> : x86::pair_packing {};
template <>
struct pair_packers<detail::x86_amx_set> : x86::pair_packing {};

}  // namespace cpu
}  // namespace fusedattn

#endif  // FUSEDATTN_X86_KERNELS

namespace fusedattn {
namespace cpu {

/// Calls f(arch) with the tag of the best kernel set the running CPU supports (cpu::best's choice) and returns
/// what f returns: amx where the CPU has AMX-BF16 and the OS grants the tile permission (all-bf16 storage on the
/// tiles, every other storage type on avx512's kernels: detail::amx_for_bf16), else avx512bf16 where vdpbf16ps
/// outruns the FMAs (x86::bf16_dot_pays), else avx512 (bf16 and f16 widened to f32); on AArch64 built for FEAT_BF16,
/// neon_bf16 where the CPU has it (arm_kernels.hpp: BFDOT for bf16 storage, NEON for the rest); else compiled_arch
/// where the CPU has it, else scalar_arch.
template <class F>
decltype(auto) with_best_arch(F&& f) {
#if FUSEDATTN_X86_KERNELS
#if !defined(FUSEDATTN_AMX_EMULATE)
  if (amx::available()) return f(detail::amx_for_bf16{});
#endif
  if (avx512bf16::available() && x86::bf16_dot_pays()) return f(avx512bf16{});
  if (avx512::available()) return f(avx512{});
#endif
#if FUSEDATTN_ARM_BF16_KERNELS
  if (neon_bf16::available()) return f(neon_bf16{});
#endif
  if (xsimd::available_architectures().best >= compiled_arch::version()) return f(compiled_arch{});
  return f(scalar_arch{});
}

}  // namespace cpu
}  // namespace fusedattn
