/// @file block_layout.hpp
/// Block-sparse layouts: which (q-block, kv-block) pairs of the score matrix are computed, stored per q-block row
/// as a sorted CSR list of kv-block indices, and the builders that make them (block mask, predicate, band mask,
/// seeded random with a frame, intersection). Host-side data only; the kernel-side view is in block_sparse.hpp.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../core/problem.hpp"
#include "../core/status.hpp"
#include "../core/types.hpp"
#include "mask.hpp"

namespace fusedattn {

/// Index type of a kv-block inside a layout's column list (4 bytes: the lists are what a kernel streams).
using block_index = std::int32_t;

/// The shape a layout was built for. `batch` and `heads` count the patterns: 1 means one pattern shared by every
/// batch entry (or head); otherwise it must equal the problem's batch (or heads) and each gets its own pattern.
struct block_geometry {
  index_t seq_q = 0;
  index_t seq_kv = 0;
  index_t block_q = 0;   ///< rows of one block (any positive size; 128…1024 are the common ones)
  index_t block_kv = 0;  ///< columns of one block
  index_t batch = 1;     ///< 1: shared by every batch entry; else one pattern per batch entry
  index_t heads = 1;     ///< 1: shared by every head; else one pattern per head

  /// ceil(seq_q / block_q): q-block rows per pattern (0 for a non-positive block size). Never overflows.
  index_t n_q_blocks() const { return block_q > 0 && seq_q > 0 ? seq_q / block_q + (seq_q % block_q != 0) : 0; }
  /// ceil(seq_kv / block_kv): kv-block columns (0 for a non-positive block size). Never overflows.
  index_t n_kv_blocks() const {
    return block_kv > 0 && seq_kv > 0 ? seq_kv / block_kv + (seq_kv % block_kv != 0) : 0;
  }
  /// Number of patterns, batch · heads (saturated at INT64_MAX).
  index_t patterns() const { return detail::mul_sat(batch, heads); }
  /// CSR rows: one per (pattern, q-block row) (saturated at INT64_MAX).
  index_t rows() const { return detail::mul_sat(patterns(), n_q_blocks()); }
  /// Whether the sizes are usable: sequence lengths >= 0, positive block sizes and pattern counts, block indices
  /// that fit block_index, and a row count (and its offsets array) that fits int64.
  bool usable() const {
    return seq_q >= 0 && seq_kv >= 0 && block_q > 0 && block_kv > 0 && batch > 0 && heads > 0 &&
           n_kv_blocks() <= std::numeric_limits<block_index>::max() && rows() < INT64_MAX;
  }
};

/// A non-owning view of a layout in CSR form: the active kv-blocks of row r (r = pattern · n_q_blocks + q-block)
/// are cols[row_offsets[r] .. row_offsets[r + 1]), ascending. Optionally, `runs` lists the same blocks merged into
/// maximal runs of consecutive indices (pairs [first, last + 1)), indexed by run_offsets; kernels then visit one
/// segment per run instead of one per block. A view built by hand may leave the run arrays null.
struct block_layout_view {
  block_geometry geometry{};
  const index_t* row_offsets = nullptr;  ///< rows() + 1 entries, from 0, non-decreasing
  index_t n_row_offsets = 0;
  const block_index* cols = nullptr;     ///< row_offsets[rows()] entries
  index_t n_cols = 0;
  const index_t* run_offsets = nullptr;  ///< optional: rows() + 1 entries
  index_t n_run_offsets = 0;
  const block_index* runs = nullptr;     ///< optional: 2 · run_offsets[rows()] entries, [first, last + 1) pairs
  index_t n_runs = 0;                    ///< number of runs (pairs)
  /// Set by a builder that could not build the layout (e.g. a block mask of the wrong size): why. Validation
  /// reports it as the layout's error. Null for a well-built layout.
  const char* build_error = nullptr;
};

/// Always-active blocks on the border of the block matrix, on top of a random budget: the first `left_cols` and the
/// last `right_cols` kv-block columns of every row (attention sinks; the most recent tokens), and every block of the
/// first `top_rows` and last `bottom_rows` q-block rows.
struct block_frame {
  index_t left_cols = 0;
  index_t right_cols = 0;
  index_t top_rows = 0;
  index_t bottom_rows = 0;
};

/// A layout that owns its arrays (memory O(active blocks) — never O(seq_q · seq_kv)). Made by the builders below
/// or from CSR arrays; converts to the block_layout_view that `block_sparse` holds. The arrays are stored as given:
/// attend() validates them (sorted, unique, in range, offsets of the right length) before any use.
class block_layout {
 public:
  block_layout() = default;
  /// Takes CSR arrays (see block_layout_view) and derives the merged runs when the rows are well formed.
  block_layout(const block_geometry& g, std::vector<index_t> row_offsets, std::vector<block_index> cols)
      : geometry_(g), row_offsets_(std::move(row_offsets)), cols_(std::move(cols)) {
    build_runs();
  }

  const block_geometry& geometry() const { return geometry_; }
  const std::vector<index_t>& row_offsets() const { return row_offsets_; }
  const std::vector<block_index>& cols() const { return cols_; }
  /// Active blocks over every pattern.
  index_t active_blocks() const { return static_cast<index_t>(cols_.size()); }
  /// Active kv-blocks of CSR row r.
  index_t row_size(index_t r) const { return row_offsets_[r + 1] - row_offsets_[r]; }
  /// Fraction of blocks that are active, over every pattern (1 for a dense layout).
  double density() const {
    const double all = static_cast<double>(geometry_.rows()) * static_cast<double>(geometry_.n_kv_blocks());
    return all > 0 ? static_cast<double>(cols_.size()) / all : 0.0;
  }

  /// The non-owning view (valid while this layout lives and is not modified).
  block_layout_view view() const {
    block_layout_view v;
    v.geometry = geometry_;
    v.row_offsets = row_offsets_.data();
    v.n_row_offsets = static_cast<index_t>(row_offsets_.size());
    v.cols = cols_.data();
    v.n_cols = static_cast<index_t>(cols_.size());
    if (!run_offsets_.empty()) {
      v.run_offsets = run_offsets_.data();
      v.n_run_offsets = static_cast<index_t>(run_offsets_.size());
      v.runs = runs_.data();
      v.n_runs = static_cast<index_t>(runs_.size() / 2);
    }
    if (!build_error_.empty()) v.build_error = build_error_.c_str();
    return v;
  }
  operator block_layout_view() const { return view(); }

  /// Why a builder could not build this layout (empty when it could); attend() rejects such a layout with it.
  const std::string& build_error() const { return build_error_; }
  /// A layout with no rows that records why it could not be built.
  static block_layout failed(const block_geometry& g, std::string why) {
    block_layout l(g, {}, {});
    l.build_error_ = std::move(why);
    return l;
  }

 private:
  /// Merges each row's consecutive indices into runs; skipped (left empty) when the CSR arrays are malformed,
  /// so validation reports the malformed arrays themselves.
  void build_runs() {
    const index_t rows = geometry_.rows();
    if (!geometry_.usable() || static_cast<index_t>(row_offsets_.size()) != rows + 1 || row_offsets_[0] != 0 ||
        row_offsets_[rows] != static_cast<index_t>(cols_.size()))
      return;
    for (index_t r = 0; r < rows; ++r)
      if (row_offsets_[r + 1] < row_offsets_[r]) return;
    const index_t n_kv = geometry_.n_kv_blocks();
    for (const block_index c : cols_)
      if (c < 0 || c >= n_kv) return;
    run_offsets_.assign(1, 0);
    run_offsets_.reserve(static_cast<std::size_t>(rows + 1));
    for (index_t r = 0; r < rows; ++r) {
      for (index_t t = row_offsets_[r]; t < row_offsets_[r + 1]; ++t) {
        const block_index c = cols_[t];
        if (t > row_offsets_[r] && c == runs_.back()) {
          ++runs_.back();  // extends the current run [first, last + 1)
        } else {
          runs_.push_back(c);
          runs_.push_back(c + 1);
        }
      }
      run_offsets_.push_back(static_cast<index_t>(runs_.size() / 2));
    }
  }

  block_geometry geometry_{};
  std::vector<index_t> row_offsets_{0};
  std::vector<block_index> cols_;
  std::vector<index_t> run_offsets_;
  std::vector<block_index> runs_;
  std::string build_error_;
};

namespace detail {

/// Checks a layout on its own (sizes, CSR shape, sorted unique in-range indices, runs that match the indices).
/// Messages name the field as `block_sparse.layout.<field>` and its value; O(active blocks).
inline status check_layout(const block_layout_view& l) {
  const std::string n = "block_sparse.layout.";
  const auto s = [](index_t v) { return std::to_string(v); };
  const block_geometry& g = l.geometry;
  if (l.build_error) return status::invalid(n.substr(0, n.size() - 1) + ": " + l.build_error);
  const index_t sizes[6] = {g.seq_q, g.seq_kv, g.block_q, g.block_kv, g.batch, g.heads};
  const char* names[6] = {"seq_q", "seq_kv", "block_q", "block_kv", "batch", "heads"};
  for (int f = 0; f < 6; ++f)
    if (f < 2 ? sizes[f] < 0 : sizes[f] <= 0)
      return status::invalid(n + names[f] + " is " + s(sizes[f]) + (f < 2 ? "; it must be >= 0" : "; it must be positive"));
  const index_t n_kv = g.n_kv_blocks();
  if (n_kv > std::numeric_limits<block_index>::max())
    return status::invalid(n + "block_kv is " + s(g.block_kv) + ": " + s(n_kv) +
                           " kv-blocks do not fit a 32-bit block index");
  index_t patterns = 0, rows = 0;
  if (!mul_ok(g.batch, g.heads, patterns) || !mul_ok(patterns, g.n_q_blocks(), rows) || rows == INT64_MAX)
    return status::invalid(n + "batch x heads x q-block rows (" + s(g.batch) + " x " + s(g.heads) + " x " +
                           s(g.n_q_blocks()) + ") overflows 64 bits");
  if (l.n_row_offsets != rows + 1)
    return status::invalid(n + "row_offsets has " + s(l.n_row_offsets) + " entries; " + s(g.patterns()) +
                           " pattern(s) x " + s(g.n_q_blocks()) + " q-block rows need " + s(rows + 1));
  if (l.row_offsets == nullptr) return status::invalid(n + "row_offsets is null");
  if (l.row_offsets[0] != 0)
    return status::invalid(n + "row_offsets[0] is " + s(l.row_offsets[0]) + "; it must be 0");
  for (index_t r = 0; r < rows; ++r)
    if (l.row_offsets[r + 1] < l.row_offsets[r])
      return status::invalid(n + "row_offsets[" + s(r + 1) + "] is " + s(l.row_offsets[r + 1]) +
                             ", less than row_offsets[" + s(r) + "] = " + s(l.row_offsets[r]) +
                             "; offsets must be non-decreasing");
  if (l.row_offsets[rows] != l.n_cols)
    return status::invalid(n + "row_offsets[" + s(rows) + "] is " + s(l.row_offsets[rows]) + " but cols has " +
                           s(l.n_cols) + " entries");
  if (l.n_cols > 0 && l.cols == nullptr) return status::invalid(n + "cols is null");
  for (index_t r = 0; r < rows; ++r)
    for (index_t t = l.row_offsets[r]; t < l.row_offsets[r + 1]; ++t) {
      const index_t c = l.cols[t];
      // The message is built only for a bad entry: built for every entry, it took ~200 µs of a call's host time
      // at 2528 entries ((1,16,10000,128), 128×512 blocks, sparsity 0.9).
      const auto at = [&] { return n + "cols[" + s(t) + "] (row " + s(r) + ") is " + s(c); };
      if (c < 0 || c >= n_kv)
        return status::invalid(at() + "; kv-block indices must lie in [0, " + s(n_kv) + ")");
      if (t > l.row_offsets[r] && c == l.cols[t - 1])
        return status::invalid(at() + ", a duplicate of the previous index");
      if (t > l.row_offsets[r] && c < l.cols[t - 1])
        return status::invalid(at() + ", less than the previous index " + s(l.cols[t - 1]) +
                               "; each row must be sorted ascending");
    }
  if (l.run_offsets == nullptr && l.runs == nullptr) return {};
  // Runs are optional, but when given they must be exactly the maximal runs of consecutive indices of cols.
  if (l.run_offsets == nullptr || l.n_run_offsets != rows + 1 || l.run_offsets[0] != 0 ||
      (l.n_runs > 0 && l.runs == nullptr) || l.run_offsets[rows] != l.n_runs)
    return status::invalid(n + "run_offsets / runs do not describe " + s(rows) + " rows of runs");
  for (index_t r = 0; r < rows; ++r) {
    if (l.run_offsets[r + 1] < l.run_offsets[r] || l.run_offsets[r + 1] > l.n_runs)
      return status::invalid(n + "run_offsets[" + s(r + 1) + "] is " + s(l.run_offsets[r + 1]) +
                             "; run offsets must be non-decreasing and at most " + s(l.n_runs));
    index_t t = l.row_offsets[r];
    for (index_t u = l.run_offsets[r]; u < l.run_offsets[r + 1]; ++u) {
      const index_t first = l.runs[2 * u], end = l.runs[2 * u + 1];
      bool ok = t < l.row_offsets[r + 1] && first < end && (t == l.row_offsets[r] || l.cols[t - 1] + 1 < first);
      for (index_t c = first; ok && c < end; ++c, ++t) ok = t < l.row_offsets[r + 1] && l.cols[t] == c;
      if (!ok) return status::invalid(n + "runs[" + s(u) + "] (row " + s(r) + ") does not match cols");
    }
    if (t != l.row_offsets[r + 1])
      return status::invalid(n + "runs of row " + s(r) + " do not cover its cols");
  }
  return {};
}

/// Builds a layout row by row: `active(pattern, q_block, kv_block)` for every block, in order.
template <class Active>
block_layout layout_from_rule(const block_geometry& g, Active&& active) {
  std::vector<index_t> offsets{0};
  std::vector<block_index> cols;
  if (g.usable() && g.rows() > 0) {
    const index_t n_q = g.n_q_blocks(), n_kv = g.n_kv_blocks();
    offsets.reserve(static_cast<std::size_t>(g.rows() + 1));
    for (index_t pat = 0; pat < g.patterns(); ++pat)
      for (index_t qb = 0; qb < n_q; ++qb) {
        for (index_t kb = 0; kb < n_kv; ++kb)
          if (active(pat, qb, kb)) cols.push_back(static_cast<block_index>(kb));
        offsets.push_back(static_cast<index_t>(cols.size()));
      }
  }
  return block_layout(g, std::move(offsets), std::move(cols));
}

/// splitmix64: a small, fully specified generator, so a seed gives the same layout on every platform and standard
/// library (std::uniform_int_distribution does not promise that).
struct splitmix64 {
  std::uint64_t state;
  std::uint64_t next() {
    std::uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  /// Uniform integer in [0, n), n > 0, without modulo bias (rejection of the short last interval).
  std::uint64_t below(std::uint64_t n) {
    const std::uint64_t limit = ~std::uint64_t{0} - (~std::uint64_t{0} % n);
    std::uint64_t x;
    do x = next();
    while (x >= limit);
    return x % n;
  }
};

}  // namespace detail

/// Every block active (the dense pattern).
inline block_layout dense_layout(const block_geometry& g) {
  return detail::layout_from_rule(g, [](index_t, index_t, index_t) { return true; });
}

/// From a dense boolean block mask laid out [pattern][q_block][kv_block] (pattern = b · heads + h), e.g. a
/// std::vector<bool> or std::vector<std::uint8_t> of g.patterns() · g.n_q_blocks() · g.n_kv_blocks() entries.
/// A mask of another size gives a layout with no rows whose build_error() says so, which attend() rejects.
template <class BoolRange>
block_layout layout_from_block_mask(const block_geometry& g, const BoolRange& mask) {
  const index_t n_q = g.n_q_blocks(), n_kv = g.n_kv_blocks();
  const auto s = [](index_t v) { return std::to_string(v); };
  index_t need = 0;
  const bool fits = detail::mul_ok(g.patterns(), n_q, need) && detail::mul_ok(need, n_kv, need) &&
                    g.patterns() < INT64_MAX;
  if (!fits)
    return block_layout::failed(g, "layout_from_block_mask: " + s(g.patterns()) + " pattern(s) x " + s(n_q) +
                                       " q-block rows x " + s(n_kv) + " kv-block columns overflow 64 bits");
  if (static_cast<index_t>(mask.size()) != need)
    return block_layout::failed(g, "layout_from_block_mask: the block mask has " + s(static_cast<index_t>(mask.size())) +
                                       " entries but " + s(g.patterns()) + " pattern(s) x " + s(n_q) +
                                       " q-block rows x " + s(n_kv) + " kv-block columns need " + s(need));
  return detail::layout_from_rule(g, [&](index_t pat, index_t qb, index_t kb) {
    return static_cast<bool>(mask[static_cast<std::size_t>((pat * n_q + qb) * n_kv + kb)]);
  });
}

/// From a per-element predicate `pred(i, j)` (query i, key j), rounded up to whole blocks: a block is active when
/// any of its elements is allowed. Costs O(seq_q · seq_kv) calls at worst; for dense / causal / window use
/// layout_from_mask, which is O(blocks). Every pattern gets the same blocks.
template <class Pred>
block_layout layout_from_predicate(const block_geometry& g, Pred&& pred) {
  return detail::layout_from_rule(g, [&](index_t, index_t qb, index_t kb) {
    const index_t q1 = std::min(detail::mul_sat(qb + 1, g.block_q), g.seq_q);
    const index_t k1 = std::min(detail::mul_sat(kb + 1, g.block_kv), g.seq_kv);
    for (index_t i = qb * g.block_q; i < q1; ++i)
      for (index_t j = kb * g.block_kv; j < k1; ++j)
        if (pred(i, j)) return true;
    return false;
  });
}

/// From a band mask policy (dense{}, causal{align}, window{left, right, align}), rounded up to whole blocks: a block
/// is active exactly when it holds an element the mask allows. O(blocks).
template <class Mask>
block_layout layout_from_mask(const block_geometry& g, const Mask& mask) {
  problem p;
  p.seq_q = g.seq_q;
  p.seq_kv = g.seq_kv;
  const auto bound = bind(mask, p);
  static_assert(std::is_same_v<std::remove_cv_t<decltype(bound)>, band_mask>,
                "layout_from_mask takes a band mask policy (dense, causal, window); use layout_from_predicate "
                "for any other rule");
  // The keys rows [q0, q1) of a band may see form one range, kv_range(q0, q1), with no gap inside.
  return detail::layout_from_rule(g, [&](index_t, index_t qb, index_t kb) {
    const kv_span r = bound.kv_range(qb * g.block_q, std::min(detail::mul_sat(qb + 1, g.block_q), g.seq_q));
    return !r.empty() && kb * g.block_kv < r.end && r.begin < detail::mul_sat(kb + 1, g.block_kv);
  });
}

/// Seeded random layout: each q-block row of each pattern gets exactly round((1 − sparsity) · n_kv_blocks) active
/// blocks drawn uniformly from the columns outside the frame, plus every frame block (the frame is on top of the
/// random budget; a row with fewer free columns than the budget gets them all). The same (geometry, sparsity, seed,
/// frame) gives the same layout on every platform. `sparsity` is clamped to [0, 1], frame sizes to [0, blocks].
inline block_layout random_layout(const block_geometry& g, double sparsity, std::uint64_t seed,
                                  const block_frame& frame = {}) {
  std::vector<index_t> offsets{0};
  std::vector<block_index> cols;
  if (g.usable() && g.rows() > 0) {
    const index_t n_q = g.n_q_blocks(), n_kv = g.n_kv_blocks();
    const double keep = 1.0 - std::min(1.0, std::max(0.0, std::isnan(sparsity) ? 0.0 : sparsity));
    const index_t budget = static_cast<index_t>(std::llround(keep * static_cast<double>(n_kv)));
    const auto clamp = [](index_t v, index_t hi) { return std::min(std::max<index_t>(v, 0), hi); };
    const index_t left = clamp(frame.left_cols, n_kv), right = clamp(frame.right_cols, n_kv - left);
    const index_t top = clamp(frame.top_rows, n_q), bottom = clamp(frame.bottom_rows, n_q - top);
    std::vector<block_index> free_cols;
    std::vector<block_index> row;
    offsets.reserve(static_cast<std::size_t>(g.rows() + 1));
    for (index_t pat = 0; pat < g.patterns(); ++pat) {
      // One stream per pattern, so a per-head layout's head h does not depend on how many heads precede it.
      detail::splitmix64 rng{seed ^ (0xd1b54a32d192ed03ull * static_cast<std::uint64_t>(pat + 1))};
      for (index_t qb = 0; qb < n_q; ++qb) {
        row.clear();
        free_cols.clear();
        const bool full_row = qb < top || qb >= n_q - bottom;
        for (index_t kb = 0; kb < n_kv; ++kb) {
          if (full_row || kb < left || kb >= n_kv - right)
            row.push_back(static_cast<block_index>(kb));
          else
            free_cols.push_back(static_cast<block_index>(kb));
        }
        // Partial Fisher–Yates: the first `take` entries of free_cols become a uniform random subset.
        const index_t n_free = static_cast<index_t>(free_cols.size());
        const index_t take = std::min(budget, n_free);
        for (index_t t = 0; t < take; ++t) {
          const index_t pick = t + static_cast<index_t>(rng.below(static_cast<std::uint64_t>(n_free - t)));
          std::swap(free_cols[static_cast<std::size_t>(t)], free_cols[static_cast<std::size_t>(pick)]);
          row.push_back(free_cols[static_cast<std::size_t>(t)]);
        }
        std::sort(row.begin(), row.end());
        cols.insert(cols.end(), row.begin(), row.end());
        offsets.push_back(static_cast<index_t>(cols.size()));
      }
    }
  }
  return block_layout(g, std::move(offsets), std::move(cols));
}

/// The blocks of `layout` that also hold an element a band mask policy allows (e.g. `intersect(l, causal{})` drops
/// the blocks above the diagonal and keeps the diagonal ones). For exact element-level intersection, pass the band
/// mask to `block_sparse{layout, causal{}}` as well.
template <class Mask>
block_layout intersect(const block_layout& layout, const Mask& mask) {
  const block_geometry& g = layout.geometry();
  if (!detail::check_layout(layout.view()).ok()) return layout;  // left for attend() to reject, with its reason
  const block_layout cover = layout_from_mask(g, mask);
  const index_t n_q = g.n_q_blocks(), n_kv = g.n_kv_blocks();
  std::vector<index_t> offsets{0};
  std::vector<block_index> cols;
  for (index_t r = 0; r < g.rows(); ++r) {
    // The band's active blocks of a q-block row are one run [first, last]: the same in every pattern.
    const index_t cr = r % n_q;
    const index_t first = cover.row_size(cr) > 0 ? cover.cols()[cover.row_offsets()[cr]] : n_kv;
    const index_t last = cover.row_size(cr) > 0 ? cover.cols()[cover.row_offsets()[cr + 1] - 1] : -1;
    for (index_t t = layout.row_offsets()[r]; t < layout.row_offsets()[r + 1]; ++t)
      if (layout.cols()[t] >= first && layout.cols()[t] <= last) cols.push_back(layout.cols()[t]);
    offsets.push_back(static_cast<index_t>(cols.size()));
  }
  return block_layout(g, std::move(offsets), std::move(cols));
}

}  // namespace fusedattn
