/// @file head_mask.cuh
/// The bound mask one (batch, head) of a kernel uses (a band is the same for every head; a block-sparse layout may
/// hold one pattern per batch entry and head), and the walk over the key segments and key tiles of one q-tile.
/// Device side only.
#pragma once

#include "../../kernels/block_sparse.hpp"
#include "../../kernels/mask.hpp"

namespace fusedattn {
namespace cuda_backend {

__device__ __forceinline__ const band_mask& head_mask(const band_mask& m, index_t, index_t) { return m; }
__device__ __forceinline__ block_sparse_mask head_mask(const block_sparse_mask& m, index_t b, index_t h) {
  return for_head(m, b, h);
}

/// A band rule in 32-bit arithmetic for the per-tile and per-element tests of the flash loop (rows and keys fit in
/// int: flash_grid_fits): lo and hi are clamped to ±3·2^29, beyond any key − row difference, so the rule is the
/// same and the tests cost 32-bit registers only.
struct band32 {
  int seq_kv, lo, hi;
  __device__ __forceinline__ explicit band32(const band_mask& m) {
    constexpr index_t bound = index_t(3) << 29;
    seq_kv = int(m.seq_kv);
    lo = int(m.lo < -bound ? -bound : m.lo > bound ? bound : m.lo);
    hi = int(m.hi < -bound ? -bound : m.hi > bound ? bound : m.hi);
  }
  /// band_mask::allowed.
  __device__ __forceinline__ bool allowed(int i, int j) const { return j >= 0 && j < seq_kv && j - i >= lo && j - i <= hi; }
  /// The keys of row i that the rule allows within [k_begin, k_end) (a key tile from k0, or a block-sparse segment
  /// cut to it), as the tile's columns [c_lo, c_hi): key k0 + c is allowed when c_lo <= c < c_hi (none when
  /// c_lo >= c_hi). A masked tile's per-element test is then two comparisons with constants and a select per score,
  /// with no branch (the short-circuit `allowed` compiled to a branch per score). The sums stay in int: lo and hi
  /// are at least -3·2^29 and are cut to seq_kv (at most 2^30) before row i is added; i is below seq_q + 128, so
  /// only Q, K and V of 2^30 rows each (more memory than a GPU holds) could take i + seq_kv past 2^31.
  __device__ __forceinline__ void columns(int i, int k0, int k_begin, int k_end, int& c_lo, int& c_hi) const {
    int first = i + (lo < seq_kv ? lo : seq_kv);  // first and last allowed key of the row (last inclusive)
    int last = i + (hi < seq_kv ? hi : seq_kv);
    first = max(max(first, k_begin), 0);
    last = max(min(min(last, k_end - 1), seq_kv - 1), k0 - 1);
    c_lo = first - k0;
    c_hi = last + 1 - k0;
  }
  /// band_mask::is_partial.
  __device__ __forceinline__ bool is_partial(int q0, int q1, int k0, int k1) const {
    return !(k1 <= seq_kv && k0 >= 0 && k0 - (q1 - 1) >= lo && (k1 - 1) - q0 <= hi);
  }
};
__device__ __forceinline__ band32 element_rule(const band_mask& m) { return band32(m); }
__device__ __forceinline__ band32 element_rule(const block_sparse_mask& m) { return band32(m.band); }

/// The key segments one q-tile of rows [q0, q1) visits, in ascending order, one `next` at a time: a band has one
/// (its kv_range); a block-sparse row has one per run of listed kv-blocks (or per block when the layout has no run
/// arrays), clipped to the keys `within` lets these rows see. Only the row's run cursor is kept, so the walk costs a
/// few registers and one pair of loads per segment (no searches).
template <class Mask>
struct key_segments;

template <>
struct key_segments<band_mask> {
  kv_span keys;
  bool done;
  __device__ __forceinline__ key_segments(const band_mask& m, index_t q0, index_t q1)
      : keys(m.kv_range(q0, q1)), done(keys.empty()) {}
  /// The next segment [begin, end); false when none is left.
  __device__ __forceinline__ bool next(int& begin, int& end) {
    if (done) return false;
    done = true;
    begin = int(keys.begin);
    end = int(keys.end);
    return true;
  }
};

template <>
struct key_segments<block_sparse_mask> {
  const block_index* runs;  ///< [first, last + 1) pairs, or nullptr: single blocks from `cols`
  const block_index* cols;
  index_t u, u_end;         ///< cursor over this q-block row's runs (or blocks)
  index_t lo, hi, block_kv; ///< the keys `within` allows these rows, and the block width
  __device__ __forceinline__ key_segments(const block_sparse_mask& m, index_t q0, index_t q1)
      : runs(m.run_offsets ? m.runs : nullptr), cols(m.cols), block_kv(m.block_kv) {
    const index_t qb = q0 / m.block_q;
    const kv_span keys = m.band.kv_range(q0, q1);
    lo = keys.begin;
    hi = keys.end;
    u = m.run_offsets ? m.run_offsets[qb] : m.row_offsets[qb];
    u_end = keys.empty() ? u : m.run_offsets ? m.run_offsets[qb + 1] : m.row_offsets[qb + 1];
  }
  /// The next non-empty segment [begin, end); false when none is left.
  __device__ __forceinline__ bool next(int& begin, int& end) {
    while (u < u_end) {
      const index_t first = (runs ? runs[2 * u] : cols[u]) * block_kv;
      const index_t last = (runs ? runs[2 * u + 1] : cols[u] + 1) * block_kv;
      ++u;
      if (first >= hi) break;  // ascending: no later run reaches the allowed keys either
      const index_t b = first > lo ? first : lo, e = last < hi ? last : hi;
      if (b < e) {
        begin = int(b);
        end = int(e);
        return true;
      }
    }
    u = u_end;
    return false;
  }
};

/// The key tiles one q-tile of rows [q0, q1) visits, `BN` keys each, for both flash kernels: each of the mask's
/// segments cut into BN-aligned tiles. A tile that holds keys of two segments (runs of blocks narrower than BN, or
/// not BN-aligned) is visited once for each, and each visit counts only its segment's keys [seg_begin, seg_end):
/// the kernels' per-element test is then a range, and nothing is counted twice. `first(split, splits)` gives
/// the first tile's key (−1: none); with splits > 1 (band masks: one segment) part `split` takes an equal share of
/// the segment's tiles and may get none. `next(k0)` gives the tile after k0 (−1: the walk is over).
/// [seg_begin, seg_end) is the segment of the tile last returned (read it before calling next again).
template <class Mask, int BN>
struct key_tiles {
  key_segments<Mask> segments;
  int seg_begin = 0, seg_end = 0;
  __device__ __forceinline__ key_tiles(const Mask& m, index_t q0, index_t q1) : segments(m, q0, q1) {}
  __device__ __forceinline__ int first(int split, int splits) {
    if (!segments.next(seg_begin, seg_end)) return -1;
    int k = seg_begin / BN * BN;
    if (splits > 1) {
      const int tiles = (seg_end - k + BN - 1) / BN;
      const int from = k + (tiles * split / splits) * BN, to = k + (tiles * (split + 1) / splits) * BN;
      seg_end = to < seg_end ? to : seg_end;
      k = from < seg_end ? from : -1;
    }
    return k;
  }
  __device__ __forceinline__ int next(int k0) {
    if (k0 + BN < seg_end) return k0 + BN;
    if (!segments.next(seg_begin, seg_end)) return -1;
    return seg_begin / BN * BN;  // k0 again when the next segment starts in the same tile
  }
};

}  // namespace cuda_backend
}  // namespace fusedattn
