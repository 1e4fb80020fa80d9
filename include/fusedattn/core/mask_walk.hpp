/// @file mask_walk.hpp
/// The walk over a bound mask, written once for the host and the device: the band rule, the key segments of a q-tile
/// and their cut into kv tiles, the q tiles that see a kv tile (the backward pass's column walk), and mask_traits,
/// through which kernels ask a mask what it is. The masks themselves live in kernels/mask.hpp and block_sparse.hpp.
#pragma once

#include <type_traits>
#include <utility>

#include "../config.hpp"
#include "types.hpp"

namespace fusedattn {

/// Half-open key (or row) range [begin, end).
struct kv_span {
  index_t begin = 0;
  index_t end = 0;
  FUSEDATTN_HOST_DEVICE bool empty() const { return end <= begin; }
};

/// [a.begin, a.end) ∩ [b.begin, b.end) (empty when they do not meet).
FUSEDATTN_HOST_DEVICE inline kv_span intersect(kv_span a, kv_span b) {
  return {a.begin > b.begin ? a.begin : b.begin, a.end < b.end ? a.end : b.end};
}

/// The band rule in integer type I: key j is allowed for row i iff 0 <= j < seq_kv and lo <= j - i <= hi.
/// band_mask evaluates it in index_t; the CUDA kernels in 32-bit registers (backends/cuda/head_mask.cuh, band32).
template <class I>
struct band_rule {
  I seq_kv, lo, hi;

  /// The per-element rule.
  FUSEDATTN_HOST_DEVICE bool allowed(I i, I j) const { return j >= 0 && j < seq_kv && j - i >= lo && j - i <= hi; }
  /// Whether tile rows [q0, q1) × keys [k0, k1) holds an element the rule forbids (keys beyond seq_kv count).
  FUSEDATTN_HOST_DEVICE bool is_partial(I q0, I q1, I k0, I k1) const {
    return !(k1 <= seq_kv && k0 >= 0 && k0 - (q1 - 1) >= lo && (k1 - 1) - q0 <= hi);
  }
  /// The keys of row i the rule allows within [k_begin, k_end) (a kv tile from k0, or a segment cut to it), as the
  /// tile's columns [c_lo, c_hi): key k0 + c is allowed iff c_lo <= c < c_hi (none when c_lo >= c_hi). A masked
  /// tile's per-element test is then two comparisons with constants. lo and hi are cut to seq_kv before row i is
  /// added, so with 32-bit I the sums stay in range whenever i + seq_kv does.
  FUSEDATTN_HOST_DEVICE void columns(I i, I k0, I k_begin, I k_end, I& c_lo, I& c_hi) const {
    I first = i + (lo < seq_kv ? lo : seq_kv);  // first and last allowed key of the row (last inclusive)
    I last = i + (hi < seq_kv ? hi : seq_kv);
    first = first > k_begin ? first : k_begin;
    first = first > 0 ? first : I(0);
    last = last < k_end - 1 ? last : k_end - 1;
    last = last < seq_kv - 1 ? last : seq_kv - 1;
    last = last > k0 - 1 ? last : k0 - 1;
    c_lo = first - k0;
    c_hi = last + 1 - k0;
  }
};

/// What a kernel may ask about a bound mask's type (never `std::is_same` on a mask):
///   one_segment   every q-tile visits one key segment and every row's allowed keys are one interval of the mask's
///                 element band (a band mask): no key lies outside the segment inside a visited tile, a row is
///                 masked by band_rule::columns alone, and a q-tile's keys may be split into equal parts.
/// A mask type declares it as `static constexpr bool one_segment` (absent: false, the general walk).
template <class Mask, class = void>
struct mask_traits {
  static constexpr bool one_segment = false;
};
template <class Mask>
struct mask_traits<Mask, std::void_t<decltype(Mask::one_segment)>> {
  static constexpr bool one_segment = Mask::one_segment;
};

/// The segments of a one-segment mask: one span (empty: none).
struct span_segments {
  kv_span keys;
  bool done;
  FUSEDATTN_HOST_DEVICE explicit span_segments(kv_span k) : keys(k), done(k.empty()) {}
  /// The next segment; false when none is left.
  FUSEDATTN_HOST_DEVICE bool next(kv_span& s) {
    if (done) return false;
    done = true;
    s = keys;
    return true;
  }
};

/// The segments of one row of a row-compressed (CSR) block layout, ascending: one per run of listed kv-blocks (or one
/// per block when the layout has no run arrays), cut to the keys `keys` (those the element rule lets the rows see,
/// and the caller's key range). Only the run cursor is kept: a few registers and one pair of loads per segment.
/// B is the layout's block index type.
template <class B>
struct run_segments {
  const B* runs;        ///< [first, last + 1) pairs, or nullptr: single blocks from `cols`
  const B* cols;
  index_t u, u_end;     ///< cursor over the row's runs (or blocks)
  index_t lo, hi;       ///< the keys the segments are cut to
  index_t block_kv;
  /// Row qb of the layout (row_offsets / cols, optional run_offsets / runs), cut to `keys`.
  FUSEDATTN_HOST_DEVICE run_segments(const index_t* row_offsets, const B* cols_, const index_t* run_offsets,
                                     const B* runs_, index_t qb, index_t block_kv_, kv_span keys)
      : runs(run_offsets ? runs_ : nullptr), cols(cols_), lo(keys.begin), hi(keys.end), block_kv(block_kv_) {
    const index_t* offsets = run_offsets ? run_offsets : row_offsets;
    u = offsets[qb];
    u_end = keys.empty() ? u : offsets[qb + 1];
  }
  /// Skips, by binary search, the runs that end at or before the first key (the walk itself skips them one by one,
  /// which costs less for the short rows of a forward q-tile than the search).
  FUSEDATTN_HOST_DEVICE run_segments& seek() {
    index_t a = u, b = u_end;  // the first run ending after lo
    while (a < b) {
      const index_t mid = a + (b - a) / 2;
      const index_t end = runs ? index_t(runs[2 * mid + 1]) : index_t(cols[mid]) + 1;
      if (end * block_kv <= lo) a = mid + 1; else b = mid;
    }
    u = a;
    return *this;
  }
  /// The next non-empty segment; false when none is left.
  FUSEDATTN_HOST_DEVICE bool next(kv_span& s) {
    while (u < u_end) {
      const index_t first = index_t(runs ? runs[2 * u] : cols[u]) * block_kv;
      const index_t last = (runs ? index_t(runs[2 * u + 1]) : index_t(cols[u]) + 1) * block_kv;
      ++u;
      if (first >= hi) break;  // ascending: no later run reaches the keys either
      const index_t b = first > lo ? first : lo, e = last < hi ? last : hi;
      if (b < e) {
        s = {b, e};
        return true;
      }
    }
    u = u_end;
    return false;
  }
};

namespace detail {
/// The tile width of key_tiles: BN keys (a compile-time constant), or a run-time width when BN is 0.
template <int BN, class I>
struct tile_width {
  FUSEDATTN_HOST_DEVICE explicit tile_width(I) {}
  FUSEDATTN_HOST_DEVICE static constexpr I value() { return I(BN); }
};
template <class I>
struct tile_width<0, I> {
  I bn;
  FUSEDATTN_HOST_DEVICE explicit tile_width(I w) : bn(w) {}
  FUSEDATTN_HOST_DEVICE I value() const { return bn; }
};
}  // namespace detail

/// The kv tiles one q-tile of rows [q0, q1) visits, for every flash loop (CPU and CUDA): each of the mask's segments
/// (`mask.segments(q0, q1[, keys])`) cut into tiles that start at multiples of the width (BN, or the run-time width
/// when BN is 0). A tile holding keys of two segments (runs narrower than the width, or not aligned to it) is visited
/// once for each, and each visit counts only its segment's keys [seg_begin, seg_end), so nothing is counted twice:
/// visit k0 covers keys [max(k0, seg_begin), min(k0 + width, seg_end)).
/// `first(split, splits)` gives the first tile's start (−1: none); with splits > 1 (one_segment masks) part `split`
/// takes an equal share of the segment's tiles and may get none. `next(k0)` gives the tile after k0 (−1: the walk is
/// over). [seg_begin, seg_end) is the segment of the tile last returned (read it before calling next again).
/// I is the key type: int on the device (keys fit in 32 bits there), index_t on the host.
template <class Mask, int BN = 0, class I = int>
struct key_tiles : detail::tile_width<BN, I> {
  using cursor = decltype(std::declval<const Mask&>().segments(index_t(0), index_t(1), kv_span{}));
  cursor segments;
  I seg_begin = 0, seg_end = 0;

  /// Every key the mask lets rows [q0, q1) see (BN > 0).
  FUSEDATTN_HOST_DEVICE key_tiles(const Mask& m, index_t q0, index_t q1)
      : detail::tile_width<BN, I>(I(BN)), segments(m.segments(q0, q1)) {}
  /// The keys of [keys.begin, keys.end) only, in tiles of `width` (the run-time width, used when BN is 0).
  FUSEDATTN_HOST_DEVICE key_tiles(const Mask& m, index_t q0, index_t q1, I width, kv_span keys)
      : detail::tile_width<BN, I>(width), segments(m.segments(q0, q1, keys)) {}

  FUSEDATTN_HOST_DEVICE I width() const { return this->value(); }
  FUSEDATTN_HOST_DEVICE bool next_segment() {
    kv_span s;
    if (!segments.next(s)) return false;
    seg_begin = I(s.begin);
    seg_end = I(s.end);
    return true;
  }
  FUSEDATTN_HOST_DEVICE I first(int split = 0, int splits = 1) {
    if (!next_segment()) return -1;
    const I w = width();
    I k = seg_begin / w * w;
    if (splits > 1) {
      const I tiles = (seg_end - k + w - 1) / w;
      const I from = k + (tiles * split / splits) * w, to = k + (tiles * (split + 1) / splits) * w;
      seg_end = to < seg_end ? to : seg_end;
      k = from < seg_end ? from : I(-1);
    }
    return k;
  }
  FUSEDATTN_HOST_DEVICE I next(I k0) {
    const I w = width();
    if (k0 + w < seg_end) return k0 + w;
    if (!next_segment()) return -1;
    return seg_begin / w * w;  // k0 again when the next segment starts in the same tile
  }
};

/// Query tiles of equal height: tile t is rows [t·bm, min((t + 1)·bm, seq_q)) (the CUDA kernels' q-blocks).
struct uniform_q_tiles {
  index_t bm, seq_q;
  FUSEDATTN_HOST_DEVICE index_t tile_of(index_t row) const { return row / bm; }
  FUSEDATTN_HOST_DEVICE kv_span rows(index_t t) const { return {t * bm, (t + 1) * bm < seq_q ? (t + 1) * bm : seq_q}; }
};

/// Query tiles from their boundaries: tile t is rows [start[t], start[t + 1]), start[0] = 0, start[n] = seq_q
/// (the CPU plans' q-tiles, which never straddle a mask's q_granule).
struct listed_q_tiles {
  const index_t* start;
  index_t n;  ///< number of tiles
  /// The tile holding `row` (binary search).
  FUSEDATTN_HOST_DEVICE index_t tile_of(index_t row) const {
    index_t lo = 0, hi = n;  // last t with start[t] <= row
    while (hi - lo > 1) {
      const index_t mid = lo + (hi - lo) / 2;
      if (start[mid] <= row) lo = mid; else hi = mid;
    }
    return lo;
  }
  FUSEDATTN_HOST_DEVICE kv_span rows(index_t t) const { return {start[t], start[t + 1]}; }
};

/// The column walk of the backward pass: the q tiles of `tiles` (uniform_q_tiles or listed_q_tiles) whose rows see a
/// key of [k0, k1) under one head's mask, ascending. The candidates are the tiles meeting mask.q_range(k0, k1);
/// mask.sees keeps those holding an allowed element. The mask is passed to each call (a kernel may rebuild it per
/// head rather than keep it).
template <class Tiles>
struct q_tile_walk {
  Tiles tiles;
  index_t t, t_end, k0, k1;
  template <class Mask>
  FUSEDATTN_HOST_DEVICE q_tile_walk(const Mask& m, const Tiles& qt, index_t key0, index_t key1)
      : tiles(qt), t(0), t_end(0), k0(key0), k1(key1) {
    const kv_span r = m.q_range(k0, k1);
    if (!r.empty()) {
      t = tiles.tile_of(r.begin);
      t_end = tiles.tile_of(r.end - 1) + 1;
    }
  }
  /// The next q tile's rows; false when the walk is over.
  template <class Mask>
  FUSEDATTN_HOST_DEVICE bool next(const Mask& m, kv_span& rows) {
    while (t < t_end) {
      rows = tiles.rows(t++);
      if (m.sees(rows.begin, rows.end, k0, k1)) return true;
    }
    return false;
  }
};

}  // namespace fusedattn
