/// @file flash.cuh
/// The fused forward kernel on tensor cores (sm_80 and newer, mma.sync m16n8k16, f32 accumulation) for f16 and
/// bf16, every head_dim that is a multiple of 8 up to 256 (tiles of 32, 64, 96, 128 and 256 columns; a head_dim
/// between them runs the next wider tile with the columns past it read as zeros and not stored), every band mask
/// and block-sparse layouts, score modifiers (softcap, ALiBi, sinks), GQA/MQA and any sequence lengths. Not the
/// dispatch (attend_cuda.cuh).
///
/// One thread block owns `block_m` query rows of one (batch, head); each warp owns 16 or 32 of them. The block walks
/// the key tiles of the mask's segments (a band's kv_range; a block-sparse row's runs), `block_n` keys at a time:
///   S = Q·Kᵀ            (warp: 16 or 32 × block_n, Q fragments from registers or shared memory, K from shared)
///   S = S'/scale with S' = softcap(scale·S) + alibi    (only in the instantiation for calls with modifiers)
///   S = −inf where the mask forbids (only on tiles is_partial reports)
///   m' = max(m, rowmax(scale·S)),  P = exp(scale·S − m'),  l = l·exp(m − m') + rowsum(P),  O = O·exp(m − m')
///   O += P·V            (P re-packed from the S accumulators to 16-bit A fragments, V via transposed ldmatrix)
/// and at the end l += e^sink (with sinks), O /= l, lse = m + log l. Exponentials are base 2 with scale·log2(e)
/// folded in.
/// Loads are cp.async 16-byte copies into XOR-swizzled shared tiles (swizzle: conflict-free for rows of 4, 8, 12,
/// 16 or 32 chunks): with one K/V buffer, V of tile t streams in during Q·Kᵀ of tile t and K of tile t + 1 during
/// P·V of tile t; with two, K and V of tile t + 1 during all of t. Calls with too few blocks for the GPU
/// (decode-like ones, one head of a few thousand rows) split the key tiles over more blocks and merge the parts by
/// their lse (flash_merge_kernel).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

#include <cuda.h>
#include <cuda_runtime.h>

#include "../../core/online_softmax.hpp"
#include "../../core/problem.hpp"
#include "../../core/status.hpp"
#include "../../core/tensor.hpp"
#include "../../kernels/block_sparse.hpp"
#include "../../kernels/mask.hpp"
#include "device_types.cuh"
#include "head_mask.cuh"
#include "error.cuh"
#include "mma.cuh"
#include "nonfinite.cuh"
#include "ragged.cuh"
#include "scratch.cuh"

namespace fusedattn {
namespace cuda_backend {

/// Everything one flash launch needs, by value. Strides are in elements. `Mask` is a bound mask with the tile-loop
/// interface (band_mask, or block_sparse_mask whose arrays are in device memory).
template <class Mask>
struct flash_params_t {
  const void* q;
  const void* k;
  const void* v;
  void* o;
  float* lse;  ///< [b][h][s_q] or nullptr
  strides4 q_stride, k_stride, v_stride, o_stride;
  int batch, heads, group, seq_q, seq_kv;
  float scale_log2;  ///< softmax scale · log2(e)
  Mask mask;
  /// Split-KV (decode): `splits` > 1 cuts each block's key tiles into that many parts, grid.z = batch · splits; part
  /// s writes its normalised O in f32 to o_part[s][b][h][i][:] and its lse to lse_part[s][b][h][i], and
  /// flash_merge_kernel combines them. With splits = 1 both are unused and O, lse are written directly.
  int splits;
  float* o_part;
  float* lse_part;
  /// Read by the Hopper kernel only (its TMA copies; launch_flash_hopper fills them): the tensor maps of K and V
  /// (the warp-specialised kernel's also of Q, and of O for its stores), and which problem dimension (1 seq,
  /// 2 head, 3 batch) each outer dimension of a map is (make_tile_map).
  CUtensorMap k_map{}, v_map{}, q_map{}, o_map{};
  int k_order[3] = {1, 2, 3}, v_order[3] = {1, 2, 3}, q_order[3] = {1, 2, 3}, o_order[3] = {1, 2, 3};
  /// Read by the warp-specialised Hopper kernel (hopper_schedule_for sets it): 0 orders the work items head by
  /// head, 1 q-block first across all heads (every head's heaviest q-block, then the next ...), handed to the
  /// blocks of the persistent grid in a snake.
  int q_block_major = 0;
  /// Read by launch_flash_hopper (policy::cuda::concurrent): 1 launches the warp-specialised kernel one block per
  /// work item even where hopper_schedule_for would take a persistent grid.
  int per_item = 0;
  /// The problem's head_dim: the columns of Q, K, V and O (0: the tile's). A tile wider than it (the Hopper 128
  /// tile for 96; the mma.sync tile of the next supported width for any multiple of 8) reads the columns past it as
  /// zeros (tensor maps, or predicated copies), and its stores and flash_merge_kernel stop at it.
  int head_dim = 0;
  /// The repair pass's flag (launch_flash_repair; null: no repair follows): a block whose O holds an inf or NaN
  /// sets it to 1, and flash_repair_kernel returns at once while it is 0.
  int* nonfinite = nullptr;
  /// A ragged batch in one launch (ragged.cuh; the warp-specialised Hopper kernel and the repair pass; null cu_q:
  /// not ragged): Q, K, V, O are packed (batch 1, seq_q and seq_kv the token totals, lse [h][token]), sequence b
  /// owns rows [cu_q[b], cu_q[b + 1]) and keys [cu_kv[b], cu_kv[b + 1]), `mask` is bound to lengths (0, 0) and
  /// `shift` rebinds it to each sequence's; `ragged_items` counts the work items (ragged_items()).
  const int* cu_q = nullptr;
  const int* cu_kv = nullptr;
  int ragged_items = 0;
  int* ragged_next = nullptr;  ///< the Hopper kernel's item counter (zeroed before the launch; null: items dealt
                               ///< round robin): items handed out past each block's first
  ragged_shift shift{};
};
using flash_params = flash_params_t<band_mask>;

/// The parameters every flash launch starts from, filled by name: the views' addresses and strides, the problem's
/// extents, head_dim and softmax scale, the bound mask; one split, no scratch, no repair flag (the launch functions
/// and callers set those, and the Hopper tensor maps and ragged fields, where they apply).
template <class Mask, class In, class Out>
flash_params_t<Mask> flash_params_of(const problem& p, const tensor_ref<const In>& q, const tensor_ref<const In>& k,
                                     const tensor_ref<const In>& v, const tensor_ref<Out>& o, const Mask& mask,
                                     float* lse) {
  flash_params_t<Mask> fp{};
  fp.q = q.data;
  fp.k = k.data;
  fp.v = v.data;
  fp.o = o.data;
  fp.lse = lse;
  fp.q_stride = q.stride;
  fp.k_stride = k.stride;
  fp.v_stride = v.stride;
  fp.o_stride = o.stride;
  fp.batch = int(p.batch);
  fp.heads = int(p.heads);
  fp.group = int(p.group_size());
  fp.seq_q = int(p.seq_q);
  fp.seq_kv = int(p.seq_kv);
  fp.head_dim = int(p.head_dim);
  fp.scale_log2 = static_cast<float>(p.softmax_scale() * log2e);
  fp.mask = mask;
  fp.splits = 1;
  return fp;
}

/// Compile-time tile shape of one flash instantiation: `Warps` warps, each owning `WarpRows` (16 or 32) query rows,
/// so a K or V fragment read from shared memory feeds WarpRows / 16 mma tiles. `Stages` K/V buffers: 1 streams V of
/// tile t during Q·Kᵀ of t and K of t + 1 during P·V of t (two barriers per tile); 2 loads K and V of tile t + 1
/// into the other buffer while all of tile t runs (one barrier per tile).
template <int HeadDim, int Warps, int BlockN, int WarpRows = 16, int Stages = 1>
struct flash_tile {
  static constexpr int head_dim = HeadDim;
  static constexpr int warps = Warps;
  static constexpr int threads = 32 * Warps;
  static constexpr int m_tiles = WarpRows / 16;     ///< 16-row mma tiles per warp
  static constexpr int block_m = WarpRows * Warps;  ///< query rows per block
  static constexpr int block_n = BlockN;            ///< keys per tile
  static constexpr int chunks = HeadDim / 8;        ///< 16-byte chunks per row
  static constexpr int stages = Stages;
  static constexpr int smem_elems = (block_m + 2 * Stages * block_n) * HeadDim;  ///< Q, K and V tiles
  /// One 16-row tile keeps its Q fragments (head_dim / 4 registers) in registers; two re-read them from shared
  /// memory (register budget), and so does head_dim 256, whose 128-float accumulator leaves no room for 64 more.
  static constexpr bool q_in_registers = WarpRows == 16 && HeadDim <= 128;
  static_assert(HeadDim % 32 == 0,
                "the swizzle needs rows of a multiple of four 16-byte chunks (head_dim 32, 64, 96, ...)");
  static_assert(BlockN % 16 == 0, "block_n must be a multiple of the mma k extent (16)");
  static_assert(WarpRows == 16 || WarpRows == 32, "a warp owns 16 or 32 query rows");
  static_assert(Stages == 1 || Stages == 2, "flash keeps one or two K/V buffers");
};

/// Offset in elements of (row, 16-byte chunk) in a swizzled tile of `Chunks` chunks per row. Shared memory serves
/// 8 chunks (128 bytes, its 32 banks) per phase, the 8 chunk slots mod 8 being the 8 bank groups, and every access
/// of the kernel is a phase of 8 chunks: an ldmatrix matrix (or the O staging of a warp) takes 8 consecutive rows at
/// one logical chunk; a cp.async store or the O read-back 8 consecutive chunks of the row-major tile, 8-aligned.
/// Let G = gcd(Chunks, 8): 8 for head_dim 64, 128, 256; 4 for head_dim 32 and 96. Unswizzled, row r starts in
/// group r·Chunks mod 8, which takes only 8 / G values over 8 rows (a multiple of G). The swizzle XORs the chunk
/// index with sigma(r) = (r / (8 / G)) mod G, constant over 8 / G rows and taking all G values over 8 rows, so
/// (r·Chunks mod 8, sigma(r)) is different for each of 8 consecutive rows and so is their group
/// (r·Chunks + (c ^ sigma(r))) mod 8, whose low log2(G) bits are (c mod G) ^ sigma(r) and whose high bits move with
/// r·Chunks mod 8. The XOR only permutes chunks inside an aligned group of G chunks, which lies in one row (G divides
/// Chunks) and in one 8-aligned run of the tile (G divides 8), so 8 consecutive chunks of the tile still fill the 8
/// groups. With G = 8 this is chunk ^ (row mod 8).
template <int Chunks>
__device__ __forceinline__ int swizzle(int row, int chunk) {
  static_assert(Chunks % 4 == 0, "the swizzle needs a multiple of four 16-byte chunks per row");
  constexpr int group = Chunks % 8 == 0 ? 8 : 4;  // G = gcd(Chunks, 8)
  constexpr int step_shift = group == 8 ? 0 : 1;  // log2(8 / G): rows with the same sigma
  return row * (Chunks * 8) + ((chunk ^ ((row >> step_shift) & (group - 1))) << 3);
}

/// Block-wide cp.async of rows [0, Rows) of a tile (row r at `g + r·stride_s`) into swizzled shared memory;
/// rows at and past `valid` are zero-filled (never read), and so are the 16-byte chunks at and past `valid_chunks`
/// (a head_dim narrower than the tile's: those columns add nothing to Q·Kᵀ and are not stored).
template <class Tile, int Rows, class E>
__device__ __forceinline__ void load_tile(E* smem, const E* g, index_t stride_s, int valid, int valid_chunks) {
  for (int c = threadIdx.x; c < Rows * Tile::chunks; c += Tile::threads) {
    const int r = c / Tile::chunks, ch = c % Tile::chunks;
    const bool ok = r < valid && ch < valid_chunks;
    cp_async_16(smem + swizzle<Tile::chunks>(r, ch), g + (ok ? r : 0) * stride_s + (ok ? ch : 0) * 8, ok);
  }
}

/// The score modifiers of one (batch, head) in the form the flash tile loops apply them (core/score_mod.hpp's
/// bound_mods::apply, for scores kept unscaled): the loops exponentiate 2^(scale·log2e·S − m) on the raw S = q·k, so
/// a tile with modifiers is rewritten in place to
///   S' = apply(scale·S, h, i, j) / scale = cap_out·tanh(S·cap_in) − slope·|j − i − offset|,
///   cap_in = scale / cap, cap_out = cap / scale, slope = slope_h / scale (offset: bound_mods::alibi_offset),
/// and the softmax runs unchanged. tanh(x) = 1 − 2 / (2^(2·log2e·x) + 1), both steps on the special-function unit
/// (ex2.approx and rcp.approx: absolute error about 2^-21; ±inf give ±1, NaN stays NaN): five instructions a score,
/// which costs less than taking 2^y on the FMA pipe (docs/design.md, rejected designs). ALiBi's |j − i − offset| is
/// one conversion a tile plus constants (exact: integers below 2^24). The sink, in base 2 (−inf when off), joins the
/// epilogue only (add_sink). Built only in the kernels' instantiation for calls with modifiers (`Mods`).
struct tile_mods {
  float cap_in2 = 0.f;   ///< 2·log2e·scale / cap; 0: no softcap
  float cap_out = 0.f;   ///< cap / scale
  float cap_neg2 = 0.f;  ///< −2·cap / scale
  float slope = 0.f;     ///< slope_h / scale
  float offset = 0.f;    ///< bound_mods::alibi_offset
  float sink2 = -INFINITY;  ///< sink_h · log2e, or −inf
  bool capped = false, biased = false;
  tile_mods() = default;
  __device__ __forceinline__ tile_mods(const bound_mods& m, int h, float scale_log2) {
    constexpr float log2e = float(fusedattn::log2e);
    const float scale = scale_log2 / log2e;
    capped = m.softcap != 0.f;
    biased = m.alibi_slopes != nullptr;
    if (capped) cap_in2 = 2.f * scale_log2 / m.softcap, cap_out = m.softcap / scale, cap_neg2 = -2.f * cap_out;
    if (biased) slope = m.alibi_slopes[h] / scale, offset = float(m.alibi_offset);
    sink2 = m.sink<float>(h) * log2e;
  }
  /// cap_out·tanh(s·cap_in) = cap_out − 2·cap_out / (2^(s·cap_in2) + 1).
  __device__ __forceinline__ float cap_score(float s) const {
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(fast_exp2(s * cap_in2) + 1.f));
    return fmaf(cap_neg2, r, cap_out);
  }
  /// S' of the raw score s of row i, key j.
  __device__ __forceinline__ float apply(float s, int i, int j) const {
    if (capped) s = cap_score(s);
    if (biased) s -= slope * fabsf(float(j - i) - offset);
    return s;
  }
  /// Applies the modifiers to a thread's part of a 16-row score tile (m16n8 accumulators: s[n][e] is row
  /// `row` + 8·(e / 2), key k0 + 8n + 2t + e % 2), when the call has any that change scores.
  template <int BN>
  __device__ __forceinline__ void apply_tile(float (&s)[BN / 8][4], int row, int k0, int t) const {
    if (capped) {
#pragma unroll
      for (int n = 0; n < BN / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[n][e] = cap_score(s[n][e]);
    }
    if (biased) {
      const float d0 = float(k0 + 2 * t - row) - offset;  // j − i − offset of element s[0][0]
#pragma unroll
      for (int n = 0; n < BN / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[n][e] -= slope * fabsf(d0 + float(8 * n + (e & 1) - 8 * (e / 2)));
    }
  }
};

/// The modifiers of head h of a call, for the kernels' instantiation `Mods` (a default, unused tile_mods without).
template <bool Mods, class Mask>
__device__ __forceinline__ tile_mods make_tile_mods(const Mask& mask, int h, float scale_log2) {
  if constexpr (Mods) return tile_mods(mods_of(mask), h, scale_log2);
  else return tile_mods{};
}

/// A finished row's sink: core/online_softmax.hpp's online::add_sink on the row max m and its sum l (over the quad),
/// in base 2; returns the factor O's accumulator takes. A row that saw no key gets O = 0, lse = the sink logit.
__device__ __forceinline__ float add_sink(float& m, float& l, float sink2) { return online::add_sink(m, l, sink2); }

/// Raises the repair pass's flag (p.nonfinite, when set) if a thread's accumulators hold an inf or NaN: their sum is
/// then non-finite (a finite sum that overflows raises it too, which only costs a repair that finds nothing).
template <int N>
__device__ __forceinline__ void flag_nonfinite(int* nonfinite, const float (&acc)[N][4]) {
  if (nonfinite == nullptr) return;
  float sum = 0.f;
#pragma unroll
  for (int n = 0; n < N; ++n) sum += (acc[n][0] + acc[n][1]) + (acc[n][2] + acc[n][3]);
  if (!isfinite(sum)) *nonfinite = 1;
}

/// The K and V tile loads of the mma.sync kernel (flash_forward_block's loader): rows [k0, k0 + block_n) of this
/// head's K or V into a swizzled buffer by block-wide cp.async (load_tile), the rows past seq_kv and the columns past
/// the problem's head_dim (`cols_ch` 16-byte chunks) zero-filled. A view of the block's values (references); its
/// members are inlined as ordinary functions, not forced (forcing them changes ptxas's schedule).
template <class E, class Tile, class Mask>
struct mma_kv_loader {
  const flash_params_t<Mask>& p;
  const E* const& k_head;  ///< K of this (batch, kv head)
  const E* const& v_head;  ///< V of this (batch, kv head)
  const int& cols_ch;
  /// Keys left from k0, at most block_n.
  __device__ int rows(int k0) const { return p.seq_kv - k0 < Tile::block_n ? p.seq_kv - k0 : Tile::block_n; }
  /// K (V) rows from key k0 into dst.
  __device__ void k(E* dst, int k0) const {
    load_tile<Tile, Tile::block_n>(dst, k_head + k0 * p.k_stride.s, p.k_stride.s, rows(k0), cols_ch);
  }
  __device__ void v(E* dst, int k0) const {
    load_tile<Tile, Tile::block_n>(dst, v_head + k0 * p.v_stride.s, p.v_stride.s, rows(k0), cols_ch);
  }
  /// K and V rows from key k0 into k_dst and v_dst.
  __device__ void both(E* k_dst, E* v_dst, int k0) const {
    const int n = rows(k0);
    load_tile<Tile, Tile::block_n>(k_dst, k_head + k0 * p.k_stride.s, p.k_stride.s, n, cols_ch);
    load_tile<Tile, Tile::block_n>(v_dst, v_head + k0 * p.v_stride.s, p.v_stride.s, n, cols_ch);
  }
};

/// One q-block of the mma.sync kernel: rows [m_block·block_m, ...) of head h, batch and split `bz` (batch · splits +
/// split); flash_forward_kernel runs one a block, flash_repair_kernel those it finds non-finite. `Guarded` (the
/// repair kernel only) checks, on each tile with masked keys, whether its V holds an inf or NaN, and if so takes
/// plain_pv for that tile's P·V; the tensor cores would form 0·inf for a masked key (docs/design.md, Numerics).
/// `Mods`: the call has score modifiers (tile_mods; calls without run the instantiation that has no trace of them).
/// Its K/V loads are mma_kv_loader's; Q·Kᵀ, the mask and softmax step, P·V and the O epilogue stay inline: moved into
/// functions of their own they compile to the same instructions, but flash_repair_kernel's come out in another order.
template <class E, class Tile, class Mask, bool Guarded, bool Mods = false>
__device__ __forceinline__ void flash_forward_block(const flash_params_t<Mask>& p, int m_block, int h, int bz) {
  constexpr int D = Tile::head_dim, BM = Tile::block_m, BN = Tile::block_n, CH = Tile::chunks, MT = Tile::m_tiles;
  constexpr bool band = mask_traits<Mask>::one_segment;  // one key segment: no tile reaches past it
  constexpr float neg_inf = -INFINITY;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  E* sq = reinterpret_cast<E*>(smem_raw);  // [BM][D] swizzled; reused to stage O
  E* sk = sq + BM * D;                     // [stages][BN][D] swizzled
  E* sv = sk + Tile::stages * BN * D;      // [stages][BN][D] swizzled

  const int b = bz / p.splits, split = bz % p.splits, h_kv = h / p.group;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;  // mma fragment coordinates: row group, thread in group

  // Row and key indices fit in int (flash_grid_fits); offsets are formed in index_t. M-tile mt of this warp covers
  // rows [mt_row(mt), mt_row(mt) + 16); this thread holds rows mt_row(mt) + g and mt_row(mt) + g + 8 of it.
  const int q0 = m_block * BM;
  const int q1 = q0 + BM < p.seq_q ? q0 + BM : p.seq_q;
  const int warp_row = warp * 16 * MT;  // this warp's first row in the tile
  const auto mt_row = [&](int mt) { return q0 + warp_row + 16 * mt; };
  const auto mt_end = [&](int mt) { return mt_row(mt) + 16 < p.seq_q ? mt_row(mt) + 16 : p.seq_q; };

  const E* q_head = static_cast<const E*>(p.q) + b * p.q_stride.b + h * p.q_stride.h;
  const E* k_head = static_cast<const E*>(p.k) + b * p.k_stride.b + h_kv * p.k_stride.h;
  const E* v_head = static_cast<const E*>(p.v) + b * p.v_stride.b + h_kv * p.v_stride.h;
  E* o_head = static_cast<E*>(p.o) + b * p.o_stride.b + h * p.o_stride.h;
  // 16-byte chunks of a row that hold the problem's columns; those past them load as zeros and are not stored.
  const int cols_ch = p.head_dim > 0 ? p.head_dim / 8 : CH;

  // The key tiles (key_tiles): each of the mask's segments (one for a band, the runs of listed blocks for
  // block-sparse) cut into BN-aligned tiles; a split (band only) takes its share of the one segment; k0 = -1 ends.
  const Mask mask = head_mask(p.mask, b, h);
  key_tiles<Mask, BN> tiles(mask, q0, q1);
  const band32 rule = element_rule(mask);  // the band (a block-sparse mask's `within`) in 32-bit arithmetic
  const int k_first = tiles.first(split, p.splits);
  [[maybe_unused]] const tile_mods mods = make_tile_mods<Mods>(mask, h, p.scale_log2);
  const mma_kv_loader<E, Tile, Mask> kv{p, k_head, v_head, cols_ch};

  load_tile<Tile, BM>(sq, q_head + q0 * p.q_stride.s, p.q_stride.s, q1 - q0, cols_ch);
  if (k_first >= 0) {
    kv.k(sk, k_first);
    if constexpr (Tile::stages == 2) kv.v(sv, k_first);
  }
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();

  // Q fragments (16 × 16 A tiles): all of head_dim kept in registers for one m-tile, else re-read per k-step.
  std::uint32_t q_frag[Tile::q_in_registers ? D / 16 : 1][4];
  if constexpr (Tile::q_in_registers) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) ldmatrix_x4(q_frag[kk], sq + swizzle<CH>(warp_row + lane % 16, kk * 2 + lane / 16));
  }

  float acc[MT][D / 8][4];  // O of each m-tile, 16 rows × D, as D/8 accumulator tiles of 16 × 8
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int n = 0; n < D / 8; ++n) acc[mt][n][0] = acc[mt][n][1] = acc[mt][n][2] = acc[mt][n][3] = 0.f;
  float m_run[MT][2], l_run[MT][2];  // running max of scale·log2(e)·s; this thread's part of the running sum
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) m_run[mt][0] = m_run[mt][1] = neg_inf, l_run[mt][0] = l_run[mt][1] = 0.f;

  for (int k0 = k_first, k_next = -1, stage = 0; k0 >= 0; k0 = k_next, stage ^= Tile::stages - 1) {
    [[maybe_unused]] const int tile_begin = tiles.seg_begin, tile_end = tiles.seg_end;  // before next() moves on
    const E* sk_t = sk + stage * BN * D;
    const E* sv_t = sv + stage * BN * D;
    if constexpr (Tile::stages == 1) {
      // V of this tile streams in while Q·Kᵀ runs (every warp finished P·V of the last tile at the closing barrier).
      kv.v(sv, k0);
      cp_async_commit();
    } else {
      // K and V of the next tile stream into the other buffer while this whole tile runs (every warp finished the
      // tile that last used it at the closing barrier).
      k_next = tiles.next(k0);
      if (k_next >= 0) {
        kv.both(sk + (stage ^ 1) * BN * D, sv + (stage ^ 1) * BN * D, k_next);
        cp_async_commit();
      }
    }

    // S (16 × BN per m-tile) = Q (16 × D) · Kᵀ (D × BN); one ldmatrix_x4 gives the B fragments of two 8-key tiles,
    // used by every m-tile.
    float s[MT][BN / 8][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int n = 0; n < BN / 8; ++n) s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      std::uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        if constexpr (Tile::q_in_registers) {
#pragma unroll
          for (int i = 0; i < 4; ++i) a[mt][i] = q_frag[kk][i];
        } else {
          ldmatrix_x4(a[mt], sq + swizzle<CH>(warp_row + 16 * mt + lane % 16, kk * 2 + lane / 16));
        }
      }
#pragma unroll
      for (int np = 0; np < BN / 16; ++np) {
        std::uint32_t kf[4];
        ldmatrix_x4(kf, sk_t + swizzle<CH>(np * 16 + lane % 8 + (lane / 16) * 8, kk * 2 + (lane / 8) % 2));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma_16816<E>(s[mt][2 * np], a[mt], kf[0], kf[1]);
          mma_16816<E>(s[mt][2 * np + 1], a[mt], kf[2], kf[3]);
        }
      }
    }

    // Per-element mask, only on tiles that need it. A band tests the tile against its edges and the end of the keys.
    // A block-sparse tile is visited once per segment (run of listed blocks) it holds keys of (key_tiles), and counts
    // only that segment's keys: a tile inside its segment can only be cut by the element rule `within` and the end
    // of the keys; one that reaches past the segment's edge also masks the keys outside [tile_begin, tile_end).
    std::uint32_t pk[MT][BN / 8][2];  // P packed to 16 bits as soon as it is known: rows g and g + 8 of each key tile
    const bool past_edge = !band && (k0 < tile_begin || k0 + BN > tile_end);
    [[maybe_unused]] bool warp_partial = false;  // some row of this warp has a masked key in the tile (Guarded)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      if constexpr (Mods) mods.apply_tile<BN>(s[mt], mt_row(mt) + g, k0, t);  // S' = apply(scale·S) / scale
      const bool masked = past_edge || rule.is_partial(mt_row(mt), mt_end(mt), k0, k0 + BN);
      warp_partial = warp_partial || masked;
      if (masked) {
#pragma unroll
        for (int n = 0; n < BN / 8; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int c = n * 8 + 2 * t + (e & 1), i = mt_row(mt) + g + 8 * (e / 2), j = k0 + c;
            bool ok = rule.allowed(i, j);
            if constexpr (!band) ok = ok && j >= tile_begin && j < tile_end;
            if (!ok) s[mt][n][e] = neg_inf;
          }
      }

      // Online softmax, rows g (e = 0, 1) and g + 8 (e = 2, 3); a row is spread over the 4 threads of a quad.
      // The row max is taken on the raw scores and scaled once (scale > 0).
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float mx = neg_inf;
#pragma unroll
        for (int n = 0; n < BN / 8; ++n) mx = fmaxf(mx, fmaxf(s[mt][n][2 * r], s[mt][n][2 * r + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        mx = fmaxf(m_run[mt][r], mx * p.scale_log2);
        const float m_use = mx == neg_inf ? 0.f : mx;  // a row with nothing allowed yet keeps P = 0, no NaN
        const float alpha = fast_exp2(m_run[mt][r] - m_use);
        m_run[mt][r] = mx;
        float sum = 0.f;
#pragma unroll
        for (int n = 0; n < BN / 8; ++n)
#pragma unroll
          for (int e = 2 * r; e < 2 * r + 2; ++e) {
            s[mt][n][e] = fast_exp2(fmaf(s[mt][n][e], p.scale_log2, -m_use));
            sum += s[mt][n][e];
          }
        l_run[mt][r] = l_run[mt][r] * alpha + sum;
#pragma unroll
        for (int n = 0; n < BN / 8; ++n) pk[mt][n][r] = mma_type<E>::pack(s[mt][n][2 * r], s[mt][n][2 * r + 1]);
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
          acc[mt][n][2 * r] *= alpha;
          acc[mt][n][2 * r + 1] *= alpha;
        }
      }
    }

    if constexpr (Tile::stages == 1) {
      cp_async_wait<0>();
      __syncthreads();  // V landed; every warp is done with this K tile
      k_next = tiles.next(k0);
      if (k_next >= 0) {
        kv.k(sk, k_next);
        cp_async_commit();
      }
    }

    // O (16 × D per m-tile) += P (16 × BN) · V (BN × D); the packed P of key tiles 2kk, 2kk + 1 is the A fragment;
    // one transposed ldmatrix_x4 gives the B fragments of two 8-column tiles of V, used by every m-tile. Guarded: a
    // tile with masked keys whose V holds an inf or NaN takes plain_pv instead.
    if (Guarded && warp_partial && __any_sync(0xffffffffu, has_nonfinite<E, BN * D>(sv_t, lane, 32))) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
        plain_pv<E, BN, D>(acc[mt], pk[mt], lane,
                           [&](int j, int c) { return widen(sv_t[swizzle<CH>(j, c / 8) + c % 8]); });
    } else {
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        std::uint32_t a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          a[mt][0] = pk[mt][2 * kk][0];
          a[mt][1] = pk[mt][2 * kk][1];
          a[mt][2] = pk[mt][2 * kk + 1][0];
          a[mt][3] = pk[mt][2 * kk + 1][1];
        }
#pragma unroll
        for (int dp = 0; dp < D / 16; ++dp) {
          std::uint32_t vf[4];
          ldmatrix_x4_trans(vf, sv_t + swizzle<CH>(kk * 16 + lane % 8 + ((lane / 8) % 2) * 8, dp * 2 + lane / 16));
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            mma_16816<E>(acc[mt][2 * dp], a[mt], vf[0], vf[1]);
            mma_16816<E>(acc[mt][2 * dp + 1], a[mt], vf[2], vf[3]);
          }
        }
      }
    }
    cp_async_wait<0>();
    __syncthreads();  // the next tile's loads landed; every warp is done with this tile's buffers
  }

  // O = acc / l; lse = ln 2 · (m + log2 l). A row that saw no key (l = 0): O = 0, lse = −inf. A NaN logit left
  // l = NaN (exp2 of it, summed; no later step clears it): O and lse NaN. With sinks, the sink joins l first
  // (add_sink; a split's parts leave it to flash_merge_kernel).
  // O is staged through this warp's rows of the Q tile (no other warp reads them), then written as 16-byte chunks;
  // a split writes its part in f32 straight from the accumulators instead.
  constexpr float ln2 = float(fusedattn::ln2);
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) flag_nonfinite(p.nonfinite, acc[mt]);
  if (p.splits > 1) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float l = l_run[mt][r];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const float inv_l = l == 0.f ? 0.f : 1.f / l;
        const int row = mt_row(mt) + g + 8 * r;
        if (row >= p.seq_q) continue;
        const index_t part_row = ((static_cast<index_t>(split) * p.batch + b) * p.heads + h) * p.seq_q + row;
        if (t == 0) p.lse_part[part_row] = l == 0.f ? neg_inf : (m_run[mt][r] + log2f(l)) * ln2;
#pragma unroll
        for (int n = 0; n < D / 8; ++n)
          *reinterpret_cast<float2*>(p.o_part + part_row * D + n * 8 + 2 * t) =
              make_float2(acc[mt][n][2 * r] * inv_l, acc[mt][n][2 * r + 1] * inv_l);
      }
    return;
  }
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float l = l_run[mt][r];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      float inv_l = l == 0.f ? 0.f : 1.f / l;
      if constexpr (Mods) {
        const float alpha = add_sink(m_run[mt][r], l, mods.sink2);
        inv_l = l == 0.f ? 0.f : alpha / l;
      }
      const int row = mt_row(mt) + g + 8 * r;
      if (p.lse != nullptr && t == 0 && row < p.seq_q)
        p.lse[(static_cast<index_t>(b) * p.heads + h) * p.seq_q + row] = l == 0.f ? neg_inf : (m_run[mt][r] + log2f(l)) * ln2;
      if constexpr (!Tile::q_in_registers) __syncwarp();  // this warp's Q reads are done before O overwrites them
#pragma unroll
      for (int n = 0; n < D / 8; ++n)
        *reinterpret_cast<std::uint32_t*>(sq + swizzle<CH>(warp_row + 16 * mt + g + 8 * r, n) + 2 * t) =
            mma_type<E>::pack(acc[mt][n][2 * r] * inv_l, acc[mt][n][2 * r + 1] * inv_l);
    }
  __syncthreads();
  for (int c = threadIdx.x; c < BM * CH; c += Tile::threads) {
    const int r = c / CH, ch = c % CH;
    if (q0 + r < p.seq_q && ch < cols_ch)
      *reinterpret_cast<uint4*>(o_head + (q0 + r) * p.o_stride.s + ch * 8) =
          *reinterpret_cast<const uint4*>(sq + swizzle<CH>(r, ch));
  }
}

/// The mma.sync flash kernel: one q-block a block; the heaviest q-blocks (under a causal mask: the last) start first,
/// so the tail of the grid is short.
template <class E, class Tile, class Mask, bool Mods = false>
__global__ void __launch_bounds__(Tile::threads) flash_forward_kernel(const flash_params_t<Mask> p) {
  flash_forward_block<E, Tile, Mask, false, Mods>(p, static_cast<int>(gridDim.x) - 1 - static_cast<int>(blockIdx.x),
                                                  blockIdx.y, blockIdx.z);
}

/// The repair pass after either flash kernel on a call with a mask (run_flash): their tensor-core P·V cannot keep a
/// masked key's P = 0 from an inf or NaN in that key's V row (0·inf = NaN inside the mma), so a row it contaminated
/// comes out NaN. The flash kernel's blocks raise p.nonfinite where their O holds an inf or NaN (flag_nonfinite);
/// while it is 0 (every finite call) each block of this kernel reads it and returns. Raised, the kernel reads O back,
/// q-block by q-block (x, x + gridDim.x, ...; the mma.sync tile's q-blocks), and recomputes with
/// flash_forward_block<..., Guarded = true> every q-block holding a non-finite value (the contaminated ones, and
/// those whose rows depend on a non-finite input, which come out the same).
template <class E, class Tile, class Mask, bool Mods = false>
__global__ void __launch_bounds__(Tile::threads) flash_repair_kernel(const flash_params_t<Mask> p) {
  if (*p.nonfinite == 0) return;
  constexpr int CH = Tile::chunks;
  const int cols_ch = p.head_dim > 0 ? p.head_dim / 8 : CH;  // chunks of O that hold the problem's columns
  const int q_blocks = (p.seq_q + Tile::block_m - 1) / Tile::block_m, items = q_blocks * p.heads * p.batch;
  for (int x = blockIdx.x; x < items; x += gridDim.x) {
    const int m_block = x % q_blocks, h = (x / q_blocks) % p.heads, b = x / (q_blocks * p.heads);
    const int q0 = m_block * Tile::block_m, rows = q0 + Tile::block_m < p.seq_q ? Tile::block_m : p.seq_q - q0;
    const E* o_head = static_cast<const E*>(p.o) + b * p.o_stride.b + h * p.o_stride.h;
    // Independent 16-byte loads (no early exit), four in flight a thread: the pass is a read of O at memory speed.
    unsigned bad = 0;
#pragma unroll 4
    for (int c = threadIdx.x; c < rows * cols_ch; c += Tile::threads)
      bad |= unsigned(has_nonfinite<E, 8>(o_head + (q0 + c / cols_ch) * p.o_stride.s + (c % cols_ch) * 8, 0, 1));
    if (__syncthreads_or(bad != 0)) {
      flash_forward_block<E, Tile, Mask, true, Mods>(p, m_block, h, b);
      __syncthreads();  // the next q-block's loads overwrite the tiles this one read last
    }
  }
}

/// flash_repair_kernel for a ragged batch in one launch (p.cu_q set; ragged.cuh): the ragged work items of the mma.sync
/// tile (p.ragged_items, counted with its block_m), each q-block to recompute run on its sequence's view (Q, K, V, O
/// from the sequence's first row and key, its lengths, the mask rebound to them). lse stays as the flash kernel wrote
/// it: m and l do not depend on V, and a row whose own inputs are not finite comes out the same either way.
template <class E, class Tile, bool Mods = false>
__global__ void __launch_bounds__(Tile::threads) flash_repair_ragged_kernel(const flash_params_t<band_mask> p) {
  if (*p.nonfinite == 0) return;
  constexpr int BM = Tile::block_m;
  const int cols_ch = p.head_dim > 0 ? p.head_dim / 8 : Tile::chunks;
  ragged_cursor seq;
  for (int x = blockIdx.x; x < p.ragged_items; x += gridDim.x) {
    seq.seek(p.cu_q, p.heads, BM, x);
    const int h = seq.head(x), m_block = seq.m_block(x), q0 = m_block * BM;
    const int rows = q0 + BM < seq.nq ? BM : seq.nq - q0;
    const E* o_seq = static_cast<const E*>(p.o) + h * p.o_stride.h + static_cast<index_t>(seq.q0) * p.o_stride.s;
    unsigned bad = 0;
#pragma unroll 4
    for (int c = threadIdx.x; c < rows * cols_ch; c += Tile::threads)
      bad |= unsigned(has_nonfinite<E, 8>(o_seq + (q0 + c / cols_ch) * p.o_stride.s + (c % cols_ch) * 8, 0, 1));
    if (__syncthreads_or(bad != 0)) {
      flash_params_t<band_mask> ps = p;
      const int k0 = p.cu_kv[seq.b], nk = p.cu_kv[seq.b + 1] - k0;
      ps.q = static_cast<const E*>(p.q) + static_cast<index_t>(seq.q0) * p.q_stride.s;
      ps.k = static_cast<const E*>(p.k) + static_cast<index_t>(k0) * p.k_stride.s;
      ps.v = static_cast<const E*>(p.v) + static_cast<index_t>(k0) * p.v_stride.s;
      ps.o = static_cast<E*>(p.o) + static_cast<index_t>(seq.q0) * p.o_stride.s;
      ps.lse = nullptr;
      ps.seq_q = seq.nq;
      ps.seq_kv = nk;
      ps.mask = sequence_band(p.mask, p.shift, seq.nq, nk);
      ps.cu_q = ps.cu_kv = nullptr;
      flash_forward_block<E, Tile, band_mask, true, Mods>(ps, m_block, h, 0);
      __syncthreads();  // the next q-block's loads overwrite the tiles this one read last
    }
  }
}

/// Combines the split parts of row (b, h, i) = blockIdx.x, one thread per column c of head_dim (the tile's: the
/// parts' row length; columns from p.head_dim on, if set, are not stored):
///   m = max_s lse_s,  w_s = exp(lse_s − m),  O = Σ_s w_s·O_s / Σ_s w_s,  lse = m + log Σ_s w_s
/// over the parts that saw a key (lse_s > −inf; the others are skipped, not weighted by 0). A row no part saw gets
/// O = 0, lse = −inf; a part whose lse is NaN (a NaN logit) makes the row's O and lse NaN. With sinks the sink joins
/// here, once, as one more part with no value row (lse_sink = sink_h, O_sink = 0): a row no part saw then gets
/// O = 0, lse = sink_h.
template <class E, class Mask>
__global__ void flash_merge_kernel(const flash_params_t<Mask> p, int head_dim) {
  const index_t r = blockIdx.x, rows = index_t(p.batch) * p.heads * p.seq_q;
  const int i = int(r % p.seq_q), h = int((r / p.seq_q) % p.heads), b = int(r / (index_t(p.seq_q) * p.heads));
  const float sink = mods_of(p.mask).template sink<float>(h);  // −inf when sinks are off
  float m = sink;
  bool nan = false;
  for (int s = 0; s < p.splits; ++s) {
    const float lse_s = p.lse_part[s * rows + r];
    m = fmaxf(m, lse_s);
    nan = nan || isnan(lse_s);
  }
  float w_sum = 0.f, o = 0.f;
  if (m != -INFINITY) {
    for (int s = 0; s < p.splits; ++s) {
      const float lse_s = p.lse_part[s * rows + r];
      if (lse_s == -INFINITY) continue;
      const float w = __expf(lse_s - m);
      w_sum += w;
      if (threadIdx.x < unsigned(head_dim)) o += w * p.o_part[(s * rows + r) * head_dim + threadIdx.x];
    }
    if (sink != -INFINITY) w_sum += __expf(sink - m);
  }
  const float nan_value = __int_as_float(0x7fffffff);
  E* o_row = static_cast<E*>(p.o) + b * p.o_stride.b + h * p.o_stride.h + i * p.o_stride.s;
  const int cols = p.head_dim > 0 ? p.head_dim : head_dim;
  if (threadIdx.x < unsigned(cols)) o_row[threadIdx.x] = narrow<E>(nan ? nan_value : w_sum > 0.f ? o / w_sum : 0.f);
  if (p.lse != nullptr && threadIdx.x == 0)
    p.lse[r] = nan ? nan_value : w_sum > 0.f ? m + logf(w_sum) : -INFINITY;
}

/// Number of key splits for a launch of `blocks` blocks over `kv_tiles` key tiles: split calls that leave the GPU
/// under-filled — decode-like ones (one q-block per head) below two blocks per multiprocessor, others (several
/// q-blocks, e.g. one head of a few thousand rows) below half a block per multiprocessor — into parts of at least
/// two tiles, so that about two blocks run per multiprocessor.
inline int flash_splits(index_t q_blocks, index_t blocks, index_t kv_tiles, int multiprocessors) {
  constexpr index_t blocks_per_sm = 2, min_tiles_per_split = 2, max_splits = 64;  // flash_grid_fits relies on 64
  if (blocks >= blocks_per_sm * multiprocessors) return 1;
  if (q_blocks > 1 && 2 * blocks > multiprocessors) return 1;
  index_t splits = (blocks_per_sm * multiprocessors + blocks - 1) / blocks;
  if (splits > kv_tiles / min_tiles_per_split) splits = kv_tiles / min_tiles_per_split;
  if (splits > max_splits) splits = max_splits;
  return splits > 1 ? int(splits) : 1;
}

/// The key splits of a flash launch whose tile has `block_m` query rows and `block_n` keys (flash_splits; only
/// one-segment masks (mask_traits) are split: a split cuts one segment).
template <class Mask>
int flash_split_count(index_t batch, index_t heads, index_t seq_q, index_t seq_kv, int block_m, int block_n,
                      int multiprocessors) {
  if (!mask_traits<Mask>::one_segment) return 1;
  const index_t q_blocks = (seq_q + block_m - 1) / block_m;
  return flash_splits(q_blocks, q_blocks * heads * batch, (seq_kv + block_n - 1) / block_n, multiprocessors);
}

/// Device scratch of a split-KV launch: each part's O rows of `head_dim` floats and its lse.
inline std::size_t flash_split_scratch_bytes(int splits, index_t rows, int head_dim) {
  return splits > 1 ? sizeof(float) * std::size_t(splits) * std::size_t(rows) * (std::size_t(head_dim) + 1) : 0;
}

/// The tile shape for a head dimension on sm_80 / sm_90 (mma.sync path): one heuristic, chosen among the tiles
/// bench/gpu times (FUSEDATTN_BENCH_TILE_SWEEP): head_dim 128 takes 4 warps of 32 rows and 64-key
/// tiles, head_dim 64 4 warps of 32 rows and 128-key tiles (each K/V fragment feeds two mma tiles). head_dim 128
/// keeps two K/V buffers (96 KB of shared memory: two blocks per multiprocessor on sm_90, one on sm_80's 164 KB);
/// head_dim 64 one (a second costs it register spills).
/// The others follow the register budget (a thread holds O as head_dim / 8 × 4 floats per 16-row m-tile, S as
/// block_n / 8 × 4) and bench/gpu/head_dim_sweep.cu (f16, (4, 16, 4096), dense and causal, H200): head_dim 32
/// (O: 32 floats for two m-tiles) takes head_dim 64's tile with two K/V buffers (40 KB; 3-5 % ahead of one buffer
/// or 64 keys);
/// head_dim 96 (O: 96 floats) head_dim 128's warps and 64-key tiles with one buffer (48 KB; two tie within 1 % but
/// spill 12 bytes on sm_90); head_dim 256 (O: 128 floats for one m-tile) warps of 16 rows with Q re-read from
/// shared memory and one K/V buffer of 64 keys (96 KB; 2-6 % ahead of 8 warps, 17 % of two 32-key buffers).
/// Every default tile needs at most 99 KB of shared memory, the per-block limit of sm_86 / sm_89 (sm_80 163 KB,
/// sm_90 227 KB); the new ones spill no registers on sm_80 or sm_90 (ptxas -v).
template <int HeadDim>
struct flash_default_tile;
template <>
struct flash_default_tile<32> {
  using type = flash_tile<32, 4, 128, 32, 2>;
};
template <>
struct flash_default_tile<64> {
  using type = flash_tile<64, 4, 128, 32, 1>;
};
template <>
struct flash_default_tile<96> {
  using type = flash_tile<96, 4, 64, 32, 1>;
};
template <>
struct flash_default_tile<128> {
  using type = flash_tile<128, 4, 64, 32, 2>;
};
template <>
struct flash_default_tile<256> {
  using type = flash_tile<256, 4, 64, 16, 1>;
};

/// The tile widths flash has, ascending: the one list flash_applies, flash_fits_mask and run_flash read. A head_dim
/// that is a multiple of 8 runs the narrowest tile at least as wide (40 and 64 the 64 tile, 80 the 96 tile, 136 the
/// 256 tile), its columns past head_dim loaded as zeros (load_tile) and not stored.
template <int... HeadDims>
struct head_dim_list {};
using flash_head_dims = head_dim_list<32, 64, 96, 128, 256>;
inline constexpr int flash_max_head_dim = 256;
inline constexpr const char* flash_head_dims_text = "every multiple of 8 up to 256";

/// with_default_tile's walk over the list, one tile width at a time.
template <class R, class F>
R with_tile_of(index_t, R otherwise, F&, head_dim_list<>) {
  return otherwise;
}
template <class R, class F, int HeadDim, int... Rest>
R with_tile_of(index_t head_dim, R otherwise, F& f, head_dim_list<HeadDim, Rest...>) {
  if (head_dim <= HeadDim) return f(typename flash_default_tile<HeadDim>::type{});
  return with_tile_of(head_dim, std::move(otherwise), f, head_dim_list<Rest...>{});
}
/// `f(Tile{})` with Tile = the mma.sync tile that runs head_dim (flash_default_tile of the narrowest width in
/// flash_head_dims at least head_dim), or `otherwise` when head_dim is not a multiple of 8 in [8, 256].
template <class R, class F>
R with_default_tile(index_t head_dim, R otherwise, F&& f) {
  if (head_dim < 8 || head_dim % 8 != 0 || head_dim > flash_max_head_dim) return otherwise;
  return with_tile_of(head_dim, std::move(otherwise), f, flash_head_dims{});
}

/// Largest dynamic shared memory a block may opt into on every device flash runs on (sm_86 and sm_89: 99 KB).
inline constexpr int flash_max_smem_bytes = 99 * 1024;
template <int... HeadDims>
constexpr bool default_tiles_fit(head_dim_list<HeadDims...>) {
  constexpr int element_bytes = 2;  // f16, bf16
  return ((flash_default_tile<HeadDims>::type::smem_elems * element_bytes <= flash_max_smem_bytes) && ...);
}
static_assert(default_tiles_fit(flash_head_dims{}),
              "every default flash tile must fit the 99 KB of shared memory a block gets on sm_86 / sm_89");

/// True when flash can read and write these views with 16-byte copies: aligned base pointers and row, head and
/// batch strides that are multiples of 8 elements.
template <class T>
bool flash_aligned(const tensor_ref<T>& t) {
  constexpr index_t vec = 16 / index_t(sizeof(T));
  return reinterpret_cast<std::uintptr_t>(t.data) % 16 == 0 && t.stride.s % vec == 0 && t.stride.h % vec == 0 &&
         t.stride.b % vec == 0;
}

/// The current device's number of multiprocessors (`count`), or the runtime's error.
inline status device_multiprocessors(int& count) {
  int device = 0;
  if (status st = from_cuda(cudaGetDevice(&device), "cudaGetDevice"); !st) return st;
  return from_cuda(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device),
                   "cudaDeviceGetAttribute(multiprocessors)");
}

/// launch_flash_kernel's `blocks_per_sm` for a 1-D grid of one block per work item.
inline constexpr int one_block_per_item = 1 << 30;

/// Launches a flash kernel `kernel` (flash_forward_kernel, flash_hopper_kernel or flash_hopper_ws_kernel) with
/// `smem` bytes of dynamic shared memory and `threads` threads a block, plus the merge of split-KV parts when the
/// call is decode-like. `Tile` gives block_m, block_n and head_dim; `E` is the device element type (__half or
/// __nv_bfloat16); `p.splits`, `o_part`, `lse_part` are filled in here. The grid: `blocks_per_sm` = 0, block
/// (q-block, head, batch · splits) (the first two kernels); > 0, a 1-D grid of at most that many blocks per
/// multiprocessor, each walking the work items (q-block, head, batch, split) x, x + gridDim.x, ...
/// (flash_hopper_ws_kernel; a split-KV call gets one block per item).
template <class E, class Tile, class Mask>
status launch_flash_kernel(void (*kernel)(flash_params_t<Mask>), int smem, flash_params_t<Mask> p, cudaStream_t stream,
                           int threads = Tile::threads, int blocks_per_sm = 0) {
  if (status st = from_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
                            "cudaFuncSetAttribute(flash kernel)");
      !st)
    return st;
  int multiprocessors = 0;
  if (status st = device_multiprocessors(multiprocessors); !st) return st;
  const index_t q_blocks = (p.seq_q + Tile::block_m - 1) / Tile::block_m;
  p.splits = flash_split_count<Mask>(p.batch, p.heads, p.seq_q, p.seq_kv, Tile::block_m, Tile::block_n, multiprocessors);
  p.o_part = p.lse_part = nullptr;
  const index_t rows = index_t(p.batch) * p.heads * p.seq_q;
  if (p.splits > 1) {
    void *o_part = nullptr, *lse_part = nullptr;
    if (status st = scratch_allocate(o_part, sizeof(float) * p.splits * rows * Tile::head_dim, stream,
                                     "cudaMallocFromPoolAsync(split-KV parts of O)");
        !st)
      return st;
    if (status st = scratch_allocate(lse_part, sizeof(float) * p.splits * rows, stream,
                                     "cudaMallocFromPoolAsync(split-KV parts of lse)");
        !st) {
      cudaFreeAsync(o_part, stream);
      return st;
    }
    p.o_part = static_cast<float*>(o_part);
    p.lse_part = static_cast<float*>(lse_part);
  }
  const index_t items = q_blocks * p.heads * p.batch * p.splits;  // work items (q-block, head, batch, split)
  if (blocks_per_sm > 0 && p.splits > 1) blocks_per_sm = one_block_per_item;
  const dim3 grid = blocks_per_sm > 0 ? dim3(unsigned(std::min<index_t>(items, index_t(blocks_per_sm) * multiprocessors)))
                                      : dim3(unsigned(q_blocks), p.heads, p.batch * p.splits);
  kernel<<<grid, threads, smem, stream>>>(p);
  if (p.splits == 1) return last_launch("flash kernel");
  const status launched = last_launch("flash kernel");
  if (launched) flash_merge_kernel<E, Mask><<<unsigned(rows), Tile::head_dim, 0, stream>>>(p, Tile::head_dim);
  const status merged = launched ? last_launch("flash_merge_kernel") : launched;
  cudaFreeAsync(p.o_part, stream);
  cudaFreeAsync(p.lse_part, stream);
  return merged;
}

/// Launches one mma.sync flash instantiation (see launch_flash_kernel).
/// `Mods`: the instantiation for calls with score modifiers.
template <class E, class Tile, class Mask, bool Mods = false>
status launch_flash(flash_params_t<Mask> p, cudaStream_t stream) {
  return launch_flash_kernel<E, Tile>(flash_forward_kernel<E, Tile, Mask, Mods>, Tile::smem_elems * int(sizeof(E)), p,
                                      stream);
}

/// Launches a repair kernel (flash_repair_kernel, flash_repair_ragged_kernel; `name` for errors) of the mma.sync tile
/// `Tile` over `items` work items: one block per multiprocessor (at most one per item), no key splits.
template <class E, class Tile, class Mask>
status launch_repair(void (*kernel)(flash_params_t<Mask>), const char* name, flash_params_t<Mask> p, index_t items,
                     cudaStream_t stream) {
  constexpr int smem = Tile::smem_elems * int(sizeof(E));
  if (status st = from_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
                            (std::string("cudaFuncSetAttribute(") + name + ")").c_str());
      !st)
    return st;
  int multiprocessors = 0;
  if (status st = device_multiprocessors(multiprocessors); !st) return st;
  if (items == 0) return {};
  p.splits = 1;
  p.o_part = p.lse_part = nullptr;
  kernel<<<unsigned(std::min<index_t>(items, multiprocessors)), Tile::threads, smem, stream>>>(p);
  return last_launch(name);
}

/// Launches flash_repair_kernel for `p` (the flash call's parameters, p.nonfinite its flag; the mma.sync tile `Tile`
/// of its head_dim) over its q-blocks.
template <class E, class Tile, class Mask, bool Mods = false>
status launch_flash_repair(const flash_params_t<Mask>& p, cudaStream_t stream) {
  const index_t items = (p.seq_q + Tile::block_m - 1) / Tile::block_m * index_t(p.heads) * p.batch;
  return launch_repair<E, Tile, Mask>(flash_repair_kernel<E, Tile, Mask, Mods>, "flash_repair_kernel", p, items, stream);
}

/// Launches flash_repair_ragged_kernel for a ragged call's `p` (p.nonfinite its flag) over its ragged work items
/// (`host_cu_q`: the query offsets as the host reads them).
template <class E, class Tile, bool Mods = false>
status launch_flash_repair_ragged(flash_params_t<band_mask> p, const std::int32_t* host_cu_q, index_t sequences,
                                  cudaStream_t stream) {
  const index_t items = ragged_items(host_cu_q, sequences, p.heads, Tile::block_m);
  p.ragged_items = int(items);
  return launch_repair<E, Tile, band_mask>(flash_repair_ragged_kernel<E, Tile, Mods>, "flash_repair_ragged_kernel", p,
                                           items, stream);
}

/// Grid limits of a flash launch: errc::unsupported naming the extent that does not fit.
inline status flash_grid_fits(const problem& p) {
  constexpr index_t max_yz = 65535, max_seq = index_t(1) << 30;  // row + tile arithmetic stays inside int
  constexpr index_t max_splits = 64;                                // flash_splits' bound: grid.z = batch · splits
  if (p.heads > max_yz) return {errc::unsupported, "problem.heads is " + std::to_string(p.heads) + "; CUDA flash takes at most 65535"};
  if (p.batch > max_yz / max_splits)
    return {errc::unsupported, "problem.batch is " + std::to_string(p.batch) + "; CUDA flash takes at most 1023"};
  if (p.batch * p.heads * p.seq_q > max_seq)
    return {errc::unsupported, "problem.batch * heads * seq_q exceeds 2^30, the CUDA flash limit"};
  if (p.seq_q > max_seq || p.seq_kv > max_seq)
    return {errc::unsupported, "problem.seq_q/seq_kv exceed 2^30, the CUDA flash limit"};
  return {};
}

}  // namespace cuda_backend
}  // namespace fusedattn
