/// @file decode.cuh
/// The CUDA decode kernel ("cuda.decode"): a few query rows per kv head (the GQA group's heads × seq_q <= 16) against
/// a long KV cache read from a strided tensor, a paged cache or a ragged batch: four warps a block stream K/V tiles
/// through cp.async and mma.sync, keys split over the SMs and merged by lse. Not the prefill kernel (flash.cuh). Score
/// modifiers run in a second instantiation (flash.cuh's tile_mods per row, the sink in split 0's epilogue).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <type_traits>

#include <cuda_runtime.h>

#include "../../core/problem.hpp"
#include "../../core/status.hpp"
#include "../../core/tensor.hpp"
#include "../../dispatch/policy.hpp"
#include "../../kernels/kv_source.hpp"
#include "../../kernels/mask.hpp"
#include "device_types.cuh"
#include "error.cuh"
#include "flash.cuh"
#include "mma.cuh"
#include "scratch.cuh"

namespace fusedattn {
namespace cuda_backend {

/// The most query rows (group size × seq_q) one decode block serves: its kv head's K/V tile is loaded once for them.
inline constexpr index_t decode_max_rows = 16;

/// Where a decode block reads key j of kv head h of sequence b (element offsets; head_dim is contiguous):
///   paged (block_table set):  block_table[b·blocks_per_seq + j / page_size]·page + h·head + (j % page_size)·token
///   ragged (cu set):          (cu[b] + j)·token + h·head
///   strided:                  b·batch + h·head + j·token
/// K and V share the offsets (their own base pointers).
struct decode_kv {
  const void* k = nullptr;
  const void* v = nullptr;
  index_t batch = 0, head = 0, token = 0, page = 0;  ///< element strides
  const std::int32_t* block_table = nullptr;
  index_t blocks_per_seq = 0;
  int page_size = 0;
  const std::int32_t* cu = nullptr;        ///< ragged: cumulative key offsets
  const std::int32_t* seq_lens = nullptr;  ///< paged: keys per sequence
  index_t seq_kv = 0;                      ///< strided: keys of every sequence

  __device__ __forceinline__ index_t length(int b) const {
    if (seq_lens != nullptr) return seq_lens[b];
    if (cu != nullptr) return cu[b + 1] - cu[b];
    return seq_kv;
  }
  /// Offset of key 0 of (b, h) for the strided and ragged kinds.
  __device__ __forceinline__ index_t base(int b, int h) const {
    return (cu != nullptr ? index_t(cu[b]) * token : index_t(b) * batch) + index_t(h) * head;
  }
};

/// Run-time parameters of one decode launch. Row r of a block (r < rows = group · seq_q) is query i = r % seq_q of
/// head h_kv · group + r / seq_q. The mask of sequence b allows key j to row i when
///   0 <= j < len_b  and  lo0 + shift·len_b <= j − i <= hi0 + shift·len_b
/// (shift 1 for bottom-right alignment, whose band moves with each sequence's length).
struct decode_params {
  const void* q = nullptr;
  void* o = nullptr;
  strides4 q_stride{}, o_stride{};
  float* lse = nullptr;
  index_t lse_b = 0, lse_h = 0, lse_i = 0;  ///< lse element strides of batch, head, query row
  decode_kv kv{};
  int batch = 0, heads = 0, heads_kv = 0, group = 0, seq_q = 0, rows = 0;
  index_t lo0 = 0, hi0 = 0, shift = 0;
  float scale_log2 = 0.f;  ///< scale · log2(e)
  int splits = 1;          ///< key chunks per (sequence, kv head); > 1: parts in o_part / lse_part, then the merge
  index_t chunk = 0;       ///< keys per split
  float* o_part = nullptr;    ///< [split][b][h][i][d], normalised, f32
  float* lse_part = nullptr;  ///< [split][b][h][i]
  bound_mods mods{};          ///< score modifiers of a sequence of 0 keys (run by decode_kernel<..., true> only)
  index_t alibi_shift = 0;    ///< ALiBi offset of sequence b: mods.alibi_offset + alibi_shift·len_b
};

/// The tile geometry of a decode instantiation: 128 threads, four warps that stream keys independently. Each warp
/// takes key tiles of 16 (tiles w, w + 4, w + 8, ... of its block's share), each through its own cp.async pipeline of
/// `stages` tiles in shared memory, and runs Q·Kᵀ and P·V on mma.sync m16n8k16 with the query rows (at most 16)
/// padded to 16; the four warps' online-softmax states are merged in shared memory at the end, in warp order.
template <int HeadDim>
struct decode_tile {
  static constexpr int threads = 128;
  static constexpr int warps = threads / 32;
  static constexpr int head_dim = HeadDim;
  static constexpr int rows = 16;                            ///< query rows of the mma tile
  static constexpr int warp_keys = 16;                       ///< keys of one warp's tile
  static constexpr int block_n = warps * warp_keys;          ///< keys of one round of the block's warps
  static constexpr int stages = HeadDim <= 64 ? 5 : 3;       ///< per warp; stages − 1 tiles in flight
  static constexpr int chunks = HeadDim / 8;                 ///< 16-byte chunks of a row
  static constexpr int pitch = HeadDim + 8;                  ///< smem row pitch in elements (conflict-free ldmatrix)
  static constexpr int p_pitch = warp_keys + 1;              ///< pitch of a warp's P tile (masked tiles only)
  static_assert(HeadDim % 16 == 0 && (warp_keys * chunks) % 32 == 0, "decode tile: head_dim a multiple of 16");

  template <class E>
  static constexpr std::size_t warp_stage_bytes() { return std::size_t(2) * warp_keys * pitch * sizeof(E); }
  /// The pipelines, or after the loop the warps' states: acc [warp][row][d] and (m, l) [warp][row], f32.
  template <class E>
  static constexpr std::size_t big_bytes() {
    const std::size_t pipe = std::size_t(warps) * stages * warp_stage_bytes<E>();
    const std::size_t reduce = std::size_t(warps) * rows * (HeadDim + 2) * sizeof(float);
    return pipe > reduce ? pipe : reduce;
  }
  template <class E>
  static constexpr std::size_t smem_bytes() {
    return big_bytes<E>() + std::size_t(rows) * pitch * sizeof(E) + std::size_t(warps) * rows * p_pitch * sizeof(float);
  }
};

/// One block: (sequence b, kv head h_kv, split) over its share of the sequence's keys; warp w over key tiles w, w + 4,
/// ... of 16 keys. Per warp tile [k0, k0 + 16):
///   S = Q·Kᵀ (mma, f32), scaled by scale·log2e   (16 rows × 16 keys)
///   m' = max(m, rowmax S), P = 2^(S − m'), l = l·2^(m − m') + rowsum P
///   acc = acc·2^(m − m') + P·V                    (P rounded to the storage type, mma, f32)
/// then the warps' (m, l, acc) are merged in warp order: O = Σ 2^(m_w − M)·acc_w / Σ 2^(m_w − M)·l_w,
/// lse = ln2·(M + log2 L); a row without keys: O = 0, lse = −inf; a NaN l (a NaN logit) gives NaN.
/// Masked and out-of-range keys get P = 0; keys past the range are zero-filled; a warp tile with a masked key inside
/// the range runs P·V on CUDA cores and skips P = 0 there (a masked key's inf or NaN in V reaches no output).
/// `Mods`: allowed scores become tile_mods::apply's S' (row g and g + 8 each with its own head's modifiers), and
/// split 0 adds the sink to its rows' (m, l) before it writes O and lse (the merge then counts it once).
template <class E, class Tile, bool Mods = false>
__global__ void __launch_bounds__(Tile::threads) decode_kernel(const decode_params p) {
  constexpr int D = Tile::head_dim, R = Tile::rows, WK = Tile::warp_keys, ST = Tile::stages, W = Tile::warps;
  constexpr int C = Tile::chunks, PITCH = Tile::pitch, PP = Tile::p_pitch, NT = D / 8;
  constexpr int STAGE = 2 * WK * PITCH;  // elements of one warp stage: K rows then V rows
  extern __shared__ __align__(128) unsigned char smem_raw[];
  E* q_s = reinterpret_cast<E*>(smem_raw + Tile::template big_bytes<E>());             // R × PITCH
  float* p_all = reinterpret_cast<float*>(q_s + R * PITCH);                            // W × R × PP
  float* red_s = reinterpret_cast<float*>(smem_raw);                                   // W × R × D after the loop
  float* ml_s = red_s + W * R * D;                                                     // W × R × (m, l)

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");  // the merge may be placed now; it waits for us
#endif
  const int t = threadIdx.x, warp = t / 32, lane = t % 32;
  const int g = lane / 4, qd = lane % 4;  // mma fragment row (and row + 8) and column pair
  const int h_kv = blockIdx.x % p.heads_kv;
  const int b = blockIdx.x / p.heads_kv;
  const int split = blockIdx.y;
  const index_t len = p.kv.length(b);
  const index_t lo = p.lo0 + p.shift * len, hi = p.hi0 + p.shift * len;
  // Keys any row may see (band_mask::kv_range of rows [0, seq_q)), then this split's share.
  const kv_span seen = band_mask{p.seq_q, len, lo, hi}.kv_range(0, p.seq_q);
  index_t kb = seen.begin, ke = seen.end;
  const index_t s0 = kb + index_t(split) * p.chunk;
  index_t s1 = s0 + p.chunk;
  if (s1 > ke) s1 = ke;
  kb = s0;
  ke = s1;
  const int n_tiles = ke > kb ? int((ke - kb + WK - 1) / WK) : 0;  // warp tiles of the block
  const int my_tiles = n_tiles > warp ? (n_tiles - warp + W - 1) / W : 0;

  // Q rows in the storage type (padding rows 0), 16 bytes a thread at a time.
  for (int e = t; e < R * C; e += Tile::threads) {
    const int r = e / C, cc = e % C;
    uint4 x = make_uint4(0u, 0u, 0u, 0u);
    if (r < p.rows) {
      const int h = h_kv * p.group + r / p.seq_q, i = r % p.seq_q;
      const E* qr = static_cast<const E*>(p.q) + index_t(b) * p.q_stride.b + index_t(h) * p.q_stride.h +
                    index_t(i) * p.q_stride.s;
      x = *reinterpret_cast<const uint4*>(qr + cc * 8);
    }
    *reinterpret_cast<uint4*>(q_s + r * PITCH + cc * 8) = x;
  }

  const index_t base_bh = p.kv.block_table == nullptr ? p.kv.base(b, h_kv) : 0;
  const E* kg = static_cast<const E*>(p.kv.k);
  const E* vg = static_cast<const E*>(p.kv.v);
  E* pipe = reinterpret_cast<E*>(smem_raw) + warp * ST * STAGE;
  float* p_s = p_all + warp * R * PP;
  // Loads this warp's tile `it` (block tile warp + W·it) into its stage `it % ST`: lane copies chunk lane % C of rows
  // lane / C + RS·x. A paged cache walks the block table from one 32-bit division a tile (RS < 8 <= page_size: a
  // step crosses at most one page boundary).
  constexpr int RS = 32 / C;
  static_assert(32 % C == 0 && RS < 8, "decode tile: a lane's rows step by 32 / chunks");
  const int r0 = lane / C, cc = lane % C;
  const std::int32_t* table = p.kv.block_table == nullptr ? nullptr : p.kv.block_table + index_t(b) * p.kv.blocks_per_seq;
  const index_t head_off = index_t(h_kv) * p.kv.head + cc * 8;
  auto load_tile = [&](int it) {
    E* ks = pipe + (it % ST) * STAGE + cc * 8;
    E* vs = ks + WK * PITCH;
    const index_t k0 = kb + index_t(warp + W * it) * WK;
    if (table != nullptr) {
      const unsigned ps = unsigned(p.kv.page_size), j0 = unsigned(k0 + r0);
      unsigned pg = j0 / ps, in = j0 - pg * ps;
#pragma unroll
      for (int x = 0; x < WK / RS; ++x) {
        const int row = r0 + RS * x;
        const bool valid = k0 + row < ke;
        const index_t off = valid ? index_t(table[pg]) * p.kv.page + head_off + index_t(in) * p.kv.token : 0;
        cp_async_16<l2_prefetch::line128>(ks + row * PITCH, kg + off, valid);
        cp_async_16<l2_prefetch::line128>(vs + row * PITCH, vg + off, valid);
        in += RS;
        if (in >= ps) {
          in -= ps;
          ++pg;
        }
      }
    } else {
#pragma unroll
      for (int x = 0; x < WK / RS; ++x) {
        const int row = r0 + RS * x;
        const index_t j = k0 + row;
        const bool valid = j < ke;
        const index_t off = valid ? base_bh + j * p.kv.token + cc * 8 : 0;
        cp_async_16<l2_prefetch::line128>(ks + row * PITCH, kg + off, valid);
        cp_async_16<l2_prefetch::line128>(vs + row * PITCH, vg + off, valid);
      }
    }
  };
#pragma unroll
  for (int s = 0; s < ST - 1; ++s) {
    if (s < my_tiles) load_tile(s);
    cp_async_commit();
  }
  __syncthreads();  // Q landed

  float acc[NT][4];
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[n][c] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};  // rows g, g + 8; l is this thread's columns' part
  // ldmatrix lane addresses: Q as the A operand (matrices rows 0-7 / 8-15 × k 0-7 / 8-15), K as B (keys 0-7 / 8-15
  // × d 0-7 / 8-15), V transposed as B (keys 0-7 / 8-15 × d 0-7 / 8-15).
  const int mi = lane / 8, mr = lane % 8;
  const E* q_lane = q_s + ((mi % 2) * 8 + mr) * PITCH + (mi / 2) * 8;
  const int k_lane = ((mi / 2) * 8 + mr) * PITCH + (mi % 2) * 8;
  const int v_lane = ((mi % 2) * 8 + mr) * PITCH + (mi / 2) * 8;
  const index_t i_row[2] = {g % p.seq_q, (g + 8) % p.seq_q};
  [[maybe_unused]] tile_mods tm[2];
  if constexpr (Mods) {
    bound_mods mb = p.mods;
    mb.alibi_offset += p.alibi_shift * len;
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2) {
      const int r = g + 8 * h2;  // padding rows (r >= rows) take the group's first head
      tm[h2] = tile_mods(mb, h_kv * p.group + (r < p.rows ? r / p.seq_q : 0), p.scale_log2);
    }
  }

  for (int it = 0; it < my_tiles; ++it) {
    cp_async_wait<ST - 2>();
    __syncwarp();  // tile `it` landed for every lane; the stage of tile it − 1 is no longer read
    if (it + ST - 1 < my_tiles) load_tile(it + ST - 1);
    cp_async_commit();
    const E* ks = pipe + (it % ST) * STAGE;
    const E* vs = ks + WK * PITCH;
    const index_t k0 = kb + index_t(warp + W * it) * WK;

    // S = Q·Kᵀ: s[n] holds keys 8n + 2·qd, +1 of rows g (s[n][0..1]) and g + 8 (s[n][2..3]).
    float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      std::uint32_t qa[4], kf[4];
      ldmatrix_x4(qa, q_lane + kk * 16);
      ldmatrix_x4(kf, ks + k_lane + kk * 16);
      mma_16816<E>(s[0], qa, kf[0], kf[1]);
      mma_16816<E>(s[1], qa, kf[2], kf[3]);
    }

    // Online softmax over the tile; masked keys and keys past the range get P = 0.
    const band_rule<index_t> rule{ke, lo, hi};
    float mt[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const index_t j = k0 + 8 * n + 2 * qd + (c & 1);
        float sc = s[n][c];
        if constexpr (Mods) sc = tm[c / 2].apply(sc, int(i_row[c / 2]), int(j));
        s[n][c] = rule.allowed(i_row[c / 2], j) ? sc * p.scale_log2 : -INFINITY;
        mt[c / 2] = fmaxf(mt[c / 2], s[n][c]);
      }
    float alpha[2];
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2) {
      mt[h2] = fmaxf(mt[h2], __shfl_xor_sync(0xffffffffu, mt[h2], 1));
      mt[h2] = fmaxf(mt[h2], __shfl_xor_sync(0xffffffffu, mt[h2], 2));
      const float m_new = fmaxf(m_run[h2], mt[h2]);
      alpha[h2] = m_run[h2] == -INFINITY ? (m_new == -INFINITY ? 1.f : 0.f) : fast_exp2(m_run[h2] - m_new);
      m_run[h2] = m_new;
    }
    std::uint32_t pa[4];  // P as the A operand: rows g / g + 8 × keys 2·qd (+8)
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      float pv[4];
#pragma unroll
      for (int c = 0; c < 4; ++c) pv[c] = s[n][c] == -INFINITY ? 0.f : fast_exp2(s[n][c] - m_run[c / 2]);
      l_run[0] = n == 0 ? l_run[0] * alpha[0] + (pv[0] + pv[1]) : l_run[0] + (pv[0] + pv[1]);
      l_run[1] = n == 0 ? l_run[1] * alpha[1] + (pv[2] + pv[3]) : l_run[1] + (pv[2] + pv[3]);
      pa[2 * n] = mma_type<E>::pack(pv[0], pv[1]);
      pa[2 * n + 1] = mma_type<E>::pack(pv[2], pv[3]);
    }
    if (!__all_sync(0xffffffffu, alpha[0] == 1.f && alpha[1] == 1.f)) {
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        acc[n][0] *= alpha[0];
        acc[n][1] *= alpha[0];
        acc[n][2] *= alpha[1];
        acc[n][3] *= alpha[1];
      }
    }

    // acc += P·V. A tile with a masked key inside the range (some P are 0 only by the mask) runs on CUDA cores.
    const index_t k_last = (k0 + WK - 1 < ke ? k0 + WK - 1 : ke - 1);
    const bool masked_inside = !(k0 - (p.seq_q - 1) >= lo && k_last <= hi);
    if (!masked_inside) {
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        std::uint32_t vf[4];
        ldmatrix_x4_trans(vf, vs + v_lane + dp * 16);
        mma_16816<E>(acc[2 * dp], pa, vf[0], vf[1]);
        mma_16816<E>(acc[2 * dp + 1], pa, vf[2], vf[3]);
      }
    } else {
      // The rounded P through shared memory; thread (g, qd) sums its acc elements over the keys its rows see.
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        p_s[g * PP + 8 * n + 2 * qd] = mma_type<E>::unpack(pa[2 * n], 0);
        p_s[g * PP + 8 * n + 2 * qd + 1] = mma_type<E>::unpack(pa[2 * n], 1);
        p_s[(g + 8) * PP + 8 * n + 2 * qd] = mma_type<E>::unpack(pa[2 * n + 1], 0);
        p_s[(g + 8) * PP + 8 * n + 2 * qd + 1] = mma_type<E>::unpack(pa[2 * n + 1], 1);
      }
      __syncwarp();
      for (int key = 0; key < WK; ++key) {
        const float p0 = p_s[g * PP + key], p1 = p_s[(g + 8) * PP + key];
        if (p0 == 0.f && p1 == 0.f) continue;
#pragma unroll
        for (int n = 0; n < NT; ++n) {
          const std::uint32_t vv = *reinterpret_cast<const std::uint32_t*>(vs + key * PITCH + 8 * n + 2 * qd);
          const float v0 = mma_type<E>::unpack(vv, 0), v1 = mma_type<E>::unpack(vv, 1);
          if (p0 != 0.f) {
            acc[n][0] = fmaf(p0, v0, acc[n][0]);
            acc[n][1] = fmaf(p0, v1, acc[n][1]);
          }
          if (p1 != 0.f) {
            acc[n][2] = fmaf(p1, v0, acc[n][2]);
            acc[n][3] = fmaf(p1, v1, acc[n][3]);
          }
        }
      }
    }
  }
  cp_async_wait<0>();
#pragma unroll
  for (int h2 = 0; h2 < 2; ++h2) {
    l_run[h2] += __shfl_xor_sync(0xffffffffu, l_run[h2], 1);
    l_run[h2] += __shfl_xor_sync(0xffffffffu, l_run[h2], 2);
  }
  __syncthreads();  // the pipelines' memory becomes the merge buffer

  // Each warp's state: red[warp][row][d], ml[warp][row] = (m, l).
  float* red_w = red_s + warp * R * D;
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    *reinterpret_cast<float2*>(red_w + g * D + 8 * n + 2 * qd) = make_float2(acc[n][0], acc[n][1]);
    *reinterpret_cast<float2*>(red_w + (g + 8) * D + 8 * n + 2 * qd) = make_float2(acc[n][2], acc[n][3]);
  }
  if (qd == 0) {
    ml_s[(warp * R + g) * 2] = m_run[0];
    ml_s[(warp * R + g) * 2 + 1] = l_run[0];
    ml_s[(warp * R + g + 8) * 2] = m_run[1];
    ml_s[(warp * R + g + 8) * 2 + 1] = l_run[1];
  }
  __syncthreads();
  constexpr float ln2 = float(fusedattn::ln2);
  for (int e = t; e < p.rows * D; e += Tile::threads) {
    const int r = e / D, c = e % D;
    float m = -INFINITY;
#pragma unroll
    for (int w = 0; w < W; ++w) m = fmaxf(m, ml_s[(w * R + r) * 2]);
    // Warps in order; a warp without keys (l = 0) adds nothing, a NaN l reaches l and O.
    float l = 0.f, sum = 0.f;
#pragma unroll
    for (int w = 0; w < W; ++w) {
      const float lw = ml_s[(w * R + r) * 2 + 1];
      if (lw == 0.f) continue;
      const float scale = fast_exp2(ml_s[(w * R + r) * 2] - m);
      l = fmaf(scale, lw, l);
      sum = fmaf(scale, red_s[(w * R + r) * D + c], sum);
    }
    const int h = h_kv * p.group + r / p.seq_q, i = r % p.seq_q;
    if constexpr (Mods) {
      if (split == 0) sum *= add_sink(m, l, p.mods.sink<float>(h) * float(fusedattn::log2e));
    }
    const float out = l == 0.f ? 0.f : sum / l;  // a NaN l gives NaN
    const float lse = l == 0.f ? -INFINITY : (m + log2f(l)) * ln2;
    if (p.splits > 1) {
      const index_t row = ((index_t(split) * p.batch + b) * p.heads + h) * p.seq_q + i;
      p.o_part[row * D + c] = out;
      if (c == 0) p.lse_part[row] = lse;
    } else {
      E* orow = static_cast<E*>(p.o) + index_t(b) * p.o_stride.b + index_t(h) * p.o_stride.h + index_t(i) * p.o_stride.s;
      orow[c] = narrow<E>(out);
      if (c == 0 && p.lse != nullptr) p.lse[index_t(b) * p.lse_b + index_t(h) * p.lse_h + index_t(i) * p.lse_i] = lse;
    }
  }
}

/// The most key splits of one decode launch (decode_splits' bound): the merge gives each part one thread.
inline constexpr int decode_max_splits = 128;

/// Combines the splits of row (b, h, i) = blockIdx.x (after the decode grid, griddepcontrol.wait): m = max_s lse_s,
/// w_s = e^(lse_s − m), O = Σ w_s·O_s / Σ w_s, lse = m + log Σ w_s, over the parts that saw a key (lse_s > −inf). No
/// part saw one: O = 0, lse = −inf; a part with a NaN lse makes O and lse NaN. 128 threads: thread s reads part s's
/// lse (m and Σ w_s by fixed-order block reductions); warp w sums parts w, w + 4, ... over float4 columns, and the
/// four warps' sums are added in warp order, so the result does not depend on timing.
template <class E>
__global__ void __launch_bounds__(128) decode_merge_kernel(const decode_params p, int head_dim) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");  // the decode blocks' parts are complete and visible
#endif
  constexpr int threads = 128, warps = threads / 32, max_c4 = 64;  // float4 columns: head_dim <= 256
  __shared__ float w_s[decode_max_splits];
  __shared__ float red[warps];
  __shared__ float4 sums[warps - 1][max_c4];
  const int t = threadIdx.x, lane = t % 32, warp = t / 32;
  const index_t row = blockIdx.x;
  const index_t rows = index_t(p.batch) * p.heads * p.seq_q;
  const int i = int(row % p.seq_q), h = int((row / p.seq_q) % p.heads), b = int(row / (index_t(p.seq_q) * p.heads));
  const float x = t < p.splits ? p.lse_part[t * rows + row] : -INFINITY;
  const bool nan = __syncthreads_or(isnan(x)) != 0;
  float m = x;
#pragma unroll
  for (int o = 16; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if (lane == 0) red[warp] = m;
  __syncthreads();
  m = fmaxf(fmaxf(red[0], red[1]), fmaxf(red[2], red[3]));
  __syncthreads();  // red is reused for the sum
  const float e = x == -INFINITY ? 0.f : __expf(x - m);
  if (t < p.splits) w_s[t] = e;
  float w = e;
#pragma unroll
  for (int o = 16; o > 0; o /= 2) w += __shfl_xor_sync(0xffffffffu, w, o);
  if (lane == 0) red[warp] = w;
  __syncthreads();
  const float w_sum = ((red[0] + red[1]) + red[2]) + red[3];
  const int c4_count = head_dim / 4;
  const float* part0 = p.o_part + row * head_dim;
  const index_t part_stride = rows * head_dim;
  float4 acc[max_c4 / 32];
#pragma unroll
  for (int r = 0; r < max_c4 / 32; ++r) acc[r] = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
  for (int s = warp; s < p.splits; s += warps) {
    const float ws = w_s[s];
#pragma unroll
    for (int r = 0; r < max_c4 / 32; ++r) {
      const int c4 = lane + 32 * r;
      if (c4 < c4_count && ws != 0.f) {  // a part without keys adds nothing (its O is 0)
        const float4 v = *reinterpret_cast<const float4*>(part0 + s * part_stride + 4 * c4);
        acc[r].x = fmaf(ws, v.x, acc[r].x);
        acc[r].y = fmaf(ws, v.y, acc[r].y);
        acc[r].z = fmaf(ws, v.z, acc[r].z);
        acc[r].w = fmaf(ws, v.w, acc[r].w);
      }
    }
  }
  if (warp > 0)
#pragma unroll
    for (int r = 0; r < max_c4 / 32; ++r)
      if (lane + 32 * r < c4_count) sums[warp - 1][lane + 32 * r] = acc[r];
  __syncthreads();
  if (warp == 0) {
    E* orow = static_cast<E*>(p.o) + index_t(b) * p.o_stride.b + index_t(h) * p.o_stride.h + index_t(i) * p.o_stride.s;
#pragma unroll
    for (int r = 0; r < max_c4 / 32; ++r) {
      const int c4 = lane + 32 * r;
      if (c4 >= c4_count) continue;
      float4 a = acc[r];
#pragma unroll
      for (int w2 = 0; w2 < warps - 1; ++w2) {
        const float4 v = sums[w2][c4];
        a.x += v.x;
        a.y += v.y;
        a.z += v.z;
        a.w += v.w;
      }
      const float vals[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
      for (int c = 0; c < 4; ++c) orow[4 * c4 + c] = narrow<E>(nan ? NAN : w_sum > 0.f ? vals[c] / w_sum : 0.f);
    }
    if (p.lse != nullptr && lane == 0)
      p.lse[index_t(b) * p.lse_b + index_t(h) * p.lse_h + index_t(i) * p.lse_i] =
          nan ? NAN : w_sum > 0.f ? m + logf(w_sum) : -INFINITY;
  }
}

/// `f(Tile{})` for the decode tile of head_dim (any rows <= decode_max_rows share it); `otherwise` when none fits.
template <class R, class F>
R with_decode_tile(index_t head_dim, index_t rows, R otherwise, F&& f) {
  if (rows > decode_max_rows) return otherwise;
  switch (head_dim) {
    case 64: return f(decode_tile<64>{});
    case 128: return f(decode_tile<128>{});
    case 256: return f(decode_tile<256>{});
    default: return otherwise;
  }
}

/// ok when the decode kernel takes a call of storage type T: f16 or bf16, head_dim 64, 128 or 256, at most
/// decode_max_rows rows per kv head, compute capability 8.0 or newer, the tile's shared memory available; else
/// errc::unsupported saying why.
template <class T>
status decode_applies(const problem& p) {
  using E = device_t<T>;
  if (!std::is_same_v<E, __half> && !std::is_same_v<E, __nv_bfloat16>)
    return {errc::unsupported, std::string("cuda.decode takes f16 and bf16; this call is ") + scalar_name<T>()};
  if (p.head_dim != 64 && p.head_dim != 128 && p.head_dim != 256)
    return {errc::unsupported, "problem.head_dim is " + std::to_string(p.head_dim) + "; cuda.decode takes 64, 128, 256"};
  if (p.group_size() * p.seq_q > decode_max_rows)
    return {errc::unsupported, "cuda.decode serves at most 16 query rows per kv head (group size × seq_q); this call has " +
                                   std::to_string(p.group_size() * p.seq_q)};
  if (p.batch * p.heads_kv > index_t(INT32_MAX) || p.heads > 65535 * 64)
    return {errc::unsupported, "cuda.decode: batch × heads_kv is past the grid's limit"};
  int device = 0, major = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
    cudaGetLastError();
    return {errc::unsupported, "cuda.decode: the device cannot be asked for its compute capability"};
  }
  if (major < 8) return {errc::unsupported, "cuda.decode needs compute capability 8.0 or newer"};
  int smem_optin = 0;
  if (cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess) {
    cudaGetLastError();
    return {errc::unsupported, "cuda.decode: the device cannot be asked for its shared memory"};
  }
  const std::size_t needed = with_decode_tile(p.head_dim, p.group_size() * p.seq_q, std::size_t(0), [](auto tile) {
    return decltype(tile)::template smem_bytes<E>();
  });
  if (needed > std::size_t(smem_optin))
    return {errc::unsupported, "cuda.decode needs " + std::to_string(needed) + " bytes of shared memory a block; this device offers " +
                                   std::to_string(smem_optin)};
  return {};
}

/// Whether a pointer and element strides suit the kernel's 16-byte copies (strides multiples of 8 elements).
inline bool decode_aligned(const void* ptr, std::initializer_list<index_t> strides) {
  if (reinterpret_cast<std::uintptr_t>(ptr) % 16 != 0) return false;
  for (index_t s : strides)
    if (s % 8 != 0) return false;
  return true;
}

/// Splits for a launch of `blocks` (sequence, kv head) blocks over at most `keys` keys, `per_sm` blocks resident on
/// each of `multiprocessors` SMs: the count (at most 128, each split at least two rounds of block_n keys) of least
/// cost, in quarter rounds: waves × (4·rounds a block + 8 for a block's start and end + 2 for writing its part when
/// it splits) + 4 for the merge pass, waves = ⌈blocks·splits / resident slots⌉; more splits only where they cost
/// at least 2 % less (the model's resolution).
/// E.g. 8 × 8 blocks over 32768 keys on 132 SMs × 2: 4 splits (256 blocks, one wave), not 5 (two waves); 64 × 8
/// blocks: 1 (two full waves; splitting further adds start-up and merge traffic).
inline int decode_splits(index_t blocks, index_t keys, int block_n, int multiprocessors, int per_sm) {
  constexpr index_t max_splits = decode_max_splits, min_rounds = 2, fixed = 8, part = 2, merge = 4;
  const index_t slots = index_t(multiprocessors > 0 ? multiprocessors : 1) * (per_sm > 0 ? per_sm : 1);
  const index_t n = block_n > 0 ? block_n : 1;
  const index_t rounds = (keys + n - 1) / n;
  index_t limit = keys / (min_rounds * n);
  if (limit > max_splits) limit = max_splits;
  if (blocks <= 0 || limit <= 1) return 1;
  index_t best = 1, best_cost = -1;
  for (index_t s = 1; s <= limit; ++s) {
    const index_t waves = (blocks * s + slots - 1) / slots;
    const index_t cost = waves * (4 * ((rounds + s - 1) / s) + fixed + (s > 1 ? part : 0)) + (s > 1 ? merge : 0);
    if (best_cost < 0 || cost * 50 < best_cost * 49) {
      best = s;
      best_cost = cost;
    }
  }
  return int(best);
}

/// Scratch bytes of a decode launch with `splits` parts (0 for one).
inline std::size_t decode_scratch_bytes(int splits, const problem& p) {
  if (splits <= 1) return 0;
  const std::size_t rows = std::size_t(splits) * p.batch * p.heads * p.seq_q;
  return rows * (std::size_t(p.head_dim) + 1) * sizeof(float);
}

/// The split count a launch would use (decode_applies must have said ok); `max_keys` bounds every sequence's keys.
template <class T>
status decode_plan_splits(const problem& p, index_t max_keys, int& splits) {
  using E = device_t<T>;
  splits = 1;
  return with_decode_tile(p.head_dim, p.group_size() * p.seq_q, status{errc::unsupported, "cuda.decode: no tile"},
                          [&](auto tile) -> status {
                            using Tile = decltype(tile);
                            if constexpr (std::is_same_v<E, __half> || std::is_same_v<E, __nv_bfloat16>) {
                              // SM count and blocks per SM, asked once per device (the shared-memory opt-in with them).
                              static std::atomic<int> cached_sms[max_cached_devices], cached_per_sm[max_cached_devices];
                              int device = 0, sms = 0, per_sm = 0;
                              if (status st = from_cuda(cudaGetDevice(&device), "cudaGetDevice"); !st) return st;
                              if (device < max_cached_devices && cached_per_sm[device] > 0) {
                                sms = cached_sms[device];
                                per_sm = cached_per_sm[device];
                              } else {
                                if (status st = from_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device),
                                                          "cudaDeviceGetAttribute");
                                    !st)
                                  return st;
                                const std::size_t smem = Tile::template smem_bytes<E>();
                                auto kernel = decode_kernel<E, Tile>;
                                if (status st = from_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)),
                                                          "cudaFuncSetAttribute(decode_kernel)");
                                    !st)
                                  return st;
                                if (status st = from_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, Tile::threads, smem),
                                                          "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
                                    !st)
                                  return st;
                                if (device < max_cached_devices) {
                                  cached_sms[device] = sms;
                                  cached_per_sm[device] = per_sm;
                                }
                              }
                              splits = decode_splits(p.batch * p.heads_kv, max_keys, Tile::block_n, sms, per_sm);
                              return {};
                            } else {
                              return {errc::unsupported, "cuda.decode takes f16 and bf16"};
                            }
                          });
}

/// Launches the decode kernel (and the merge when it splits) on `stream`. `dp` holds everything but the splits and
/// scratch; `max_keys` bounds every sequence's keys (the split size derives from it). decode_applies must have said
/// ok and the pointers must be device memory.
template <class T>
status launch_decode(const problem& p, decode_params dp, index_t max_keys, cudaStream_t stream) {
  using E = device_t<T>;
  if constexpr (!(std::is_same_v<E, __half> || std::is_same_v<E, __nv_bfloat16>)) {
    return decode_applies<T>(p);
  } else {
    int splits = 1;
    if (status st = decode_plan_splits<T>(p, max_keys, splits); !st) return st;
    return with_decode_tile(p.head_dim, p.group_size() * p.seq_q, status{errc::unsupported, "cuda.decode: no tile"},
                            [&](auto tile) -> status {
                              using Tile = decltype(tile);
                              dp.splits = splits;
                              dp.chunk = (max_keys + splits - 1) / splits;
                              dp.chunk = (dp.chunk + Tile::block_n - 1) / Tile::block_n * Tile::block_n;
                              if (dp.chunk == 0) dp.chunk = Tile::block_n;
                              struct owner {
                                void* ptr = nullptr;
                                cudaStream_t stream;
                                ~owner() {
                                  if (ptr != nullptr) cudaFreeAsync(ptr, stream);
                                }
                              } scratch{nullptr, stream};
                              if (splits > 1) {
                                if (status st = scratch_allocate(scratch.ptr, decode_scratch_bytes(splits, p), stream,
                                                                 "cudaMallocFromPoolAsync(decode split parts)");
                                    !st)
                                  return st;
                                const index_t rows = index_t(splits) * p.batch * p.heads * p.seq_q;
                                dp.o_part = static_cast<float*>(scratch.ptr);
                                dp.lse_part = dp.o_part + rows * p.head_dim;
                              }
                              const dim3 grid(unsigned(p.batch * p.heads_kv), unsigned(splits));
                              // The opt-in beside the launch: each translation unit launches its own copy of the kernel.
                              const auto kernel = dp.mods.any() ? decode_kernel<E, Tile, true> : decode_kernel<E, Tile, false>;
                              constexpr int smem = int(Tile::template smem_bytes<E>());
                              if (status st = from_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
                                                        "cudaFuncSetAttribute(decode_kernel)");
                                  !st)
                                return st;
                              kernel<<<grid, Tile::threads, smem, stream>>>(dp);
                              if (status st = last_launch("decode_kernel"); !st) return st;
                              if (splits > 1) {
                                const index_t rows = p.batch * p.heads * p.seq_q;
                                // On sm_90 and newer the merge is a programmatic dependent launch: its blocks are
                                // placed while the decode blocks run and wait for them in griddepcontrol.wait.
                                int device = 0, major = 0;
                                const bool pdl = cudaGetDevice(&device) == cudaSuccess &&
                                                 cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess &&
                                                 major >= 9;
                                cudaLaunchAttribute attr[1];
                                attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
                                attr[0].val.programmaticStreamSerializationAllowed = 1;
                                cudaLaunchConfig_t cfg{};
                                cfg.gridDim = dim3(unsigned(rows));
                                cfg.blockDim = dim3(128);
                                cfg.dynamicSmemBytes = 0;
                                cfg.stream = stream;
                                cfg.attrs = attr;
                                cfg.numAttrs = pdl ? 1 : 0;
                                if (status st = from_cuda(cudaLaunchKernelEx(&cfg, decode_merge_kernel<E>, dp, int(p.head_dim)),
                                                          "cudaLaunchKernelEx(decode_merge_kernel)");
                                    !st)
                                  return st;
                              }
                              return {};
                            });
  }
}

/// The query/output/lse half of decode_params for (batch, heads, seq_q, d) views and an lse of strides
/// (lse_b, lse_h, lse_i).
template <class T>
decode_params decode_io(const problem& p, const tensor_ref<const T>& q, const tensor_ref<T>& o, float* lse,
                        index_t lse_b, index_t lse_h, index_t lse_i) {
  decode_params dp;
  dp.q = q.data;
  dp.o = o.data;
  dp.q_stride = q.stride;
  dp.o_stride = o.stride;
  dp.lse = lse;
  dp.lse_b = lse_b;
  dp.lse_h = lse_h;
  dp.lse_i = lse_i;
  dp.batch = int(p.batch);
  dp.heads = int(p.heads);
  dp.heads_kv = int(p.heads_kv);
  dp.group = int(p.group_size());
  dp.seq_q = int(p.seq_q);
  dp.rows = int(p.group_size() * p.seq_q);
  dp.scale_log2 = static_cast<float>(p.softmax_scale() * log2e);
  return dp;
}

/// ok when q and o suit the decode kernel's copies and indexing (16-byte aligned, strides multiples of 8 elements).
template <class T>
status decode_views_fit(const tensor_ref<const T>& q, const tensor_ref<T>& o) {
  if (!decode_aligned(q.data, {q.stride.b, q.stride.h, q.stride.s}) || q.stride.d != 1 ||
      !decode_aligned(o.data, {o.stride.b, o.stride.h, o.stride.s}) || o.stride.d != 1)
    return {errc::unsupported,
            "cuda.decode needs 16-byte aligned q and o with unit head_dim stride and other strides multiples of 8"};
  return {};
}

/// Whether plain attend on policy::cuda runs the decode kernel ("cuda.decode"): policy::cuda{.kernel = automatic},
/// a band mask (score modifiers included), f16/bf16, head_dim 64/128/256, group size × seq_q <= 16, and K and V with the
/// same 16-byte aligned strides.
template <class T, class Mask>
bool decode_takes(const policy::cuda& pol, const problem& p, const tensor_ref<const T>& q, const tensor_ref<const T>& k,
                  const tensor_ref<const T>& v, const tensor_ref<T>& o, const Mask& mask) {
  (void)mask;  // its type decides
  if constexpr (!mask_traits<Mask>::one_segment) {
    return false;
  } else {
    if (pol.kernel != policy::cuda_kernel::automatic || p.seq_q > decode_max_rows) return false;
    if (!decode_applies<T>(p) || !decode_views_fit(q, o)) return false;
    return decode_aligned(k.data, {k.stride.b, k.stride.h, k.stride.s}) &&
           decode_aligned(v.data, {v.stride.b, v.stride.h, v.stride.s}) && k.stride.d == 1 && v.stride.d == 1 &&
           k.stride.b == v.stride.b && k.stride.h == v.stride.h && k.stride.s == v.stride.s;
  }
}

/// Runs plain attend's call on the decode kernel (decode_takes said yes) over strided K and V.
template <class T>
status run_decode(const policy::cuda& pol, const problem& p, const tensor_ref<const T>& q, const tensor_ref<const T>& k,
                  const tensor_ref<const T>& v, const tensor_ref<T>& o, const band_mask& mask, float* lse) {
  decode_params dp = decode_io(p, q, o, lse, p.heads * p.seq_q, p.seq_q, 1);
  dp.lo0 = mask.lo;
  dp.hi0 = mask.hi;
  dp.shift = 0;
  dp.mods = mask.mods;  // bound to this call's seq_q and seq_kv: alibi_shift stays 0
  dp.kv.k = k.data;
  dp.kv.v = v.data;
  dp.kv.batch = k.stride.b;
  dp.kv.head = k.stride.h;
  dp.kv.token = k.stride.s;
  dp.kv.seq_kv = p.seq_kv;
  return launch_decode<T>(p, dp, p.seq_kv, static_cast<cudaStream_t>(pol.stream));
}

/// The band of a serving mask as decode_params wants it: lo0, hi0 for a sequence of 0 keys and the shift per key
/// (1 when the mask's alignment is bottom-right). `bind_len(L)` binds the mask to seq_q rows and L keys.
template <class BindLen>
void decode_band(BindLen&& bind_len, index_t seq_q, decode_params& dp) {
  const band_mask b0 = bind_len(index_t(0));
  const band_mask b1 = bind_len(seq_q + 1);
  constexpr index_t unb = band_mask::unbounded;
  const bool lo_b = b0.lo > -unb, hi_b = b0.hi < unb;
  dp.shift = hi_b ? (b1.hi - b0.hi) / (seq_q + 1) : lo_b ? (b1.lo - b0.lo) / (seq_q + 1) : 0;
  dp.lo0 = lo_b ? b0.lo : -unb;
  dp.hi0 = hi_b ? b0.hi : unb;
  dp.mods = b0.mods;
  dp.alibi_shift = (b1.mods.alibi_offset - b0.mods.alibi_offset) / (seq_q + 1);
}

}  // namespace cuda_backend
}  // namespace fusedattn
