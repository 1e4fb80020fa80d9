/// @file micro_kernels.hpp
/// Register-blocked micro-kernels of the CPU flash loop on `cpu::simd<Acc, Arch>`: the S = Q·Kᵀ tile over a
/// packed Kᵀ tile, the rescale-and-accumulate acc = α·acc + P·V, and the decode kernel's variants that read K
/// and V in place in their storage type. Packing and the softmax are elsewhere.
#pragma once

#include <cmath>
#include <type_traits>
#include <utility>

#include "../config.hpp"
#include "../core/types.hpp"
#include "simd.hpp"
#include "arm_kernels.hpp"
#include "x86_kernels.hpp"

#if defined(__GNUC__) && !defined(__clang__)
#define FUSEDATTN_UNROLL _Pragma("GCC unroll 16")
#elif defined(__clang__)
#define FUSEDATTN_UNROLL _Pragma("unroll")
#else
#define FUSEDATTN_UNROLL
#endif

/// Inlines a micro-kernel's inner loop into the micro-kernel (its accumulators then stay in registers).
#if defined(__GNUC__) || defined(__clang__)
#define FUSEDATTN_INLINE_BODY inline __attribute__((always_inline))
#else
#define FUSEDATTN_INLINE_BODY inline
#endif

namespace fusedattn {
namespace cpu {

/// Keeps a loaded vector in a register. Without it GCC re-reads the operand from memory inside every FMA
/// (one load per FMA instead of one per vector), which makes the micro-kernels load-bound.
template <class Vec>
inline void pin_register(Vec& x) {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
  if constexpr (std::is_class<Vec>::value) asm volatile("" : "+v"(x.data));
#else
  (void)x;
#endif
}

/// Calls f(std::integral_constant<index_t, n>{}) for a run-time n in [1, N] (nothing for n outside it): turns a
/// tail count (rows or vectors left over by a register block) into a template argument of a micro-kernel.
template <index_t N, class F>
inline void with_count(index_t n, F&& f) {
  if constexpr (N >= 1) {
    if (n == N) f(std::integral_constant<index_t, N>{});
    else with_count<N - 1>(n, std::forward<F>(f));
  }
}

/// The inner loop that every register-blocked micro-kernel shares: acc[r][n] += Σ_x a(r, x) · b[x][n·W .. n·W+W)
/// for x in [0, k), in ascending x.
///   a: a(r, x) = a[r·ars + x·axs], so one body reads its operand row-wise (axs = 1) or column-wise;
///   b: k rows of NV vectors, row stride ldb.
/// The NV vectors of one b row are loaded once and used by all MR rows; each a element is broadcast once and used
/// by all NV vectors.
template <class Acc, class Arch, index_t MR, index_t NV>
FUSEDATTN_INLINE_BODY void fma_rows(typename simd<Acc, Arch>::type (&acc)[MR][NV], const Acc* a, index_t ars,
                                    index_t axs, const Acc* b, index_t ldb, index_t k) {
  using V = simd<Acc, Arch>;
  using vec = typename V::type;
  constexpr index_t W = V::width;
  for (index_t x = 0; x < k; ++x) {
    vec b_x[NV];
    FUSEDATTN_UNROLL for (index_t n = 0; n < NV; ++n) {
      b_x[n] = V::load(b + x * ldb + n * W);
      pin_register(b_x[n]);
    }
    const Acc* a_x = a + x * axs;
    FUSEDATTN_UNROLL for (index_t r = 0; r < MR; ++r) {
      const vec a_rx = V::broadcast(a_x[r * ars]);
      FUSEDATTN_UNROLL for (index_t n = 0; n < NV; ++n) acc[r][n] = V::fma(a_rx, b_x[n], acc[r][n]);
    }
  }
}

/// One MR × (NR·W) block of S = Q·Kᵀ.
///   q:  MR rows of the (scaled) Q tile, row stride ldq;        shape MR × d
///   kt: the packed Kᵀ tile at the block's first key, row stride ldk;  shape d × (NR·W)
///   s:  output, row stride lds;                                 shape MR × (NR·W)
/// Math: s[r][j] = Σ_c q[r][c] · kt[c][j] (fma_rows). The backward pass runs it for every C = A·Bᵀ over a packed Bᵀ
/// (backward_kernels.hpp, abt_tile).
template <class Acc, class Arch, index_t MR, index_t NR>
FUSEDATTN_NOINLINE void qk_block(const Acc* q, index_t ldq, const Acc* kt, index_t ldk, index_t d, Acc* s,
                                 index_t lds) {
  using V = simd<Acc, Arch>;
  using vec = typename V::type;
  constexpr index_t W = V::width;
  vec acc[MR][NR];
  FUSEDATTN_UNROLL for (index_t r = 0; r < MR; ++r)
    FUSEDATTN_UNROLL for (index_t n = 0; n < NR; ++n) acc[r][n] = V::broadcast(Acc(0));
  fma_rows<Acc, Arch, MR, NR>(acc, q, ldq, 1, kt, ldk, d);
  FUSEDATTN_UNROLL for (index_t r = 0; r < MR; ++r)
    FUSEDATTN_UNROLL for (index_t n = 0; n < NR; ++n) V::store(s + r * lds + n * W, acc[r][n]);
}

/// S = Q·Kᵀ for a whole tile: rows [0, rows), key columns [0, cols) (a multiple of qk_nr·W).
///   kt: packed Kᵀ panels, each d × (qk_nr·W) contiguous (panel_stride = d·qk_nr·W elements apart).
/// Panels are the outer loop so one contiguous d × (qk_nr·W) panel stays in L1 while every row block uses it.
/// Rows go qk_mr at a time, the last rows % qk_mr as one smaller block (a decode row costs one row, not qk_mr).
/// Under the x86 kernel sets (arch_x86.hpp) the tile runs x86_kernels.hpp's f32, bf16-pair or AMX kernels instead.
template <class Acc, class Arch>
inline void qk_tile(const Acc* q, index_t ldq, const Acc* kt, index_t d, index_t rows, index_t cols, Acc* s,
                    index_t lds) {
#if FUSEDATTN_X86_KERNELS
  if constexpr (is_x86_set_v<Arch>) {
    return x86::qk_tile<Arch>(q, ldq, kt, d, rows, cols, s, lds);
  } else
#endif
#if FUSEDATTN_ARM_BF16_KERNELS
  if constexpr (is_arm_bf16_set_v<Arch>) {
    return arm::qk_tile(q, ldq, kt, d, rows, cols, s, lds);
  } else
#endif
  {
    using shape = kernel_shape<Acc, Arch>;
    constexpr index_t MR = shape::qk_mr, NR = shape::qk_nr, C = shape::cols;
    const index_t full = rows / MR * MR;
    for (index_t j = 0; j < cols; j += C) {
      for (index_t i = 0; i < full; i += MR)
        qk_block<Acc, Arch, MR, NR>(q + i * ldq, ldq, kt + j * d, C, d, s + i * lds + j, lds);
      with_count<MR - 1>(rows - full, [&](auto rest) {
        qk_block<Acc, Arch, decltype(rest)::value, NR>(q + full * ldq, ldq, kt + j * d, C, d, s + full * lds + j,
                                                       lds);
      });
    }
  }
}

/// One MR × (NV·W) block of the output accumulator.
///   p:     MR rows of P, row stride ldp;                shape MR × keys
///   v:     the packed V tile at the block's first column, row stride ldv;  shape keys × (NV·W)
///   alpha: MR rescale factors exp(m_old − m_new)
///   acc:   in/out, row stride lda;                     shape MR × (NV·W)
/// Math: acc[r][c] = α[r] · acc[r][c] + Σ_j p[r][j] · v[j][c]; the rescale is fused into the load of acc.
template <class Acc, class Arch, index_t MR, index_t NV>
FUSEDATTN_NOINLINE void pv_block(const Acc* p, index_t ldp, const Acc* v, index_t ldv, index_t keys, const Acc* alpha,
                                 Acc* acc, index_t lda) {
  using V = simd<Acc, Arch>;
  using vec = typename V::type;
  constexpr index_t W = V::width;
  vec o[MR][NV];
  FUSEDATTN_UNROLL for (index_t r = 0; r < MR; ++r) {
    const vec a = V::broadcast(alpha[r]);
    FUSEDATTN_UNROLL for (index_t n = 0; n < NV; ++n) o[r][n] = V::mul(a, V::load(acc + r * lda + n * W));
  }
  fma_rows<Acc, Arch, MR, NV>(o, p, ldp, 1, v, ldv, keys);
  FUSEDATTN_UNROLL for (index_t r = 0; r < MR; ++r)
    FUSEDATTN_UNROLL for (index_t n = 0; n < NV; ++n) V::store(acc + r * lda + n * W, o[r][n]);
}

/// One column chunk of NV vectors for every row: pv_mr rows at a time, the last rows % pv_mr as one smaller block.
template <class Acc, class Arch, index_t NV>
inline void pv_chunk(const Acc* p, index_t ldp, const Acc* v, index_t ldv, index_t keys, const Acc* alpha, Acc* acc,
                     index_t lda, index_t rows) {
  constexpr index_t MR = kernel_shape<Acc, Arch>::pv_mr;
  const index_t full = rows / MR * MR;
  for (index_t i = 0; i < full; i += MR)
    pv_block<Acc, Arch, MR, NV>(p + i * ldp, ldp, v, ldv, keys, alpha + i, acc + i * lda, lda);
  with_count<MR - 1>(rows - full, [&](auto rest) {
    pv_block<Acc, Arch, decltype(rest)::value, NV>(p + full * ldp, ldp, v, ldv, keys, alpha + full,
                                                   acc + full * lda, lda);
  });
}

/// acc = diag(α)·acc + P·V for a whole tile: rows [0, rows), keys [0, keys), accumulator columns [0, dp)
/// (a multiple of the vector width).
///   v: packed V chunks at the tile's first key: chunk c (columns [c·vw, (c+1)·vw), vw = pv_nr·W) is keys × vw
///      contiguous, chunk_stride elements after chunk c − 1.
/// Chunks are the outer loop so one contiguous keys × vw slice of V stays in L1 while every row block uses it;
/// the last chunk takes the remaining 1 .. pv_nr−1 vectors. Under the x86 kernel sets the tile runs
/// x86_kernels.hpp's kernels; the bf16-pair and AMX sets round P to bf16 pairs in place first (P is dead after this
/// step).
template <class Acc, class Arch>
inline void pv_tile(Acc* p, index_t ldp, const Acc* v, index_t chunk_stride, index_t keys, index_t dp,
                    const Acc* alpha, Acc* acc, index_t lda, index_t rows) {
#if FUSEDATTN_X86_KERNELS
  if constexpr (is_x86_set_v<Arch>) {
    return x86::pv_tile<Arch>(p, ldp, v, chunk_stride, keys, dp, alpha, acc, lda, rows);
  } else
#endif
#if FUSEDATTN_ARM_BF16_KERNELS
  if constexpr (is_arm_bf16_set_v<Arch>) {
    return arm::pv_tile(p, ldp, v, chunk_stride, keys, dp, alpha, acc, lda, rows);
  } else
#endif
  {
    using shape = kernel_shape<Acc, Arch>;
    constexpr index_t W = shape::width;
    constexpr index_t NV = shape::pv_nr;
    constexpr index_t ldv = shape::vw;
    index_t c = 0;
    for (; c + ldv <= dp; c += ldv, v += chunk_stride)
      pv_chunk<Acc, Arch, NV>(p, ldp, v, ldv, keys, alpha, acc + c, lda, rows);
    const index_t rest = (dp - c) / W;
    FUSEDATTN_ASSERT(rest < NV);
    with_count<NV - 1>(rest, [&](auto n) {
      pv_chunk<Acc, Arch, decltype(n)::value>(p, ldp, v, ldv, keys, alpha, acc + c, lda, rows);
    });
  }
}

// ---- Decode micro-kernels: K and V read in place, in their storage type T, at a row stride (no packing). ----

/// W values of storage type T at `x` as one vector of Acc. float → float is a load; Eigen::half and
/// Eigen::bfloat16 widen in registers (AVX-512 / AVX2 / NEON conversions where the arch has them, else one value
/// at a time); both widenings are exact, so every path gives the same bits as static_cast<Acc>.
template <class Acc, class Arch, class T>
inline typename simd<Acc, Arch>::type load_as(const T* x) {
  using V = simd<Acc, Arch>;
  if constexpr (std::is_same<T, Acc>::value) {
    return V::load(x);
  } else {
    constexpr bool is_half = std::is_same<T, Eigen::half>::value;
    constexpr bool is_bf16 = std::is_same<T, Eigen::bfloat16>::value;
    (void)is_half, (void)is_bf16;
#if XSIMD_WITH_AVX512F
    if constexpr (std::is_base_of<xsimd::avx512f, Arch>::value && std::is_same<Acc, float>::value &&
                  (is_half || is_bf16)) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
      if constexpr (is_half) return _mm512_cvtph_ps(raw);
      else return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    }
#endif
#if XSIMD_WITH_AVX2
    if constexpr (std::is_base_of<xsimd::avx2, Arch>::value && std::is_same<Acc, float>::value && is_bf16) {
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
    }
#if defined(__F16C__)
    if constexpr (std::is_base_of<xsimd::avx2, Arch>::value && std::is_same<Acc, float>::value && is_half)
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
#endif
#endif
#if XSIMD_WITH_NEON64
    // AArch64: bf16 is the upper half of an f32 (a 16-bit left shift); f16 by FCVTL.
    if constexpr (std::is_base_of<xsimd::neon64, Arch>::value && std::is_same<Acc, float>::value && is_bf16)
      return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(reinterpret_cast<const std::uint16_t*>(x)), 16));
    if constexpr (std::is_base_of<xsimd::neon64, Arch>::value && std::is_same<Acc, float>::value && is_half)
      return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(reinterpret_cast<const std::uint16_t*>(x))));
#endif
    alignas(64) Acc lanes[V::width];
    for (index_t i = 0; i < V::width; ++i) lanes[i] = static_cast<Acc>(x[i]);
    return V::load(lanes);
  }
}

/// Asks for the cache line holding `x` in L2 (a hint: results never depend on it). The decode micro-kernels request
/// the next step's K or V rows this way, one line for each line they load (the same offset in the same-numbered
/// row), so that the requests spread over the loads instead of queueing up in bursts, which stall the core once
/// its miss buffers are full. Whether to request is decided at the call (a template parameter, the line test): GCC 12
/// drops a prefetch that sits under a run-time condition inside the inlined function itself.
template <class T>
FUSEDATTN_INLINE_BODY void request_line(const T* x) {
#if defined(__GNUC__) || defined(__clang__)
  __builtin_prefetch(x, 0, 1);
#else
  (void)x;
#endif
}

/// Register blocking of the decode micro-kernels: dot products MR rows × NK keys (MR·NK accumulators, reduced
/// together by reduce_each), and the in-place P·V: up to 4 rows × pv_nv vectors of head_dim columns (a decode row
/// block is small), more rows as the prefill's P·V (kernel_shape::pv_mr rows × pv_nr vectors).
template <class Acc, class Arch>
struct decode_shape {
  static constexpr index_t dot_mr = has_32_registers<Arch>() ? 4 : 2;
  static constexpr index_t dot_nk = 4;
  static constexpr index_t pv_small_rows = 4;
  static constexpr index_t pv_nv = has_32_registers<Arch>() ? 4 : kernel_shape<Acc, Arch>::pv_nr;
};

/// The lane sums of W vectors at once (the transposed reduction): lane i of the result is the sum of x[i]'s lanes.
/// Every lane is summed by the same tree, whatever the other vectors hold (on AVX-512: lanes i and i + 8 first,
/// then i and i + 4, i and i + 2, i and i + 1), so a dot product's bits do not depend on the block it was computed
/// in. W − 1 vector additions for W sums instead of W horizontal reductions.
template <class Acc, class Arch>
inline typename simd<Acc, Arch>::type reduce_each(const typename simd<Acc, Arch>::type* x) {
  using V = simd<Acc, Arch>;
  if constexpr (V::width == 1) {
    return x[0];
  } else {
#if XSIMD_WITH_AVX512F
    if constexpr (std::is_same<Acc, float>::value && V::width == 16) {
      // Level 1 folds each vector's 256-bit halves, level 2 its 128-bit quarters (both across a pair of vectors),
      // levels 3 and 4 the pairs and single lanes inside 128-bit blocks. Four levels leave lane L holding input
      // 4·(L % 4) + L / 4, so the inputs go in that order (the permutation is its own inverse).
      __m512 l1[8], l2[4], l3[2];
      constexpr int perm[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};
      FUSEDATTN_UNROLL for (int i = 0; i < 8; ++i) {
        const __m512 a = x[perm[2 * i]], b = x[perm[2 * i + 1]];
        l1[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xee));
      }
      FUSEDATTN_UNROLL for (int i = 0; i < 4; ++i)
        l2[i] = _mm512_add_ps(_mm512_shuffle_f32x4(l1[2 * i], l1[2 * i + 1], 0x88),
                              _mm512_shuffle_f32x4(l1[2 * i], l1[2 * i + 1], 0xdd));
      FUSEDATTN_UNROLL for (int i = 0; i < 2; ++i)
        l3[i] = _mm512_add_ps(_mm512_shuffle_ps(l2[2 * i], l2[2 * i + 1], 0x44),
                              _mm512_shuffle_ps(l2[2 * i], l2[2 * i + 1], 0xee));
      return _mm512_add_ps(_mm512_shuffle_ps(l3[0], l3[1], 0x88), _mm512_shuffle_ps(l3[0], l3[1], 0xdd));
    } else
#endif
    {
      return xsimd::haddp(x);
    }
  }
}

/// a·b + c for the scalar tails of the in-place micro-kernels: one fused rounding where the target has an FMA
/// instruction (FP_FAST_FMAF / FP_FAST_FMA), else a product and a sum. Written out rather than left to the
/// compiler's contraction, which may treat two instantiations differently (an f32 K row and a widened 16-bit one
/// must give the same bits).
template <class Acc>
inline Acc tail_mul_add(Acc a, Acc b, Acc c) {
#if defined(FP_FAST_FMAF)
  if constexpr (std::is_same<Acc, float>::value) return std::fma(a, b, c);
#endif
#if defined(FP_FAST_FMA)
  if constexpr (std::is_same<Acc, double>::value) return std::fma(a, b, c);
#endif
  const Acc ab = a * b;
  return ab + c;
}

/// One MR × NK block of scores, each a dot product over head_dim:
///   q: MR query rows (Acc), row stride ldq;        shape MR × d
///   k: NK pointers to key rows (storage type T, read in place);  each d values
///   s: output, row stride lds;                     shape MR × NK
/// Math: s[r][n] = Σ_c q[r][c] · k[n][c], vector lanes over c, then the lanes of all MR·NK accumulators summed
/// together (reduce_each, W at a time); the last d % W columns are added one at a time. Each K vector is loaded
/// (and widened) once for all MR rows; with `Ahead`, the same line of row ahead[n] is requested (request_line).
template <class Acc, class Arch, class T, index_t MR, index_t NK, bool Ahead>
FUSEDATTN_NOINLINE void dot_block(const Acc* q, index_t ldq, const T* const* k, index_t d, Acc* s, index_t lds,
                                  const T* const* ahead) {
  using V = simd<Acc, Arch>;
  using vec = typename V::type;
  constexpr index_t W = V::width, M = MR * NK, G = (M + W - 1) / W;
  const index_t dv = d / W * W;
  vec acc[G * W];
  FUSEDATTN_UNROLL for (index_t i = 0; i < G * W; ++i) acc[i] = V::broadcast(Acc(0));
  const T* kr[NK];
  FUSEDATTN_UNROLL for (index_t n = 0; n < NK; ++n) kr[n] = k[n];
  for (index_t c = 0; c < dv; c += W) {
    vec k_c[NK];
    FUSEDATTN_UNROLL for (index_t n = 0; n < NK; ++n) {
      k_c[n] = load_as<Acc, Arch>(kr[n] + c);
      pin_register(k_c[n]);
      if constexpr (Ahead)
        if ((c * index_t(sizeof(T))) % 64 == 0) request_line(ahead[n] + c);  // once a line
    }
    FUSEDATTN_UNROLL for (index_t r = 0; r < MR; ++r) {
      const vec q_rc = V::load(q + r * ldq + c);
      FUSEDATTN_UNROLL for (index_t n = 0; n < NK; ++n) acc[r * NK + n] = V::fma(q_rc, k_c[n], acc[r * NK + n]);
    }
  }
  alignas(64) Acc sums[G * W];
  FUSEDATTN_UNROLL for (index_t g = 0; g < G; ++g) V::store(sums + g * W, reduce_each<Acc, Arch>(acc + g * W));
  if (dv == d) {
    FUSEDATTN_UNROLL for (index_t r = 0; r < MR; ++r)
      FUSEDATTN_UNROLL for (index_t n = 0; n < NK; ++n) s[r * lds + n] = sums[r * NK + n];
  } else {
    for (index_t r = 0; r < MR; ++r)
      for (index_t n = 0; n < NK; ++n) {
        Acc x = sums[r * NK + n];
        for (index_t c = dv; c < d; ++c) x = tail_mul_add(q[r * ldq + c], static_cast<Acc>(kr[n][c]), x);
        s[r * lds + n] = x;
      }
  }
}

/// S (rows × keys) = Q · Kᵀ with K read in place: key j's row at k[j]; Q rows at stride ldq.
/// Rows dot_mr and keys dot_nk at a time, the tails as smaller blocks. `ahead`: null, or a row for each key whose
/// lines the first row block requests as it loads key j's (the next step's K rows; any valid address will do).
template <class Acc, class Arch, class T>
inline void dot_tile(const Acc* q, index_t ldq, index_t rows, const T* const* k, index_t keys, index_t d, Acc* s,
                     index_t lds, const T* const* ahead = nullptr) {
  constexpr index_t MR = decode_shape<Acc, Arch>::dot_mr, NK = decode_shape<Acc, Arch>::dot_nk;
  const index_t full_r = rows / MR * MR, full_k = keys / NK * NK;
  auto rows_block = [&](index_t j, auto nk) {
    constexpr index_t N = decltype(nk)::value;
    const T* const* a = ahead != nullptr ? ahead + j : nullptr;
    for (index_t i = 0; i < full_r; i += MR) {
      if (i == 0 && a != nullptr)
        dot_block<Acc, Arch, T, MR, N, true>(q, ldq, k + j, d, s + j, lds, a);
      else
        dot_block<Acc, Arch, T, MR, N, false>(q + i * ldq, ldq, k + j, d, s + i * lds + j, lds, nullptr);
    }
    with_count<MR - 1>(rows - full_r, [&](auto mr) {
      constexpr index_t R = decltype(mr)::value;
      const Acc* qr = q + full_r * ldq;
      Acc* sr = s + full_r * lds + j;
      if (full_r == 0 && a != nullptr)
        dot_block<Acc, Arch, T, R, N, true>(qr, ldq, k + j, d, sr, lds, a);
      else
        dot_block<Acc, Arch, T, R, N, false>(qr, ldq, k + j, d, sr, lds, nullptr);
    });
  };
  for (index_t j = 0; j < full_k; j += NK) rows_block(j, std::integral_constant<index_t, NK>{});
  with_count<NK - 1>(keys - full_k, [&](auto nk) { rows_block(full_k, nk); });
}

/// One MR × (NV·W) block of acc += P·V with V read in place (no rescale: the caller applied α already).
///   p: MR rows of P, row stride ldp;                      shape MR × keys
///   v: pointers to the value rows (storage type T); the block reads columns [c, c + NV·W) of each
///   acc: in/out, row stride lda, at column c;             shape MR × (NV·W)
///   ahead: with `Ahead`, rows whose lines at the same columns are requested as each V row's are loaded
template <class Acc, class Arch, class T, index_t MR, index_t NV, bool Ahead>
FUSEDATTN_NOINLINE void pv_block_in_place(const Acc* p, index_t ldp, const T* const* v, index_t c, index_t keys,
                                          Acc* acc, index_t lda, const T* const* ahead) {
  using V = simd<Acc, Arch>;
  using vec = typename V::type;
  constexpr index_t W = V::width;
  vec o[MR][NV];
  FUSEDATTN_UNROLL for (index_t r = 0; r < MR; ++r)
    FUSEDATTN_UNROLL for (index_t n = 0; n < NV; ++n) o[r][n] = V::load(acc + r * lda + n * W);
  for (index_t j = 0; j < keys; ++j) {
    const T* vr = v[j] + c;
    vec v_j[NV];
    FUSEDATTN_UNROLL for (index_t n = 0; n < NV; ++n) {
      v_j[n] = load_as<Acc, Arch>(vr + n * W);
      pin_register(v_j[n]);
      if constexpr (Ahead)
        if (((c + n * W) * index_t(sizeof(T))) % 64 == 0) request_line(ahead[j] + c + n * W);  // once a line
    }
    FUSEDATTN_UNROLL for (index_t r = 0; r < MR; ++r) {
      const vec p_rj = V::broadcast(p[r * ldp + j]);
      FUSEDATTN_UNROLL for (index_t n = 0; n < NV; ++n) o[r][n] = V::fma(p_rj, v_j[n], o[r][n]);
    }
  }
  FUSEDATTN_UNROLL for (index_t r = 0; r < MR; ++r)
    FUSEDATTN_UNROLL for (index_t n = 0; n < NV; ++n) V::store(acc + r * lda + n * W, o[r][n]);
}

/// acc (rows × d) += P (rows × keys) · V (keys × d) with V read in place, key j's row at v[j]. Up to
/// decode_shape::pv_small_rows rows: one row block, column chunks of pv_nv vectors; more rows: blocks of pv_mr rows
/// (the last rows % pv_mr as one smaller block), chunks of pv_nr vectors; then single vectors, and the last d % W
/// columns one value at a time. Each output column sums its keys in ascending order whatever the blocking. `ahead`:
/// null, or a row for each key whose lines the first row block requests (as dot_tile).
template <class Acc, class Arch, class T>
inline void pv_tile_in_place(const Acc* p, index_t ldp, const T* const* v, index_t keys, index_t d, Acc* acc,
                             index_t lda, index_t rows, const T* const* ahead = nullptr) {
  using shape = kernel_shape<Acc, Arch>;
  using dshape = decode_shape<Acc, Arch>;
  constexpr index_t W = shape::width;
  const index_t dv = d / W * W;
  auto columns = [&](auto mr_max, auto nv_max) {
    constexpr index_t MR = decltype(mr_max)::value, NV = decltype(nv_max)::value;
    const index_t full_r = rows / MR * MR;
    auto chunk = [&](index_t c, auto nv) {
      constexpr index_t N = decltype(nv)::value;
      for (index_t i = 0; i < full_r; i += MR) {
        if (i == 0 && ahead != nullptr)
          pv_block_in_place<Acc, Arch, T, MR, N, true>(p, ldp, v, c, keys, acc + c, lda, ahead);
        else
          pv_block_in_place<Acc, Arch, T, MR, N, false>(p + i * ldp, ldp, v, c, keys, acc + i * lda + c, lda,
                                                        nullptr);
      }
      with_count<MR - 1>(rows - full_r, [&](auto mr) {
        constexpr index_t R = decltype(mr)::value;
        const Acc* pr = p + full_r * ldp;
        Acc* ar = acc + full_r * lda + c;
        if (full_r == 0 && ahead != nullptr)
          pv_block_in_place<Acc, Arch, T, R, N, true>(pr, ldp, v, c, keys, ar, lda, ahead);
        else
          pv_block_in_place<Acc, Arch, T, R, N, false>(pr, ldp, v, c, keys, ar, lda, nullptr);
      });
    };
    index_t c = 0;
    for (; c + NV * W <= dv; c += NV * W) chunk(c, std::integral_constant<index_t, NV>{});
    for (; c < dv; c += W) chunk(c, std::integral_constant<index_t, 1>{});
  };
  if (rows <= dshape::pv_small_rows)
    columns(std::integral_constant<index_t, dshape::pv_small_rows>{},
            std::integral_constant<index_t, dshape::pv_nv>{});
  else
    columns(std::integral_constant<index_t, shape::pv_mr>{}, std::integral_constant<index_t, shape::pv_nr>{});
  for (index_t c = dv; c < d; ++c)
    for (index_t r = 0; r < rows; ++r) {
      Acc x = acc[r * lda + c];
      for (index_t j = 0; j < keys; ++j) x = tail_mul_add(p[r * ldp + j], static_cast<Acc>(v[j][c]), x);
      acc[r * lda + c] = x;
    }
}

}  // namespace cpu
}  // namespace fusedattn
