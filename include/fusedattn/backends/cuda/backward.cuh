/// @file backward.cuh
/// The backward pass of attention on tensor cores (sm_80 and newer, mma.sync m16n8k16, f32 accumulation) for f16
/// and bf16: dQ, dK, dV by recomputation, FlashAttention-2 style, every band mask and block-sparse layouts, GQA/MQA.
/// On an sm_90a device at head_dim 64 and 128 the same steps run as wgmma kernels (backward_hopper.cuh, included at
/// the end of this file); other calls take the mma.sync kernels below. Included by dispatch/backward.hpp when
/// FUSEDATTN_WITH_CUDA is 1 (nvcc only).
///
/// Three kernels on the call's stream, no atomics (results are bitwise the same on every run):
///   1. backward_delta_kernel: δ_i = Σ_c dO[i][c]·O[i][c] per query row (f32 scratch; 0 for a row that saw no key).
///   2. backward_dkdv_kernel: one block per (kv tile, kv head, batch); each warp owns 16 keys and keeps their dK and
///      dV in registers while the block walks the query heads of the group and, per head, the q tiles that see the
///      kv tile (the column walk: mask.q_range, mask.sees), Q, dO, lse and δ of the next q tile streaming in during
///      the current one. Per q tile, with the scores kept transposed (keys are the mma rows):
///        Sᵀ = K·Qᵀ,  Pᵀ = 2^(scale·log2e·Sᵀ − lse·log2e),  dV += Pᵀ·dO,  dPᵀ = V·dOᵀ,  dSᵀ = Pᵀ∘(dPᵀ − δ),  dK += dSᵀ·Q
///      and dK·scale, dV are stored once, summed over the group in ascending head order.
///   3. backward_dq_kernel: one block per (q tile, head, batch), the forward's walk over the mask's key tiles (two
///      K/V buffers); per tile S = Q·Kᵀ, P, dP = dO·Vᵀ, dS = P∘(dP − δ), dQ += dS·K, and dQ·scale is stored once.
/// dQ by a kernel of its own recomputes S and dP once more (7 GEMMs of the head's size instead of 5), in exchange
/// for no f32 scratch of dQ and no ordered or atomic accumulation across kv tiles. With policy::cuda::deterministic
/// false the Hopper path takes the other side of that trade (backward_hopper.cuh: dQ added by atomics).
/// Score modifiers run in the kernels' second instantiation (`Mods`): the recomputed scores become S' (softcap, then
/// the ALiBi bias, before the mask), P = 2^(scale·log2e·S' − lse·log2e) with the forward's lse (which counts the
/// sink), and dS takes softcap's chain-rule factor 1 − tanh²; a fourth kernel, backward_sink_kernel, writes
/// d sink_h = −Σ_{b,i} e^(sink_h − lse_{b,h,i})·δ_{b,h,i} when sinks.grad is set.
#pragma once

#if !defined(__CUDACC__)
#error "fusedattn's CUDA backend must be compiled by nvcc (a .cu file)"
#endif

#include <cstdint>
#include <string>
#include <type_traits>

#include <cuda_runtime.h>

#include "../../core/problem.hpp"
#include "../../core/status.hpp"
#include "../../core/tensor.hpp"
#include "../../dispatch/policy.hpp"
#include "../../kernels/block_sparse.hpp"
#include "../../kernels/mask.hpp"
#include "../../kernels/modifiers.hpp"
#include "attend_cuda.cuh"
#include "device_layout.cuh"
#include "device_types.cuh"
#include "error.cuh"
#include "flash.cuh"
#include "head_mask.cuh"
#include "mma.cuh"
#include "scratch.cuh"

namespace fusedattn {
namespace cuda_backend {

/// Everything the backward kernels need, by value. Strides in elements; `Mask` is band_mask or a block_sparse_mask
/// whose arrays are in device memory.
template <class Mask>
struct backward_params_t {
  const void* q;
  const void* k;
  const void* v;
  const void* o;
  const void* d_o;
  const float* lse;  ///< [b][h][i], natural log; −inf: the row saw no key
  void* dq;
  void* dk;
  void* dv;
  strides4 q_stride, k_stride, v_stride, o_stride, do_stride, dq_stride, dk_stride, dv_stride;
  int batch, heads, heads_kv, group, seq_q, seq_kv, head_dim;
  float scale;       ///< softmax scale
  float scale_log2;  ///< softmax scale · log2(e)
  float* delta;      ///< [b][h][i] scratch: δ (backward_delta_kernel)
  Mask mask;
  float* dq_accum;   ///< [b][h][i][c] f32 scratch of the atomic-dQ Hopper path, else nullptr
};

/// Query row i of head h, batch b, as every backward kernel reads it: lse·log2e (+inf for a row that saw no key or
/// lies past seq_q, so that its P is 0) and δ (0 there).
template <class Mask>
__device__ __forceinline__ void row_lse_delta(const backward_params_t<Mask>& p, int b, int h, int i, float& lse2,
                                              float& dlt) {
  const index_t row = (index_t(b) * p.heads + h) * p.seq_q + i;
  const float l = i < p.seq_q ? p.lse[row] : -INFINITY;
  lse2 = l == -INFINITY ? INFINITY : l * float(fusedattn::log2e);
  dlt = l == -INFINITY ? 0.f : p.delta[row];
}

/// Tile shape of the backward kernels for a tile width `HeadDim` (a multiple of 32; a narrower head_dim that is a
/// multiple of 8 runs the next wider tile with the columns past it read as zeros and not stored). 4 warps; the
/// dK/dV kernel: 64 keys a block (16 a warp), q tiles of 64 rows (two buffers of Q, dO, lse and δ); the dQ kernel:
/// 64 query rows a block (16 a warp), key tiles of 64 (two K/V buffers). At head_dim 128 either kernel takes
/// 97 KB of shared memory (under the 99 KB a block gets on sm_86 / sm_89; two blocks per multiprocessor on sm_90).
template <int HeadDim>
struct backward_tile {
  static constexpr int head_dim = HeadDim;
  static constexpr int chunks = HeadDim / 8;  ///< 16-byte chunks per row
  static constexpr int warps = 4;
  static constexpr int threads = 32 * warps;
  static constexpr int block_kv = 16 * warps;  ///< keys a dK/dV block owns; keys per tile of the dQ kernel
  static constexpr int block_q = 64;           ///< q rows per tile of the dK/dV kernel; rows a dQ block owns
  static_assert(block_q == 16 * warps, "the dQ kernel's warps own 16 rows each");
  /// K, V; Q, dO twice; lse·log2e and δ twice.
  static constexpr int dkdv_smem = (2 * block_kv + 4 * block_q) * HeadDim * 2 + 4 * block_q * int(sizeof(float));
  /// Q, dO; K, V twice.
  static constexpr int dq_smem = (2 * block_q + 4 * block_kv) * HeadDim * 2;
  static_assert(HeadDim % 32 == 0, "the swizzle needs rows of a multiple of four 16-byte chunks");
};

/// The tile widths the backward kernels have, ascending.
inline constexpr int backward_max_head_dim = 128;
inline constexpr const char* backward_head_dims_text = "every multiple of 8 up to 128";

/// `f(backward_tile<W>{})` for the narrowest W in {32, 64, 96, 128} at least head_dim, or `otherwise` when head_dim
/// is not a multiple of 8 in [8, 128].
template <class R, class F>
R with_backward_tile(index_t head_dim, R otherwise, F&& f) {
  if (head_dim < 8 || head_dim % 8 != 0 || head_dim > backward_max_head_dim) return otherwise;
  if (head_dim <= 32) return f(backward_tile<32>{});
  if (head_dim <= 64) return f(backward_tile<64>{});
  if (head_dim <= 96) return f(backward_tile<96>{});
  return f(backward_tile<128>{});
}

/// δ of each query row: 16 threads a row, eight columns each (one 16-byte load of O and one of dO: head_dim is at
/// most 128 and rows are 16-byte aligned, backward_applies), sixteen rows a block; the threads' sums are reduced in
/// a fixed order. A row that saw no key (lse = −inf) gets δ = 0, so that its P = 0 gives dS = 0 whatever its O holds.
template <class E, class Mask>
__global__ void __launch_bounds__(256) backward_delta_kernel(const backward_params_t<Mask> p) {
  const index_t rows = index_t(p.batch) * p.heads * p.seq_q;
  const index_t r = index_t(blockIdx.x) * 16 + threadIdx.x / 16;
  const int c = (threadIdx.x % 16) * 8;
  float sum = 0.f;
  if (r < rows && c < p.head_dim) {
    const index_t i = r % p.seq_q, h = (r / p.seq_q) % p.heads, b = r / (index_t(p.seq_q) * p.heads);
    const uint4 o = *reinterpret_cast<const uint4*>(static_cast<const E*>(p.o) + b * p.o_stride.b +
                                                    h * p.o_stride.h + i * p.o_stride.s + c);
    const uint4 d = *reinterpret_cast<const uint4*>(static_cast<const E*>(p.d_o) + b * p.do_stride.b +
                                                    h * p.do_stride.h + i * p.do_stride.s + c);
    const E* oe = reinterpret_cast<const E*>(&o);
    const E* de = reinterpret_cast<const E*>(&d);
#pragma unroll
    for (int e = 0; e < 8; ++e) sum = fmaf(widen(oe[e]), widen(de[e]), sum);
  }
#pragma unroll
  for (int x = 8; x > 0; x /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, x);
  if (r < rows && threadIdx.x % 16 == 0) p.delta[r] = p.lse[r] == -INFINITY ? 0.f : sum;
}

/// The column walk of one dK/dV block: the (query head, q tile) pairs whose tile of `BM` rows sees keys
/// [k0, k1) of kv head h_kv, query heads ascending, q tiles ascending (core/mask_walk.hpp's q_tile_walk per head).
template <class Mask, int BM>
struct column_walk {
  const backward_params_t<Mask>& p;
  int b, h, h_end;
  q_tile_walk<uniform_q_tiles> tiles;
  __device__ __forceinline__ column_walk(const backward_params_t<Mask>& params, int batch, int h_kv, int key0,
                                         int key1)
      : p(params), b(batch), h(h_kv * params.group), h_end((h_kv + 1) * params.group),
        tiles(head_mask(params.mask, batch, h), uniform_q_tiles{BM, params.seq_q}, key0, key1) {}
  /// The next pair (head, first row of the q tile); false when the walk is over.
  __device__ __forceinline__ bool next(int& head, int& q0) {
    for (;;) {
      kv_span rows;
      if (tiles.next(head_mask(p.mask, b, h), rows)) {
        head = h;
        q0 = int(rows.begin);
        return true;
      }
      if (++h >= h_end) return false;
      tiles = q_tile_walk<uniform_q_tiles>(head_mask(p.mask, b, h), tiles.tiles, tiles.k0, tiles.k1);
    }
  }
};

/// Whether key j of a q tile starting at row q0 lies in a block the mask lists (mask.block_listed; a band lists all).
template <class Mask>
__device__ __forceinline__ bool key_listed(const Mask& m, int q0, int j) {
  return m.block_listed(q0, j);
}

/// Stores a thread's part of a 16-row accumulator tile (rows `row0` + g and + 8, columns 2t, 2t + 1 of each 8-wide
/// tile) times `factor` to rows [.., rows) and columns [.., cols) of `out` (row stride `stride`).
template <class E, int D>
__device__ __forceinline__ void store_rows(E* out, index_t stride, const float (&acc)[D / 8][4], int row0, int rows,
                                           int cols, float factor, int g, int t) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + g + 8 * r;
    if (row >= rows) continue;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      const int c = n * 8 + 2 * t;
      if (c < cols)
        *reinterpret_cast<std::uint32_t*>(out + row * stride + c) =
            mma_type<E>::pack(acc[n][2 * r] * factor, acc[n][2 * r + 1] * factor);
    }
  }
}

/// c (16 × N per warp, N/8 accumulator tiles) += A (16 rows of a swizzled [row][D] tile from row `a_row`) · Bᵀ,
/// B the rows [0, N) of a swizzled [row][D] tile: the product of two row-major tiles over their D columns.
template <class E, int D, int N>
__device__ __forceinline__ void mma_abt(float (&c)[N / 8][4], const E* a_tile, int a_row, const E* b_tile, int lane) {
  constexpr int CH = D / 8;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    std::uint32_t a[4];
    ldmatrix_x4(a, a_tile + swizzle<CH>(a_row + lane % 16, kk * 2 + lane / 16));
#pragma unroll
    for (int np = 0; np < N / 16; ++np) {
      std::uint32_t bf[4];
      ldmatrix_x4(bf, b_tile + swizzle<CH>(np * 16 + lane % 8 + (lane / 16) * 8, kk * 2 + (lane / 8) % 2));
      mma_16816<E>(c[2 * np], a, bf[0], bf[1]);
      mma_16816<E>(c[2 * np + 1], a, bf[2], bf[3]);
    }
  }
}

/// c (16 × D) += A (16 × K, packed 16-bit fragments from accumulators: pk[n][r] holds row g + 8r, columns 2t, 2t + 1
/// of the n-th 8-wide tile) · B (rows [0, K) of a swizzled [K][D] tile).
template <class E, int D, int K>
__device__ __forceinline__ void mma_packed_b(float (&c)[D / 8][4], const std::uint32_t (&pk)[K / 8][2],
                                             const E* b_tile, int lane) {
  constexpr int CH = D / 8;
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk) {
    const std::uint32_t a[4] = {pk[2 * kk][0], pk[2 * kk][1], pk[2 * kk + 1][0], pk[2 * kk + 1][1]};
#pragma unroll
    for (int dp = 0; dp < D / 16; ++dp) {
      std::uint32_t bf[4];
      ldmatrix_x4_trans(bf, b_tile + swizzle<CH>(kk * 16 + lane % 8 + ((lane / 8) % 2) * 8, dp * 2 + lane / 16));
      mma_16816<E>(c[2 * dp], a, bf[0], bf[1]);
      mma_16816<E>(c[2 * dp + 1], a, bf[2], bf[3]);
    }
  }
}

template <int N>
__device__ __forceinline__ void zero_acc(float (&c)[N][4]) {
#pragma unroll
  for (int n = 0; n < N; ++n) c[n][0] = c[n][1] = c[n][2] = c[n][3] = 0.f;
}

/// dK and dV of one kv tile: see the file comment (2.).
/// The score modifiers of one head in the backward kernels: flash.cuh's tile_mods split into its softcap part and
/// its ALiBi part, so that the recomputed S' = bias(cap(S)) keeps cap(S) for softcap's chain-rule factor.
struct backward_mods {
  tile_mods cap, bias;
  backward_mods() = default;
  __device__ __forceinline__ explicit backward_mods(const tile_mods& m) : cap(m), bias(m) {
    cap.biased = false;
    bias.capped = false;
  }
  /// Rewrites the raw score s of row i, key j to S' and returns d S' / d S = 1 − (cap(S) / cap_out)² (1 without
  /// softcap).
  __device__ __forceinline__ float apply(float& s, int i, int j) const {
    const float c = cap.apply(s, i, j);
    s = bias.apply(c, i, j);
    if (!cap.capped) return 1.f;
    const float r = c / cap.cap_out;
    return 1.f - r * r;
  }
};

/// d sink_h = −Σ_{b,i} e^(sink_h − lse_{b,h,i})·δ_{b,h,i} into mods.sink_grad[h]: one block of 256 threads per head,
/// a fixed summation order (bitwise the same on every run); rows that saw no key (δ = 0) add nothing.
template <class Mask>
__global__ void __launch_bounds__(256) backward_sink_kernel(const backward_params_t<Mask> p, const bound_mods mods) {
  __shared__ float red[256];
  const int h = blockIdx.x;
  const float sink = mods.sink<float>(h);
  float sum = 0.f;
  const index_t rows = index_t(p.batch) * p.seq_q;
  for (index_t e = threadIdx.x; e < rows; e += 256) {
    const index_t b = e / p.seq_q, i = e % p.seq_q;
    const index_t row = (b * p.heads + h) * p.seq_q + i;
    const float l = p.lse[row];
    if (l != -INFINITY) sum = fmaf(expf(sink - l), p.delta[row], sum);
  }
  red[threadIdx.x] = sum;
  __syncthreads();
  for (int w = 128; w > 0; w >>= 1) {
    if (int(threadIdx.x) < w) red[threadIdx.x] += red[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) mods.sink_grad[h] = 0.f - red[0];
}

/// The element-wise steps of the dK/dV kernels (mma.sync and wgmma) on a transposed score tile Sᵀ: this thread's
/// keys k0 + kw + g + 8r (e / 2 = r; kw: the warp's first key in the block's tile) and rows q0 + 8n + 2t + (e & 1) (the m16n8 accumulator layout). With `Mods` the
/// score modifiers rewrite Sᵀ and `cg` gets softcap's chain-rule factor; where `partial`, entries the mask forbids
/// become −inf; then Pᵀ = 2^(scale·log2e·Sᵀ − lse·log2e) in place (`lse_t`: the q tile's lse·log2e, +inf for a row
/// without keys: P = 0), packed to `pk` (the A fragments of dV += Pᵀ·dO).
template <class E, class Mask, bool Mods, int BM>
__device__ __forceinline__ void transposed_probs(float (&s)[BM / 8][4], float (&cg)[BM / 8][4],
                                                 std::uint32_t (&pk)[BM / 8][2], const backward_params_t<Mask>& p,
                                                 const Mask& mask, int h, int q0, int k0, int kw, bool partial,
                                                 const float* lse_t, int g, int t) {
  constexpr bool band = mask_traits<Mask>::one_segment;  // one key segment, no listed blocks
  if constexpr (Mods) {
    const backward_mods bm(make_tile_mods<true>(mask, h, p.scale_log2));
#pragma unroll
    for (int n = 0; n < BM / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        cg[n][e] = bm.apply(s[n][e], q0 + n * 8 + 2 * t + (e & 1), k0 + kw + g + 8 * (e / 2));
  }
  if (partial) {
    const band32 rule = element_rule(mask);
    bool listed[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) listed[r] = key_listed(mask, q0, k0 + kw + g + 8 * r);
#pragma unroll
    for (int n = 0; n < BM / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = q0 + n * 8 + 2 * t + (e & 1), j = k0 + kw + g + 8 * (e / 2);
        if (!(rule.allowed(i, j) && (band || listed[e / 2]))) s[n][e] = -INFINITY;
      }
  }
#pragma unroll
  for (int n = 0; n < BM / 8; ++n) {
    const float l0 = lse_t[n * 8 + 2 * t], l1 = lse_t[n * 8 + 2 * t + 1];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      s[n][2 * r] = fast_exp2(fmaf(s[n][2 * r], p.scale_log2, -l0));
      s[n][2 * r + 1] = fast_exp2(fmaf(s[n][2 * r + 1], p.scale_log2, -l1));
      pk[n][r] = mma_type<E>::pack(s[n][2 * r], s[n][2 * r + 1]);
    }
  }
}

/// dSᵀ = Pᵀ∘(dPᵀ − δ) (times softcap's factor `cg` with `Mods`) on the layout of transposed_probs, packed to `pd`
/// (the A fragments of dK += dSᵀ·Q); `delta_t`: the q tile's δ.
template <class E, bool Mods, int BM>
__device__ __forceinline__ void transposed_dscores(const float (&s)[BM / 8][4], const float (&dp)[BM / 8][4],
                                                   const float (&cg)[BM / 8][4], const float* delta_t,
                                                   std::uint32_t (&pd)[BM / 8][2], int t) {
#pragma unroll
  for (int n = 0; n < BM / 8; ++n) {
    const float d0 = delta_t[n * 8 + 2 * t], d1 = delta_t[n * 8 + 2 * t + 1];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float x0 = s[n][2 * r] * (dp[n][2 * r] - d0), x1 = s[n][2 * r + 1] * (dp[n][2 * r + 1] - d1);
      if constexpr (Mods) x0 *= cg[n][2 * r], x1 *= cg[n][2 * r + 1];
      pd[n][r] = mma_type<E>::pack(x0, x1);
    }
  }
}

/// The element-wise steps of the dQ kernels (mma.sync and wgmma) on a score tile S of the warp's rows [w0, w1)
/// (this thread's rows w0 + g + 8·(e / 2), keys k0 + 8n + 2t + (e & 1)): with `Mods` the modifiers (`bm`) rewrite S
/// and `cg` gets softcap's factor; entries the mask forbids (on tiles the rule calls partial, or past the
/// block-sparse run [tile_begin, tile_end)) become −inf; then P = 2^(scale·log2e·S − lse·log2e) in place (`lse2`:
/// this thread's two rows).
template <class Mask, bool Mods, int BN>
__device__ __forceinline__ void row_probs(float (&s)[BN / 8][4], float (&cg)[BN / 8][4],
                                          const backward_params_t<Mask>& p, const backward_mods& bm,
                                          const band32& rule, int w0, int w1, int k0, int tile_begin, int tile_end,
                                          const float (&lse2)[2], int g, int t) {
  constexpr bool band = mask_traits<Mask>::one_segment;  // one key segment, no listed blocks
  if constexpr (Mods) {
#pragma unroll
    for (int n = 0; n < BN / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) cg[n][e] = bm.apply(s[n][e], w0 + g + 8 * (e / 2), k0 + n * 8 + 2 * t + (e & 1));
  }
  const bool past_edge = !band && (k0 < tile_begin || k0 + BN > tile_end);
  if (w0 < w1 && (past_edge || rule.is_partial(w0, w1, k0, k0 + BN))) {
#pragma unroll
    for (int n = 0; n < BN / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = w0 + g + 8 * (e / 2), j = k0 + n * 8 + 2 * t + (e & 1);
        bool ok = rule.allowed(i, j);
        if constexpr (!band) ok = ok && j >= tile_begin && j < tile_end;
        if (!ok) s[n][e] = -INFINITY;
      }
  }
#pragma unroll
  for (int n = 0; n < BN / 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[n][e] = fast_exp2(fmaf(s[n][e], p.scale_log2, -lse2[e / 2]));
}

/// dS = P∘(dP − δ) (times `cg` with `Mods`) on the layout of row_probs, packed to `pk` (the A fragments of
/// dQ += dS·K); `dlt`: this thread's two rows' δ.
template <class E, bool Mods, int BN>
__device__ __forceinline__ void row_dscores(const float (&s)[BN / 8][4], const float (&dp)[BN / 8][4],
                                            const float (&cg)[BN / 8][4], const float (&dlt)[2],
                                            std::uint32_t (&pk)[BN / 8][2]) {
#pragma unroll
  for (int n = 0; n < BN / 8; ++n)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float x0 = s[n][2 * r] * (dp[n][2 * r] - dlt[r]), x1 = s[n][2 * r + 1] * (dp[n][2 * r + 1] - dlt[r]);
      if constexpr (Mods) x0 *= cg[n][2 * r], x1 *= cg[n][2 * r + 1];
      pk[n][r] = mma_type<E>::pack(x0, x1);
    }
}

template <class E, class Tile, class Mask, bool Mods = false>
__global__ void __launch_bounds__(Tile::threads) backward_dkdv_kernel(const backward_params_t<Mask> p) {
  constexpr int D = Tile::head_dim, BN = Tile::block_kv, BM = Tile::block_q;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  E* sk = reinterpret_cast<E*>(smem_raw);            // [BN][D] swizzled
  E* sv = sk + BN * D;                               // [BN][D]
  E* sq = sv + BN * D;                               // [2][BM][D]
  E* sdo = sq + 2 * BM * D;                          // [2][BM][D]
  float* s_lse = reinterpret_cast<float*>(sdo + 2 * BM * D);  // [2][BM]: lse·log2e, +inf for rows without keys
  float* s_delta = s_lse + 2 * BM;                            // [2][BM]

  const int h_kv = blockIdx.y, b = blockIdx.z;
  const int k0 = blockIdx.x * BN, k1 = k0 + BN < p.seq_kv ? k0 + BN : p.seq_kv;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int kw = warp * 16;  // the warp's first key in the tile
  const int cols_ch = p.head_dim / 8;
  const E* k_head = static_cast<const E*>(p.k) + b * p.k_stride.b + h_kv * p.k_stride.h;
  const E* v_head = static_cast<const E*>(p.v) + b * p.v_stride.b + h_kv * p.v_stride.h;
  load_tile<Tile, BN>(sk, k_head + k0 * p.k_stride.s, p.k_stride.s, k1 - k0, cols_ch);
  load_tile<Tile, BN>(sv, v_head + k0 * p.v_stride.s, p.v_stride.s, k1 - k0, cols_ch);

  // Q, dO (cp.async) and the rows' lse·log2e and δ (plain stores, seen after the next barrier) of one q tile.
  const auto load_q_tile = [&](int stage, int h, int q0) {
    const int rows = q0 + BM < p.seq_q ? BM : p.seq_q - q0;
    load_tile<Tile, BM>(sq + stage * BM * D,
                    static_cast<const E*>(p.q) + b * p.q_stride.b + h * p.q_stride.h + q0 * p.q_stride.s,
                    p.q_stride.s, rows, cols_ch);
    load_tile<Tile, BM>(sdo + stage * BM * D,
                    static_cast<const E*>(p.d_o) + b * p.do_stride.b + h * p.do_stride.h + q0 * p.do_stride.s,
                    p.do_stride.s, rows, cols_ch);
    for (int r = threadIdx.x; r < BM; r += Tile::threads)
      row_lse_delta(p, b, h, q0 + r, s_lse[stage * BM + r], s_delta[stage * BM + r]);
  };

  column_walk<Mask, BM> walk(p, b, h_kv, k0, k1);
  int h = 0, q0 = 0;
  bool have = walk.next(h, q0);
  if (have) load_q_tile(0, h, q0);
  cp_async_commit();

  float dk[D / 8][4], dv[D / 8][4];
  zero_acc(dk);
  zero_acc(dv);
  for (int stage = 0; have; stage ^= 1) {
    int h_next = 0, q_next = 0;
    const bool have_next = walk.next(h_next, q_next);
    cp_async_wait<0>();
    __syncthreads();  // this stage landed; every warp is done with the other one
    if (have_next) {
      load_q_tile(stage ^ 1, h_next, q_next);
      cp_async_commit();
    }
    const E* sq_t = sq + stage * BM * D;
    const E* sdo_t = sdo + stage * BM * D;
    const float* lse_t = s_lse + stage * BM;
    const float* delta_t = s_delta + stage * BM;
    const Mask mask = head_mask(p.mask, b, h);
    const int q1 = q0 + BM < p.seq_q ? q0 + BM : p.seq_q;
    const bool partial = mask.is_partial(q0, q1, k0, k1);

    // Sᵀ (16 keys × BM rows) = K·Qᵀ; then Pᵀ in place (masked entries and rows without keys exactly 0).
    float s[BM / 8][4];
    zero_acc(s);
    mma_abt<E, D, BM>(s, sk, kw, sq_t, lane);
    [[maybe_unused]] float cg[BM / 8][4];  // softcap's chain-rule factor (Mods)
    std::uint32_t pk[BM / 8][2];
    transposed_probs<E, Mask, Mods, BM>(s, cg, pk, p, mask, h, q0, k0, kw, partial, lse_t, g, t);
    // dV (16 keys × D) += Pᵀ·dO.
    mma_packed_b<E, D, BM>(dv, pk, sdo_t, lane);
    // dPᵀ = V·dOᵀ; dSᵀ = Pᵀ∘(dPᵀ − δ), packed over Pᵀ's fragments.
    {
      float dp[BM / 8][4];
      zero_acc(dp);
      mma_abt<E, D, BM>(dp, sv, kw, sdo_t, lane);
      transposed_dscores<E, Mods, BM>(s, dp, cg, delta_t, pk, t);
    }
    // dK (16 keys × D) += dSᵀ·Q.
    mma_packed_b<E, D, BM>(dk, pk, sq_t, lane);
    h = h_next;
    q0 = q_next;
    have = have_next;
  }
  cp_async_wait<0>();  // a block whose walk is empty still has its K/V copies in flight

  E* dk_head = static_cast<E*>(p.dk) + b * p.dk_stride.b + h_kv * p.dk_stride.h + index_t(k0) * p.dk_stride.s;
  E* dv_head = static_cast<E*>(p.dv) + b * p.dv_stride.b + h_kv * p.dv_stride.h + index_t(k0) * p.dv_stride.s;
  store_rows<E, D>(dk_head, p.dk_stride.s, dk, kw, k1 - k0, p.head_dim, p.scale, g, t);
  store_rows<E, D>(dv_head, p.dv_stride.s, dv, kw, k1 - k0, p.head_dim, 1.f, g, t);
}

/// dQ of one q tile: see the file comment (3.).
template <class E, class Tile, class Mask, bool Mods = false>
__global__ void __launch_bounds__(Tile::threads) backward_dq_kernel(const backward_params_t<Mask> p) {
  constexpr int D = Tile::head_dim, BM = Tile::block_q, BN = Tile::block_kv;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  E* sq = reinterpret_cast<E*>(smem_raw);  // [BM][D] swizzled
  E* sdo = sq + BM * D;                    // [BM][D]
  E* sk = sdo + BM * D;                    // [2][BN][D]
  E* sv = sk + 2 * BN * D;                 // [2][BN][D]

  const int m_block = int(gridDim.x) - 1 - int(blockIdx.x), h = blockIdx.y, b = blockIdx.z;
  const int h_kv = h / p.group;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int q0 = m_block * BM, q1 = q0 + BM < p.seq_q ? q0 + BM : p.seq_q;
  const int wr = warp * 16;  // the warp's first row in the tile
  const int w0 = q0 + wr, w1 = w0 + 16 < p.seq_q ? w0 + 16 : p.seq_q;
  const int cols_ch = p.head_dim / 8;
  const E* k_head = static_cast<const E*>(p.k) + b * p.k_stride.b + h_kv * p.k_stride.h;
  const E* v_head = static_cast<const E*>(p.v) + b * p.v_stride.b + h_kv * p.v_stride.h;
  auto rows_left = [](int from, int end, int cap) { return end - from < cap ? end - from : cap; };

  const Mask mask = head_mask(p.mask, b, h);
  [[maybe_unused]] backward_mods bm;
  if constexpr (Mods) bm = backward_mods(make_tile_mods<true>(mask, h, p.scale_log2));
  key_tiles<Mask, BN> tiles(mask, q0, q1);
  const band32 rule = element_rule(mask);
  const int k_first = tiles.first(0, 1);

  load_tile<Tile, BM>(sq, static_cast<const E*>(p.q) + b * p.q_stride.b + h * p.q_stride.h + q0 * p.q_stride.s,
                  p.q_stride.s, q1 - q0, cols_ch);
  load_tile<Tile, BM>(sdo, static_cast<const E*>(p.d_o) + b * p.do_stride.b + h * p.do_stride.h + q0 * p.do_stride.s,
                  p.do_stride.s, q1 - q0, cols_ch);
  if (k_first >= 0) {
    const int rows = rows_left(k_first, p.seq_kv, BN);
    load_tile<Tile, BN>(sk, k_head + k_first * p.k_stride.s, p.k_stride.s, rows, cols_ch);
    load_tile<Tile, BN>(sv, v_head + k_first * p.v_stride.s, p.v_stride.s, rows, cols_ch);
  }
  cp_async_commit();

  // This thread's rows w0 + g and w0 + g + 8: lse·log2e (+inf for a row without keys or past seq_q: P = 0) and δ.
  float lse2[2], dlt[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) row_lse_delta(p, b, h, w0 + g + 8 * r, lse2[r], dlt[r]);
  cp_async_wait<0>();
  __syncthreads();

  float dq[D / 8][4];
  zero_acc(dq);
  for (int k0 = k_first, k_next = -1, stage = 0; k0 >= 0; k0 = k_next, stage ^= 1) {
    const int tile_begin = tiles.seg_begin, tile_end = tiles.seg_end;  // before next() moves on
    const E* sk_t = sk + stage * BN * D;
    const E* sv_t = sv + stage * BN * D;
    k_next = tiles.next(k0);
    if (k_next >= 0) {
      const int rows = rows_left(k_next, p.seq_kv, BN);
      load_tile<Tile, BN>(sk + (stage ^ 1) * BN * D, k_head + k_next * p.k_stride.s, p.k_stride.s, rows, cols_ch);
      load_tile<Tile, BN>(sv + (stage ^ 1) * BN * D, v_head + k_next * p.v_stride.s, p.v_stride.s, rows, cols_ch);
      cp_async_commit();
    }

    // S (16 rows × BN) = Q·Kᵀ; masked entries −inf (tiles past a segment's edge, or cut by the band or seq_kv).
    float s[BN / 8][4];
    zero_acc(s);
    mma_abt<E, D, BN>(s, sq, wr, sk_t, lane);
    [[maybe_unused]] float cg[BN / 8][4];  // softcap's chain-rule factor (Mods)
    row_probs<Mask, Mods, BN>(s, cg, p, bm, rule, w0, w1, k0, tile_begin, tile_end, lse2, g, t);

    // dP = dO·Vᵀ; dS = P∘(dP − δ), packed; dQ += dS·K.
    std::uint32_t pk[BN / 8][2];
    {
      float dp[BN / 8][4];
      zero_acc(dp);
      mma_abt<E, D, BN>(dp, sdo, wr, sv_t, lane);
      row_dscores<E, Mods, BN>(s, dp, cg, dlt, pk);
    }
    mma_packed_b<E, D, BN>(dq, pk, sk_t, lane);
    cp_async_wait<0>();
    __syncthreads();  // the next tile landed; every warp is done with this one's buffers
  }

  E* dq_head = static_cast<E*>(p.dq) + b * p.dq_stride.b + h * p.dq_stride.h + index_t(q0) * p.dq_stride.s;
  store_rows<E, D>(dq_head, p.dq_stride.s, dq, wr, q1 - q0, p.head_dim, p.scale, g, t);
}

/// The backward kernels' limits for a call: errc::unsupported naming what does not fit, else ok.
template <class T>
status backward_applies(const problem& p, const tensor_ref<const T>* const (&in)[5], const tensor_ref<T>* const (&out)[3]) {
  using E = device_t<T>;
  if (!std::is_same_v<E, __half> && !std::is_same_v<E, __nv_bfloat16>)
    return {errc::unsupported,
            std::string("the CUDA backward kernel takes f16 and bf16; this call is ") + scalar_name<T>()};
  if (!with_backward_tile(p.head_dim, false, [](auto) { return true; }))
    return {errc::unsupported, "problem.head_dim is " + std::to_string(p.head_dim) +
                                   "; the CUDA backward kernel takes " + backward_head_dims_text};
  bool aligned = true;
  for (const auto* x : in) aligned = aligned && flash_aligned(*x);
  for (const auto* x : out) aligned = aligned && flash_aligned(*x);
  if (!aligned)
    return {errc::unsupported, "the CUDA backward kernel needs 16-byte aligned data and row/head/batch strides that "
                               "are multiples of 8 elements for q, k, v, o, d_o, dq, dk and dv"};
  if (device_major() < 8) return {errc::unsupported, "the CUDA backward kernel needs compute capability 8.0 or newer"};
  return flash_grid_fits(p);
}

/// A block-sparse layout must keep every 64-row q tile in one q-block row.
inline status backward_fits_mask(const band_mask&) { return {}; }
inline status backward_fits_mask(const block_sparse_mask& m) {
  constexpr int rows = backward_tile<64>::block_q;
  if (m.block_q % rows == 0) return {};
  return {errc::unsupported, "the CUDA backward kernel needs block_sparse's block_q to be a multiple of " +
                                 std::to_string(rows) + " (its q tile); block_q is " + std::to_string(m.block_q)};
}

/// The Hopper (wgmma) dK/dV and dQ kernels for a call at head_dim 64 or 128 on an sm_90a device
/// (backward_hopper.cuh, included at the end of this file): `launched` false when they do not take the call (the
/// mma.sync kernels then run), else the status of their launches. `bp.delta` is filled already; `atomic_dq`
/// (policy::cuda::deterministic = false) takes the atomic-dQ kernel where one exists, its f32 scratch from `arena`.
template <class E, class Mask>
status launch_backward_hopper(const problem& p, const backward_params_t<Mask>& bp, bool mods, bool atomic_dq,
                              scratch_arena& arena, cudaStream_t stream, bool& launched);

/// Launches the three kernels for a validated call whose pointers are device memory and which backward_applies
/// accepted. `mask`: band, or block-sparse with device arrays.
template <class T, class Mask>
status run_backward(const problem& p, const tensor_ref<const T>& q, const tensor_ref<const T>& k,
                    const tensor_ref<const T>& v, const tensor_ref<const T>& o, const tensor_ref<const T>& d_o,
                    const float* lse, const tensor_ref<T>& dq, const tensor_ref<T>& dk, const tensor_ref<T>& dv,
                    const Mask& mask, cudaStream_t stream, bool deterministic = true) {
  using E = device_t<T>;
  if constexpr (std::is_same_v<E, __half> || std::is_same_v<E, __nv_bfloat16>) {
    backward_params_t<Mask> bp{q.data, k.data, v.data, o.data, d_o.data, lse, dq.data, dk.data, dv.data,
                               q.stride, k.stride, v.stride, o.stride, d_o.stride, dq.stride, dk.stride, dv.stride,
                               int(p.batch), int(p.heads), int(p.heads_kv), int(p.group_size()), int(p.seq_q),
                               int(p.seq_kv), int(p.head_dim), static_cast<float>(p.softmax_scale()),
                               static_cast<float>(p.softmax_scale() * log2e), nullptr, mask, nullptr};
    const index_t rows = p.batch * p.heads * p.seq_q;
    const bound_mods mods = mods_of(mask);
    scratch_arena arena(stream);
    if (rows > 0) {
      if (status st = arena.allocate(bp.delta, rows, "backward: delta rows"); !st) return st;
      backward_delta_kernel<E, Mask><<<unsigned((rows + 15) / 16), 256, 0, stream>>>(bp);
      if (status st = last_launch("backward_delta_kernel"); !st) return st;
    }
    const auto sink_grad = [&]() -> status {
      if (mods.sink_logits == nullptr || mods.sink_grad == nullptr) return {};
      backward_sink_kernel<Mask><<<unsigned(p.heads), 256, 0, stream>>>(bp, mods);
      return last_launch("backward_sink_kernel");
    };
    bool hopper = false;
    if (status st = launch_backward_hopper<E>(p, bp, mods.changes_scores(), !deterministic, arena, stream, hopper);
        !st)
      return st;
    if (hopper) return sink_grad();
    const status no_tile{errc::unsupported, "problem.head_dim: the CUDA backward kernel has no tile for it"};
    return with_backward_tile(p.head_dim, no_tile, [&](auto tile) -> status {
      using Tile = decltype(tile);
      // One block per kv tile (dK, dV), then one per q tile (dQ), each on its dynamic shared memory.
      const auto launch = [&](auto kernel, int smem, index_t rows, int tile_rows, int heads,
                              const char* name) -> status {
        if (rows == 0) return {};
        const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
        if (e != cudaSuccess) return from_cuda(e, ("cudaFuncSetAttribute(" + std::string(name) + ")").c_str());
        const dim3 grid(unsigned((rows + tile_rows - 1) / tile_rows), unsigned(heads), unsigned(p.batch));
        kernel<<<grid, Tile::threads, smem, stream>>>(bp);
        return last_launch(name);
      };
      const auto kernels = [&](auto mods_on) -> status {
        constexpr bool Mods = decltype(mods_on)::value;
        if (status st = launch(backward_dkdv_kernel<E, Tile, Mask, Mods>, Tile::dkdv_smem, p.seq_kv, Tile::block_kv,
                               int(p.heads_kv), "backward_dkdv_kernel");
            !st)
          return st;
        return launch(backward_dq_kernel<E, Tile, Mask, Mods>, Tile::dq_smem, p.seq_q, Tile::block_q, int(p.heads),
                      "backward_dq_kernel");
      };
      if (status st = mods.changes_scores() ? kernels(std::true_type{}) : kernels(std::false_type{}); !st) return st;
      return sink_grad();
    });
  } else {
    return {errc::unsupported,
            std::string("the CUDA backward kernel takes f16 and bf16; this call is ") + scalar_name<T>()};
  }
}

/// policy::cuda's backward after validation: refusals (device pointers, the modifiers' arrays included, types,
/// head_dim, alignment, block-sparse geometry), then the launch on the policy's stream. Nothing is launched for a zero
/// batch or heads.
template <class T, class Mask>
status backward(const policy::cuda& pol, const problem& p, const tensor_ref<const T>& q,
                const tensor_ref<const T>& k, const tensor_ref<const T>& v, const tensor_ref<const T>& o,
                const tensor_ref<const T>& d_o, const float* lse, const tensor_ref<T>& dq, const tensor_ref<T>& dk,
                const tensor_ref<T>& dv, const Mask& mask) {
  const tensor_ref<const T>* const in[5] = {&q, &k, &v, &o, &d_o};
  const tensor_ref<T>* const out[3] = {&dq, &dk, &dv};
  const char* in_name[5] = {"q", "k", "v", "o", "d_o"};
  const char* out_name[3] = {"dq", "dk", "dv"};
  for (int i = 0; i < 5; ++i)
    if (in[i]->data != nullptr)
      if (status st = check_device_pointer(in[i]->data, in_name[i]); !st) return st;
  for (int i = 0; i < 3; ++i)
    if (out[i]->data != nullptr)
      if (status st = check_device_pointer(out[i]->data, out_name[i]); !st) return st;
  if (status st = check_device_pointer(lse, "lse"); !st) return st;
  const bound_mods& mods = mods_of(mask);
  const void* mod_ptrs[3] = {mods.alibi_slopes, mods.sink_logits, mods.sink_grad};
  const char* mod_names[3] = {"alibi.slopes", "sinks.logits", "sinks.grad"};
  for (int i = 0; i < 3; ++i)
    if (mod_ptrs[i] != nullptr)
      if (status st = check_device_pointer(mod_ptrs[i], mod_names[i]); !st) return st;
  if (status st = backward_applies(p, in, out); !st) return st;
  if (status st = backward_fits_mask(mask); !st) return st;
  if (p.batch == 0 || p.heads == 0) return {};
  return run_backward(p, q, k, v, o, d_o, lse, dq, dk, dv, mask, static_cast<cudaStream_t>(pol.stream),
                      pol.deterministic);
}

}  // namespace cuda_backend

namespace detail {

/// policy::cuda, band masks.
template <class T>
status run_backward(const policy::cuda& pol, const problem& p, const tensor_ref<const T>& q,
                    const tensor_ref<const T>& k, const tensor_ref<const T>& v, const tensor_ref<const T>& o,
                    const tensor_ref<const T>& d_o, const float* lse, const tensor_ref<T>& dq,
                    const tensor_ref<T>& dk, const tensor_ref<T>& dv, const band_mask& mask) {
  return cuda_backend::backward(pol, p, q, k, v, o, d_o, lse, dq, dk, dv, mask);
}
/// policy::cuda, block_sparse{layout}: the layout (host arrays) is copied to the device first.
template <class T>
status run_backward(const policy::cuda& pol, const problem& p, const tensor_ref<const T>& q,
                    const tensor_ref<const T>& k, const tensor_ref<const T>& v, const tensor_ref<const T>& o,
                    const tensor_ref<const T>& d_o, const float* lse, const tensor_ref<T>& dq,
                    const tensor_ref<T>& dk, const tensor_ref<T>& dv, const block_sparse_mask& mask) {
  // A zero extent: no element is allowed, so the layout's element rule alone gives the zeros to write (no copy).
  if (p.batch == 0 || p.heads == 0 || p.seq_q == 0 || p.seq_kv == 0)
    return cuda_backend::backward(pol, p, q, k, v, o, d_o, lse, dq, dk, dv, mask.band);
  const auto stream = static_cast<cudaStream_t>(pol.stream);
  cuda_backend::scratch_arena arena(stream);
  block_sparse_mask on_device;
  if (status st = cuda_backend::layout_to_device(mask, arena, stream, on_device); !st) return st;
  return cuda_backend::backward(pol, p, q, k, v, o, d_o, lse, dq, dk, dv, on_device);
}
/// policy::cuda with a layout already on the device (cuda::device_block_sparse): its geometry is checked first.
template <class T>
status run_backward(const policy::cuda& pol, const problem& p, const tensor_ref<const T>& q,
                    const tensor_ref<const T>& k, const tensor_ref<const T>& v, const tensor_ref<const T>& o,
                    const tensor_ref<const T>& d_o, const float* lse, const tensor_ref<T>& dq,
                    const tensor_ref<T>& dk, const tensor_ref<T>& dv, const cuda::device_block_sparse_mask& mask) {
  if (status st = cuda::check_geometry(mask.geometry, p); !st) return st;
  return cuda_backend::backward(pol, p, q, k, v, o, d_o, lse, dq, dk, dv, mask.mask);
}

}  // namespace detail
}  // namespace fusedattn

#include "backward_hopper.cuh"  // launch_backward_hopper and its kernels
