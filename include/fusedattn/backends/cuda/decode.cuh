/// @file decode.cuh
/// The CUDA decode kernel ("cuda.decode"): a few query rows per kv head (the GQA group's heads × seq_q <= 16) against
/// a long KV cache read from a strided tensor, a paged cache or a ragged batch, at memory speed. Not the prefill
/// kernel (flash.cuh); no score modifiers yet.
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
  __device__ __forceinline__ index_t offset(int b, int h, index_t base_bh, index_t j) const {
    if (block_table == nullptr) return base_bh + j * token;
    const index_t pg = block_table[index_t(b) * blocks_per_seq + j / page_size];
    return pg * page + index_t(h) * head + (j % page_size) * token;
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
};

/// The tile geometry of a decode instantiation: 128 threads; key tiles of block_n rows, `stages` of them in flight
/// through cp.async; rows padded to Rows (4, 8 or 16) query rows.
template <int HeadDim, int Rows>
struct decode_tile {
  static constexpr int threads = 128;
  static constexpr int warps = threads / 32;
  static constexpr int head_dim = HeadDim;
  static constexpr int rows = Rows;
  static constexpr int block_n = HeadDim > 128 ? 32 : 64;
  static constexpr int stages = 3;
  static constexpr int chunks = HeadDim / 8;               ///< 16-byte chunks of a row
  static constexpr int pitch = HeadDim + 8;                ///< smem row pitch in elements (conflict-free 16 B reads)
  static constexpr int slices = threads / chunks;          ///< key slices of the P·V step
  static constexpr int score_groups = threads / block_n;   ///< row groups of the Q·Kᵀ step
  static constexpr int rows_per_thread = Rows / score_groups > 0 ? Rows / score_groups : 1;
  static constexpr int s_pitch = block_n + 1;
  static_assert(threads % chunks == 0 && block_n % slices == 0, "decode tile: slices must divide the tile");
  static_assert(Rows % score_groups == 0 || Rows < score_groups, "decode tile: rows must split over score groups");

  template <class E>
  static constexpr std::size_t stage_bytes() { return std::size_t(2) * block_n * pitch * sizeof(E); }
  template <class E>
  static constexpr std::size_t smem_bytes() {
    const std::size_t pipe = stages * stage_bytes<E>();
    const std::size_t reduce = std::size_t(slices) * Rows * HeadDim * sizeof(float);
    const std::size_t fixed = std::size_t(Rows) * HeadDim * sizeof(float) + std::size_t(Rows) * s_pitch * sizeof(float) +
                              3 * Rows * sizeof(float);
    return (pipe > reduce ? pipe : reduce) + fixed;
  }
};

/// Eight 16-bit values (16 bytes) widened to float.
template <class E>
__device__ __forceinline__ void widen8(const uint4& raw, float (&x)[8]) {
  const std::uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    x[2 * u] = mma_type<E>::unpack(w[u], 0);
    x[2 * u + 1] = mma_type<E>::unpack(w[u], 1);
  }
}

/// One block: (sequence b, kv head h_kv, split) over its share of the sequence's keys.
///   per key tile [k0, k0 + block_n):  S = (scale·log2e·Q)·Kᵀ   (rows × block_n, f32)
///                                     m' = max(m, rowmax S), P = 2^(S − m'), l = l·2^(m − m') + rowsum P
///                                     acc = acc·2^(m − m') + P·V
///   at the end: O = acc / l, lse = ln2·(m + log2 l); a row without keys: O = 0, lse = −inf.
/// Masked and out-of-range keys get P = 0; keys past the range are zero-filled, and on a tile with masked keys
/// inside the range P·V skips P = 0 (a masked key's inf or NaN in V reaches no output).
template <class E, class Tile>
__global__ void __launch_bounds__(Tile::threads) decode_kernel(const decode_params p) {
  constexpr int D = Tile::head_dim, R = Tile::rows, BN = Tile::block_n, ST = Tile::stages;
  constexpr int C = Tile::chunks, PITCH = Tile::pitch, NS = Tile::slices, SG = Tile::score_groups;
  constexpr int RPT = Tile::rows_per_thread, SP = Tile::s_pitch;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  E* kv_smem = reinterpret_cast<E*>(smem_raw);
  const std::size_t big = Tile::template smem_bytes<E>() - (std::size_t(R) * D + std::size_t(R) * SP + 3 * R) * sizeof(float);
  float* q_s = reinterpret_cast<float*>(smem_raw + big);  // R × D
  float* s_s = q_s + R * D;                                // R × SP
  float* alpha_s = s_s + R * SP;                           // R
  float* l_s = alpha_s + R;                                // R
  float* m_s = l_s + R;                                    // R
  float* red_s = reinterpret_cast<float*>(smem_raw);      // NS × R × D after the loop

  const int t = threadIdx.x, warp = t / 32, lane = t % 32;
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
  const int n_tiles = ke > kb ? int((ke - kb + BN - 1) / BN) : 0;

  // Q rows, scaled by scale·log2e, as f32 (padding rows 0).
  for (int e = t; e < R * D; e += Tile::threads) {
    const int r = e / D, c = e % D;
    float x = 0.f;
    if (r < p.rows) {
      const int h = h_kv * p.group + r / p.seq_q, i = r % p.seq_q;
      const E* qr = static_cast<const E*>(p.q) + index_t(b) * p.q_stride.b + index_t(h) * p.q_stride.h +
                    index_t(i) * p.q_stride.s;
      x = widen(qr[c]) * p.scale_log2;
    }
    q_s[e] = x;
  }
  if (t < R) {
    m_s[t] = -INFINITY;
    l_s[t] = 0.f;
  }

  const index_t base_bh = p.kv.block_table == nullptr ? p.kv.base(b, h_kv) : 0;
  const E* kg = static_cast<const E*>(p.kv.k);
  const E* vg = static_cast<const E*>(p.kv.v);
  // Loads key tile `it` into stage `it % ST`: thread t copies chunk t % C of rows t / C + NS·x.
  auto load_tile = [&](int it) {
    E* ks = kv_smem + (it % ST) * 2 * BN * PITCH;
    E* vs = ks + BN * PITCH;
    const index_t k0 = kb + index_t(it) * BN;
    const int cc = t % C;
#pragma unroll
    for (int x = 0; x < BN / NS; ++x) {
      const int row = t / C + NS * x;
      const index_t j = k0 + row;
      const bool valid = j < ke;
      const index_t off = valid ? p.kv.offset(b, h_kv, base_bh, j) + cc * 8 : 0;
      cp_async_16(ks + row * PITCH + cc * 8, kg + off, valid);
      cp_async_16(vs + row * PITCH + cc * 8, vg + off, valid);
    }
  };
#pragma unroll
  for (int s = 0; s < ST - 1; ++s) {
    if (s < n_tiles) load_tile(s);
    cp_async_commit();
  }

  float acc[R][8];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int c = 0; c < 8; ++c) acc[r][c] = 0.f;
  const int pv_chunk = t % C, pv_slice = t / C;

  for (int it = 0; it < n_tiles; ++it) {
    cp_async_wait<ST - 2>();
    __syncthreads();  // tile `it` landed for every thread; tile it − 1 is no longer read
    if (it + ST - 1 < n_tiles) load_tile(it + ST - 1);
    cp_async_commit();
    const E* ks = kv_smem + (it % ST) * 2 * BN * PITCH;
    const E* vs = ks + BN * PITCH;
    const index_t k0 = kb + index_t(it) * BN;

    // S = Q·Kᵀ: thread t takes key t % BN against rows t / BN + SG·x.
    {
      const int j = t % BN, rg = t / BN;
      float s[RPT];
#pragma unroll
      for (int x = 0; x < RPT; ++x) s[x] = 0.f;
#pragma unroll 4
      for (int cc = 0; cc < C; ++cc) {
        float kx[8];
        widen8<E>(*reinterpret_cast<const uint4*>(ks + j * PITCH + cc * 8), kx);
#pragma unroll
        for (int x = 0; x < RPT; ++x) {
          const int r = rg + SG * x;
          const float4 qa = *reinterpret_cast<const float4*>(q_s + r * D + cc * 8);
          const float4 qb = *reinterpret_cast<const float4*>(q_s + r * D + cc * 8 + 4);
          s[x] = fmaf(qa.x, kx[0], s[x]);
          s[x] = fmaf(qa.y, kx[1], s[x]);
          s[x] = fmaf(qa.z, kx[2], s[x]);
          s[x] = fmaf(qa.w, kx[3], s[x]);
          s[x] = fmaf(qb.x, kx[4], s[x]);
          s[x] = fmaf(qb.y, kx[5], s[x]);
          s[x] = fmaf(qb.z, kx[6], s[x]);
          s[x] = fmaf(qb.w, kx[7], s[x]);
        }
      }
#pragma unroll
      for (int x = 0; x < RPT; ++x)
        if (rg + SG * x < R) s_s[(rg + SG * x) * SP + j] = s[x];
    }
    __syncthreads();

    // Online softmax: warp w takes rows w, w + 4, ...; masked keys and keys past the range get P = 0.
    for (int r = warp; r < R; r += Tile::warps) {
      if (r >= p.rows) {
        if (lane == 0) alpha_s[r] = 1.f;
        for (int j = lane; j < BN; j += 32) s_s[r * SP + j] = 0.f;
        continue;
      }
      const index_t i = r % p.seq_q;
      float sv[BN / 32];
      float mt = -INFINITY;
#pragma unroll
      for (int u = 0; u < BN / 32; ++u) {
        const int j = lane + 32 * u;
        const bool ok = band_rule<index_t>{ke, lo, hi}.allowed(i, k0 + j);  // the band, keys past ke masked
        sv[u] = ok ? s_s[r * SP + j] : -INFINITY;
        mt = fmaxf(mt, sv[u]);
      }
#pragma unroll
      for (int off = 16; off > 0; off /= 2) mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, off));
      const float m_old = m_s[r];
      const float m_new = fmaxf(m_old, mt);
      float sum = 0.f;
#pragma unroll
      for (int u = 0; u < BN / 32; ++u) {
        const float pv = sv[u] == -INFINITY ? 0.f : fast_exp2(sv[u] - m_new);
        s_s[r * SP + lane + 32 * u] = pv;
        sum += pv;
      }
#pragma unroll
      for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
      if (lane == 0) {
        const float alpha = m_old == -INFINITY ? (m_new == -INFINITY ? 1.f : 0.f) : fast_exp2(m_old - m_new);
        alpha_s[r] = alpha;
        l_s[r] = l_s[r] * alpha + sum;
        m_s[r] = m_new;
      }
    }
    __syncthreads();

    // acc = acc·alpha + P·V: thread t takes columns 8·(t % C) .. + 7 of keys t / C + NS·x, every row.
    {
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const float a = alpha_s[r];
#pragma unroll
        for (int c = 0; c < 8; ++c) acc[r][c] *= a;
      }
      // A tile with a masked key inside the range: some P are 0 only by the mask.
      const bool masked_inside = !(k0 - (p.seq_q - 1) >= lo && (k0 + BN - 1 < ke ? k0 + BN - 1 : ke - 1) <= hi);
      if (!masked_inside) {
#pragma unroll 2
        for (int j = pv_slice; j < BN; j += NS) {
          float vx[8];
          widen8<E>(*reinterpret_cast<const uint4*>(vs + j * PITCH + pv_chunk * 8), vx);
#pragma unroll
          for (int r = 0; r < R; ++r) {
            const float pr = s_s[r * SP + j];
#pragma unroll
            for (int c = 0; c < 8; ++c) acc[r][c] = fmaf(pr, vx[c], acc[r][c]);
          }
        }
      } else {
        for (int j = pv_slice; j < BN; j += NS) {
          float vx[8];
          widen8<E>(*reinterpret_cast<const uint4*>(vs + j * PITCH + pv_chunk * 8), vx);
#pragma unroll
          for (int r = 0; r < R; ++r) {
            const float pr = s_s[r * SP + j];
            if (pr == 0.f) continue;  // masked for this row: its V may hold inf or NaN
#pragma unroll
            for (int c = 0; c < 8; ++c) acc[r][c] = fmaf(pr, vx[c], acc[r][c]);
          }
        }
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // the pipeline's memory becomes the reduction buffer

  // Sum the key slices: red[slice][r][c].
#pragma unroll
  for (int r = 0; r < R; ++r) {
    float4* dst = reinterpret_cast<float4*>(red_s + (pv_slice * R + r) * D + pv_chunk * 8);
    dst[0] = make_float4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
    dst[1] = make_float4(acc[r][4], acc[r][5], acc[r][6], acc[r][7]);
  }
  __syncthreads();
  constexpr float ln2 = float(fusedattn::ln2);
  for (int e = t; e < p.rows * D; e += Tile::threads) {
    const int r = e / D, c = e % D;
    float sum = 0.f;
#pragma unroll
    for (int s = 0; s < NS; ++s) sum += red_s[(s * R + r) * D + c];
    const float l = l_s[r];
    const float out = l == 0.f ? 0.f : sum / l;  // a NaN l gives NaN
    const int h = h_kv * p.group + r / p.seq_q, i = r % p.seq_q;
    const float lse = l == 0.f ? -INFINITY : (m_s[r] + log2f(l)) * ln2;
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

/// Combines the splits of row (b, h, i) = blockIdx.x: m = max_s lse_s, w_s = e^(lse_s − m),
/// O = Σ w_s·O_s / Σ w_s, lse = m + log Σ w_s, over the parts that saw a key (lse_s > −inf). No part saw one: O = 0,
/// lse = −inf; a part with a NaN lse makes O and lse NaN.
template <class E>
__global__ void decode_merge_kernel(const decode_params p, int head_dim) {
  const index_t row = blockIdx.x;
  const index_t rows = index_t(p.batch) * p.heads * p.seq_q;
  const int i = int(row % p.seq_q), h = int((row / p.seq_q) % p.heads), b = int(row / (index_t(p.seq_q) * p.heads));
  float m = -INFINITY;
  bool nan = false;
  for (int s = 0; s < p.splits; ++s) {
    const float x = p.lse_part[s * rows + row];
    m = fmaxf(m, x);
    nan = nan || isnan(x);
  }
  float w_sum = 0.f;
  for (int s = 0; s < p.splits; ++s) {
    const float x = p.lse_part[s * rows + row];
    if (x != -INFINITY) w_sum += __expf(x - m);
  }
  E* orow = static_cast<E*>(p.o) + index_t(b) * p.o_stride.b + index_t(h) * p.o_stride.h + index_t(i) * p.o_stride.s;
  for (int c = threadIdx.x; c < head_dim; c += blockDim.x) {
    float acc = 0.f;
    for (int s = 0; s < p.splits; ++s) {
      const float x = p.lse_part[s * rows + row];
      if (x == -INFINITY) continue;
      acc += __expf(x - m) * p.o_part[(s * rows + row) * head_dim + c];
    }
    orow[c] = narrow<E>(nan ? NAN : w_sum > 0.f ? acc / w_sum : 0.f);
  }
  if (p.lse != nullptr && threadIdx.x == 0)
    p.lse[index_t(b) * p.lse_b + index_t(h) * p.lse_h + index_t(i) * p.lse_i] =
        nan ? NAN : w_sum > 0.f ? m + logf(w_sum) : -INFINITY;
}

/// `f(Tile{})` for the decode tile of head_dim and rows (group · seq_q); `otherwise` when none fits.
template <class R, class F>
R with_decode_tile(index_t head_dim, index_t rows, R otherwise, F&& f) {
  auto by_rows = [&](auto dim) -> R {
    constexpr int D = decltype(dim)::value;
    if (rows <= 4) return f(decode_tile<D, 4>{});
    if (rows <= 8) return f(decode_tile<D, 8>{});
    if (rows <= 16) return f(decode_tile<D, 16>{});
    return otherwise;
  };
  switch (head_dim) {
    case 64: return by_rows(std::integral_constant<int, 64>{});
    case 128: return by_rows(std::integral_constant<int, 128>{});
    case 256: return by_rows(std::integral_constant<int, 256>{});
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

/// Splits for a launch of `blocks` (sequence, kv head) blocks over at most `keys` keys: enough to fill every SM
/// `per_sm` times, each split at least two key tiles, at most 128.
inline int decode_splits(index_t blocks, index_t keys, int block_n, int multiprocessors, int per_sm) {
  constexpr index_t max_splits = 128, min_tiles = 2;
  const index_t target = index_t(multiprocessors) * (per_sm > 0 ? per_sm : 1);
  index_t splits = (target + blocks - 1) / blocks;
  const index_t by_keys = keys / (min_tiles * block_n);
  if (splits > by_keys) splits = by_keys;
  if (splits > max_splits) splits = max_splits;
  return splits < 1 ? 1 : int(splits);
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
                              decode_kernel<E, Tile><<<grid, Tile::threads, Tile::template smem_bytes<E>(), stream>>>(dp);
                              if (status st = last_launch("decode_kernel"); !st) return st;
                              if (splits > 1) {
                                const index_t rows = p.batch * p.heads * p.seq_q;
                                decode_merge_kernel<E><<<unsigned(rows), 128, 0, stream>>>(dp, int(p.head_dim));
                                if (status st = last_launch("decode_merge_kernel"); !st) return st;
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
/// a band mask without score modifiers, f16/bf16, head_dim 64/128/256, group size × seq_q <= 16, and K and V with the
/// same 16-byte aligned strides.
template <class T, class Mask>
bool decode_takes(const policy::cuda& pol, const problem& p, const tensor_ref<const T>& q, const tensor_ref<const T>& k,
                  const tensor_ref<const T>& v, const tensor_ref<T>& o, const Mask& mask) {
  if constexpr (!mask_traits<Mask>::one_segment) {
    return false;
  } else {
    if (pol.kernel != policy::cuda_kernel::automatic || mods_of(mask).any() || p.seq_q > decode_max_rows) return false;
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
}

}  // namespace cuda_backend
}  // namespace fusedattn
