/// @file block_sparse.hpp
/// Block-sparse attention as one more mask policy of the tile loop: the user-facing `block_sparse{layout}`, its
/// validation, and `block_sparse_mask`, the bound, host/device-clean view (pointers + sizes) that tells the loop
/// which key segments a q-tile visits. Not a kernel: the same loop that runs dense and causal attention runs this.
#pragma once

#include <string>
#include <variant>

#include "../config.hpp"
#include "../core/mask_walk.hpp"
#include "../core/problem.hpp"
#include "../core/status.hpp"
#include "../core/types.hpp"
#include "block_layout.hpp"
#include "mask.hpp"

namespace fusedattn {

/// Block-sparse attention: query i sees key j iff the block (i / block_q, j / block_kv) is listed in the layout's
/// row for (batch, head) — and, when `within` is not dense, the element rule of `within` allows (i, j) too
/// (`block_sparse{layout, causal{}}` is exact causal attention restricted to the listed blocks).
/// A view: the layout's arrays must outlive every call that uses this mask.
struct block_sparse {
  /// An element rule intersected with the block pattern.
  using element_rule = std::variant<dense, causal, window>;

  block_layout_view layout{};
  element_rule within = dense{};

  block_sparse() = default;
  /// Views an owning layout (which must outlive the calls).
  block_sparse(const block_layout& l, element_rule w = dense{}) : layout(l.view()), within(w) {}
  /// A temporary layout would dangle: keep the layout in a variable.
  block_sparse(const block_layout&&, element_rule = dense{}) = delete;
  /// Views CSR arrays owned elsewhere (run arrays optional).
  explicit block_sparse(const block_layout_view& v, element_rule w = dense{}) : layout(v), within(w) {}
};

/// A block_sparse mask bound to a problem: plain data (pointers + sizes), host/device-clean. Before a kernel uses it
/// for one (batch, head) it selects that head's pattern with `for_head(mask, b, h)`.
struct block_sparse_mask {
  index_t seq_q = 0;
  index_t seq_kv = 0;
  index_t block_q = 1;
  index_t block_kv = 1;
  index_t n_q_blocks = 0;
  index_t pattern_batch = 1;              ///< 1 when shared by every batch entry
  index_t pattern_heads = 1;              ///< 1 when shared by every head
  const index_t* row_offsets = nullptr;   ///< n_q_blocks + 1 offsets of the selected pattern (absolute into cols)
  const block_index* cols = nullptr;      ///< sorted active kv-blocks
  const index_t* run_offsets = nullptr;   ///< optional: offsets of the merged runs (null: one segment per block)
  const block_index* runs = nullptr;      ///< [first, last + 1) pairs
  band_mask band{};                       ///< the element rule `within`, intersected

  /// Several segments per q-tile (mask_traits).
  static constexpr bool one_segment = false;

  /// q-tiles must not straddle a multiple of block_q: a q-tile then lies in one q-block row.
  FUSEDATTN_HOST_DEVICE index_t q_granule() const { return block_q; }

  /// The segments of rows [q0, q1) (one q-block row), ascending: the runs of listed kv-blocks, cut to the keys
  /// `within` lets these rows see and to `keys` (core/mask_walk.hpp, run_segments). None when the row lists no block.
  FUSEDATTN_HOST_DEVICE run_segments<block_index> segments(index_t q0, index_t q1) const {
    return run_segments<block_index>(row_offsets, cols, run_offsets, runs, q0 / block_q, block_kv,
                                     band.kv_range(q0, q1));
  }
  FUSEDATTN_HOST_DEVICE run_segments<block_index> segments(index_t q0, index_t q1, kv_span keys) const {
    return run_segments<block_index>(row_offsets, cols, run_offsets, runs, q0 / block_q, block_kv,
                                     intersect(band.kv_range(q0, q1), keys));
  }
  /// Number of key segments rows [q0, q1) visit.
  FUSEDATTN_HOST_DEVICE index_t num_segments(index_t q0, index_t q1) const {
    FUSEDATTN_ASSERT(q0 < q1 && q0 / block_q == (q1 - 1) / block_q);
    run_segments<block_index> walk = segments(q0, q1);
    index_t n = 0;
    for (kv_span s; walk.next(s);) ++n;
    return n;
  }

  /// The column walk of the backward pass: rows that may see a key of [k0, k1) (a superset: the band's rows).
  FUSEDATTN_HOST_DEVICE kv_span q_range(index_t k0, index_t k1) const { return band.q_range(k0, k1); }
  /// Whether tile rows [q0, q1) × keys [k0, k1) holds an allowed element: some q-block row of the tile lists a
  /// block holding a key of [k0, k1) that `within` lets these rows see.
  FUSEDATTN_HOST_DEVICE bool sees(index_t q0, index_t q1, index_t k0, index_t k1) const {
    for (index_t qb = q0 / block_q; qb <= (q1 - 1) / block_q; ++qb) {
      const index_t r0 = qb * block_q > q0 ? qb * block_q : q0, r1 = (qb + 1) * block_q < q1 ? (qb + 1) * block_q : q1;
      kv_span s;
      if (segments(r0, r1, {k0, k1}).seek().next(s)) return true;
    }
    return false;
  }

  /// Position of kv-block kb in row qb's sorted list, or -1 (binary search).
  FUSEDATTN_HOST_DEVICE index_t find(index_t qb, index_t kb) const {
    index_t lo = row_offsets[qb], hi = row_offsets[qb + 1];
    while (lo < hi) {
      const index_t mid = lo + (hi - lo) / 2;
      if (cols[mid] < kb) lo = mid + 1; else hi = mid;
    }
    return lo < row_offsets[qb + 1] && cols[lo] == kb ? lo : -1;
  }

  /// Whether tile rows [q0, q1) × keys [k0, k1) holds an element the mask forbids: a key past seq_kv, an element
  /// `within` forbids, or a block that is not listed.
  FUSEDATTN_HOST_DEVICE bool is_partial(index_t q0, index_t q1, index_t k0, index_t k1) const {
    if (q1 <= q0 || k1 <= k0) return false;
    if (band.is_partial(q0, q1, k0, k1)) return true;
    const index_t kb0 = k0 / block_kv, kb1 = (k1 - 1) / block_kv;
    for (index_t qb = q0 / block_q; qb <= (q1 - 1) / block_q; ++qb) {
      // Sorted, unique indices: kb0 … kb1 are all listed iff kb0 is at some t and kb1 at t + (kb1 − kb0).
      const index_t t = find(qb, kb0);
      const index_t u = t + (kb1 - kb0);
      if (t < 0 || u >= row_offsets[qb + 1] || cols[u] != kb1) return true;
    }
    return false;
  }

  /// The band the element rule is (`within`); kernels test elements against it and block_listed.
  FUSEDATTN_HOST_DEVICE const band_mask& element_band() const { return band; }
  /// Whether key j (below seq_kv) lies in a block row i's q-block lists.
  FUSEDATTN_HOST_DEVICE bool block_listed(index_t i, index_t j) const {
    return j < seq_kv && find(i / block_q, j / block_kv) >= 0;
  }
  /// The per-element rule (the test oracle uses only this).
  FUSEDATTN_HOST_DEVICE bool allowed(index_t i, index_t j) const {
    return i >= 0 && i < seq_q && band.allowed(i, j) && find(i / block_q, j / block_kv) >= 0;
  }
};

/// The score modifiers of a block-sparse mask live in its element rule.
FUSEDATTN_HOST_DEVICE inline const bound_mods& mods_of(const block_sparse_mask& m) { return m.band.mods; }

/// The mask of one (batch, head): the pattern of batch entry b and head h (shared patterns ignore b or h).
FUSEDATTN_HOST_DEVICE inline block_sparse_mask for_head(const block_sparse_mask& m, index_t b, index_t h) {
  block_sparse_mask r = m;
  const index_t pattern = (m.pattern_batch > 1 ? b : 0) * m.pattern_heads + (m.pattern_heads > 1 ? h : 0);
  r.row_offsets += pattern * m.n_q_blocks;
  if (r.run_offsets) r.run_offsets += pattern * m.n_q_blocks;
  r.pattern_batch = 1;
  r.pattern_heads = 1;
  return r;
}

namespace detail {
/// The fields of a bound block-sparse mask that come from a layout's geometry (arrays and element rule left empty).
inline block_sparse_mask bind_geometry(const block_geometry& g) {
  block_sparse_mask r;
  r.seq_q = g.seq_q;
  r.seq_kv = g.seq_kv;
  r.block_q = g.block_q;
  r.block_kv = g.block_kv;
  r.n_q_blocks = g.n_q_blocks();
  r.pattern_batch = g.batch;
  r.pattern_heads = g.heads;
  return r;
}
}  // namespace detail

/// Binds a block_sparse mask to a problem. Preconditions: validated (see check_mask).
inline block_sparse_mask bind(const block_sparse& m, const problem& p) {
  const block_layout_view& l = m.layout;
  block_sparse_mask r = detail::bind_geometry(l.geometry);
  r.seq_q = p.seq_q;
  r.seq_kv = p.seq_kv;
  r.row_offsets = l.row_offsets;
  r.cols = l.cols;
  r.run_offsets = l.run_offsets;
  r.runs = l.runs;
  r.band = std::visit([&](const auto& w) { return bind(w, p); }, m.within);
  return r;
}
inline block_sparse_mask bind(const block_sparse_mask& m, const problem&) { return m; }

inline const char* mask_name(const block_sparse&) { return "block_sparse"; }

namespace detail {

/// The layout geometry `g` was built for problem `p` (seq_q, seq_kv, and heads / batch equal or shared); the
/// status names the field as `owner` + "layout." + field (owner: "block_sparse." or "device_block_sparse.").
inline status check_geometry(const block_geometry& g, const problem& p, const std::string& owner) {
  const std::string n = owner + "layout.";
  const auto s = [](index_t v) { return std::to_string(v); };
  if (g.seq_q != p.seq_q)
    return status::invalid(n + "seq_q is " + s(g.seq_q) + " but problem.seq_q is " + s(p.seq_q) +
                           "; the layout was built for another sequence length");
  if (g.seq_kv != p.seq_kv)
    return status::invalid(n + "seq_kv is " + s(g.seq_kv) + " but problem.seq_kv is " + s(p.seq_kv) +
                           "; the layout was built for another sequence length");
  if (g.heads != 1 && g.heads != p.heads)
    return status::invalid(n + "heads is " + s(g.heads) + " but problem.heads is " + s(p.heads) +
                           "; it must be 1 (shared) or equal");
  if (g.batch != 1 && g.batch != p.batch)
    return status::invalid(n + "batch is " + s(g.batch) + " but problem.batch is " + s(p.batch) +
                           "; it must be 1 (shared) or equal");
  return {};
}

/// The element rule `within` is valid: alignments are align values, window bounds >= 0; the status names the field
/// as `owner` + "within: ..." (owner: "block_sparse." or "device_block_sparse.").
inline status check_element_rule(const block_sparse::element_rule& within, const std::string& owner) {
  const std::string n = owner + "within: ";
  if (const auto* c = std::get_if<causal>(&within))
    if (c->alignment != align::top_left && c->alignment != align::bottom_right)
      return status::invalid(n + "causal.alignment is not a valid fusedattn::align value");
  if (const auto* w = std::get_if<window>(&within)) {
    if (w->left < 0 || w->right < 0)
      return status::invalid(n + "window.left / window.right are " + std::to_string(w->left) + " / " +
                             std::to_string(w->right) + "; they must be >= 0");
    if (w->alignment != align::top_left && w->alignment != align::bottom_right)
      return status::invalid(n + "window.alignment is not a valid fusedattn::align value");
  }
  return {};
}

/// Checks a block_sparse mask against a problem: the layout was built for this problem's seq_q, seq_kv, heads and
/// batch (or shares its pattern over heads / batch), its arrays are well formed, and `within` is a valid rule.
inline status check_mask(const block_sparse& m, const problem& p) {
  if (status st = check_geometry(m.layout.geometry, p, "block_sparse."); !st) return st;
  if (status st = check_layout(m.layout); !st) return st;
  return check_element_rule(m.within, "block_sparse.");
}

}  // namespace detail
}  // namespace fusedattn
