/// @file flash_hopper.cuh
/// The fused forward kernel on Hopper's warpgroup tensor cores (sm_90a: wgmma.mma_async), f16 and bf16 with f32
/// accumulation, head_dim 64, 128, 192 and 256 (and every other multiple of 8 above 64 on the next tile up: launch_flash_hopper): the same function, masks,
/// block-sparse walk, GQA, split-KV and lse as the mma.sync kernel of flash.cuh, whose parameters (flash_params_t)
/// and launch (launch_flash_kernel) it shares.
/// Not the dispatch (attend_cuda.cuh picks it on sm_90 devices when the build has sm_90a code: hopper_flash_ready).
///
/// A work item is block_m = 128 query rows of one (batch, head) (and one split-KV part): two warpgroups of 64 rows
/// (three and 192 rows in hopper_turns_tile), each warp 16 of them (the m16n8 accumulator layout, as in flash.cuh).
/// Per key tile j of block_n keys, each warpgroup runs
///   S_j = Q·K_jᵀ              (wgmma, Q and K_j from shared memory)          — issued, asynchronous
///   O  += P_{j-1}·V_{j-1}      (wgmma, P from registers, V_{j-1} from shared) — issued, asynchronous
///   modify S_j (score modifiers: tile_mods, in the instantiation for calls with modifiers only);
///   mask S_j; m_j = max(m_{j-1}, rowmax(scale·S_j)); P_j = exp(scale·S_j − m_j); l = l·α + rowsum(P_j)
///                              (while P_{j-1}·V_{j-1} still runs on the tensor cores)
///   O *= α = exp(m_{j-1} − m_j) once P_{j-1}·V_{j-1} is done
/// so the softmax of one tile may overlap the P·V product of the previous one (in the SASS of CUDA 13.0, ptxas puts
/// the wait for that product before the softmax; docs/design.md, "CUDA", the Hopper flash kernel). Shared tiles are
/// 128-byte swizzled atoms (wgmma.cuh); TMA brings the tiles in (tma.cuh; two K and two V buffers, an mbarrier each).
/// Exponentials are base 2 with scale·log2(e) folded in, as in flash.cuh. Two kernels run these steps:
///   flash_hopper_ws_kernel (tiles of one block per SM: head_dim 128, 192 and 256 and those padded to them, and 64 where
///     every q-block sees every key — no mask, decode: hopper_whole_row_tile; and hopper_turns_tile, unmasked or causal calls of many
///     items, whose three consumer warpgroups take turns on the tensor cores) — warp-specialised: a producer
///     warpgroup issues every copy (Q too) into buffers that "empty" mbarriers hand back, the consumer warpgroups
///     compute with no block barrier and write O by TMA, items walked by a persistent grid (no mask, block-sparse;
///     causal and window with few items a block, dealt q-block first: hopper_schedule_for) or one block each;
///   flash_hopper_kernel (tiles of two blocks per SM: the other head_dim 64 calls) — every warp computes, Q by
///     cp.async, one block barrier per key tile guards the buffers.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include <cuda_runtime.h>

#include "../../core/status.hpp"
#include "error.cuh"
#include "flash.cuh"
#include "head_mask.cuh"
#include "mma.cuh"
#include "tma.cuh"
#include "wgmma.cuh"

namespace fusedattn {
namespace cuda_backend {

/// Compile-time tile shape of the Hopper kernels: `Warpgroups` computing warpgroups of 64 query rows (two by default;
/// three in hopper_turns_tile; one and four exist for the bench's sweeps), `BlockN` keys per tile, two K and two
/// V buffers. `MinBlocks` blocks per multiprocessor bound the registers (__launch_bounds__) and pick the kernel
/// (warp_specialized).
template <int HeadDim, int BlockN, int MinBlocks = 1, int Warpgroups = 2>
struct hopper_tile {
  static constexpr int head_dim = HeadDim;
  static constexpr int warpgroups = Warpgroups;
  static constexpr int threads = 128 * warpgroups;
  static constexpr int block_m = 64 * warpgroups;  ///< query rows per block
  static constexpr int block_n = BlockN;           ///< keys per tile
  static constexpr int chunks = HeadDim / 8;       ///< 16-byte chunks per row
  static constexpr int min_blocks = MinBlocks;
  static constexpr int atom_bytes = 1024;  ///< one 8-row, 128-byte swizzle atom; tiles start on its boundary
  /// Q, two K and two V tiles, slack to align the start to an atom, and four mbarriers (TMA copies).
  /// One block per multiprocessor: flash_hopper_ws_kernel (a producer warpgroup besides the `warpgroups` consumer
  /// ones, which take the registers it gives back); several: flash_hopper_kernel (every warp computes, the register
  /// file shared by the blocks).
  static constexpr bool warp_specialized = MinBlocks == 1;
  /// flash_hopper_ws_kernel's consumer warpgroups take turns on the tensor cores (each issues its products once the
  /// one before it has finished its own). Only tiles of three or more consumer warpgroups take turns: with two, the
  /// warpgroups already alternate and turns only add waiting (docs/design.md, rejected alternatives).
  static constexpr bool take_turns = Warpgroups > 2;
  /// flash_hopper_kernel's shared memory: Q, two K and two V tiles, slack to align the start to an atom, and four
  /// mbarriers (TMA copies).
  static constexpr int smem_bytes = (block_m + 4 * block_n) * HeadDim * 2 + atom_bytes + 64;
  /// flash_hopper_ws_kernel's: two Q buffers where they fit in 227 KB (an item's Q then loads during the previous
  /// item), two K, two V, the slack, and hopper_ws_shared.
  static constexpr int q_buffers = (2 * block_m + 4 * block_n) * HeadDim * 2 + atom_bytes + 256 <= 227 * 1024 ? 2 : 1;
  static constexpr int ws_smem_bytes = (q_buffers * block_m + 4 * block_n) * HeadDim * 2 + atom_bytes + 256;
  static_assert(HeadDim == 64 || HeadDim == 128 || HeadDim == 192 || HeadDim == 256,
                "the Hopper kernel takes head_dim 64, 128, 192 and 256");
  static_assert(BlockN == 64 || BlockN == 80 || BlockN == 96 || BlockN == 112 || BlockN == 128,
                "wgmma_ss is written for block_n 64, 80, 96, 112 and 128");
  static_assert(ws_smem_bytes <= 227 * 1024, "one block's shared memory on sm_90 is at most 227 KB");
};

/// Offset in elements of (row, 16-byte chunk) in a tile of `Rows` rows stored as 64-column panels of 128-byte
/// swizzled atoms: panel chunk / 8 holds rows [0, Rows) of columns [64·panel, 64·panel + 64), 128 bytes a row, and
/// chunk c of row r sits at chunk c ^ (r mod 8) of its row (the layout wgmma's 128-byte swizzle mode reads).
template <int Rows>
__device__ __forceinline__ int atom_offset(int row, int chunk) {
  return (chunk >> 3) * (Rows * 64) + row * 64 + (((chunk & 7) ^ (row & 7)) << 3);
}

/// Block-wide cp.async of rows [0, Rows) of a tile (row r at `g + r·stride_s`) into the panel layout; rows at and
/// past `valid` are zero-filled (their scores are masked, their P is 0). flash_hopper_kernel's Q tile, once per block.
template <class Tile, int Rows, class E>
__device__ __forceinline__ void load_atoms(E* smem, const E* g, index_t stride_s, int valid) {
  constexpr int CH = Tile::chunks;
  for (int c = threadIdx.x; c < Rows * CH; c += Tile::threads) {
    const int r = c / CH, ch = c % CH;
    const bool ok = r < valid;
    cp_async_16(smem + atom_offset<Rows>(r, ch), g + (ok ? r : 0) * stride_s + ch * 8, ok);
  }
}

/// Pins 32-bit fragment registers in program order around asynchronous wgmma (see fence_operands).
template <int Tiles>
__device__ __forceinline__ void fence_fragments(std::uint32_t (&a)[Tiles][2]) {
#pragma unroll
  for (int i = 0; i < Tiles; ++i)
#pragma unroll
    for (int e = 0; e < 2; ++e) asm volatile("" : "+r"(a[i][e])::"memory");
}

/// The descriptor of a tile `elements` further on: a descriptor's address field counts 16-byte units and no tile
/// crosses the 2^18-byte window it covers, so the descriptor of base + offset is that of base plus offset / 8.
__device__ __forceinline__ std::uint64_t desc_plus(std::uint64_t desc, int elements) {
  return desc + std::uint64_t(elements >> 3);
}

// The per-tile steps both Hopper kernels run in each consumer warp (rows row0 + g and row0 + g + 8 of this thread,
// spread over a quad; a warpgroup's 64 rows start at 64·wg of the block's Q tile).

/// S (64 × BN per warpgroup) = Q (64 × D) · Kᵀ (D × BN), issued and committed: D/16 wgmma steps of 16 head-dim
/// columns; step kk reads chunk pair kk of panel kk / 4 of this warpgroup's Q rows and of the K tile.
template <class E, class Tile>
__device__ __forceinline__ void issue_scores(float (&s)[Tile::block_n / 8][4], std::uint64_t q_desc,
                                             std::uint64_t k_desc) {
  constexpr int D = Tile::head_dim, BM = Tile::block_m, BN = Tile::block_n;
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const int panel = kk / 4, col = (kk % 4) * 16;
    wgmma_ss<E, BN>(s, desc_plus(q_desc, panel * BM * 64 + col), desc_plus(k_desc, panel * BN * 64 + col), kk > 0);
  }
  wgmma_commit();
}

/// O (64 × D per warpgroup) += P (64 × BN, registers) · V (BN × D), issued and committed: BN/16 steps of 16 keys;
/// the packed P of key tiles 2kk, 2kk + 1 is this warp's A fragment, V rows [16kk, 16kk + 16) an N-major
/// descriptor over the panels of at most 128 output columns: D / 128 products of N = 128 (panels 2c, 2c + 1), then
/// one of N = 64 for the last panel when D is an odd number of panels (head_dim 64: one of N = 64; 192: N = 128 on
/// panels 0–1, N = 64 on panel 2; 256: two of N = 128).
template <class E, class Tile>
__device__ __forceinline__ void issue_pv(float (&acc)[Tile::head_dim / 8][4], std::uint32_t (&pk)[Tile::block_n / 8][2],
                                         std::uint64_t v_desc) {
  constexpr int D = Tile::head_dim, BN = Tile::block_n, wide = D / 128, rest = D % 128;
  static_assert(rest == 0 || rest == 64, "issue_pv splits head_dim into products of 128 and 64 columns");
  fence_fragments(pk);  // P is in its registers before the first wgmma: no move may land between them
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < BN / 16; ++kk) {
    const std::uint32_t a[4] = {pk[2 * kk][0], pk[2 * kk][1], pk[2 * kk + 1][0], pk[2 * kk + 1][1]};
#pragma unroll
    for (int c = 0; c < wide; ++c)
      wgmma_rs<E, 128>(*reinterpret_cast<float(*)[16][4]>(&acc[c * 16]), a,
                       desc_plus(v_desc, 2 * c * BN * 64 + kk * 16 * 64));
    if constexpr (rest != 0)
      wgmma_rs<E, rest>(*reinterpret_cast<float(*)[rest / 8][4]>(&acc[wide * 16]), a,
                        desc_plus(v_desc, 2 * wide * BN * 64 + kk * 16 * 64));
  }
  wgmma_commit();
}

/// Where this thread's rows are and what the softmax needs of the call.
struct softmax_rows {
  int row0, row_end;  ///< the warp's rows [row0, row_end)
  int g, t;           ///< accumulator coordinates: row group, thread in group
  float scale_log2;   ///< softmax scale · log2(e)
};

/// Modifiers, mask, online softmax and packing of one score tile S (keys [k0, k0 + BN)): with `Mods` the score
/// modifiers first (tile_mods); the per-element mask only on tiles that need it (`rule`; a block-sparse tile past
/// its run [tile_begin, tile_end) also masks by that range); m_run, l_run advance; P goes to `pk` (16-bit pairs: the
/// A fragment of P·V), or with `Pack` false stays in `s` in f32 (pack_p packs it later); alpha[r] is the factor O
/// must be rescaled by before this tile's P·V is added.
template <class E, int BN, bool Band, bool Mods, bool Pack = true>
__device__ __forceinline__ void tile_softmax(float (&s)[BN / 8][4], std::uint32_t (&pk)[BN / 8][2], float (&alpha)[2],
                                             float (&m_run)[2], float (&l_run)[2], const band32& rule,
                                             const softmax_rows& w, int k0, int tile_begin, int tile_end,
                                             const tile_mods& mods) {
  constexpr float neg_inf = -INFINITY;
  if constexpr (Mods) mods.apply_tile<BN>(s, w.row0 + w.g, k0, w.t);
  const bool past_edge = !Band && (k0 < tile_begin || k0 + BN > tile_end);
  if (past_edge || rule.is_partial(w.row0, w.row_end, k0, k0 + BN)) {
    // Row g + 8r of this thread may see the tile's columns [c_lo, c_hi) (band32::columns); its scores sit at
    // columns n·8 + 2t + (e & 1), so with 2t taken off the bounds each test compares against a constant.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      int c_lo, c_hi;
      rule.columns(w.row0 + w.g + 8 * r, k0, Band ? k0 : tile_begin, Band ? k0 + BN : tile_end, c_lo, c_hi);
      c_lo -= 2 * w.t;
      c_hi -= 2 * w.t;
#pragma unroll
      for (int n = 0; n < BN / 8; ++n)
#pragma unroll
        for (int e = 2 * r; e < 2 * r + 2; ++e) {
          const int c = n * 8 + (e & 1);
          s[n][e] = (c >= c_lo) & (c < c_hi) ? s[n][e] : neg_inf;
        }
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float mx = neg_inf;
#pragma unroll
    for (int n = 0; n < BN / 8; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * r], s[n][2 * r + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    mx = fmaxf(m_run[r], mx * w.scale_log2);
    const float m_use = mx == neg_inf ? 0.f : mx;  // a row with nothing allowed yet keeps P = 0, no NaN
    alpha[r] = fast_exp2(m_run[r] - m_use);
    m_run[r] = mx;
    float sum = 0.f;
#pragma unroll
    for (int n = 0; n < BN / 8; ++n) {
      const float p0 = fast_exp2(fmaf(s[n][2 * r], w.scale_log2, -m_use));
      const float p1 = fast_exp2(fmaf(s[n][2 * r + 1], w.scale_log2, -m_use));
      sum += p0 + p1;
      if constexpr (Pack) {
        pk[n][r] = mma_type<E>::pack(p0, p1);
      } else {
        s[n][2 * r] = p0;
        s[n][2 * r + 1] = p1;
      }
    }
    l_run[r] = l_run[r] * alpha[r] + sum;
  }
}

/// P, left in f32 by tile_softmax<..., false>, packed to 16-bit pairs: the A fragment of P·V.
template <class E, int BN>
__device__ __forceinline__ void pack_p(const float (&s)[BN / 8][4], std::uint32_t (&pk)[BN / 8][2]) {
#pragma unroll
  for (int n = 0; n < BN / 8; ++n)
#pragma unroll
    for (int r = 0; r < 2; ++r) pk[n][r] = mma_type<E>::pack(s[n][2 * r], s[n][2 * r + 1]);
}

/// O *= alpha, row by row (after the P·V that O holds has completed).
template <int D>
__device__ __forceinline__ void rescale(float (&acc)[D / 8][4], const float (&alpha)[2]) {
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
    acc[n][0] *= alpha[0];
    acc[n][1] *= alpha[0];
    acc[n][2] *= alpha[1];
    acc[n][3] *= alpha[1];
  }
}

/// The end of one q-block (b, h, split; rows from q0) in this warp: O = acc / l, lse = ln 2 · (m + log2 l); a row
/// that saw no key (l = 0) gets O = 0, lse = −inf; one whose l is NaN (a NaN logit: exp2 of it joined the sum, and
/// no later step clears it) O = lse = NaN. A split writes its f32 part and lse straight to o_part / lse_part; else
/// lse goes to p.lse and O, packed, into the staging tile `stage` (the q-block's Q tile, panel layout, `BM` rows),
/// which the caller copies out once every warp has staged its rows (store_rows, or a TMA store). 1/l is the
/// approximate reciprocal (__fdividef, 2 ulp): O is rounded to 16 bits after it. With `Mods` the sink joins l first
/// (add_sink; a split's parts leave it to flash_merge_kernel). A block whose O holds an inf or NaN raises the repair
/// pass's flag (flag_nonfinite). `Ragged` (a ragged batch, ragged.cuh): the q-block's sequence starts at packed row
/// `seq_q0` and has `seq_rows` rows; lse goes to [h][seq_q0 + row].
template <class E, class Tile, class Mask, bool Mods, bool Ragged = false>
__device__ __forceinline__ void finish_rows(const flash_params_t<Mask>& p, float (&acc)[Tile::head_dim / 8][4],
                                            const float (&m_run)[2], const float (&l_run)[2], const softmax_rows& w,
                                            int b, int h, int split, int q0, E* stage, const tile_mods& mods,
                                            int seq_q0 = 0, int seq_rows = 0) {
  constexpr int D = Tile::head_dim, BM = Tile::block_m;
  constexpr float ln2 = float(fusedattn::ln2);
  flag_nonfinite(p.nonfinite, acc);
  float inv_l[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float l = l_run[r], m = m_run[r];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    inv_l[r] = l == 0.f ? 0.f : __fdividef(1.f, l);
    if constexpr (Mods) {
      if (p.splits == 1) {
        const float alpha = add_sink(m, l, mods.sink2);
        inv_l[r] = l == 0.f ? 0.f : __fdividef(alpha, l);
      }
    }
    const int row = w.row0 + w.g + 8 * r;
    const float lse = l == 0.f ? -INFINITY : (m + log2f(l)) * ln2;
    if (p.splits > 1) {
      if (row >= p.seq_q) continue;
      const index_t part_row = ((static_cast<index_t>(split) * p.batch + b) * p.heads + h) * p.seq_q + row;
      if (w.t == 0) p.lse_part[part_row] = lse;
#pragma unroll
      for (int n = 0; n < D / 8; ++n)
        *reinterpret_cast<float2*>(p.o_part + part_row * D + n * 8 + 2 * w.t) =
            make_float2(acc[n][2 * r] * inv_l[r], acc[n][2 * r + 1] * inv_l[r]);
    } else if constexpr (Ragged) {
      if (p.lse != nullptr && w.t == 0 && row < seq_rows) p.lse[static_cast<index_t>(h) * p.seq_q + seq_q0 + row] = lse;
    } else if (p.lse != nullptr && w.t == 0 && row < p.seq_q) {
      p.lse[(static_cast<index_t>(b) * p.heads + h) * p.seq_q + row] = lse;
    }
  }
  if (p.splits > 1) return;
  // O into the staging tile, two 16-byte chunks of the warp's 16 rows per stmatrix: matrices 0 and 1 are rows
  // g and g + 8 of chunk 2j, 2 and 3 those of chunk 2j + 1 (each an accumulator's 8 × 8 piece). Lane l gives row
  // 8·((l / 8) % 2) + l % 8 of chunk 2j + l / 16; as rows start at multiples of 8, its swizzled place in the atom
  // is chunk (2j mod 8) ^ (l / 16) ^ (l % 8), and panel j / 4. Rows past seq_q are staged too (never stored).
  const int lane = 4 * w.g + w.t;
  const int row = w.row0 - q0 + 8 * ((lane >> 3) & 1) + (lane & 7);
  const int c = (lane >> 4) ^ (lane & 7);
  const std::uint32_t base = smem_address(stage) + std::uint32_t(row * 128);
#pragma unroll
  for (int j = 0; j < D / 16; ++j) {
    const std::uint32_t at = base + std::uint32_t((j >> 2) * (BM * 128) + ((((2 * j) & 7) ^ c) << 4));
    stmatrix_x4(at, mma_type<E>::pack(acc[2 * j][0] * inv_l[0], acc[2 * j][1] * inv_l[0]),
                mma_type<E>::pack(acc[2 * j][2] * inv_l[1], acc[2 * j][3] * inv_l[1]),
                mma_type<E>::pack(acc[2 * j + 1][0] * inv_l[0], acc[2 * j + 1][1] * inv_l[0]),
                mma_type<E>::pack(acc[2 * j + 1][2] * inv_l[1], acc[2 * j + 1][3] * inv_l[1]));
  }
}

/// Copies rows [r0, r1) of the staged O tile (panel layout, `BM` rows) to rows q0 + r of `o` (row stride `stride`),
/// those below `row_end` only, `chunks` 16-byte chunks a row, by `threads` threads of which this is `tid`.
template <int BM, class E>
__device__ __forceinline__ void store_rows(E* o, index_t stride, const E* stage, int q0, int r0, int r1, int row_end,
                                           int chunks, int tid, int threads) {
  for (int c = tid; c < (r1 - r0) * chunks; c += threads) {
    const int r = r0 + c / chunks, ch = c % chunks;
    if (q0 + r < row_end)
      *reinterpret_cast<uint4*>(o + (q0 + r) * stride + ch * 8) =
          *reinterpret_cast<const uint4*>(stage + atom_offset<BM>(r, ch));
  }
}

/// The kernel of tiles with several blocks per multiprocessor (hopper_tile::warp_specialized false): every warp
/// computes. Q comes by cp.async (every thread, once per block); K and V tiles by TMA (thread 0 issues a tensor copy
/// per 64-column panel, completing on the buffer's mbarrier, which every thread waits on); one block barrier per
/// key tile guards the buffers.
template <class E, class Tile, class Mask, bool Mods = false>
__global__ void __launch_bounds__(Tile::threads, Tile::min_blocks)
    flash_hopper_kernel(const __grid_constant__ flash_params_t<Mask> p) {
#if FUSEDATTN_WGMMA_COMPILED
  constexpr int D = Tile::head_dim, BM = Tile::block_m, BN = Tile::block_n;
  constexpr bool band = mask_traits<Mask>::one_segment;  // one key segment: no tile reaches past it
  constexpr std::uint32_t atom = Tile::atom_bytes;          // K-major: 8 rows to the next 8 rows
  constexpr std::uint32_t v_panel = BN * 128;               // V, N-major: one 64-column panel to the next
  extern __shared__ unsigned char smem_raw[];
  const std::uint32_t raw = smem_address(smem_raw);
  E* sq = reinterpret_cast<E*>(smem_raw + ((raw + atom - 1) / atom * atom - raw));  // [BM][D] in panels
  E* sk = sq + BM * D;      // [2][BN][D] in panels
  E* sv = sk + 2 * BN * D;  // [2][BN][D] in panels
  std::uint64_t* full = reinterpret_cast<std::uint64_t*>(sv + 2 * BN * D);  // K buffers 0, 1; V buffers 2, 3
  if (threadIdx.x == 0)
    for (int i = 0; i < 4; ++i) mbarrier_init(full + i);

  // Heaviest q-blocks (under a causal mask: the last) start first, so the tail of the grid is short.
  const int m_block = static_cast<int>(gridDim.x) - 1 - static_cast<int>(blockIdx.x);
  const int h = blockIdx.y, b = blockIdx.z / p.splits, split = blockIdx.z % p.splits, h_kv = h / p.group;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wg = warp / 4;
  const int q0 = m_block * BM;
  const int q1 = q0 + BM < p.seq_q ? q0 + BM : p.seq_q;
  // This warp holds rows [row0, row0 + 16) of the block (warpgroup wg's 64 rows start at 64·wg).
  const int row0 = q0 + 16 * warp;
  const softmax_rows w{row0, row0 + 16 < p.seq_q ? row0 + 16 : p.seq_q, lane / 4, lane % 4, p.scale_log2};

  const E* q_head = static_cast<const E*>(p.q) + b * p.q_stride.b + h * p.q_stride.h;

  // Q streams in while the mask's first segment is looked up (a block-sparse layout: dependent global loads).
  load_atoms<Tile, BM>(sq, q_head + q0 * p.q_stride.s, p.q_stride.s, q1 - q0);
  // The key tiles, as in flash_forward_kernel (key_tiles); k0 = -1 ends the walk.
  const Mask mask = head_mask(p.mask, b, h);
  key_tiles<Mask, BN> tiles(mask, q0, q1);
  const band32 rule = element_rule(mask);
  const int k_first = tiles.first(split, p.splits);
  [[maybe_unused]] const tile_mods mods = make_tile_mods<Mods>(mask, h, p.scale_log2);
  // TMA: one thread announces the tile's bytes on the buffer's mbarrier and copies it panel by panel (keys past
  // seq_kv arrive as zeros); each wait flips the buffer's expected parity, every copy being waited for once.
  auto tma_tile = [&](E* dst, const CUtensorMap& map, const int (&order)[3], int k0, std::uint64_t* bar) {
    if (threadIdx.x == 0) {
      int at[3];
      for (int i = 0; i < 3; ++i) at[i] = order[i] == 1 ? k0 : order[i] == 2 ? h_kv : b;
      mbarrier_expect_bytes(bar, BN * D * int(sizeof(E)));
      for (int c = 0; c < D / 64; ++c) tma_load_4d(dst + c * BN * 64, &map, c * 64, at[0], at[1], at[2], bar);
    }
  };
  unsigned parity = 0;  // bit i: the phase of mbarrier `full + i` to wait for next
  auto wait_tile = [&](int i) {
    mbarrier_wait(full + i, (parity >> i) & 1u);
    parity ^= 1u << i;
  };
  auto load_k = [&](int k0, int stage) { tma_tile(sk + stage * BN * D, p.k_map, p.k_order, k0, full + stage); };
  auto load_v = [&](int k0, int stage) { tma_tile(sv + stage * BN * D, p.v_map, p.v_order, k0, full + 2 + stage); };

  // The wgmma descriptors, built once (desc_plus moves them to a buffer).
  const std::uint64_t q_desc = swizzled_descriptor(sq + wg * 64 * 64, 16, atom);
  const std::uint64_t k_desc = swizzled_descriptor(sk, 16, atom);
  const std::uint64_t v_desc = swizzled_descriptor(sv, v_panel, atom);

  float acc[D / 8][4];
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};
#pragma unroll
  for (int n = 0; n < D / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;

  // Tile 0's segment, read before the walk moves on to tile 1.
  int tile_begin = tiles.seg_begin, tile_end = tiles.seg_end;
  int k_next = -1;
  cp_async_commit();  // Q
  // K_0, and K_1 and V_0 into the free buffers at once, so no copy waits on tile 0's scores (a short q-block, as in
  // a block-sparse row of a few tiles, would otherwise wait for two memory latencies before its loop).
  if (k_first >= 0) {
    load_k(k_first, 0);
    k_next = tiles.next(k_first);
    if (k_next >= 0) load_k(k_next, 1);
    load_v(k_first, 0);

    // Tile 0: S_0 and its softmax (nothing to add to O yet); K_1 and V_0 stream in meanwhile.
    std::uint32_t pk[BN / 8][2];  // P of the tile whose P·V is next
    cp_async_wait<0>();  // Q, visible to wgmma after the proxy fence and the barrier
    fence_proxy_async();
    __syncthreads();
    wait_tile(0);
    int k0 = k_first, k_stage = 1, v_stage = 0;
    {
      float s[BN / 8][4];
      float alpha[2];
      issue_scores<E, Tile>(s, q_desc, k_desc);
      wgmma_wait<0>();
      fence_operands(s);
      tile_softmax<E, BN, band, Mods>(s, pk, alpha, m_run, l_run, rule, w, k0, tile_begin, tile_end, mods);
    }
    for (k0 = k_next; k0 >= 0; k0 = k_next) {
      // Every warpgroup is done with S_{j-1} (K buffer k_stage ^ 1) and P_{j-2}·V_{j-2} (V buffer v_stage ^ 1),
      // so K_{j+1} and V_j may overwrite them; then K_j and V_{j-1} must have landed.
      __syncthreads();
      wait_tile(k_stage);
      wait_tile(2 + v_stage);
      tile_begin = tiles.seg_begin;
      tile_end = tiles.seg_end;

      float s[BN / 8][4];
      std::uint32_t pk_next[BN / 8][2];
      float alpha[2];
      issue_scores<E, Tile>(s, q_desc, desc_plus(k_desc, k_stage * BN * D));
      issue_pv<E, Tile>(acc, pk, desc_plus(v_desc, v_stage * BN * D));
      // The next tile is found and its loads issued while the wgmma run.
      k_next = tiles.next(k0);
      if (k_next >= 0) load_k(k_next, k_stage ^ 1);
      load_v(k0, v_stage ^ 1);
      wgmma_wait<1>();  // S_j is ready; P_{j-1}·V_{j-1} may still run
      fence_operands(s);
      tile_softmax<E, BN, band, Mods>(s, pk_next, alpha, m_run, l_run, rule, w, k0, tile_begin, tile_end, mods);
      wgmma_wait<0>();
      fence_operands(acc);
      fence_fragments(pk);
      rescale<D>(acc, alpha);
#pragma unroll
      for (int n = 0; n < BN / 8; ++n) pk[n][0] = pk_next[n][0], pk[n][1] = pk_next[n][1];
      k_stage ^= 1;
      v_stage ^= 1;
    }
    // The last tile's P·V.
    wait_tile(2 + v_stage);
    issue_pv<E, Tile>(acc, pk, desc_plus(v_desc, v_stage * BN * D));
    wgmma_wait<0>();
    fence_operands(acc);
    fence_fragments(pk);
  }

  // O is staged through the Q tile and written as 16-byte chunks; a split writes its f32 part straight.
  cp_async_wait<0>();  // a block with no key tile never waited for its Q copy, which must land before O is staged
  __syncthreads();     // every warpgroup's reads of Q are done
  finish_rows<E, Tile, Mask, Mods>(p, acc, m_run, l_run, w, b, h, split, q0, sq, mods);
  if (p.splits > 1) return;
  __syncthreads();
  store_rows<BM>(static_cast<E*>(p.o) + b * p.o_stride.b + h * p.o_stride.h, p.o_stride.s, sq, q0, 0, BM, p.seq_q,
                 Tile::chunks, threadIdx.x, Tile::threads);
#else
  (void)p;
#endif
}

/// Shared-memory bookkeeping of the warp-specialised kernel, after its tiles: the mbarriers of each buffer and what
/// the producer tells the consumers about each key tile (its keys, its run, whether it ends its item) and each item.
struct hopper_ws_shared {
  std::uint64_t q_full[2], q_empty[2], k_full[2], k_empty[2], v_full[2], v_empty[2];
  int k0[2], seg_begin[2], seg_end[2], last[2];  ///< per K buffer
  int has_tiles[2];                               ///< per Q buffer: the item has at least one key tile
  int item[2][4];                                 ///< per Q buffer: the item's q-block, head, batch, split
  ragged_cursor cursor;                           ///< ragged calls, the producer's: its items' sequence
  int claim[3];   ///< ragged calls, the producer's: the item it was last asked for, that item, the next one
  int seq[2][3];  ///< per Q buffer, ragged calls: the sequence's first row, its rows and its keys
};
static_assert(sizeof(hopper_ws_shared) <= 256, "hopper_tile::ws_smem_bytes leaves 256 bytes for the bookkeeping");

/// Registers a thread of flash_hopper_ws_kernel keeps after setmaxnreg. The block holds what its threads were
/// launched with — 64K shared out evenly, in steps of 8 (168 a thread for two consumer warpgroups, 128 for three,
/// 96 for four) — and setmaxnreg only moves registers within it (an increase past it waits forever): the producer
/// warpgroup gives back all but hopper_producer_registers, and each consumer thread takes an equal share of the
/// rest, in steps of 8, at most 240.
inline constexpr int hopper_producer_registers = 24;
template <int ConsumerWarpgroups>
inline constexpr int hopper_launch_registers = 65536 / (128 * (ConsumerWarpgroups + 1)) / 8 * 8;
template <int ConsumerWarpgroups>
inline constexpr int hopper_consumer_registers =
    std::min(240, (hopper_launch_registers<ConsumerWarpgroups> * 128 * (ConsumerWarpgroups + 1) -
                   hopper_producer_registers * 128) /
                      (128 * ConsumerWarpgroups) / 8 * 8);
static_assert(hopper_consumer_registers<2> == 240 && hopper_consumer_registers<3> == 160 &&
              hopper_consumer_registers<4> == 112);

/// One work item of the warp-specialised kernel: a q-block of one (batch, head) and one split-KV part.
struct hopper_item {
  int m_block, h, b, split;
};

/// The tile scheduler of flash_hopper_ws_kernel: the block's n-th item is index(n) = blockIdx.x + n·gridDim.x (a
/// persistent grid of one block per SM, or one block per item), while index(n) < items; at(x) is item x, in the
/// order of flash_hopper_kernel's grid: the q-blocks of one (batch, head) together, heaviest (under a causal mask:
/// the last) first; then heads, splits, batch. Or (p.q_block_major) the last q-block of every head first, then the
/// one before ..., dealt in a snake: the other way round every second round, so that the block handed the heaviest
/// item of one round gets the lightest of the next. A view of the kernel's parameters and of the counts it formed
/// (references: the producer and the consumers read them where the kernel keeps them); `BM` is the tile's block_m.
/// Its members are inlined as ordinary functions, not forced: forcing them changes ptxas's schedule of the kernel.
template <class Mask, int BM>
struct hopper_ws_scheduler {
  const flash_params_t<Mask>& p;
  const int& q_blocks;  ///< q-blocks per (batch, head): (p.seq_q + BM − 1) / BM
  const int& items;     ///< work items of the call: q_blocks · heads · splits · batch
  /// Item x.
  __device__ hopper_item at(int x) const {
    hopper_item it;
    if (p.q_block_major) {
      const int per_q_block = p.heads * p.splits * p.batch;
      it.m_block = q_blocks - 1 - x / per_q_block;
      x %= per_q_block;
    } else {
      it.m_block = q_blocks - 1 - x % q_blocks;
      x /= q_blocks;
    }
    it.h = x % p.heads;
    x /= p.heads;
    it.split = x % p.splits;
    it.b = x / p.splits;
    return it;
  }
  /// The block's n-th item.
  __device__ int index(int n) const {
    const int g = static_cast<int>(gridDim.x), bx = static_cast<int>(blockIdx.x);
    return n * g + (p.q_block_major && (n & 1) ? g - 1 - bx : bx);
  }
};

/// The producer of flash_hopper_ws_kernel, run by one thread of warpgroup 0: walks the block's items (`sched`) and
/// their key tiles (key_tiles) and issues the TMA copies of Q, K and V into the buffers as the consumers free them
/// ("empty" mbarriers), writing beside each K buffer the tile's keys, its run and whether it ends its item, and beside
/// each Q buffer the item and whether it has a key tile. With two Q buffers the next item's Q is issued once the
/// current item's second key tile is (not after its last), so it has landed when the consumers turn to it.
/// Buffers are used round robin: item n in Q buffer n % QB, the block's key tile kt in K and V buffer kt % 2; a
/// "full" barrier's phase for them is n / QB (kt / 2) mod 2, and its "empty" partner's the one before.
/// It forms the shared-memory layout from the dynamic array itself, as the kernel does (the arithmetic then folds
/// into each access as in one function; handed the kernel's pointers, ptxas schedules the kernel differently).
/// `Ragged` (ragged.cuh): items come from the counter p.ragged_next, their sequences from a ragged_cursor; each Q
/// buffer also gets the item's sequence (ws.seq), copies address the sequence's rows and keys in the packed maps,
/// and after the last item the next Q buffer gets the end (item −1, an arrival without a copy).
template <class E, class Tile, class Mask, bool Ragged = false>
__device__ __forceinline__ void hopper_ws_produce(const flash_params_t<Mask>& p,
                                                  const hopper_ws_scheduler<Mask, Tile::block_m>& sched) {
  constexpr int D = Tile::head_dim, BM = Tile::block_m, BN = Tile::block_n, QB = Tile::q_buffers;
  constexpr std::uint32_t atom = Tile::atom_bytes;
  extern __shared__ unsigned char smem_raw[];
  const std::uint32_t raw = smem_address(smem_raw);
  E* sq = reinterpret_cast<E*>(smem_raw + ((raw + atom - 1) / atom * atom - raw));  // [QB][BM][D] in panels
  E* sk = sq + QB * BM * D;                                                          // [2][BN][D] in panels
  E* sv = sk + 2 * BN * D;                                                           // [2][BN][D] in panels
  hopper_ws_shared& ws = *reinterpret_cast<hopper_ws_shared*>(sv + 2 * BN * D);
  // One tile of `rows` rows at (row, head, batch), panel by panel, completing on `bar`.
  auto tma_tile = [&](E* dst, const CUtensorMap& map, const int (&order)[3], int row, int head, int batch, int rows,
                      std::uint64_t* bar) {
    int at[3];
    for (int i = 0; i < 3; ++i) at[i] = order[i] == 1 ? row : order[i] == 2 ? head : batch;
    mbarrier_expect_bytes(bar, rows * D * int(sizeof(E)));
    for (int c = 0; c < D / 64; ++c) tma_load_4d(dst + c * rows * 64, &map, c * 64, at[0], at[1], at[2], bar);
  };
  // Item x; for a ragged batch also its sequence (first row, rows, first key, keys: ragged_cursor, every item in
  // batch 0 of the packed tensors; seq is not used otherwise). The cursor and the counter's state below live in
  // shared memory (only this thread reads them): kept in registers, they do not fit the producer's 24 after
  // setmaxnreg, and ptxas spills (308 bytes at head_dim 128).
  [[maybe_unused]] ragged_cursor& cursor = ws.cursor;
  if constexpr (Ragged) cursor = ragged_cursor{};
  auto item_at = [&](int x, [[maybe_unused]] int (&seq)[4]) {
    if constexpr (Ragged) {
      cursor.seek(p.cu_q, p.heads, BM, x, p.cu_kv);  // reads offsets only when the sequence changes
      seq[0] = cursor.q0, seq[1] = cursor.nq, seq[2] = cursor.k0, seq[3] = cursor.nk;
      return hopper_item{cursor.m_block(x), cursor.head(x), 0, 0};
    } else {
      return sched.at(x);
    }
  };
  auto item_mask = [&](const hopper_item& it, [[maybe_unused]] const int (&seq)[4]) -> decltype(auto) {
    if constexpr (Ragged) return sequence_band(p.mask, p.shift, seq[1], seq[3]);
    else return head_mask(p.mask, it.b, it.h);
  };
  // The block's n-th item. A ragged batch under a mask with limits (p.ragged_next set) hands items out as blocks
  // ask (the block's first is blockIdx.x, the next ones come from the counter): its q-blocks differ in cost, and a
  // fixed round robin leaves some blocks twice the work of others. Item n + 1 is taken from the counter as soon as
  // n is known to be an item, so that the atomic's round trip overlaps item n's copies. Asked for n, then n again,
  // then n + 1 ...: the last answer is kept. Unmasked, every item of a sequence costs the same and the scheduler's
  // round robin (no atomics) is faster.
  [[maybe_unused]] int& asked_n = ws.claim[0];
  [[maybe_unused]] int& asked_x = ws.claim[1];
  [[maybe_unused]] int& next_x = ws.claim[2];
  if constexpr (Ragged) asked_n = -1;
  auto index = [&](int n) {
    if constexpr (Ragged) {
      if (n != asked_n) {
        asked_n = n;
        if (p.ragged_next == nullptr) {
          asked_x = sched.index(n);
        } else {
          asked_x = n == 0 ? int(blockIdx.x) : next_x;
          if (asked_x < sched.items) next_x = int(gridDim.x) + atomicAdd(p.ragged_next, 1);
        }
      }
      return asked_x;
    } else {
      return sched.index(n);
    }
  };
  // Item n's Q into buffer n % QB, once the consumers have freed it, with the item and whether it has a key tile
  // (the loop below walks the item again for its tiles: a second at() and first() on this one thread).
  auto load_q = [&](int n) {
    const int x = index(n);
    if (x >= sched.items) {
      if constexpr (Ragged) {  // the end, told to the consumers through the item's Q buffer (no copy arrives)
        const int qb = n % QB;
        mbarrier_wait(&ws.q_empty[qb], ((n / QB) & 1) ^ 1);
        ws.item[qb][0] = -1;
        mbarrier_arrive(&ws.q_full[qb]);
      }
      return;
    }
    int seq[4];
    const hopper_item it = item_at(x, seq);
    const int rows = Ragged ? seq[1] : p.seq_q;
    const int q0 = it.m_block * BM, q1 = q0 + BM < rows ? q0 + BM : rows;
    key_tiles<Mask, BN> tiles(item_mask(it, seq), q0, q1);
    const int qb = n % QB;
    mbarrier_wait(&ws.q_empty[qb], ((n / QB) & 1) ^ 1);
    // Published by the arrival below (release): the consumers read the item from here.
    ws.has_tiles[qb] = tiles.first(it.split, p.splits) >= 0;
    ws.item[qb][0] = it.m_block, ws.item[qb][1] = it.h, ws.item[qb][2] = it.b, ws.item[qb][3] = it.split;
    if constexpr (Ragged) ws.seq[qb][0] = seq[0], ws.seq[qb][1] = seq[1], ws.seq[qb][2] = seq[3];
    tma_tile(sq + qb * BM * D, p.q_map, p.q_order, (Ragged ? seq[0] : 0) + q0, it.h, it.b, BM, &ws.q_full[qb]);
  };
  constexpr bool early_q = QB > 1;
  if (early_q) load_q(0);
  int kt = 0;
  for (int n = 0, x = index(0); x < sched.items; x = index(++n)) {
    int seq[4];
    const hopper_item it = item_at(x, seq);
    const int rows = Ragged ? seq[1] : p.seq_q, key0 = Ragged ? seq[2] : 0;
    const int q0 = it.m_block * BM, q1 = q0 + BM < rows ? q0 + BM : rows;
    const Mask mask = item_mask(it, seq);
    key_tiles<Mask, BN> tiles(mask, q0, q1);
    const int k_first = tiles.first(it.split, p.splits);
    if (!early_q) load_q(n);
    if (early_q && k_first < 0) load_q(n + 1);
    for (int k0 = k_first, k_next, i = 0; k0 >= 0; k0 = k_next, ++kt, ++i) {
      const int stage = kt % 2, parity = ((kt / 2) & 1) ^ 1;
      const int seg_begin = tiles.seg_begin, seg_end = tiles.seg_end;  // the run of this tile
      k_next = tiles.next(k0);
      mbarrier_wait(&ws.k_empty[stage], parity);
      ws.k0[stage] = k0;
      ws.seg_begin[stage] = seg_begin;
      ws.seg_end[stage] = seg_end;
      ws.last[stage] = k_next < 0;
      tma_tile(sk + stage * BN * D, p.k_map, p.k_order, key0 + k0, it.h / p.group, it.b, BN, &ws.k_full[stage]);
      mbarrier_wait(&ws.v_empty[stage], parity);
      tma_tile(sv + stage * BN * D, p.v_map, p.v_order, key0 + k0, it.h / p.group, it.b, BN, &ws.v_full[stage]);
      if (early_q && (i == 1 || (k_next < 0 && i == 0))) load_q(n + 1);
    }
  }
  // The end, in the buffer of the item the block was refused (with two Q buffers the last item's load_q(n + 1) told it).
  if constexpr (Ragged && !early_q) load_q(asked_n);
}

/// Turns on the tensor cores of flash_hopper_ws_kernel's consumer warpgroups (hopper_tile::take_turns; without, both
/// do nothing): warpgroup wg issues its wgmma once warpgroup wg − 1 (cyclically) has finished its own, so one
/// warpgroup's softmax runs while the next one's products do. Barrier 8 + wg (1 + wg is the O store's): this
/// warpgroup's 128 threads wait there for the 128 of the one before it. Inlined as ordinary functions, not forced
/// (as the scheduler's).
template <class Tile>
struct hopper_ws_turns {
  static_assert(Tile::warpgroups <= 7, "named barriers 1..7 stage O, 8..15 pass the turns");
  static constexpr int turn_threads = 256;
  const int& wg;  ///< this thread's consumer warpgroup
  /// Waits until the warpgroup before this one has issued and finished its products.
  __device__ void wait() const {
    if constexpr (Tile::take_turns) named_barrier(8 + wg, turn_threads);
  }
  /// Hands the tensor cores to the next warpgroup.
  __device__ void pass() const {
    if constexpr (Tile::take_turns) named_barrier_arrive(8 + (wg + 1) % Tile::warpgroups, turn_threads);
  }
};

/// The kernel of tiles with one block per multiprocessor (hopper_tile::warp_specialized), FlashAttention-3's
/// structure, assembled from roles: shared state (the tiles, then hopper_ws_shared), the tile scheduler
/// (hopper_ws_scheduler: the block's work items, q-block, head, batch, split), the producer (hopper_ws_produce:
/// warpgroup 0, one thread issuing the TMA copies of Q (two buffers where they fit), K and V (two each) as soon as
/// the consumers free a buffer), the consumers' turns on the tensor cores (hopper_ws_turns), and the consumers'
/// mainloop and epilogue below, which stay in the kernel: moved into functions of their own, the same instructions
/// come out in another order. The producer writes the item's coordinates beside its Q, so the consumers do no index
/// arithmetic between items.
/// Warpgroups 1.. are the consumers, 64 query rows each, running flash_hopper_kernel's per-tile sequence with no
/// block barrier: each waits on a buffer's "full" mbarrier and frees it once its wgmma have read it. A warpgroup
/// stages its O rows in its own rows of the item's Q buffer and one of its threads writes them with a TMA store
/// (tensor map p.o_map; rows past seq_q are clipped by the copy). The buffer is freed once the copy has read them;
/// with two Q buffers that thread waits for the read only after the next item's first scores are issued
/// (release_stored). The producer gives back registers (setmaxnreg 24) so that the consumers may take 240.
template <class E, class Tile, class Mask, bool Mods = false, bool Ragged = false>
__global__ void __launch_bounds__(Tile::threads + 128, 1)
    flash_hopper_ws_kernel(const __grid_constant__ flash_params_t<Mask> p) {
  static_assert(!Ragged || std::is_same_v<Mask, band_mask>, "a ragged batch takes a band mask");
#if FUSEDATTN_WGMMA_COMPILED
  constexpr int D = Tile::head_dim, BM = Tile::block_m, BN = Tile::block_n, QB = Tile::q_buffers;
  constexpr bool band = mask_traits<Mask>::one_segment;  // one key segment: no tile reaches past it
  constexpr std::uint32_t atom = Tile::atom_bytes;
  constexpr std::uint32_t v_panel = BN * 128;
  extern __shared__ unsigned char smem_raw[];
  const std::uint32_t raw = smem_address(smem_raw);
  E* sq = reinterpret_cast<E*>(smem_raw + ((raw + atom - 1) / atom * atom - raw));  // [QB][BM][D] in panels
  E* sk = sq + QB * BM * D;                                                          // [2][BN][D] in panels
  E* sv = sk + 2 * BN * D;                                                           // [2][BN][D] in panels
  hopper_ws_shared& ws = *reinterpret_cast<hopper_ws_shared*>(sv + 2 * BN * D);
  if (threadIdx.x == 0) {
    for (int i = 0; i < 2; ++i) {
      mbarrier_init(&ws.q_full[i]);
      mbarrier_init(&ws.k_full[i]);
      mbarrier_init(&ws.v_full[i]);
      mbarrier_init(&ws.q_empty[i], Tile::threads);  // every consumer thread arrives
      mbarrier_init(&ws.k_empty[i], Tile::threads);
      mbarrier_init(&ws.v_empty[i], Tile::threads);
    }
  }
  __syncthreads();

  // The work items (hopper_ws_scheduler) and the buffers' round robin (hopper_ws_produce).
  const int q_blocks = (p.seq_q + BM - 1) / BM;
  const int items = Ragged ? p.ragged_items : q_blocks * p.heads * p.splits * p.batch;
  const hopper_ws_scheduler<Mask, BM> sched{p, q_blocks, items};

  if (threadIdx.x < 128) {  // ---- the producer warpgroup: thread 0 issues every copy, the others leave
    if constexpr (Tile::warpgroups > 1) warpgroup_registers_dec<hopper_producer_registers>();
    if (threadIdx.x != 0) return;
    hopper_ws_produce<E, Tile, Mask, Ragged>(p, sched);
    return;
  }

  // ---- the consumer warpgroups
  // hopper_consumer_registers: 240 a thread for two consumer warpgroups, 160 for three, 112 for four; one has 255.
  if constexpr (Tile::warpgroups > 1) warpgroup_registers_inc<hopper_consumer_registers<Tile::warpgroups>>();
  const int ct = threadIdx.x - 128;  // consumer thread
  const int warp = ct / 32, lane = ct % 32, wg = warp / 4;
  // This thread is done reading a buffer: every consumer thread arrives (an arrival by lane 0 only, predicated on
  // the lane, made ptxas serialise the wgmma: note C7513).
  auto release = [&](std::uint64_t* bar) { mbarrier_arrive(bar); };
  constexpr bool turns = Tile::take_turns;
  const hopper_ws_turns<Tile> turn{wg};
  if (wg == Tile::warpgroups - 1) turn.pass();  // warpgroup 0 goes first
  const std::uint64_t q_desc0 = swizzled_descriptor(sq + wg * 64 * 64, 16, atom);
  const std::uint64_t k_desc = swizzled_descriptor(sk, 16, atom);
  const std::uint64_t v_desc = swizzled_descriptor(sv, v_panel, atom);
  float acc[D / 8][4];
  int kt = 0;
  // The thread of each warpgroup that stores O by TMA does not wait for the store to have read the staged rows before
  // the next item (with two Q buffers, the next item's Q is in the other one): it frees the buffer once the next
  // item's first scores are issued (release_stored), or at the end. Its warp would otherwise hold up its
  // warpgroup's next products for the read. With one Q buffer the next Q needs this buffer, so it waits at once.
  constexpr bool defer_store_wait = QB > 1;
  int stored_qb = -1;  // the Q buffer a TMA store of this thread may still be reading (−1: none)
  auto release_stored = [&] {
    if (defer_store_wait && stored_qb >= 0) {
      bulk_wait_read<0>();
      release(&ws.q_empty[stored_qb]);
      stored_qb = -1;
    }
  };
  // The consumers' items: the scheduler's, or a ragged batch's as the producer is handed them, until it writes the
  // end (−1) in place of an item.
  for (int n = 0, x = sched.index(0); Ragged || x < items; x = sched.index(++n)) {
    const int qb = n % QB;
    const std::uint64_t q_desc = desc_plus(q_desc0, qb * BM * D);
    float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};
#pragma unroll
    for (int nn = 0; nn < D / 8; ++nn) acc[nn][0] = acc[nn][1] = acc[nn][2] = acc[nn][3] = 0.f;

    mbarrier_wait(&ws.q_full[qb], (n / QB) & 1);
    if constexpr (Ragged)
      if (ws.item[qb][0] < 0) break;
    // The item, as the producer wrote it beside its Q (the scheduler's divisions stay off this path).
    const hopper_item it{ws.item[qb][0], ws.item[qb][1], ws.item[qb][2], ws.item[qb][3]};
    const int q0 = it.m_block * BM;
    const int row0 = q0 + 16 * warp;
    // A ragged batch's item: its sequence's first row, rows and keys, and the mask bound to them.
    [[maybe_unused]] int seq_q0 = 0, seq_rows = 0;
    [[maybe_unused]] band_mask seq_mask;
    if constexpr (Ragged) {
      seq_q0 = ws.seq[qb][0], seq_rows = ws.seq[qb][1];
      seq_mask = sequence_band(p.mask, p.shift, seq_rows, ws.seq[qb][2]);
    }
    const int row_end = Ragged ? seq_rows : p.seq_q;
    const softmax_rows w{row0, row0 + 16 < row_end ? row0 + 16 : row_end, lane / 4, lane % 4, p.scale_log2};
    const band32 rule = [&] {
      if constexpr (Ragged) return element_rule(seq_mask);
      else return element_rule(head_mask(p.mask, it.b, it.h));
    }();
    [[maybe_unused]] const tile_mods mods = [&] {
      if constexpr (Ragged) return make_tile_mods<Mods>(seq_mask, it.h, p.scale_log2);
      else return make_tile_mods<Mods>(p.mask, it.h, p.scale_log2);
    }();
    if (ws.has_tiles[qb]) {
      std::uint32_t pk[BN / 8][2];  // P of tile kt − 1, whose P·V is next
      mbarrier_wait(&ws.k_full[kt % 2], (kt / 2) & 1);
      bool last = ws.last[kt % 2];
      {  // tile 0 of the item: S_0 and its softmax
        // (a buffer's notes are read before it is freed: the producer then rewrites them)
        const int k0 = ws.k0[kt % 2], tile_begin = ws.seg_begin[kt % 2], tile_end = ws.seg_end[kt % 2];
        float s[BN / 8][4];
        float alpha[2];
        turn.wait();
        issue_scores<E, Tile>(s, q_desc, desc_plus(k_desc, (kt % 2) * BN * D));
        release_stored();  // the last item's O store, while S_0 runs
        wgmma_wait<0>();
        fence_operands(s);
        turn.pass();
        release(&ws.k_empty[kt % 2]);
        tile_softmax<E, BN, band, Mods>(s, pk, alpha, m_run, l_run, rule, w, k0, tile_begin, tile_end, mods);
      }
      for (++kt; !last; ++kt) {  // S_j with P_{j-1}·V_{j-1}, as in flash_hopper_kernel
        const int stage = kt % 2;
        mbarrier_wait(&ws.k_full[stage], (kt / 2) & 1);
        mbarrier_wait(&ws.v_full[stage ^ 1], ((kt - 1) / 2) & 1);
        const int k0 = ws.k0[stage], tile_begin = ws.seg_begin[stage], tile_end = ws.seg_end[stage];
        last = ws.last[stage];
        float s[BN / 8][4];
        float alpha[2];
        turn.wait();
        issue_scores<E, Tile>(s, q_desc, desc_plus(k_desc, stage * BN * D));
        issue_pv<E, Tile>(acc, pk, desc_plus(v_desc, (stage ^ 1) * BN * D));
        if constexpr (turns) {  // both products done before the softmax: the turn passes when the tensor cores free
          wgmma_wait<0>();
          fence_operands(s);
          fence_operands(acc);
          fence_fragments(pk);
          turn.pass();
          release(&ws.k_empty[stage]);
          release(&ws.v_empty[stage ^ 1]);
          // Into pk_next, then copied: packing straight into pk (free here) changes ptxas's schedule of this
          // kernel for the worse.
          std::uint32_t pk_next[BN / 8][2];
          tile_softmax<E, BN, band, Mods>(s, pk_next, alpha, m_run, l_run, rule, w, k0, tile_begin, tile_end, mods);
#pragma unroll
          for (int nn = 0; nn < BN / 8; ++nn) pk[nn][0] = pk_next[nn][0], pk[nn][1] = pk_next[nn][1];
        } else {  // S_j's exponentials under P_{j-1}·V_{j-1}; P_j, in f32 meanwhile, is packed into pk once that
                  // product has finished (FlashAttention-3's order: one set of P registers, not two)
          wgmma_wait<1>();
          fence_operands(s);
          release(&ws.k_empty[stage]);
          tile_softmax<E, BN, band, Mods, false>(s, pk, alpha, m_run, l_run, rule, w, k0, tile_begin, tile_end, mods);
          wgmma_wait<0>();
          fence_operands(acc);
          fence_fragments(pk);
          release(&ws.v_empty[stage ^ 1]);
          pack_p<E, BN>(s, pk);
        }
        rescale<D>(acc, alpha);
      }
      // The last tile's P·V.
      const int v_stage = (kt - 1) % 2;
      mbarrier_wait(&ws.v_full[v_stage], ((kt - 1) / 2) & 1);
      turn.wait();
      issue_pv<E, Tile>(acc, pk, desc_plus(v_desc, v_stage * BN * D));
      wgmma_wait<0>();
      fence_operands(acc);
      fence_fragments(pk);
      turn.pass();
      release(&ws.v_empty[v_stage]);
    }

    // O is staged through this warpgroup's 64 rows of the item's Q buffer (only this warpgroup read them) and
    // written by the warpgroup; then the buffer is freed for the item after next (by the storing thread once the
    // store has read it).
    release_stored();  // an item without key tiles issued no scores
    E* stage = sq + qb * BM * D;
    finish_rows<E, Tile, Mask, Mods, Ragged>(p, acc, m_run, l_run, w, it.b, it.h, it.split, q0, stage, mods, seq_q0,
                                             seq_rows);
    fence_proxy_async();  // the staged rows (generic proxy) precede the TMA store's reads, the Q reads its next write
    // A ragged batch's warpgroup whose 64 rows run past its sequence: a TMA store of the box would write the next
    // sequence's rows, so its threads copy the staged rows that belong to the sequence (16-byte chunks of the
    // problem's columns).
    if (Ragged && q0 + 64 * (wg + 1) > seq_rows) {
      named_barrier(1 + wg, 128);
      store_rows<BM>(static_cast<E*>(p.o) + it.h * p.o_stride.h + static_cast<index_t>(seq_q0) * p.o_stride.s,
                     p.o_stride.s, stage, q0, 64 * wg, 64 * wg + 64, seq_rows, p.head_dim > 0 ? p.head_dim / 8 : D / 8,
                     ct % 128, 128);
      fence_proxy_async();  // these reads (generic proxy) precede the next Q's TMA write into the buffer
    } else if (p.splits == 1) {
      named_barrier(1 + wg, 128);  // this warpgroup's rows are staged
      if (ct % 128 == 0) {
        int at[3];
        for (int i = 0; i < 3; ++i)
          at[i] = p.o_order[i] == 1 ? seq_q0 + q0 + 64 * wg : p.o_order[i] == 2 ? it.h : it.b;
#pragma unroll
        for (int c = 0; c < D / 64; ++c)
          tma_store_4d(&p.o_map, stage + c * BM * 64 + wg * 64 * 64, c * 64, at[0], at[1], at[2]);
        bulk_commit();
        if constexpr (defer_store_wait) stored_qb = qb;
        else bulk_wait_read<0>();
      }
    }
    if (stored_qb != qb) release(&ws.q_empty[qb]);  // the storing thread frees it in release_stored
  }
  release_stored();  // the block's last store has read its rows before the block's shared memory goes
  if (wg == 0) turn.wait();  // the last warpgroup's last pass (no barrier is left with arrivals pending)
#else
  (void)p;
#endif
}

/// Writes FUSEDATTN_WGMMA_COMPILED of the code the device runs. A template only so that a program may include this
/// header from several .cu files (a plain __global__ defined in a header is defined once per file: a link error).
template <int Unused = 0>
__global__ void wgmma_probe_kernel(int* compiled) { *compiled = FUSEDATTN_WGMMA_COMPILED; }

/// True when the current device is a Hopper (compute capability 9.0) and this program carries sm_90a code for it
/// (the Hopper kernel's body exists only there). Asked of the device once per device, by a one-thread probe launch
/// and a synchronous copy; while `stream` is being captured into a graph nothing is launched and the answer is
/// false until a call outside capture has asked.
inline bool hopper_flash_ready(cudaStream_t stream) {
  static std::atomic<int> known[max_cached_devices];  // 0 not asked, 1 yes, 2 no (zero-initialised: static storage)
  int device = 0, major = 0, minor = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device >= max_cached_devices ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  if (major != 9 || minor != 0) return false;
  if (known[device] != 0) return known[device] == 1;
  bool capturing = false;
  if (!stream_capturing(stream, capturing) || capturing) {
    cudaGetLastError();
    return false;
  }
  int* flag = nullptr;
  int compiled = 0;
  bool asked = cudaMalloc(&flag, sizeof(int)) == cudaSuccess;
  if (asked) {
    wgmma_probe_kernel<><<<1, 1>>>(flag);
    asked = cudaMemcpy(&compiled, flag, sizeof(int), cudaMemcpyDeviceToHost) == cudaSuccess;
    cudaFree(flag);
  }
  cudaGetLastError();
  known[device] = asked && compiled == 1 ? 1 : 2;
  return known[device] == 1;
}

/// The Hopper kernel's tile for a head dimension, chosen among the tiles bench/gpu times (FUSEDATTN_BENCH_TILE_SWEEP):
/// 128 query rows (two warpgroups) for all; head_dim 128 takes 128-key tiles and one block per multiprocessor
/// (161 KB of shared memory, 220 registers a thread), head_dim 64 takes 64-key tiles and two blocks (49 KB each, at
/// most 128 registers), head_dim 256 80-key tiles and one block (225 KB, the most that fits: 96-key tiles do not;
/// 80 keys beat 64 by a few per cent), head_dim 192 (three 64-column panels) 112-key tiles and one block (217 KB,
/// one Q buffer; on an H200, 80-key tiles with two Q buffers tie it without a mask and range from 8 % slower to 3 %
/// faster under a causal one, 96-key tiles are 8-14 % slower, and head_dim 136-192 padded to the 256 tile 16-24 %).
/// One warpgroup of 64 rows is much slower than two.
template <int HeadDim>
struct hopper_default_tile;
template <>
struct hopper_default_tile<64> {
  using type = hopper_tile<64, 64, 2>;
};
template <>
struct hopper_default_tile<128> {
  using type = hopper_tile<128, 128, 1>;
};
template <>
struct hopper_default_tile<192> {
  using type = hopper_tile<192, 112, 1>;
};
template <>
struct hopper_default_tile<256> {
  using type = hopper_tile<256, 80, 1>;
};

/// The Hopper tile for calls whose every q-block walks the whole row of keys (hopper_takes_whole_rows) and that do not
/// take hopper_turns_tile (below): head_dim 64 streams 128-key tiles with one block per multiprocessor,
/// warp-specialised; head_dim 128 and 256 keep their default. It beats the default 64-key tile on decode and on
/// unmasked calls; under a causal mask the q-blocks' rows differ in length, and two blocks per SM balance them
/// better, so causal calls keep the default.
template <int HeadDim>
struct hopper_whole_row_tile {
  using type = typename hopper_default_tile<HeadDim>::type;
};
template <>
struct hopper_whole_row_tile<64> {
  using type = hopper_tile<64, 128, 1>;
};
/// True when every q-block of the call sees every key: a band without limits (no mask), or one q-block per head
/// (decode-like calls, which split the keys). Block-sparse calls keep the default tile.
inline bool hopper_takes_whole_rows(const band_mask& m, index_t seq_q) {
  return (m.lo == -band_mask::unbounded && m.hi == band_mask::unbounded) ||
         seq_q <= hopper_whole_row_tile<64>::type::block_m;
}
inline bool hopper_takes_whole_rows(const block_sparse_mask&, index_t) { return false; }

/// How the warp-specialised kernel's work items (q-block, head, batch) reach its blocks. A persistent grid (one
/// block per SM walking the items) overlaps the next item's loads with the current one's work; one block per item
/// lets the hardware hand out the next item as an SM frees.
/// - No mask, block-sparse: persistent, head by head (items cost about the same or vary at random).
/// - Causal or window band, whose q-blocks' costs differ in order: a round robin head by head leaves some SMs the
///   long items. Dealt q-block first across heads in a snake (flash_hopper_ws_kernel) they balance, and the
///   persistent grid wins where a block has few items (at most hopper_banded_rounds); with more, one block per
///   item wins.
/// Split-KV calls (decode) always take one block per item (launch_flash_kernel).
struct hopper_schedule {
  bool persistent;
  bool q_block_major;
};
inline constexpr int hopper_banded_rounds = 8;  ///< most items per block for a persistent causal or window call
inline hopper_schedule hopper_schedule_for(const band_mask& m, index_t items, int multiprocessors) {
  if (m.lo == -band_mask::unbounded && m.hi == band_mask::unbounded) return {true, false};
  if (items <= index_t(hopper_banded_rounds) * multiprocessors) return {true, true};
  return {false, false};
}
inline hopper_schedule hopper_schedule_for(const block_sparse_mask&, index_t, int) { return {true, false}; }

/// The Hopper tile for head_dim 64 calls with many work items (hopper_takes_turns_tile): three consumer warpgroups
/// (192-row blocks) that take turns on the tensor cores (hopper_tile::take_turns), 128-key tiles. At head_dim 64 a
/// warpgroup's softmax of a tile takes about as long as its two products, and the two warpgroups of
/// hopper_whole_row_tile run both in step (ncu on (4,32,4096,64): tensor pipe and exponential unit each about half
/// busy); with three taking turns, one warpgroup's products run while the other two exponentiate. It gains on calls
/// of at least hopper_turns_min_rounds rounds of items; on fewer, larger items ((1,32,512,64): 96 items on 132
/// multiprocessors) it leaves SMs idle. Causal calls of many items take it too, one block per item.
template <int HeadDim>
struct hopper_turns_tile {
  using type = typename hopper_whole_row_tile<HeadDim>::type;
};
template <>
struct hopper_turns_tile<64> {
  using type = hopper_tile<64, 128, 1, 3>;
};
/// Fewest rounds of hopper_turns_tile's work items over the multiprocessors for it to take an unmasked call (with at
/// least two rounds flash_splits never splits the keys, so the tile has no split-KV path to serve).
inline constexpr int hopper_turns_min_rounds = 2;
/// True for a head_dim 64 call with more than one q-block of hopper_whole_row_tile<64> per head that either has no
/// mask and whose items in hopper_turns_tile<64>'s blocks fill at least hopper_turns_min_rounds rounds of the
/// device's multiprocessors, or is causal (either alignment: a band without a lower limit) with more than
/// hopper_banded_rounds rounds, so that hopper_schedule_for gives it one block per item. A window, and causal calls
/// of fewer items (a persistent grid, whose long and short items the two-blocks kernel balances better), keep
/// hopper_default_tile<64>.
inline bool hopper_takes_turns_tile(const band_mask& m, index_t batch, index_t heads, index_t seq_q,
                                    int multiprocessors) {
  using tile = hopper_turns_tile<64>::type;
  if (m.lo != -band_mask::unbounded || seq_q <= hopper_whole_row_tile<64>::type::block_m) return false;
  const index_t items = (seq_q + tile::block_m - 1) / tile::block_m * heads * batch;
  if (m.hi == band_mask::unbounded) return items >= index_t(hopper_turns_min_rounds) * multiprocessors;
  return items > index_t(hopper_banded_rounds) * multiprocessors;
}
inline bool hopper_takes_turns_tile(const block_sparse_mask&, index_t, index_t, index_t, int) { return false; }

/// Makes the tensor maps of a Hopper flash call (make_tile_map) for `Tile`'s boxes: K and V, and with `q_and_o` (the
/// warp-specialised kernel) Q and O; p.head_dim columns (0: the tile's). False when the driver refuses one.
template <class E, class Tile, class Mask>
bool make_flash_maps(flash_params_t<Mask>& p, bool q_and_o) {
  constexpr bool bf16 = std::is_same_v<E, __nv_bfloat16>;
  const int cols = p.head_dim > 0 ? p.head_dim : Tile::head_dim;
  const index_t heads_kv = p.heads / p.group;
  return make_tile_map(p.k_map, p.k_order, p.k, bf16, cols, p.seq_kv, heads_kv, p.batch, p.k_stride, Tile::block_n) &&
         make_tile_map(p.v_map, p.v_order, p.v, bf16, cols, p.seq_kv, heads_kv, p.batch, p.v_stride, Tile::block_n) &&
         (!q_and_o ||
          (make_tile_map(p.q_map, p.q_order, p.q, bf16, cols, p.seq_q, p.heads, p.batch, p.q_stride, Tile::block_m) &&
           make_tile_map(p.o_map, p.o_order, p.o, bf16, cols, p.seq_q, p.heads, p.batch, p.o_stride, 64)));
}

/// Launches the Hopper kernel of `Tile` (hopper_flash_ready must have said yes): flash_hopper_ws_kernel for a tile
/// of one block per SM, else flash_hopper_kernel; split-KV and merge as launch_flash. The kernels read K and V (the
/// warp-specialised one Q too) through tensor maps made here; should the driver refuse one (flash_applies already
/// asks for 16-byte multiple strides, which the maps need), the call runs the portable kernel instead.
/// p.head_dim below the tile's (72–120 on the 128 tile, 136–184 on the 192 tile, 200–248 on the 256 tile:
/// choose_flash_route) needs the warp-specialised kernel, whose
/// copies are all tensor maps: they read the columns past p.head_dim as zeros, which add nothing to Q·Kᵀ and give
/// P·V columns that the O store (its map stops at p.head_dim) and the merge leave out. `Mods`: the instantiation for
/// calls with score modifiers.
template <class E, class Tile, class Mask, bool Mods = false>
status launch_flash_hopper(flash_params_t<Mask> p, cudaStream_t stream) {
  const int cols = p.head_dim > 0 ? p.head_dim : Tile::head_dim;
  if constexpr (Tile::warp_specialized) {
    int multiprocessors = 0;
    if (status st = device_multiprocessors(multiprocessors); !st) return st;
    const index_t items = (p.seq_q + Tile::block_m - 1) / Tile::block_m * index_t(p.heads) * p.batch;
    const hopper_schedule schedule = hopper_schedule_for(p.mask, items, multiprocessors);
    p.q_block_major = schedule.q_block_major;
    if (make_flash_maps<E, Tile>(p, true))
      return launch_flash_kernel<E, Tile>(flash_hopper_ws_kernel<E, Tile, Mask, Mods>, Tile::ws_smem_bytes, p, stream,
                                          Tile::threads + 128,
                                          schedule.persistent && !p.per_item ? 1 : one_block_per_item);
  } else {
    // Q by cp.async reads whole rows of the tile's head_dim: no narrower head_dim here.
    if (cols == Tile::head_dim && make_flash_maps<E, Tile>(p, false))
      return launch_flash_kernel<E, Tile>(flash_hopper_kernel<E, Tile, Mask, Mods>, Tile::smem_bytes, p, stream);
  }
  return with_default_tile(cols, status{errc::unsupported, "problem.head_dim: CUDA flash has no tile for it"},
                           [&](auto tile) { return launch_flash<E, decltype(tile), Mask, Mods>(p, stream); });
}

/// Runs a ragged batch (ragged.cuh; p: the packed views, p.cu_q and p.cu_kv the device offsets, p.mask bound to
/// lengths (0, 0) and p.shift) in one launch of flash_hopper_ws_kernel<..., Ragged = true> on `Tile` (a
/// warp-specialised tile; hopper_flash_ready must have said yes), a persistent grid over the ragged work items
/// (under a mask with limits taken from a counter as blocks free, else dealt round robin), then
/// its repair pass (flash_repair_ragged_kernel: a tile's keys past its sequence are the next sequence's, masked, and
/// an inf or NaN in their V rows would reach O through the tensor-core product as for any masked key).
/// `host_cu_q`: the query offsets as the host reads them. errc::unsupported when the driver refuses a tensor map
/// (the caller then runs the sequences one by one).
template <class E, class Tile, bool Mods = false>
status launch_flash_hopper_ragged(flash_params_t<band_mask> p, const std::int32_t* host_cu_q, index_t sequences,
                                  cudaStream_t stream) {
  static_assert(Tile::warp_specialized, "a ragged batch runs the warp-specialised kernel");
  const int cols = p.head_dim > 0 ? p.head_dim : Tile::head_dim;
  p.batch = 1;  // the packed tensors
  if (!make_flash_maps<E, Tile>(p, true))
    return {errc::unsupported, "the driver refused a tensor map of the ragged batch"};
  const index_t items = ragged_items(host_cu_q, sequences, p.heads, Tile::block_m);
  if (items == 0) return {};
  int multiprocessors = 0;
  if (status st = device_multiprocessors(multiprocessors); !st) return st;
  p.splits = 1;
  p.o_part = p.lse_part = nullptr;
  p.q_block_major = 0;
  p.ragged_items = int(items);
  struct flag_owner {  // frees the repair flag and the item counter in stream order, after both kernels
    void* ptr = nullptr;
    cudaStream_t stream;
    ~flag_owner() {
      if (ptr != nullptr) cudaFreeAsync(ptr, stream);
    }
  } flag{nullptr, stream};
  if (status st = scratch_allocate(flag.ptr, 2 * sizeof(int), stream,
                                   "cudaMallocFromPoolAsync(repair pass flag, item counter)");
      !st)
    return st;
  p.nonfinite = static_cast<int*>(flag.ptr);
  // Items from a counter under a mask with limits (causal, window: q-blocks of different costs), else round robin.
  const bool limits = p.mask.lo != -band_mask::unbounded || p.mask.hi != band_mask::unbounded;
  p.ragged_next = limits ? p.nonfinite + 1 : nullptr;
  if (status st = from_cuda(cudaMemsetAsync(p.nonfinite, 0, 2 * sizeof(int), stream),
                            "cudaMemsetAsync(repair flag, item counter)");
      !st)
    return st;
  const auto kernel = flash_hopper_ws_kernel<E, Tile, band_mask, Mods, true>;
  if (status st = from_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 Tile::ws_smem_bytes),
                            "cudaFuncSetAttribute(flash kernel)");
      !st)
    return st;
  kernel<<<unsigned(std::min<index_t>(items, multiprocessors)), Tile::threads + 128, Tile::ws_smem_bytes, stream>>>(p);
  if (status st = last_launch("flash kernel (ragged)"); !st) return st;
  return with_default_tile(cols, status{errc::unsupported, "problem.head_dim: CUDA flash has no tile for it"},
                           [&](auto tile) {
                             return launch_flash_repair_ragged<E, decltype(tile), Mods>(p, host_cu_q, sequences,
                                                                                        stream);
                           });
}

}  // namespace cuda_backend
}  // namespace fusedattn
