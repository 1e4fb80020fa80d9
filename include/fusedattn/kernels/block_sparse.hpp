/// @file block_sparse.hpp
/// Block-sparse attention as one more mask policy of the tile loop: the user-facing `block_sparse{layout}`, its
/// validation, and `block_sparse_mask`, the bound, host/device-clean view (pointers + sizes) that tells the loop
/// which key segments a q-tile visits. Not a kernel: the same loop that runs dense and causal attention runs this.
#pragma once

#include <string>
#include <variant>

#include "../config.hpp"
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

  /// q-tiles must not straddle a multiple of block_q: a q-tile then lies in one q-block row.
  FUSEDATTN_HOST_DEVICE index_t q_granule() const { return block_q; }

  /// Number of runs (merged consecutive blocks, or single blocks without run arrays) of q-block row qb.
  FUSEDATTN_HOST_DEVICE index_t run_count(index_t qb) const {
    return run_offsets ? run_offsets[qb + 1] - run_offsets[qb] : row_offsets[qb + 1] - row_offsets[qb];
  }
  /// First kv-block of run u of row qb.
  FUSEDATTN_HOST_DEVICE index_t run_first(index_t qb, index_t u) const {
    return run_offsets ? runs[2 * (run_offsets[qb] + u)] : cols[row_offsets[qb] + u];
  }
  /// One past the last kv-block of run u of row qb.
  FUSEDATTN_HOST_DEVICE index_t run_end(index_t qb, index_t u) const {
    return run_offsets ? runs[2 * (run_offsets[qb] + u) + 1] : cols[row_offsets[qb] + u] + 1;
  }
  /// The runs of row qb that hold a key of [k_begin, k_end): [first, last) as run numbers (binary searches).
  FUSEDATTN_HOST_DEVICE void runs_in(index_t qb, index_t k_begin, index_t k_end, index_t& first,
                                     index_t& last) const {
    index_t lo = 0, hi = run_count(qb);
    while (lo < hi) {  // first run ending after k_begin
      const index_t mid = lo + (hi - lo) / 2;
      if (run_end(qb, mid) * block_kv <= k_begin) lo = mid + 1; else hi = mid;
    }
    first = lo;
    hi = run_count(qb);
    while (lo < hi) {  // first run starting at or after k_end
      const index_t mid = lo + (hi - lo) / 2;
      if (run_first(qb, mid) * block_kv < k_end) lo = mid + 1; else hi = mid;
    }
    last = lo;
  }

  /// Segments of rows [q0, q1) (one q-block row): the runs of active kv-blocks, clipped to the keys `within` lets
  /// these rows see and to seq_kv. None when the row lists no block.
  FUSEDATTN_HOST_DEVICE index_t num_segments(index_t q0, index_t q1) const {
    FUSEDATTN_ASSERT(q0 < q1 && q0 / block_q == (q1 - 1) / block_q);
    const kv_span keys = band.kv_range(q0, q1);
    if (keys.empty()) return 0;
    index_t first = 0, last = 0;
    runs_in(q0 / block_q, keys.begin, keys.end, first, last);
    return last - first;
  }
  /// The r-th segment (ascending keys) of rows [q0, q1).
  FUSEDATTN_HOST_DEVICE kv_span segment(index_t q0, index_t q1, index_t r) const {
    const index_t qb = q0 / block_q;
    const kv_span keys = band.kv_range(q0, q1);
    index_t first = 0, last = 0;
    runs_in(qb, keys.begin, keys.end, first, last);
    const index_t b = run_first(qb, first + r) * block_kv, e = run_end(qb, first + r) * block_kv;
    return {b > keys.begin ? b : keys.begin, e < keys.end ? e : keys.end};
  }

  /// The column walk of the backward pass: rows that may see a key of [k0, k1) (a superset: the band's rows).
  FUSEDATTN_HOST_DEVICE kv_span q_range(index_t k0, index_t k1) const { return band.q_range(k0, k1); }
  /// Whether tile rows [q0, q1) × keys [k0, k1) holds an allowed element: some q-block row of the tile lists a
  /// block holding a key of [k0, k1) that `within` lets these rows see.
  FUSEDATTN_HOST_DEVICE bool sees(index_t q0, index_t q1, index_t k0, index_t k1) const {
    for (index_t qb = q0 / block_q; qb <= (q1 - 1) / block_q; ++qb) {
      const index_t r0 = qb * block_q > q0 ? qb * block_q : q0, r1 = (qb + 1) * block_q < q1 ? (qb + 1) * block_q : q1;
      const kv_span keys = band.kv_range(r0, r1);
      const index_t b = keys.begin > k0 ? keys.begin : k0, e = keys.end < k1 ? keys.end : k1;
      if (b >= e) continue;
      index_t first = 0, last = 0;
      runs_in(qb, b, e, first, last);
      if (last > first) return true;
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

/// Binds a block_sparse mask to a problem. Preconditions: validated (see check_mask).
inline block_sparse_mask bind(const block_sparse& m, const problem& p) {
  const block_layout_view& l = m.layout;
  block_sparse_mask r;
  r.seq_q = p.seq_q;
  r.seq_kv = p.seq_kv;
  r.block_q = l.geometry.block_q;
  r.block_kv = l.geometry.block_kv;
  r.n_q_blocks = l.geometry.n_q_blocks();
  r.pattern_batch = l.geometry.batch;
  r.pattern_heads = l.geometry.heads;
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

/// Checks a block_sparse mask against a problem: the layout was built for this problem's seq_q, seq_kv, heads and
/// batch (or shares its pattern over heads / batch), its arrays are well formed, and `within` is a valid rule.
inline status check_mask(const block_sparse& m, const problem& p) {
  const std::string n = "block_sparse.layout.";
  const block_geometry& g = m.layout.geometry;
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
  if (status st = check_layout(m.layout); !st) return st;
  if (const auto* c = std::get_if<causal>(&m.within))
    if (c->alignment != align::top_left && c->alignment != align::bottom_right)
      return status::invalid("block_sparse.within: causal.alignment is not a valid fusedattn::align value");
  if (const auto* w = std::get_if<window>(&m.within)) {
    if (w->left < 0 || w->right < 0)
      return status::invalid("block_sparse.within: window.left / window.right are " + s(w->left) + " / " +
                             s(w->right) + "; they must be >= 0");
    if (w->alignment != align::top_left && w->alignment != align::bottom_right)
      return status::invalid("block_sparse.within: window.alignment is not a valid fusedattn::align value");
  }
  return {};
}

}  // namespace detail
}  // namespace fusedattn
