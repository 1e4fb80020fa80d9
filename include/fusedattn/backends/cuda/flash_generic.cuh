/// @file flash_generic.cuh
/// The fused forward kernel on CUDA cores for every call policy::cuda accepts that the tensor-core kernels do not
/// take: f32 and f64 storage, views with any alignment and strides, any head_dim up to max_head_dim, block-sparse
/// layouts with any block_q; with every mask, GQA, score modifiers and lse. Memory O(S). Not the dispatch.
///
/// Design. A block of 128 threads (4 warps) owns a q-tile of `block_m` rows of one (batch, head) and walks the key
/// tiles of its mask (key_tiles, head_mask.cuh), `block_n` keys at a time. Q, K and V are read element by element
/// (unit head_dim stride: a warp reads 32 consecutive columns of a row, so any base pointer and any row, head and
/// batch strides coalesce) and kept in shared memory in the accumulation type A (float; double for f64 storage), the
/// head_dim padded to the tile's width `DC` (32, 64, 128, 256 or 512). Per key tile:
///   S = Q·Kᵀ                 (thread: s_rows × s_cols scores, rows and keys strided so that shared reads are
///                             conflict-free; the dot product runs over the problem's head_dim only)
///   t = log2e·mods(scale·S)  (base-2 logits; the modifiers only on calls that have them, a per-tile branch)
///   t = −inf where the mask forbids (only on tiles with masked keys: is_partial, or a tile reaching past its segment)
///   per row (a warp a row, a lane per key): m' = new_max(m, max t), P = 2^(t − m'), l, α = online::update(...)
///   O = α·O + P·V            (thread: block_m / 4 rows × DC / 32 columns, lanes on consecutive columns)
/// and at the end the sink joins (online::add_sink), O = acc·inverse_sum(l), lse = online::lse(m, l): the running
/// max, rescale and finish are core/online_softmax.hpp's. Numerics (docs/design.md): a tile whose V holds an inf or
/// NaN (seen while it is loaded, __syncthreads_or) takes a P·V that skips every key whose P is 0, so a masked key's V
/// never multiplies anything; a NaN logit reaches l and so its row's O and lse; a row that sees no key gives O = 0
/// and lse = −inf (or the sink). Block-sparse layouts: a q-tile never straddles a q-block row (block_q smaller than
/// block_m gives q-tiles of block_q rows). Calls with few q-tiles (decode-like) split the key tiles of a band mask
/// over several blocks; each part keeps (m, l, unnormalised O) in A and generic_merge_kernel combines them with
/// online::part_weight (in A, so f64 stays f64). Accuracy: the f32 computation (f64 for f64 storage); P is not
/// rounded to the storage type. Speed: a CUDA-core kernel, well below the tensor-core kernels on f16/bf16.
#pragma once

#include <algorithm>
#include <cmath>
#include <string>
#include <type_traits>

#include <cuda_runtime.h>

#include "../../core/online_softmax.hpp"
#include "../../core/problem.hpp"
#include "../../core/score_mod.hpp"
#include "../../core/status.hpp"
#include "../../core/tensor.hpp"
#include "../../kernels/block_sparse.hpp"
#include "../../kernels/mask.hpp"
#include "device_types.cuh"
#include "error.cuh"
#include "flash.cuh"
#include "head_mask.cuh"
#include "scratch.cuh"

namespace fusedattn {
namespace cuda_backend {

/// The accumulation type of the generic kernel for a device element type: double for f64, float otherwise.
template <class E>
using generic_accum_t = std::conditional_t<std::is_same_v<E, double>, double, float>;

/// 2^x and a·b + c in the accumulation type (the single-precision functions for float).
__device__ __forceinline__ float generic_exp2(float x) { return exp2f(x); }
__device__ __forceinline__ double generic_exp2(double x) { return exp2(x); }
__device__ __forceinline__ float generic_fma(float a, float b, float c) { return fmaf(a, b, c); }
__device__ __forceinline__ double generic_fma(double a, double b, double c) { return fma(a, b, c); }

/// Compile-time tile of the generic kernel: head_dim capacity `DC` (a multiple of 32), `BM` query rows, `BN` keys a
/// tile; each S thread computes `SR` × `SC` scores, each O thread BM / 4 rows × DC / 32 columns (a warp's lanes on
/// consecutive columns). Shared memory (A elements): Q [BM][DC + 1], K [BN][DC + 1], V [BN][DC], P [BM][BN + 1] and
/// three row vectors (m, l, α); every tile fits the 99 KB a block may take on sm_86 / sm_89.
template <class A, int DC, int BM, int BN, int SR, int SC>
struct generic_tile {
  using acc = A;
  static constexpr int threads = 128, warps = threads / 32;
  static constexpr int head_dim = DC, block_m = BM, block_n = BN;
  static constexpr int s_rows = SR, s_cols = SC;
  static constexpr int s_x = BN / SC;                  ///< S threads along the keys
  static constexpr int s_y = BM / SR;                  ///< S threads along the rows
  static constexpr int s_threads = s_x * s_y;          ///< threads that compute S (the others wait)
  static constexpr int o_rows = BM / warps, o_cols = DC / 32;
  static constexpr int qk_pitch = DC + 1, v_pitch = DC, p_pitch = BN + 1;
  static constexpr int smem_elems = (BM + BN) * qk_pitch + BN * v_pitch + BM * p_pitch + 3 * BM;
  static constexpr int smem_bytes = smem_elems * int(sizeof(A));
  static_assert(DC % 32 == 0, "the head_dim capacity must be a multiple of a warp's 32 lanes");
  static_assert(BM % warps == 0 && BM % SR == 0 && BN % SC == 0, "the thread grids must tile the q-tile and key tile");
  static_assert(s_threads <= threads, "S needs more threads than a block has");
  static_assert(BN <= 64, "the softmax step gives a lane at most two keys of a tile");
  static_assert(smem_bytes <= flash_max_smem_bytes, "a generic tile must fit 99 KB of shared memory");
};

/// The tile for accumulation type A and head_dim capacity DC (S and O micro-tiles balanced against shared memory).
template <class A, int DC>
struct generic_default_tile;
template <> struct generic_default_tile<float, 32> { using type = generic_tile<float, 32, 32, 64, 4, 4>; };
template <> struct generic_default_tile<float, 64> { using type = generic_tile<float, 64, 32, 64, 4, 4>; };
template <> struct generic_default_tile<float, 128> { using type = generic_tile<float, 128, 32, 32, 2, 4>; };
template <> struct generic_default_tile<float, 256> { using type = generic_tile<float, 256, 32, 16, 2, 2>; };
template <> struct generic_default_tile<float, 512> { using type = generic_tile<float, 512, 16, 16, 1, 2>; };
template <> struct generic_default_tile<double, 32> { using type = generic_tile<double, 32, 32, 64, 4, 4>; };
template <> struct generic_default_tile<double, 64> { using type = generic_tile<double, 64, 32, 32, 2, 4>; };
template <> struct generic_default_tile<double, 128> { using type = generic_tile<double, 128, 32, 16, 2, 2>; };
template <> struct generic_default_tile<double, 256> { using type = generic_tile<double, 256, 16, 8, 1, 1>; };
template <> struct generic_default_tile<double, 512> { using type = generic_tile<double, 512, 8, 8, 1, 1>; };

static_assert(max_head_dim <= 512, "the generic kernel's widest tile holds 512 columns");

/// `f(Tile{})` with the generic tile of the narrowest capacity (32, 64, 128, 256, 512) holding head_dim.
template <class A, class F>
auto with_generic_tile(index_t head_dim, F&& f) {
  if (head_dim <= 32) return f(typename generic_default_tile<A, 32>::type{});
  if (head_dim <= 64) return f(typename generic_default_tile<A, 64>::type{});
  if (head_dim <= 128) return f(typename generic_default_tile<A, 128>::type{});
  if (head_dim <= 256) return f(typename generic_default_tile<A, 256>::type{});
  return f(typename generic_default_tile<A, 512>::type{});
}

/// Everything one generic launch needs, by value. Strides in elements. A q-tile never straddles a multiple of
/// `q_group` rows (the mask's q_granule: block_q for block-sparse, seq_q for a band); `tiles_per_group` q-tiles
/// cover one group. Work item x (0 ≤ x < items) is (q-tile, head, batch, split), q-tile fastest, heaviest first.
template <class Mask>
struct generic_params {
  const void* q;
  const void* k;
  const void* v;
  void* o;
  float* lse;  ///< [b][h][s_q] or nullptr
  strides4 q_stride, k_stride, v_stride, o_stride;
  int batch, heads, group, seq_q, seq_kv, head_dim;
  double scale;  ///< softmax scale
  Mask mask;
  index_t q_group, tiles_per_group, q_tiles, items;
  /// Split-KV: with splits > 1 part s of row r = (b·heads + h)·seq_q + i writes m_part[s·rows + r] (base 2),
  /// l_part[...] and its unnormalised O to o_part[(s·rows + r)·head_dim + c], all in the accumulation type;
  /// generic_merge_kernel combines them. Unused with splits = 1.
  int splits;
  void* o_part;
  void* m_part;
  void* l_part;
};

/// The rows [q0, q1) of q-tile `tile` (0 ≤ tile < q_tiles): `tile_rows` rows a tile, cut at every q_group rows.
__device__ __forceinline__ void generic_tile_rows(index_t tile, index_t q_group, index_t tiles_per_group, int seq_q,
                                                  int tile_rows, int& q0, int& q1) {
  const index_t g = tile / tiles_per_group, t = tile % tiles_per_group;
  const index_t begin = g * q_group + t * tile_rows;
  index_t end = begin + tile_rows;
  const index_t group_end = (g + 1) * q_group;
  end = end < group_end ? end : group_end;
  end = end < seq_q ? end : index_t(seq_q);
  q0 = int(begin);
  q1 = int(end);
}

/// The generic kernel: one work item (q-tile, head, batch, split) after another (a 1-D grid walking the items), see
/// the file comment. `E` the device storage type, `Tile` a generic_tile.
template <class E, class Tile, class Mask>
__global__ void __launch_bounds__(Tile::threads) flash_generic_kernel(const generic_params<Mask> p) {
  using A = typename Tile::acc;
  constexpr int BM = Tile::block_m, BN = Tile::block_n, SR = Tile::s_rows, SC = Tile::s_cols;
  constexpr int OR = Tile::o_rows, OC = Tile::o_cols, QP = Tile::qk_pitch, VP = Tile::v_pitch, PP = Tile::p_pitch;
  constexpr int SX = Tile::s_x, SY = Tile::s_y, W = Tile::warps;
  constexpr A neg_inf = -INFINITY;
  constexpr A log2e_a = A(log2e);
  extern __shared__ __align__(16) unsigned char generic_smem[];
  A* sq = reinterpret_cast<A*>(generic_smem);  // [BM][QP]
  A* sk = sq + BM * QP;                         // [BN][QP]
  A* sv = sk + BN * QP;                         // [BN][VP]
  A* sp = sv + BN * VP;                         // [BM][PP]: the tile's logits, then its probabilities
  A* row_m = sp + BM * PP;                      // [BM] running max (base 2)
  A* row_l = row_m + BM;                        // [BM] running sum
  A* row_a = row_l + BM;                        // [BM] the tile's rescale α, at the end the factor of O

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int D = p.head_dim;
  const A scale = A(p.scale), scale_log2 = A(p.scale) * log2e_a;
  const index_t rows_total = index_t(p.batch) * p.heads * p.seq_q;

  // V columns past head_dim stay zero (the loads below write columns < D only), so the unused accumulators stay 0.
  for (int e = tid; e < BN * VP; e += Tile::threads) sv[e] = A(0);

  for (index_t x = blockIdx.x; x < p.items; x += gridDim.x) {
    const index_t tile = p.q_tiles - 1 - x % p.q_tiles;  // the heaviest q-tiles (causal: the last) first
    index_t rest = x / p.q_tiles;
    const int h = int(rest % p.heads);
    rest /= p.heads;
    const int b = int(rest % p.batch), split = int(rest / p.batch), h_kv = h / p.group;
    int q0 = 0, q1 = 0;
    generic_tile_rows(tile, p.q_group, p.tiles_per_group, p.seq_q, BM, q0, q1);
    if (q0 >= q1) continue;  // a q-tile past the end of a short last q-block row (the same for the whole block)
    const int rows = q1 - q0;

    const E* q_head = static_cast<const E*>(p.q) + b * p.q_stride.b + h * p.q_stride.h;
    const E* k_head = static_cast<const E*>(p.k) + b * p.k_stride.b + h_kv * p.k_stride.h;
    const E* v_head = static_cast<const E*>(p.v) + b * p.v_stride.b + h_kv * p.v_stride.h;
    const Mask mask = head_mask(p.mask, b, h);
    const bound_mods& mods = mods_of(mask);
    const bool modified = mods.changes_scores();
    key_tiles<Mask, BN> walk(mask, q0, q1);
    const band32 rule = element_rule(mask);

    __syncthreads();  // the previous item is done with every buffer
    // Q tile: a warp per row, a lane per column; rows past the tile's end read as zeros (never stored).
    for (int r = warp; r < BM; r += W)
      for (int c = lane; c < D; c += 32) sq[r * QP + c] = r < rows ? A(widen(q_head[(q0 + r) * p.q_stride.s + c])) : A(0);
    for (int r = tid; r < BM; r += Tile::threads) row_m[r] = neg_inf, row_l[r] = A(0);

    A acc[OR][OC];
#pragma unroll
    for (int a = 0; a < OR; ++a)
#pragma unroll
      for (int k = 0; k < OC; ++k) acc[a][k] = A(0);

    for (int k0 = walk.first(split, p.splits); k0 >= 0; k0 = walk.next(k0)) {
      const int seg_begin = walk.seg_begin, seg_end = walk.seg_end;
      const int valid = p.seq_kv - k0 < BN ? p.seq_kv - k0 : BN;
      // K and V tiles (a warp per key row); rows past seq_kv are zeros. A V value that is ±inf or NaN sends this
      // tile to the P·V that skips keys whose P is 0.
      bool v_bad = false;
      for (int r = warp; r < BN; r += W) {
        const E* k_row = k_head + index_t(k0 + r) * p.k_stride.s;
        const E* v_row = v_head + index_t(k0 + r) * p.v_stride.s;
        for (int c = lane; c < D; c += 32) {
          const A kx = r < valid ? A(widen(k_row[c])) : A(0);
          const A vx = r < valid ? A(widen(v_row[c])) : A(0);
          sk[r * QP + c] = kx;
          sv[r * VP + c] = vx;
          v_bad = v_bad || !isfinite(vx);
        }
      }
      const bool tile_v_bad = __syncthreads_or(v_bad) != 0;

      // S = Q·Kᵀ and the base-2 logits, masked where the tile needs it. Thread (sy, sx): rows sy + SY·a, keys
      // sx + SX·c.
      const bool partial = k0 < seg_begin || k0 + BN > seg_end || rule.is_partial(q0, q1, k0, k0 + BN);
      if (tid < Tile::s_threads) {
        const int sx = tid % SX, sy = tid / SX;
        A s[SR][SC];
#pragma unroll
        for (int a = 0; a < SR; ++a)
#pragma unroll
          for (int c = 0; c < SC; ++c) s[a][c] = A(0);
#pragma unroll 4
        for (int d = 0; d < D; ++d) {
          A qa[SR], kc[SC];
#pragma unroll
          for (int a = 0; a < SR; ++a) qa[a] = sq[(sy + SY * a) * QP + d];
#pragma unroll
          for (int c = 0; c < SC; ++c) kc[c] = sk[(sx + SX * c) * QP + d];
#pragma unroll
          for (int a = 0; a < SR; ++a)
#pragma unroll
            for (int c = 0; c < SC; ++c) s[a][c] = generic_fma(qa[a], kc[c], s[a][c]);
        }
#pragma unroll
        for (int a = 0; a < SR; ++a)
#pragma unroll
          for (int c = 0; c < SC; ++c) {
            const int r = sy + SY * a, col = sx + SX * c, i = q0 + r, j = k0 + col;
            A t = modified ? mods.apply(scale * s[a][c], h, i, j) * log2e_a : s[a][c] * scale_log2;
            if (partial && !(rule.allowed(i, j) && j >= seg_begin && j < seg_end)) t = neg_inf;
            sp[r * PP + col] = t;
          }
      }
      __syncthreads();

      // The online softmax of each row (a warp a row, a lane per key): P = 2^(t − m'), and α.
      for (int r = warp; r < rows; r += W) {
        constexpr int per_lane = (BN + 31) / 32;
        A t[per_lane];
        A tile_max = neg_inf;
#pragma unroll
        for (int y = 0; y < per_lane; ++y) {
          const int j = lane + 32 * y;
          t[y] = j < BN ? sp[r * PP + j] : neg_inf;
          tile_max = online::new_max(tile_max, t[y]);
        }
#pragma unroll
        for (int off = 16; off > 0; off /= 2) tile_max = online::new_max(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, off));
        A m = row_m[r], l = row_l[r];
        const A m_new = online::new_max(m, tile_max);
        // While the row has no finite logit (m' = −inf), P = 2^(t − 0): 0 for masked keys, NaN for a NaN logit,
        // which then reaches l and stays there; the state keeps m = −inf and α = 1.
        const A m_use = m_new == neg_inf ? A(0) : m_new;
        A sum = A(0);
#pragma unroll
        for (int y = 0; y < per_lane; ++y) {
          t[y] = lane + 32 * y < BN ? generic_exp2(t[y] - m_use) : A(0);
          sum += t[y];
        }
#pragma unroll
        for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
        A alpha = A(1);
        if (m_new == neg_inf) l += sum;
        else alpha = online::update(m, l, m_new, sum);
#pragma unroll
        for (int y = 0; y < per_lane; ++y)
          if (lane + 32 * y < BN) sp[r * PP + lane + 32 * y] = t[y];
        if (lane == 0) row_m[r] = m, row_l[r] = l, row_a[r] = alpha;
      }
      __syncthreads();

      // O = α·O + P·V. Thread (warp, lane): rows warp + W·a, columns lane + 32·k. A tile whose V holds an inf or
      // NaN skips every key whose P is 0 (masked, or underflowed): 0·inf is never formed.
#pragma unroll
      for (int a = 0; a < OR; ++a) {
        const A alpha = row_a[warp + W * a];  // rows past the tile's end hold values never stored
#pragma unroll
        for (int k = 0; k < OC; ++k) acc[a][k] *= alpha;
      }
      if (!tile_v_bad) {
#pragma unroll 4
        for (int j = 0; j < BN; ++j) {
          A pa[OR], vk[OC];
#pragma unroll
          for (int a = 0; a < OR; ++a) pa[a] = sp[(warp + W * a) * PP + j];
#pragma unroll
          for (int k = 0; k < OC; ++k) vk[k] = sv[j * VP + lane + 32 * k];
#pragma unroll
          for (int a = 0; a < OR; ++a)
#pragma unroll
            for (int k = 0; k < OC; ++k) acc[a][k] = generic_fma(pa[a], vk[k], acc[a][k]);
        }
      } else {
#pragma unroll 1
        for (int j = 0; j < BN; ++j) {
#pragma unroll
          for (int a = 0; a < OR; ++a) {
            const A pa = sp[(warp + W * a) * PP + j];
            if (pa == A(0)) continue;
#pragma unroll
            for (int k = 0; k < OC; ++k) acc[a][k] = generic_fma(pa, sv[j * VP + lane + 32 * k], acc[a][k]);
          }
        }
      }
      __syncthreads();  // every thread is done with this tile's K, V and P
    }

    // Finish. One part of a split: (m, l, unnormalised O) in A for generic_merge_kernel. Otherwise the sink joins
    // (online::add_sink; −inf when off changes nothing), O = acc · factor · inverse_sum(l), lse = online::lse(m, l):
    // a row that saw no key gives O = 0 and lse = −inf (or the sink), a NaN logit NaN in both.
    if (p.splits > 1) {
      A* o_part = static_cast<A*>(p.o_part);
      for (int r = tid; r < rows; r += Tile::threads) {
        const index_t part_row = split * rows_total + (index_t(b) * p.heads + h) * p.seq_q + q0 + r;
        static_cast<A*>(p.m_part)[part_row] = row_m[r];
        static_cast<A*>(p.l_part)[part_row] = row_l[r];
      }
#pragma unroll
      for (int a = 0; a < OR; ++a) {
        const int r = warp + W * a;
        if (r >= rows) continue;
        const index_t part_row = split * rows_total + (index_t(b) * p.heads + h) * p.seq_q + q0 + r;
#pragma unroll
        for (int k = 0; k < OC; ++k)
          if (lane + 32 * k < D) o_part[part_row * D + lane + 32 * k] = acc[a][k];
      }
      continue;
    }
    const A sink2 = mods.sink<A>(h) * log2e_a;
    for (int r = tid; r < rows; r += Tile::threads) {
      A m = row_m[r], l = row_l[r];
      const A factor = online::add_sink(m, l, sink2);
      row_a[r] = factor * online::inverse_sum(l);
      if (p.lse != nullptr) p.lse[(index_t(b) * p.heads + h) * p.seq_q + q0 + r] = online::lse(m, l);
    }
    __syncthreads();
    E* o_head = static_cast<E*>(p.o) + b * p.o_stride.b + h * p.o_stride.h;
#pragma unroll
    for (int a = 0; a < OR; ++a) {
      const int r = warp + W * a;
      if (r >= rows) continue;
      const A f = row_a[r];
      E* o_row = o_head + index_t(q0 + r) * p.o_stride.s;
#pragma unroll
      for (int k = 0; k < OC; ++k)
        if (lane + 32 * k < D) o_row[lane + 32 * k] = narrow<E>(acc[a][k] * f);
    }
  }
}

/// Combines the split parts of each row (a block a row, x, x + gridDim.x, ...; a thread per column) with
/// core/online_softmax.hpp: m = max of the parts that saw a key, w_s = online::part_weight(m_s, l_s, m),
/// L = Σ w_s·l_s, O = Σ w_s·O_s; then the sink joins once (online::add_sink) and O = O · factor · inverse_sum(L),
/// lse = online::lse(m, L). A part with l = 0 saw no key and is not read; a part with l = NaN (a NaN logit) makes the
/// row's O and lse NaN.
template <class E, class A, class Mask>
__global__ void generic_merge_kernel(const generic_params<Mask> p) {
  constexpr A neg_inf = -INFINITY;
  const index_t rows = index_t(p.batch) * p.heads * p.seq_q;
  const A* o_part = static_cast<const A*>(p.o_part);
  const A* m_part = static_cast<const A*>(p.m_part);
  const A* l_part = static_cast<const A*>(p.l_part);
  for (index_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int i = int(r % p.seq_q), h = int((r / p.seq_q) % p.heads), b = int(r / (index_t(p.seq_q) * p.heads));
    A m = neg_inf;
    bool nan = false;
    for (int s = 0; s < p.splits; ++s) {
      const A l_s = l_part[s * rows + r];
      nan = nan || isnan(l_s);
      if (l_s > A(0)) m = online::new_max(m, m_part[s * rows + r]);
    }
    A l = A(0);
    for (int s = 0; s < p.splits; ++s) l += online::part_weight(m_part[s * rows + r], l_part[s * rows + r], m) * l_part[s * rows + r];
    const A m_parts = m;  // the parts' weights are relative to it; add_sink moves m to the sink's logit
    const A factor = online::add_sink(m, l, mods_of(p.mask).template sink<A>(h) * A(log2e));
    const A f = nan ? A(NAN) : factor * online::inverse_sum(l);
    E* o_row = static_cast<E*>(p.o) + b * p.o_stride.b + h * p.o_stride.h + i * p.o_stride.s;
    for (int c = threadIdx.x; c < p.head_dim; c += blockDim.x) {
      A o = A(0);
      for (int s = 0; s < p.splits; ++s) {
        const A w = online::part_weight(m_part[s * rows + r], l_part[s * rows + r], m_parts);
        if (w != A(0)) o += w * o_part[(s * rows + r) * p.head_dim + c];
      }
      o_row[c] = narrow<E>(o * f);
    }
    if (p.lse != nullptr && threadIdx.x == 0) p.lse[r] = nan ? float(NAN) : online::lse(m, l);
  }
}

/// ok when the generic kernel takes the call, else errc::unsupported naming the extent: its row and key indices are
/// 32-bit (band32, key_tiles), so seq_q and seq_kv must stay below 2^30.
inline status generic_applies(const problem& p) {
  constexpr index_t max_seq = index_t(1) << 30;
  if (p.seq_q > max_seq) return {errc::unsupported, "problem.seq_q is " + std::to_string(p.seq_q) + "; cuda.flash_generic takes at most 2^30"};
  if (p.seq_kv > max_seq) return {errc::unsupported, "problem.seq_kv is " + std::to_string(p.seq_kv) + "; cuda.flash_generic takes at most 2^30"};
  return {};
}

/// The q-tiling of a generic launch: q-tiles of `block_m` rows cut at every multiple of the mask's q_granule.
template <class Mask>
void generic_q_tiles(const problem& p, const Mask& mask, int block_m, index_t& q_group, index_t& tiles_per_group,
                     index_t& q_tiles) {
  const index_t granule = mask.q_granule();
  q_group = granule > 0 && granule < p.seq_q ? granule : std::max<index_t>(p.seq_q, 1);
  tiles_per_group = (q_group + block_m - 1) / block_m;
  q_tiles = (p.seq_q + q_group - 1) / q_group * tiles_per_group;
}

/// The key splits of a generic launch (flash_split_count's rule on the generic tile; never for block-sparse).
template <class Tile, class Mask>
int generic_split_count(const problem& p, const Mask& mask, int multiprocessors) {
  index_t q_group = 0, tiles_per_group = 0, q_tiles = 0;
  generic_q_tiles(p, mask, Tile::block_m, q_group, tiles_per_group, q_tiles);
  if (q_tiles != (p.seq_q + Tile::block_m - 1) / Tile::block_m) return 1;
  return flash_split_count<Mask>(p.batch, p.heads, p.seq_q, p.seq_kv, Tile::block_m, Tile::block_n, multiprocessors);
}

/// Device scratch bytes of a generic call for storage type `T` (split parts; 0 without splits).
template <class T, class Mask>
status generic_scratch_bytes(const problem& p, const Mask& mask, std::size_t& bytes) {
  using A = generic_accum_t<device_t<T>>;
  int multiprocessors = 0;
  if (status st = device_multiprocessors(multiprocessors); !st) return st;
  const int splits = with_generic_tile<A>(p.head_dim, [&](auto tile) {
    return generic_split_count<decltype(tile)>(p, mask, multiprocessors);
  });
  const index_t rows = p.batch * p.heads * p.seq_q;
  bytes = splits > 1 ? sizeof(A) * std::size_t(splits) * std::size_t(rows) * (std::size_t(p.head_dim) + 2) : 0;
  return {};
}

/// Runs the generic kernel on a call attend validated (the file comment); asynchronous on `stream`.
template <class T, class Mask>
status run_flash_generic(const problem& p, const tensor_ref<const T>& q, const tensor_ref<const T>& k,
                         const tensor_ref<const T>& v, const tensor_ref<T>& o, const Mask& mask, float* lse,
                         cudaStream_t stream) {
  using E = device_t<T>;
  using A = generic_accum_t<E>;
  if (status st = generic_applies(p); !st) return st;
  int multiprocessors = 0;
  if (status st = device_multiprocessors(multiprocessors); !st) return st;
  return with_generic_tile<A>(p.head_dim, [&](auto tile) -> status {
    using Tile = decltype(tile);
    const auto kernel = flash_generic_kernel<E, Tile, Mask>;
    if (status st = from_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tile::smem_bytes),
                              "cudaFuncSetAttribute(flash_generic_kernel)");
        !st)
      return st;
    generic_params<Mask> gp{q.data, k.data, v.data, o.data, lse, q.stride, k.stride, v.stride, o.stride,
                            int(p.batch), int(p.heads), int(p.group_size()), int(p.seq_q), int(p.seq_kv),
                            int(p.head_dim), p.softmax_scale(), mask, 0, 0, 0, 0, 1, nullptr, nullptr, nullptr};
    generic_q_tiles(p, mask, Tile::block_m, gp.q_group, gp.tiles_per_group, gp.q_tiles);
    gp.splits = generic_split_count<Tile>(p, mask, multiprocessors);
    gp.items = gp.q_tiles * p.heads * p.batch * gp.splits;
    const index_t rows = p.batch * p.heads * p.seq_q;
    struct part_owner {  // frees the split parts in stream order, after the merge
      void* ptr = nullptr;
      cudaStream_t stream;
      ~part_owner() {
        if (ptr != nullptr) cudaFreeAsync(ptr, stream);
      }
    } parts{nullptr, stream};
    if (gp.splits > 1) {
      const std::size_t n = std::size_t(gp.splits) * std::size_t(rows);
      if (status st = scratch_allocate(parts.ptr, sizeof(A) * n * (std::size_t(p.head_dim) + 2), stream,
                                       "cudaMallocFromPoolAsync(cuda.flash_generic split parts)");
          !st)
        return st;
      gp.o_part = parts.ptr;
      gp.m_part = static_cast<A*>(parts.ptr) + n * std::size_t(p.head_dim);
      gp.l_part = static_cast<A*>(gp.m_part) + n;
    }
    constexpr index_t max_grid = 0x7fffffff;
    kernel<<<unsigned(std::min(gp.items, max_grid)), Tile::threads, Tile::smem_bytes, stream>>>(gp);
    if (status st = last_launch("flash_generic_kernel"); !st || gp.splits == 1) return st;
    generic_merge_kernel<E, A, Mask><<<unsigned(std::min(rows, max_grid)), 128, 0, stream>>>(gp);
    return last_launch("generic_merge_kernel");
  });
}

}  // namespace cuda_backend
}  // namespace fusedattn
