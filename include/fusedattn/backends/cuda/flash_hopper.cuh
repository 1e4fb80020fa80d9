/// @file flash_hopper.cuh
/// The fused forward kernel on Hopper's warpgroup tensor cores (sm_90a: wgmma.mma_async), f16 and bf16 with f32
/// accumulation, head_dim 64, 128 and 256: the same function, masks, block-sparse walk, GQA, split-KV and lse as the
/// mma.sync kernel of flash.cuh, whose parameters (flash_params_t) and launch (launch_flash_kernel) it shares.
/// Not the dispatch (attend_cuda.cuh picks it on sm_90 devices when the build has sm_90a code: hopper_flash_ready).
///
/// One thread block owns block_m = 128 query rows of one (batch, head): two warpgroups of 64 rows, each warp 16 of
/// them (the m16n8 accumulator layout, as in flash.cuh). Per key tile j of block_n keys, each warpgroup runs
///   S_j = Q·K_jᵀ              (wgmma, Q and K_j from shared memory)          — issued, asynchronous
///   O  += P_{j-1}·V_{j-1}      (wgmma, P from registers, V_{j-1} from shared) — issued, asynchronous
///   mask S_j; m_j = max(m_{j-1}, rowmax(scale·S_j)); P_j = exp(scale·S_j − m_j); l = l·α + rowsum(P_j)
///                              (while P_{j-1}·V_{j-1} still runs on the tensor cores)
///   O *= α = exp(m_{j-1} − m_j) once P_{j-1}·V_{j-1} is done
/// so the softmax of one tile may overlap the P·V product of the previous one (in the SASS of CUDA 13.0, ptxas puts
/// the wait for that product before the softmax; docs/design.md, "Instruction budget"). Shared tiles are 128-byte
/// swizzled atoms (wgmma.cuh); TMA brings K_{j+1} and V_j in while tile j runs (tma.cuh; two K and two V buffers,
/// an mbarrier each, one block barrier per tile), cp.async the Q tile once. Exponentials are base 2 with scale·log2(e) folded in, as in flash.cuh.
#pragma once

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

/// Compile-time tile shape of the Hopper kernel: two warpgroups (128 query rows), `BlockN` keys per tile, two K and
/// two V buffers. `MinBlocks` blocks per multiprocessor bound the registers (__launch_bounds__).
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
  static constexpr int smem_bytes = (block_m + 4 * block_n) * HeadDim * 2 + atom_bytes + 64;
  static_assert(HeadDim == 64 || HeadDim == 128 || HeadDim == 256, "the Hopper kernel takes head_dim 64, 128 and 256");
  static_assert(BlockN == 64 || BlockN == 128, "wgmma_ss is written for block_n 64 and 128");
};

/// Offset in elements of (row, 16-byte chunk) in a tile of `Rows` rows stored as 64-column panels of 128-byte
/// swizzled atoms: panel chunk / 8 holds rows [0, Rows) of columns [64·panel, 64·panel + 64), 128 bytes a row, and
/// chunk c of row r sits at chunk c ^ (r mod 8) of its row (the layout wgmma's 128-byte swizzle mode reads).
template <int Rows>
__device__ __forceinline__ int atom_offset(int row, int chunk) {
  return (chunk >> 3) * (Rows * 64) + row * 64 + (((chunk & 7) ^ (row & 7)) << 3);
}

/// Block-wide cp.async of rows [0, Rows) of a tile (row r at `g + r·stride_s`) into the panel layout; rows at and
/// past `valid` are zero-filled (their scores are masked, their P is 0).
/// Thread t copies chunk t mod chunks of rows t / chunks + i·step (step = threads / chunks). When step is a multiple
/// of 8 all these rows have the same swizzle phase (row mod 8), so both addresses advance by a constant per step:
/// a few instructions per copy instead of a division and a swizzle each (the copies are issued inside the key
/// loop, in the same instruction stream as the softmax).
template <class Tile, int Rows, class E>
__device__ __forceinline__ void load_atoms(E* smem, const E* g, index_t stride_s, int valid) {
  constexpr int CH = Tile::chunks, step = Tile::threads / CH;
  if constexpr (Tile::threads % CH == 0 && step % 8 == 0 && Rows % step == 0) {
    const int ch = threadIdx.x % CH, r0 = threadIdx.x / CH;
    E* dst = smem + atom_offset<Rows>(r0, ch);
    const E* src = g + r0 * stride_s + ch * 8;
    if (valid >= Rows) {  // a full tile: no row test
#pragma unroll
      for (int i = 0; i < Rows / step; ++i) cp_async_16(dst + i * step * 64, src + i * step * stride_s, true);
    } else {
#pragma unroll
      for (int i = 0; i < Rows / step; ++i) {
        const bool ok = r0 + i * step < valid;
        cp_async_16(dst + i * step * 64, ok ? src + i * step * stride_s : g, ok);
      }
    }
  } else {
    for (int c = threadIdx.x; c < Rows * CH; c += Tile::threads) {
      const int r = c / CH, ch = c % CH;
      const bool ok = r < valid;
      cp_async_16(smem + atom_offset<Rows>(r, ch), g + (ok ? r : 0) * stride_s + ch * 8, ok);
    }
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

/// Q comes by cp.async (every thread, once per block); K and V tiles by TMA (one thread issues a tensor copy per
/// 64-column panel, completing on the buffer's mbarrier, which every thread waits on).
template <class E, class Tile, class Mask>
__global__ void __launch_bounds__(Tile::threads, Tile::min_blocks)
    flash_hopper_kernel(const __grid_constant__ flash_params_t<Mask> p) {
#if FUSEDATTN_WGMMA_COMPILED
  constexpr int D = Tile::head_dim, BM = Tile::block_m, BN = Tile::block_n, CH = Tile::chunks;
  constexpr bool band = std::is_same_v<Mask, band_mask>;
  constexpr float neg_inf = -INFINITY;
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
  const int g = lane / 4, t = lane % 4;  // accumulator coordinates: row group, thread in group

  // This warp holds rows [row0, row0 + 16) of the block (warpgroup wg's 64 rows start at 64·wg); this thread rows
  // row0 + g and row0 + g + 8.
  const int q0 = m_block * BM;
  const int q1 = q0 + BM < p.seq_q ? q0 + BM : p.seq_q;
  const int row0 = q0 + 16 * warp;
  const int row_end = row0 + 16 < p.seq_q ? row0 + 16 : p.seq_q;

  const E* q_head = static_cast<const E*>(p.q) + b * p.q_stride.b + h * p.q_stride.h;
  E* o_head = static_cast<E*>(p.o) + b * p.o_stride.b + h * p.o_stride.h;

  // Q streams in while the mask's first segment is looked up (a block-sparse layout: dependent global loads).
  load_atoms<Tile, BM>(sq, q_head + q0 * p.q_stride.s, p.q_stride.s, q1 - q0);
  // The key tiles, as in flash_forward_kernel (key_tiles); k0 = -1 ends the walk.
  const Mask mask = head_mask(p.mask, b, h);
  key_tiles<Mask, BN> tiles(mask, q0, q1);
  const band32 rule = element_rule(mask);
  const int k_first = tiles.first(split, p.splits);
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

  // S (64 × BN per warpgroup) = Q (64 × D) · Kᵀ (D × BN): D/16 wgmma steps of 16 head-dim columns; step kk reads
  // chunk pair kk of panel kk / 4 of this warpgroup's Q rows and of the K tile.
  // The descriptors are built once: a descriptor's address field counts 16-byte units and no tile crosses the
  // 2^18-byte window it covers, so the descriptor of an element offset is the base descriptor plus offset / 8.
  const std::uint64_t q_desc = swizzled_descriptor(sq + wg * 64 * 64, 16, atom);
  const std::uint64_t k_desc = swizzled_descriptor(sk, 16, atom);
  const std::uint64_t v_desc = swizzled_descriptor(sv, v_panel, atom);
  auto plus = [](std::uint64_t desc, int elements) { return desc + std::uint64_t(elements >> 3); };
  auto issue_scores = [&](float (&s)[BN / 8][4], int stage) {
    wgmma_fence();
    const std::uint64_t kd0 = plus(k_desc, stage * BN * D);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const int panel = kk / 4, col = (kk % 4) * 16;
      wgmma_ss<E, BN>(s, plus(q_desc, panel * BM * 64 + col), plus(kd0, panel * BN * 64 + col), kk > 0);
    }
    wgmma_commit();
  };
  // O (64 × D per warpgroup) += P (64 × BN, registers) · V (BN × D): BN/16 steps of 16 keys; the packed P of key
  // tiles 2kk, 2kk + 1 is this warp's A fragment, V rows [16kk, 16kk + 16) an N-major descriptor over the panels
  // of at most 128 output columns (head_dim 256: two products of N = 128, panels 0–1 and 2–3).
  constexpr int NV = D < 128 ? D : 128;
  float acc[D / 8][4];
  auto issue_pv = [&](std::uint32_t (&pk)[BN / 8][2], int stage) {
    fence_fragments(pk);  // P is in its registers before the first wgmma: no move may land between them
    wgmma_fence();
    const std::uint64_t vd0 = plus(v_desc, stage * BN * D);
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      const std::uint32_t a[4] = {pk[2 * kk][0], pk[2 * kk][1], pk[2 * kk + 1][0], pk[2 * kk + 1][1]};
#pragma unroll
      for (int c = 0; c < D / NV; ++c)
        wgmma_rs<E, NV>(*reinterpret_cast<float(*)[NV / 8][4]>(&acc[c * NV / 8]), a,
                        plus(vd0, (c * NV / 64) * BN * 64 + kk * 16 * 64));
    }
    wgmma_commit();
  };

  float m_run[2] = {neg_inf, neg_inf}, l_run[2] = {0.f, 0.f};
  // Mask, online softmax and packing of one score tile (rows g and g + 8 of this warp, spread over a quad): the
  // per-element mask only on tiles that need it; alpha[r] is the factor O must be rescaled by before P of this
  // tile is added.
  auto softmax = [&](float (&s)[BN / 8][4], int k0, int tile_begin, int tile_end, std::uint32_t (&pk)[BN / 8][2],
                     float (&alpha)[2]) {
    const bool past_edge = !band && (k0 < tile_begin || k0 + BN > tile_end);
    if (past_edge || rule.is_partial(row0, row_end, k0, k0 + BN)) {
#pragma unroll
      for (int n = 0; n < BN / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int c = n * 8 + 2 * t + (e & 1), i = row0 + g + 8 * (e / 2), j = k0 + c;
          bool ok = rule.allowed(i, j);
          if constexpr (!band) ok = ok && j >= tile_begin && j < tile_end;
          if (!ok) s[n][e] = neg_inf;
        }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = neg_inf;
#pragma unroll
      for (int n = 0; n < BN / 8; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * r], s[n][2 * r + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      mx = fmaxf(m_run[r], mx * p.scale_log2);
      const float m_use = mx == neg_inf ? 0.f : mx;  // a row with nothing allowed yet keeps P = 0, no NaN
      alpha[r] = fast_exp2(m_run[r] - m_use);
      m_run[r] = mx;
      float sum = 0.f;
#pragma unroll
      for (int n = 0; n < BN / 8; ++n) {
        const float p0 = fast_exp2(fmaf(s[n][2 * r], p.scale_log2, -m_use));
        const float p1 = fast_exp2(fmaf(s[n][2 * r + 1], p.scale_log2, -m_use));
        sum += p0 + p1;
        pk[n][r] = mma_type<E>::pack(p0, p1);
      }
      l_run[r] = l_run[r] * alpha[r] + sum;
    }
  };

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
  }
  if (k_first >= 0) {
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
      issue_scores(s, 0);
      wgmma_wait<0>();
      fence_operands(s);
      softmax(s, k0, tile_begin, tile_end, pk, alpha);
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
      issue_scores(s, k_stage);
      issue_pv(pk, v_stage);
      // The next tile is found and its loads issued while the wgmma run.
      k_next = tiles.next(k0);
      if (k_next >= 0) load_k(k_next, k_stage ^ 1);
      load_v(k0, v_stage ^ 1);
      wgmma_wait<1>();  // S_j is ready; P_{j-1}·V_{j-1} may still run
      fence_operands(s);
      softmax(s, k0, tile_begin, tile_end, pk_next, alpha);
      wgmma_wait<0>();
      fence_operands(acc);
      fence_fragments(pk);
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        acc[n][0] *= alpha[0];
        acc[n][1] *= alpha[0];
        acc[n][2] *= alpha[1];
        acc[n][3] *= alpha[1];
      }
#pragma unroll
      for (int n = 0; n < BN / 8; ++n) pk[n][0] = pk_next[n][0], pk[n][1] = pk_next[n][1];
      k_stage ^= 1;
      v_stage ^= 1;
    }
    // The last tile's P·V.
    wait_tile(2 + v_stage);
    issue_pv(pk, v_stage);
    wgmma_wait<0>();
    fence_operands(acc);
    fence_fragments(pk);
  }

  // O = acc / l; lse = ln 2 · (m + log2 l). A row that saw no key: O = 0, lse = −inf. As in flash_forward_kernel:
  // O is staged through the Q tile and written as 16-byte chunks; a split writes its f32 part straight.
  constexpr float ln2 = 0.69314718055994531f;
  cp_async_wait<0>();  // a block with no key tile never waited for its Q copy, which must land before O is staged
  __syncthreads();     // every warpgroup's reads of Q are done
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float l = l_run[r];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const float inv_l = l > 0.f ? 1.f / l : 0.f;
    const int row = row0 + g + 8 * r;
    const float lse = l > 0.f ? (m_run[r] + log2f(l)) * ln2 : neg_inf;
    if (p.splits > 1) {
      if (row >= p.seq_q) continue;
      const index_t part_row = ((static_cast<index_t>(split) * p.batch + b) * p.heads + h) * p.seq_q + row;
      if (t == 0) p.lse_part[part_row] = lse;
#pragma unroll
      for (int n = 0; n < D / 8; ++n)
        *reinterpret_cast<float2*>(p.o_part + part_row * D + n * 8 + 2 * t) =
            make_float2(acc[n][2 * r] * inv_l, acc[n][2 * r + 1] * inv_l);
    } else {
      if (p.lse != nullptr && t == 0 && row < p.seq_q) p.lse[(static_cast<index_t>(b) * p.heads + h) * p.seq_q + row] = lse;
#pragma unroll
      for (int n = 0; n < D / 8; ++n)
        *reinterpret_cast<std::uint32_t*>(sq + atom_offset<BM>(row - q0, n) + 2 * t) =
            mma_type<E>::pack(acc[n][2 * r] * inv_l, acc[n][2 * r + 1] * inv_l);
    }
  }
  if (p.splits > 1) return;
  __syncthreads();
  for (int c = threadIdx.x; c < BM * CH; c += Tile::threads) {
    const int r = c / CH, ch = c % CH;
    if (q0 + r < p.seq_q)
      *reinterpret_cast<uint4*>(o_head + (q0 + r) * p.o_stride.s + ch * 8) =
          *reinterpret_cast<const uint4*>(sq + atom_offset<BM>(r, ch));
  }
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
  constexpr int max_devices = 64;
  static std::atomic<int> known[max_devices];  // 0 not asked, 1 yes, 2 no (zero-initialised: static storage)
  int device = 0, major = 0, minor = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device >= max_devices ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  if (major != 9 || minor != 0) return false;
  if (known[device] != 0) return known[device] == 1;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess || capture != cudaStreamCaptureStatusNone) {
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

/// The Hopper kernel's tile for a head dimension, chosen among the tiles bench/gpu times (docs/PERFORMANCE.md, CUDA
/// section): 128 query rows (two warpgroups) for all; head_dim 128 takes 128-key tiles and one block per
/// multiprocessor (161 KB of shared memory, 220 registers a thread), head_dim 64 takes 64-key tiles and two blocks
/// (49 KB each, at most 128 registers), head_dim 256 64-key tiles and one block (193 KB; 128-key tiles do not fit,
/// and one warpgroup of 64 rows ran at 0.55–0.6× on an H100).
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
struct hopper_default_tile<256> {
  using type = hopper_tile<256, 64, 1>;
};

/// The Hopper tile for decode-like calls (one q-block per head: split-KV, memory-bound): head_dim 64 streams
/// 128-key tiles with one block per multiprocessor (H200, (4,16,1,16384,64) bf16: 0.21 ms against 0.32 ms with the
/// default 64-key tile); head_dim 128 keeps its default.
template <int HeadDim>
struct hopper_decode_tile {
  using type = typename hopper_default_tile<HeadDim>::type;
};
template <>
struct hopper_decode_tile<64> {
  using type = hopper_tile<64, 128, 1>;
};

/// Launches the Hopper kernel (hopper_flash_ready must have said yes); split-KV and merge as launch_flash. The
/// kernel reads K and V through tensor maps made here; should the driver refuse one (flash_applies already asks
/// for 16-byte multiple strides, which the maps need), the call runs the portable kernel instead.
template <class E, class Tile, class Mask>
status launch_flash_hopper(flash_params_t<Mask> p, cudaStream_t stream) {
  constexpr bool bf16 = std::is_same_v<E, __nv_bfloat16>;
  const index_t heads_kv = p.heads / p.group;
  const bool tma = make_kv_map(p.k_map, p.k_order, p.k, bf16, Tile::head_dim, p.seq_kv, heads_kv, p.batch,
                               p.k_stride, Tile::block_n) &&
                   make_kv_map(p.v_map, p.v_order, p.v, bf16, Tile::head_dim, p.seq_kv, heads_kv, p.batch,
                               p.v_stride, Tile::block_n);
  if (tma) return launch_flash_kernel<E, Tile>(flash_hopper_kernel<E, Tile, Mask>, Tile::smem_bytes, p, stream);
  return launch_flash<E, typename flash_default_tile<Tile::head_dim>::type>(p, stream);
}

}  // namespace cuda_backend
}  // namespace fusedattn
