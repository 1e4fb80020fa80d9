/// @file mask.hpp
/// Mask policies. A user-facing mask (dense, causal, window) is bound to a problem's sequence lengths once,
/// giving a `band_mask` that answers the questions every kernel asks (the walk over them: core/mask_walk.hpp):
///   kv_range(q0, q1)               which keys rows [q0, q1) may see at all (tiles outside are skipped, not masked);
///   is_partial(q0, q1, k0, k1)     whether a tile needs per-element masking;
///   allowed(i, j)                  the per-element rule (the test oracle uses only this one).
/// Everything here is host/device-clean so the CUDA kernels include this very header.
#pragma once

#include <cstdint>
#include <limits>

#include "../config.hpp"
#include "../core/mask_walk.hpp"
#include "../core/problem.hpp"
#include "../core/score_mod.hpp"
#include "../core/types.hpp"

namespace fusedattn {

/// How a causal or window mask lines up the query and key sequences when seq_q != seq_kv.
enum class align {
  top_left,      ///< query i sits at key position i (PyTorch SDPA's `is_causal`)
  bottom_right,  ///< query i sits at key position i + seq_kv - seq_q (FlashAttention; KV-cache decoding)
};

/// Every query sees every key.
struct dense {};

/// Query i sees keys j <= pos(i), where pos(i) = i (top_left) or i + seq_kv - seq_q (bottom_right).
/// With bottom_right and seq_q > seq_kv the first seq_q - seq_kv rows see no key: their output is 0, lse -inf.
struct causal {
  align alignment = align::top_left;
};

/// Sliding window: query i sees keys j with pos(i) - left <= j <= pos(i) + right (both bounds inclusive,
/// as FlashAttention's window_size). `window{n, 0}` is causal attention limited to the last n keys.
struct window {
  index_t left = 0;
  index_t right = 0;
  align alignment = align::top_left;
};

/// A mask bound to sequence lengths: key j is allowed for query i iff lo <= j - i <= hi (and 0 <= j < seq_kv).
/// dense, causal and window all reduce to this one rule (core/mask_walk.hpp's band_rule), so the kernels carry a
/// single band code path.
struct band_mask {
  /// Stands for "no bound on this side".
  static constexpr index_t unbounded = std::numeric_limits<index_t>::max() / 4;
  /// Every q-tile visits one key segment and every row's allowed keys are one interval (mask_traits).
  static constexpr bool one_segment = true;

  index_t seq_q = 0;
  index_t seq_kv = 0;
  index_t lo = -unbounded;  ///< smallest allowed j - i
  index_t hi = unbounded;   ///< largest allowed j - i
  bound_mods mods{};        ///< score modifiers (core/score_mod.hpp); all off for a plain mask

  /// The rule in index_t arithmetic.
  FUSEDATTN_HOST_DEVICE band_rule<index_t> rule() const { return {seq_kv, lo, hi}; }
  /// The band the element rule is (a block-sparse mask's is its `within`); kernels test elements against it.
  FUSEDATTN_HOST_DEVICE const band_mask& element_band() const { return *this; }
  /// The per-element rule.
  FUSEDATTN_HOST_DEVICE bool allowed(index_t i, index_t j) const { return rule().allowed(i, j); }
  /// Whether key j lies in a block the mask lists for row i: a band lists every key.
  FUSEDATTN_HOST_DEVICE bool block_listed(index_t, index_t) const { return true; }
  /// Keys query row i may see.
  FUSEDATTN_HOST_DEVICE kv_span row_range(index_t i) const { return kv_range(i, i + 1); }
  /// Smallest key range covering every allowed key of rows [q0, q1); empty when none is allowed.
  FUSEDATTN_HOST_DEVICE kv_span kv_range(index_t q0, index_t q1) const {
    index_t b = q0 + lo;
    index_t e = (q1 - 1) + hi + 1;
    if (b < 0) b = 0;
    if (e > seq_kv) e = seq_kv;
    return {b, e};
  }
  /// Whether tile rows [q0, q1) × keys [k0, k1) holds any element the rule forbids (keys beyond seq_kv count).
  FUSEDATTN_HOST_DEVICE bool is_partial(index_t q0, index_t q1, index_t k0, index_t k1) const {
    return rule().is_partial(q0, q1, k0, k1);
  }
  // The tile-loop interface every bound mask offers (band_mask here, block_sparse_mask in block_sparse.hpp; the
  // walk over it, written once for host and device, is core/mask_walk.hpp):
  //   q_granule()                 q-tiles must not straddle a multiple of this (0: any q tiling is fine);
  //   segments(q0, q1[, keys])    a cursor over the disjoint key segments rows [q0, q1) visit, ascending
  //                               (`next(kv_span&)`), cut to `keys`; key_tiles cuts them into kv tiles;
  //   is_partial(...), allowed()  as above;
  //   for_head(mask, b, h)        (free function, below) the mask of one (batch, head).
  FUSEDATTN_HOST_DEVICE index_t q_granule() const { return 0; }
  FUSEDATTN_HOST_DEVICE span_segments segments(index_t q0, index_t q1) const {
    return span_segments(kv_range(q0, q1));
  }
  FUSEDATTN_HOST_DEVICE span_segments segments(index_t q0, index_t q1, kv_span keys) const {
    return span_segments(intersect(kv_range(q0, q1), keys));
  }
  /// Number of key segments rows [q0, q1) visit (0 or 1).
  FUSEDATTN_HOST_DEVICE index_t num_segments(index_t q0, index_t q1) const { return kv_range(q0, q1).empty() ? 0 : 1; }
  // The column walk of the backward pass (the transpose of the questions above; q_tile_walk walks it):
  //   q_range(k0, k1)             rows that may see a key of [k0, k1) (a superset for per-head masks; exact here);
  //   sees(q0, q1, k0, k1)        whether tile rows [q0, q1) × keys [k0, k1) holds an allowed element.
  /// Smallest row range covering every row that sees a key of [k0, k1); empty when none does.
  FUSEDATTN_HOST_DEVICE kv_span q_range(index_t k0, index_t k1) const {
    if (k1 > seq_kv) k1 = seq_kv;
    index_t b = k0 - hi;
    index_t e = (k1 - 1) - lo + 1;
    if (b < 0) b = 0;
    if (e > seq_q) e = seq_q;
    return {b, e};
  }
  FUSEDATTN_HOST_DEVICE bool sees(index_t q0, index_t q1, index_t k0, index_t k1) const {
    return !intersect(kv_range(q0, q1), {k0, k1}).empty();
  }

  /// Number of allowed (i, j) pairs: the score entries a perfect kernel computes.
  index_t allowed_count() const {
    index_t n = 0;
    for (index_t i = 0; i < seq_q; ++i) {
      const kv_span r = row_range(i);
      if (!r.empty()) n += r.end - r.begin;
    }
    return n;
  }
};

/// The score modifiers a bound mask carries (all off unless the user combined the mask with one).
FUSEDATTN_HOST_DEVICE inline const bound_mods& mods_of(const band_mask& m) { return m.mods; }

/// The mask rule of one (batch, head). A kernel calls this once per (b, h) before asking the questions above:
/// masks that are the same for every head return themselves; per-head masks (block_sparse_mask) overload it.
template <class Mask>
FUSEDATTN_HOST_DEVICE const Mask& for_head(const Mask& m, index_t /*b*/, index_t /*h*/) {
  return m;
}

namespace detail {
/// Offset of query row 0's key position for an alignment.
inline index_t alignment_offset(align a, const problem& p) {
  return a == align::bottom_right ? p.seq_kv - p.seq_q : 0;
}
/// Clamp a user bound so that offset +/- bound cannot overflow.
inline index_t clamp_bound(index_t v) { return v > band_mask::unbounded ? band_mask::unbounded : v; }
}  // namespace detail

/// Binds a mask to a problem's sequence lengths.
inline band_mask bind(const dense&, const problem& p) { return {p.seq_q, p.seq_kv}; }
inline band_mask bind(const causal& c, const problem& p) {
  return {p.seq_q, p.seq_kv, -band_mask::unbounded, detail::alignment_offset(c.alignment, p)};
}
inline band_mask bind(const window& w, const problem& p) {
  const index_t off = detail::alignment_offset(w.alignment, p);
  return {p.seq_q, p.seq_kv, off - detail::clamp_bound(w.left), off + detail::clamp_bound(w.right)};
}
inline band_mask bind(const band_mask& m, const problem&) { return m; }

/// Short name used in bench labels and messages.
inline const char* mask_name(const dense&) { return "dense"; }
inline const char* mask_name(const causal& c) {
  return c.alignment == align::top_left ? "causal" : "causal_br";
}
inline const char* mask_name(const window& w) {
  return w.alignment == align::top_left ? "window" : "window_br";
}

}  // namespace fusedattn
