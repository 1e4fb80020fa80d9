/// @file backward_hopper.cuh
/// The backward pass on Hopper's warpgroup tensor cores (sm_90a: wgmma, f16/bf16 in, f32 accumulators), for
/// head_dim 64 and 128: the same three steps as backward.cuh's mma.sync kernels (δ, then dK/dV, then dQ; no atomics,
/// bitwise the same on every run), with each warpgroup's products issued as wgmma from swizzled shared memory. With
/// policy::cuda::deterministic false and head_dim 128, two steps: the dK/dV kernel also forms dQ = dS·K per q tile and
/// adds it to an f32 accumulator by atomics (5 products instead of 7), then backward_dq_convert_kernel scales and
/// stores dQ. At head_dim 64 that path was slower than the dQ kernel (the dK/dV kernel's added share costs more than
/// the dQ kernel it replaces: 0.95–0.98× on an H100), so head_dim 64 runs the deterministic steps either way.
///   backward_dkdv_hopper_kernel: a block per (128 keys, kv head, batch), two warpgroups of 64 keys each; per q tile
///     of 64 rows (the column walk, Q, dO, lse and δ of the next tile copied in during the current one):
///       Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ (A and B from shared memory), Pᵀ, dV += Pᵀ·dO (Pᵀ from registers, dO N-major),
///       dSᵀ = Pᵀ∘(dPᵀ − δ), dK += dSᵀ·Q (Q N-major);
///   backward_dq_hopper_kernel: a block per (64 query rows a warpgroup, head, batch), one warpgroup at head_dim 64 and
///     two at 128 (hopper_backward_tiles); per key tile of 64 (two K/V buffers): S = Q·Kᵀ, dP = dO·Vᵀ, P,
///     dS = P∘(dP − δ), dQ += dS·K (K N-major).
/// Tiles are stored as 64-column panels of 128-byte swizzled atoms (flash_hopper.cuh's atom_offset), copied in by
/// cp.async from every thread. The element-wise steps (modifiers, mask, exponent, dS) are backward.cuh's, on the same
/// accumulator layout. Included at the end of backward.cuh, which declares launch_backward_hopper.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "backward.cuh"
#include "flash_hopper.cuh"
#include "wgmma.cuh"

namespace fusedattn {
namespace cuda_backend {

/// Tile shape of one Hopper backward kernel, `Warpgroups` warpgroups of 64 rows: the dK/dV kernel owns 64 keys a
/// warpgroup and walks q tiles of 64 rows (two buffers of Q, dO, lse and δ); the dQ kernel owns 64 query rows a
/// warpgroup and walks key tiles of 64 (two K/V buffers). Two warpgroups: one block per multiprocessor (about
/// 130 KB of shared memory at head_dim 128); one: two blocks (hopper_backward_tiles picks).
template <int HeadDim, int Warpgroups>
struct hopper_backward_tile {
  static constexpr int head_dim = HeadDim;
  static constexpr int chunks = HeadDim / 8;  ///< 16-byte chunks per row
  static constexpr int warpgroups = Warpgroups;
  static constexpr int min_blocks = Warpgroups == 1 ? 2 : 1;
  static constexpr int threads = 128 * warpgroups;
  static constexpr int block_kv = 64 * warpgroups;  ///< keys a dK/dV block owns
  static constexpr int block_q = 64;                ///< q rows per tile of the dK/dV kernel
  static constexpr int dq_rows = 64 * warpgroups;   ///< q rows a dQ block owns
  static constexpr int dq_keys = 64;                ///< keys per tile of the dQ kernel
  static constexpr int atom_bytes = 1024;           ///< tiles start on a swizzle atom
  /// K, V; Q, dO twice; lse·log2e and δ twice; slack to align the start to an atom.
  static constexpr int dkdv_smem =
      (2 * block_kv + 4 * block_q) * HeadDim * 2 + 4 * block_q * int(sizeof(float)) + atom_bytes;
  /// The atomic-dQ variant adds dSᵀ of the block's keys (BN × BM) for the dQ product.
  static constexpr int dkdv_atomic_smem = dkdv_smem + block_kv * block_q * 2;
  /// Q, dO; K, V twice; the slack.
  static constexpr int dq_smem = (2 * dq_rows + 4 * dq_keys) * HeadDim * 2 + atom_bytes;
  static_assert(HeadDim == 64 || HeadDim == 128, "the Hopper backward kernels take head_dim 64 and 128");
  static_assert(Warpgroups == 1 || Warpgroups == 2, "the Hopper backward kernels run one or two warpgroups");
};

/// The tiles a call runs, chosen by timing both kernels at one and two warpgroups (`fusedattn_bench_backward` under
/// ncu, H200): the dK/dV kernel takes two warpgroups (128 keys a block: 3–10 % faster than two blocks of 64 from
/// S 2048 on); the dQ kernel one at head_dim 64 (two blocks of 64 rows: 19–28 % faster than one of 128) and two at
/// head_dim 128 (within 3 % either way; fewer K/V copies).
template <int HeadDim>
struct hopper_backward_tiles {
  using dkdv = hopper_backward_tile<HeadDim, 2>;
  using dq = hopper_backward_tile<HeadDim, HeadDim == 64 ? 1 : 2>;
  /// Whether policy::cuda::deterministic = false takes the atomic-dQ kernel at this head_dim (at 64 the
  /// deterministic pair is faster).
  static constexpr bool atomic_dq = HeadDim == 128;
};

/// c (64 × N per warpgroup) = A·Bᵀ over D columns, issued (not committed): A is `AR` rows of a panel tile from the
/// warpgroup's first row (`a_desc`), B the N rows of a panel tile of `BR` rows (`b_desc`), both K-major.
template <class E, int D, int AR, int BR, int N>
__device__ __forceinline__ void issue_abt(float (&c)[N / 8][4], std::uint64_t a_desc, std::uint64_t b_desc) {
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const int panel = kk / 4, col = (kk % 4) * 16;
    wgmma_ss<E, N>(c, desc_plus(a_desc, panel * AR * 64 + col), desc_plus(b_desc, panel * BR * 64 + col), kk > 0);
  }
}

/// c (64 × D per warpgroup) += A (64 × K, this warp's packed fragments: pk[n][r] holds row g + 8r, columns 2t, 2t + 1
/// of the n-th 8-wide tile) · B (K rows of a panel tile, N-major descriptor `b_desc`), issued (not committed).
template <class E, int D, int K>
__device__ __forceinline__ void issue_packed(float (&c)[D / 8][4], std::uint32_t (&pk)[K / 8][2],
                                             std::uint64_t b_desc) {
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk) {
    const std::uint32_t a[4] = {pk[2 * kk][0], pk[2 * kk][1], pk[2 * kk + 1][0], pk[2 * kk + 1][1]};
    wgmma_rs<E, D>(c, a, desc_plus(b_desc, kk * 16 * 64));
  }
}

/// The atomic-dQ step of the dK/dV kernel for one q tile (rows q0.., head h): this warp's dSᵀ fragments `pd` (keys
/// kw + g + 8r, q columns 8n + 2t) go to `sds`; after the block barrier that makes every key's visible, the
/// warpgroup's dQ share (64 rows × its 64 of the 128 columns, over all BN keys) = dS·K is issued from shared memory
/// and added to p.dq_accum, two columns an atomic. Rows past seq_q are skipped (their dS is 0).
template <class E, int D, int BN, int BM, class Mask>
__device__ __forceinline__ void add_dq_share(const backward_params_t<Mask>& p, E* sds, std::uint32_t (&pd)[BM / 8][2],
                                             std::uint64_t ds_desc, std::uint64_t kq_desc, int b, int h, int q0,
                                             int wg, int warp, int kw, int g, int t) {
#pragma unroll
  for (int n = 0; n < BM / 8; ++n)
#pragma unroll
    for (int r = 0; r < 2; ++r)
      *reinterpret_cast<std::uint32_t*>(sds + atom_offset<BN>(kw + g + 8 * r, n) + 2 * t) = pd[n][r];
  static_assert(D == 128 && BN == 128, "the atomic dQ share splits 128 columns between two warpgroups");
  fence_proxy_async();
  __syncthreads();  // every key of the block
  float dq[8][4];
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < BN / 16; ++kk)
    wgmma_ss_mn<E>(dq, desc_plus(ds_desc, kk * 16 * 64), desc_plus(kq_desc, kk * 16 * 64), kk > 0);
  wgmma_commit();
  wgmma_wait<0>();
  fence_operands(dq);
  const int c0 = 64 * wg, row0 = (warp % 4) * 16 + g;
  float* head = p.dq_accum + ((index_t(b) * p.heads + h) * p.seq_q + q0) * D + c0;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int i = row0 + 8 * r;
    if (q0 + i >= p.seq_q) continue;
#pragma unroll
    for (int n = 0; n < 8; ++n)
      atomicAdd(reinterpret_cast<float2*>(head + index_t(i) * D + n * 8 + 2 * t),
                make_float2(dq[n][2 * r], dq[n][2 * r + 1]));
  }
}

/// dK and dV of 128 keys: see the file comment. With `AtomicDq` the kernel also forms each q tile's share of dQ from
/// its keys, dQ_tile += dS·K, and adds it to p.dq_accum (f32, [b][h][i][c]) by atomics; the dQ kernel then does not
/// run (5 products of the head's size instead of 7). dSᵀ goes through shared memory, read back MN-major as A; each
/// warpgroup forms 64 of the 128 columns over all 128 keys (head_dim 128 only).
template <class E, class Tile, class Mask, bool Mods = false, bool AtomicDq = false>
__global__ void __launch_bounds__(Tile::threads, Tile::min_blocks)
    backward_dkdv_hopper_kernel(const __grid_constant__ backward_params_t<Mask> p) {
#if FUSEDATTN_WGMMA_COMPILED
  constexpr int D = Tile::head_dim, BN = Tile::block_kv, BM = Tile::block_q;
  constexpr std::uint32_t atom = Tile::atom_bytes;
  extern __shared__ unsigned char smem_raw[];
  const std::uint32_t raw = smem_address(smem_raw);
  E* sk = reinterpret_cast<E*>(smem_raw + ((raw + atom - 1) / atom * atom - raw));  // [BN][D] in panels
  E* sv = sk + BN * D;                                                               // [BN][D]
  E* sq = sv + BN * D;                                                               // [2][BM][D]
  E* sdo = sq + 2 * BM * D;                                                          // [2][BM][D]
  float* s_lse = reinterpret_cast<float*>(sdo + 2 * BM * D);  // [2][BM]: lse·log2e, +inf for rows without keys
  float* s_delta = s_lse + 2 * BM;                            // [2][BM]
  // dSᵀ [BN][BM] in one panel (AtomicDq), on an atom boundary past the rest.
  E* sds = reinterpret_cast<E*>(reinterpret_cast<unsigned char*>(sk) + Tile::dkdv_smem - atom);

  const int h_kv = blockIdx.y, b = blockIdx.z;
  const int k0 = blockIdx.x * BN, k1 = k0 + BN < p.seq_kv ? k0 + BN : p.seq_kv;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, wg = warp / 4;
  const int kw = warp * 16;  // the warp's first key in the block's tile
  // The warpgroup's keys [kg0, kg1) (empty past seq_kv).
  const int kg0 = k0 + 64 * wg, kg1 = kg0 + 64 < k1 ? kg0 + 64 : (k1 > kg0 ? k1 : kg0);
  const E* k_head = static_cast<const E*>(p.k) + b * p.k_stride.b + h_kv * p.k_stride.h;
  const E* v_head = static_cast<const E*>(p.v) + b * p.v_stride.b + h_kv * p.v_stride.h;
  load_atoms<Tile, BN>(sk, k_head + index_t(k0) * p.k_stride.s, p.k_stride.s, k1 - k0);
  load_atoms<Tile, BN>(sv, v_head + index_t(k0) * p.v_stride.s, p.v_stride.s, k1 - k0);

  const auto load_q_tile = [&](int stage, int h, int q0) {
    const int rows = q0 + BM < p.seq_q ? BM : p.seq_q - q0;
    load_atoms<Tile, BM>(sq + stage * BM * D,
                         static_cast<const E*>(p.q) + b * p.q_stride.b + h * p.q_stride.h + q0 * p.q_stride.s,
                         p.q_stride.s, rows);
    load_atoms<Tile, BM>(sdo + stage * BM * D,
                         static_cast<const E*>(p.d_o) + b * p.do_stride.b + h * p.do_stride.h + q0 * p.do_stride.s,
                         p.do_stride.s, rows);
    for (int r = threadIdx.x; r < BM; r += Tile::threads)
      row_lse_delta(p, b, h, q0 + r, s_lse[stage * BM + r], s_delta[stage * BM + r]);
  };

  // The wgmma descriptors, built once (desc_plus moves them to a stage): K and V of this warpgroup's 64 keys (A,
  // K-major); Q and dO as B of the score products (K-major) and of dK and dV (N-major: q rows are the reduction).
  const std::uint64_t k_desc = swizzled_descriptor(sk + wg * 64 * 64, 16, atom);
  const std::uint64_t v_desc = swizzled_descriptor(sv + wg * 64 * 64, 16, atom);
  const std::uint64_t q_desc = swizzled_descriptor(sq, 16, atom);
  const std::uint64_t do_desc = swizzled_descriptor(sdo, 16, atom);
  const std::uint64_t q_desc_n = swizzled_descriptor(sq, BM * 128, atom);
  const std::uint64_t do_desc_n = swizzled_descriptor(sdo, BM * 128, atom);
  // The dQ product (AtomicDq), both operands MN-major: A = dS from sds (keys are the reduction), B = K.
  const std::uint64_t ds_desc = swizzled_descriptor(sds, BN * 128, atom);
  const std::uint64_t kq_desc = swizzled_descriptor(sk + wg * BN * 64, BN * 128, atom);

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
    fence_proxy_async();
    __syncthreads();  // this stage landed; every warpgroup is done with the other one
    if (have_next) {
      load_q_tile(stage ^ 1, h_next, q_next);
      cp_async_commit();
    }
    const int off = stage * BM * D;
    const float* lse_t = s_lse + stage * BM;
    const float* delta_t = s_delta + stage * BM;
    const Mask mask = head_mask(p.mask, b, h);
    const int q1 = q0 + BM < p.seq_q ? q0 + BM : p.seq_q;
    const bool partial = kg0 < kg1 && mask.is_partial(q0, q1, kg0, kg1);

    // Sᵀ (64 keys × BM rows) = K·Qᵀ and dPᵀ = V·dOᵀ, two groups; Pᵀ while dPᵀ runs.
    float s[BM / 8][4], dp[BM / 8][4];
    wgmma_fence();
    issue_abt<E, D, BN, BM, BM>(s, k_desc, desc_plus(q_desc, off));
    wgmma_commit();
    issue_abt<E, D, BN, BM, BM>(dp, v_desc, desc_plus(do_desc, off));
    wgmma_commit();
    wgmma_wait<1>();
    fence_operands(s);
    [[maybe_unused]] float cg[BM / 8][4];  // softcap's chain-rule factor (Mods)
    std::uint32_t pk[BM / 8][2];
    transposed_probs<E, Mask, Mods, BM>(s, cg, pk, p, mask, h, q0, k0, kw, partial, lse_t, g, t);
    // dV (64 keys × D) += Pᵀ·dO.
    fence_fragments(pk);
    wgmma_fence();
    issue_packed<E, D, BM>(dv, pk, desc_plus(do_desc_n, off));
    wgmma_commit();
    wgmma_wait<1>();  // dPᵀ is ready
    fence_operands(dp);
    std::uint32_t pd[BM / 8][2];
    transposed_dscores<E, Mods, BM>(s, dp, cg, delta_t, pd, t);
    // dK (64 keys × D) += dSᵀ·Q.
    fence_fragments(pd);
    wgmma_fence();
    issue_packed<E, D, BM>(dk, pd, desc_plus(q_desc_n, off));
    wgmma_commit();
    if constexpr (AtomicDq) add_dq_share<E, D, BN, BM>(p, sds, pd, ds_desc, kq_desc, b, h, q0, wg, warp, kw, g, t);
    wgmma_wait<0>();
    fence_operands(dv);
    fence_operands(dk);
    fence_fragments(pk);
    fence_fragments(pd);
    h = h_next;
    q0 = q_next;
    have = have_next;
  }
  cp_async_wait<0>();  // a block whose walk is empty still has its K/V copies in flight

  E* dk_head = static_cast<E*>(p.dk) + b * p.dk_stride.b + h_kv * p.dk_stride.h + index_t(k0) * p.dk_stride.s;
  E* dv_head = static_cast<E*>(p.dv) + b * p.dv_stride.b + h_kv * p.dv_stride.h + index_t(k0) * p.dv_stride.s;
  store_rows<E, D>(dk_head, p.dk_stride.s, dk, kw, k1 - k0, p.head_dim, p.scale, g, t);
  store_rows<E, D>(dv_head, p.dv_stride.s, dv, kw, k1 - k0, p.head_dim, 1.f, g, t);
#else
  (void)p;
#endif
}

/// dQ of 128 query rows: see the file comment.
template <class E, class Tile, class Mask, bool Mods = false>
__global__ void __launch_bounds__(Tile::threads, Tile::min_blocks)
    backward_dq_hopper_kernel(const __grid_constant__ backward_params_t<Mask> p) {
#if FUSEDATTN_WGMMA_COMPILED
  constexpr int D = Tile::head_dim, BM = Tile::dq_rows, BN = Tile::dq_keys;
  constexpr std::uint32_t atom = Tile::atom_bytes;
  extern __shared__ unsigned char smem_raw[];
  const std::uint32_t raw = smem_address(smem_raw);
  E* sq = reinterpret_cast<E*>(smem_raw + ((raw + atom - 1) / atom * atom - raw));  // [BM][D] in panels
  E* sdo = sq + BM * D;                                                              // [BM][D]
  E* sk = sdo + BM * D;                                                              // [2][BN][D]
  E* sv = sk + 2 * BN * D;                                                           // [2][BN][D]

  const int m_block = int(gridDim.x) - 1 - int(blockIdx.x), h = blockIdx.y, b = blockIdx.z;
  const int h_kv = h / p.group;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, wg = warp / 4;
  const int q0 = m_block * BM, q1 = q0 + BM < p.seq_q ? q0 + BM : p.seq_q;
  const int wr = warp * 16;  // the warp's first row in the tile
  const int w0 = q0 + wr, w1 = w0 + 16 < p.seq_q ? w0 + 16 : p.seq_q;
  const E* k_head = static_cast<const E*>(p.k) + b * p.k_stride.b + h_kv * p.k_stride.h;
  const E* v_head = static_cast<const E*>(p.v) + b * p.v_stride.b + h_kv * p.v_stride.h;
  auto rows_left = [](int from, int end, int cap) { return end - from < cap ? end - from : cap; };

  const Mask mask = head_mask(p.mask, b, h);
  [[maybe_unused]] backward_mods bm;
  if constexpr (Mods) bm = backward_mods(make_tile_mods<true>(mask, h, p.scale_log2));
  key_tiles<Mask, BN> tiles(mask, q0, q1);
  const band32 rule = element_rule(mask);
  const int k_first = tiles.first(0, 1);

  load_atoms<Tile, BM>(sq, static_cast<const E*>(p.q) + b * p.q_stride.b + h * p.q_stride.h + q0 * p.q_stride.s,
                       p.q_stride.s, q1 - q0);
  load_atoms<Tile, BM>(sdo,
                       static_cast<const E*>(p.d_o) + b * p.do_stride.b + h * p.do_stride.h + q0 * p.do_stride.s,
                       p.do_stride.s, q1 - q0);
  if (k_first >= 0) {
    const int rows = rows_left(k_first, p.seq_kv, BN);
    load_atoms<Tile, BN>(sk, k_head + index_t(k_first) * p.k_stride.s, p.k_stride.s, rows);
    load_atoms<Tile, BN>(sv, v_head + index_t(k_first) * p.v_stride.s, p.v_stride.s, rows);
  }
  cp_async_commit();

  // This thread's rows w0 + g and w0 + g + 8: lse·log2e (+inf for a row without keys or past seq_q: P = 0) and δ.
  float lse2[2], dlt[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) row_lse_delta(p, b, h, w0 + g + 8 * r, lse2[r], dlt[r]);
  cp_async_wait<0>();
  fence_proxy_async();
  __syncthreads();

  // Q and dO of this warpgroup's 64 rows (A, K-major); K and V as B of the score products (K-major) and K of dQ
  // (N-major: keys are the reduction).
  const std::uint64_t q_desc = swizzled_descriptor(sq + wg * 64 * 64, 16, atom);
  const std::uint64_t do_desc = swizzled_descriptor(sdo + wg * 64 * 64, 16, atom);
  const std::uint64_t k_desc = swizzled_descriptor(sk, 16, atom);
  const std::uint64_t v_desc = swizzled_descriptor(sv, 16, atom);
  const std::uint64_t k_desc_n = swizzled_descriptor(sk, BN * 128, atom);

  float dq[D / 8][4];
  zero_acc(dq);
  for (int k0 = k_first, k_next = -1, stage = 0; k0 >= 0; k0 = k_next, stage ^= 1) {
    const int tile_begin = tiles.seg_begin, tile_end = tiles.seg_end;  // before next() moves on
    const int off = stage * BN * D;
    k_next = tiles.next(k0);
    if (k_next >= 0) {
      const int rows = rows_left(k_next, p.seq_kv, BN);
      load_atoms<Tile, BN>(sk + (stage ^ 1) * BN * D, k_head + index_t(k_next) * p.k_stride.s, p.k_stride.s, rows);
      load_atoms<Tile, BN>(sv + (stage ^ 1) * BN * D, v_head + index_t(k_next) * p.v_stride.s, p.v_stride.s, rows);
      cp_async_commit();
    }

    // S (64 rows × BN) = Q·Kᵀ and dP = dO·Vᵀ, two groups; P while dP runs.
    float s[BN / 8][4], dp[BN / 8][4];
    wgmma_fence();
    issue_abt<E, D, BM, BN, BN>(s, q_desc, desc_plus(k_desc, off));
    wgmma_commit();
    issue_abt<E, D, BM, BN, BN>(dp, do_desc, desc_plus(v_desc, off));
    wgmma_commit();
    wgmma_wait<1>();
    fence_operands(s);
    [[maybe_unused]] float cg[BN / 8][4];  // softcap's chain-rule factor (Mods)
    row_probs<Mask, Mods, BN>(s, cg, p, bm, rule, w0, w1, k0, tile_begin, tile_end, lse2, g, t);

    // dS = P∘(dP − δ), packed; dQ += dS·K.
    wgmma_wait<0>();
    fence_operands(dp);
    std::uint32_t pk[BN / 8][2];
    row_dscores<E, Mods, BN>(s, dp, cg, dlt, pk);
    fence_fragments(pk);
    wgmma_fence();
    issue_packed<E, D, BN>(dq, pk, desc_plus(k_desc_n, off));
    wgmma_commit();
    wgmma_wait<0>();
    fence_operands(dq);
    fence_fragments(pk);
    cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();  // the next tile landed; every warpgroup is done with this one's buffers
  }

  E* dq_head = static_cast<E*>(p.dq) + b * p.dq_stride.b + h * p.dq_stride.h + index_t(q0) * p.dq_stride.s;
  store_rows<E, D>(dq_head, p.dq_stride.s, dq, wr, q1 - q0, p.head_dim, p.scale, g, t);
#else
  (void)p;
#endif
}

/// dQ = scale · p.dq_accum in the element type, eight columns a thread (the atomic-dQ path's last step).
template <class E, int D, class Mask>
__global__ void backward_dq_convert_kernel(const __grid_constant__ backward_params_t<Mask> p) {
  constexpr int chunks = D / 8;
  const index_t rows = index_t(p.batch) * p.heads * p.seq_q;
  for (index_t c = index_t(blockIdx.x) * blockDim.x + threadIdx.x; c < rows * chunks;
       c += index_t(gridDim.x) * blockDim.x) {
    const index_t row = c / chunks;
    const int ch = int(c % chunks), i = int(row % p.seq_q), h = int(row / p.seq_q % p.heads);
    const int b = int(row / (index_t(p.seq_q) * p.heads));
    const float4* src = reinterpret_cast<const float4*>(p.dq_accum + row * D + ch * 8);
    const float4 x = src[0], y = src[1];
    const float v[8] = {x.x, x.y, x.z, x.w, y.x, y.y, y.z, y.w};
    std::uint32_t packed[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) packed[e] = mma_type<E>::pack(v[2 * e] * p.scale, v[2 * e + 1] * p.scale);
    E* dst = static_cast<E*>(p.dq) + b * p.dq_stride.b + h * p.dq_stride.h + index_t(i) * p.dq_stride.s + ch * 8;
    *reinterpret_cast<uint4*>(dst) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
  }
}

/// Whether a mask's layout keeps each Hopper q tile in one q-block row: band masks always; block-sparse layouts when
/// block_q is a multiple of the dQ kernel's rows (64 at head_dim 64, 128 at head_dim 128).
inline bool hopper_backward_fits(const band_mask&, int) { return true; }
inline bool hopper_backward_fits(const block_sparse_mask& m, int rows) { return m.block_q % rows == 0; }

template <class E, class Mask>
status launch_backward_hopper(const problem& p, const backward_params_t<Mask>& bp_in, bool mods, bool atomic_dq,
                              scratch_arena& arena, cudaStream_t stream, bool& launched) {
  launched = false;
  if constexpr (std::is_same_v<E, __half> || std::is_same_v<E, __nv_bfloat16>) {
    if (p.head_dim != 64 && p.head_dim != 128) return {};
    const int dq_rows = p.head_dim == 64 ? hopper_backward_tiles<64>::dq::dq_rows
                                         : hopper_backward_tiles<128>::dq::dq_rows;
    if (!hopper_backward_fits(bp_in.mask, dq_rows) || !hopper_flash_ready(stream)) return {};
    // The atomic-dQ kernel where the flag asks for it and the tiles have one (a call without keys or queries runs
    // the deterministic pair, which writes its zeros).
    const bool tiles_atomic =
        p.head_dim == 64 ? hopper_backward_tiles<64>::atomic_dq : hopper_backward_tiles<128>::atomic_dq;
    const bool atomic = atomic_dq && tiles_atomic && p.seq_q > 0 && p.seq_kv > 0;
    backward_params_t<Mask> bp = bp_in;
    if (atomic) {
      const index_t n = p.batch * p.heads * p.seq_q * p.head_dim;
      if (status st = arena.allocate(bp.dq_accum, n, "backward: f32 dQ accumulator"); !st) return st;
      if (cudaError_t e = cudaMemsetAsync(bp.dq_accum, 0, std::size_t(n) * sizeof(float), stream); e != cudaSuccess)
        return from_cuda(e, "cudaMemsetAsync(backward: f32 dQ accumulator)");
    }
    const auto launch = [&](auto kernel, int threads, int smem, index_t rows, int tile_rows, int heads,
                            const char* name) -> status {
      if (rows == 0) return {};
      const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
      if (e != cudaSuccess) return from_cuda(e, ("cudaFuncSetAttribute(" + std::string(name) + ")").c_str());
      const dim3 grid(unsigned((rows + tile_rows - 1) / tile_rows), unsigned(heads), unsigned(p.batch));
      kernel<<<grid, threads, smem, stream>>>(bp);
      return last_launch(name);
    };
    const auto run = [&](auto tiles, auto mods_on) -> status {
      using KV = typename decltype(tiles)::dkdv;
      using Q = typename decltype(tiles)::dq;
      constexpr bool Mods = decltype(mods_on)::value;
      if constexpr (decltype(tiles)::atomic_dq) {
        if (atomic) {
          if (status st = launch(backward_dkdv_hopper_kernel<E, KV, Mask, Mods, true>, KV::threads,
                                 KV::dkdv_atomic_smem, p.seq_kv, KV::block_kv, int(p.heads_kv),
                                 "backward_dkdv_hopper_kernel(atomic dQ)");
              !st)
            return st;
          const index_t work = p.batch * p.heads * p.seq_q * (KV::head_dim / 8);
          const unsigned blocks = unsigned(std::min<index_t>((work + 255) / 256, index_t(1) << 16));
          backward_dq_convert_kernel<E, KV::head_dim, Mask><<<blocks, 256, 0, stream>>>(bp);
          return last_launch("backward_dq_convert_kernel");
        }
      }
      if (status st = launch(backward_dkdv_hopper_kernel<E, KV, Mask, Mods>, KV::threads, KV::dkdv_smem, p.seq_kv,
                             KV::block_kv, int(p.heads_kv), "backward_dkdv_hopper_kernel");
          !st)
        return st;
      return launch(backward_dq_hopper_kernel<E, Q, Mask, Mods>, Q::threads, Q::dq_smem, p.seq_q, Q::dq_rows,
                    int(p.heads), "backward_dq_hopper_kernel");
    };
    launched = true;
    const auto with_mods = [&](auto tiles) {
      return mods ? run(tiles, std::true_type{}) : run(tiles, std::false_type{});
    };
    return p.head_dim == 64 ? with_mods(hopper_backward_tiles<64>{}) : with_mods(hopper_backward_tiles<128>{});
  } else {
    (void)p, (void)bp_in, (void)mods, (void)atomic_dq, (void)arena, (void)stream;
    return {};
  }
}

}  // namespace cuda_backend
}  // namespace fusedattn
