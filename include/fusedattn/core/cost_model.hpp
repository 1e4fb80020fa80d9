/// @file cost_model.hpp
/// FLOP and byte models of one attention call, shared by the bench and by users who want roofline numbers:
/// useful FLOPs, compulsory bytes, the modelled traffic of the naive and flash schedules, and the memory table
/// (naive S×S scores vs the flash working set). Pure arithmetic on sizes; it never touches tensors.
#pragma once

#include <algorithm>
#include <cstddef>

#include "../kernels/mask.hpp"
#include "problem.hpp"
#include "types.hpp"

namespace fusedattn {

/// Cost models of attention. Every quantity is a double: counts reach 10^11 and densities are fractional.
///
/// Notation: e = bytes per stored element (sizeof(T)), a = bytes per accumulated element (sizeof(accum_t<T>)),
/// b h h_kv s_q s_kv d as in `problem`. See docs/roofline.md for the derivations and worked examples.
namespace cost {

/// Passes over the S×S score matrix that the naive pipeline makes through memory: Q·Kᵀ writes S (1),
/// scale-and-mask reads and writes it (2), the softmax reads and writes it (2; a row's max, exp, sum and divide
/// reuse one row that stays in cache), P·V reads it (1).
inline constexpr int naive_score_passes = 6;

/// FLOPs per (query row, key, head-dim element): one multiply-add (2 FLOPs) in Q·Kᵀ and one in P·V.
inline constexpr double flops_per_score_element = 4.0;

/// The q-tile and kv-tile edge a flash schedule uses, in rows.
struct tile_shape {
  index_t q = 64;   ///< query rows per q-block: K and V stream through once per q-block
  index_t kv = 64;  ///< key rows per kv-tile
};

/// Number of (query, key) pairs of one head, s_q · s_kv.
inline double score_elements(const problem& p) { return static_cast<double>(p.seq_q) * static_cast<double>(p.seq_kv); }

/// Fraction of the s_q × s_kv score entries that a bound mask allows: 1 for dense, (s+1)/(2s) for square causal.
/// @param m a mask bound to the problem's sequence lengths (any type with `allowed_count()`).
/// @param p the problem whose seq_q × seq_kv entries are counted.
template <class Bound>
double density(const Bound& m, const problem& p) {
  const double n = score_elements(p);
  return n > 0 ? static_cast<double>(m.allowed_count()) / n : 0.0;
}

/// Useful FLOPs of one call, 4 · b · h · s_q · s_kv · d · density (the exp, max and sum are not counted, as
/// usual for attention FLOP rates).
/// @param p       the problem's sizes.
/// @param density fraction of score entries computed: 1 for a kernel that computes every entry (naive, any mask),
///                the mask's allowed fraction for a kernel that skips masked tiles.
inline double flops(const problem& p, double density = 1.0) {
  return flops_per_score_element * static_cast<double>(p.batch) * static_cast<double>(p.heads) * score_elements(p) *
         static_cast<double>(p.head_dim) * density;
}

/// Elements of Q (and of O): b · h · s_q · d.
inline double q_elements(const problem& p) {
  return static_cast<double>(p.batch) * static_cast<double>(p.heads) * static_cast<double>(p.seq_q) *
         static_cast<double>(p.head_dim);
}
/// Elements of K (and of V): b · h_kv · s_kv · d.
inline double kv_elements(const problem& p) {
  return static_cast<double>(p.batch) * static_cast<double>(p.heads_kv) * static_cast<double>(p.seq_kv) *
         static_cast<double>(p.head_dim);
}

/// Compulsory bytes: Q, K and V read once and O written once, e · (2 · b·h·s_q·d + 2 · b·h_kv·s_kv·d).
/// No schedule moves less (the optional lse output, b·h·s_q floats, is left out).
/// @param p          the problem's sizes.
/// @param elem_bytes bytes per stored element, sizeof(T).
inline double compulsory_bytes(const problem& p, std::size_t elem_bytes) {
  return static_cast<double>(elem_bytes) * (2.0 * q_elements(p) + 2.0 * kv_elements(p));
}

/// Bytes of one head's S×S score matrix in the accumulation type, s_q · s_kv · a.
inline double naive_scores_bytes_per_head(const problem& p, std::size_t accum_bytes) {
  return score_elements(p) * static_cast<double>(accum_bytes);
}
/// Bytes of every head's S×S scores, b · h · s_q · s_kv · a: what a batched naive pipeline holds at once.
inline double naive_scores_bytes_total(const problem& p, std::size_t accum_bytes) {
  return static_cast<double>(p.batch) * static_cast<double>(p.heads) * naive_scores_bytes_per_head(p, accum_bytes);
}

/// Modelled memory traffic of the naive three-pass pipeline: the compulsory bytes plus `passes` trips of the
/// whole S×S score matrix, b · h · passes · s_q · s_kv · a. The naive kernel materialises every entry whatever
/// the mask, so the mask does not enter.
inline double naive_bytes(const problem& p, std::size_t elem_bytes, std::size_t accum_bytes,
                          int passes = naive_score_passes) {
  return compulsory_bytes(p, elem_bytes) + static_cast<double>(passes) * naive_scores_bytes_total(p, accum_bytes);
}

/// Key rows one head visits summed over its q-blocks: Σ over q-blocks of the length of the key segments the
/// mask lets that block see. A dense mask gives ceil(s_q / block_q) · s_kv. q-blocks are also cut at multiples
/// of the mask's `q_granule()` (block-sparse layouts), as the tile loop does.
/// @param m       a bound mask offering `q_granule()` and `segments(q0, q1)` (core/mask_walk.hpp).
/// @param p       the problem (its seq_q is cut into q-blocks).
/// @param block_q query rows per q-block (values below 1 count as 1).
template <class Bound>
double kv_rows_visited(const Bound& m, const problem& p, index_t block_q) {
  const index_t step = std::max<index_t>(1, block_q);
  const index_t granule = m.q_granule();
  double rows = 0;
  for (index_t q0 = 0; q0 < p.seq_q;) {
    index_t q1 = std::min(q0 + step, p.seq_q);
    if (granule > 0) q1 = std::min(q1, (q0 / granule + 1) * granule);
    auto segments = m.segments(q0, q1);
    for (kv_span seg; segments.next(seg);) rows += static_cast<double>(seg.end - seg.begin);
    q0 = q1;
  }
  return rows;
}

/// Modelled memory traffic of a flash (online-softmax) schedule: Q read once, O written once, and the K and V
/// rows each q-block visits re-read once per q-block, per query head:
///   e · 2 · b·h·s_q·d  +  e_kv · 2 · b·h·d · kv_rows_visited(mask, block_q).
/// The scores never leave the cache. For a dense mask this is e · (2·b·h·s_q·d + 2·b·h·s_kv·d·ceil(s_q/block_q)).
/// @param p             the problem's sizes.
/// @param m             the bound mask (see kv_rows_visited).
/// @param elem_bytes    bytes per stored element, sizeof(T), for Q and O.
/// @param block_q       query rows per q-block.
/// @param kv_elem_bytes bytes per K/V element as the kernel re-reads them (0: elem_bytes); a kernel that packs
///                      K and V once into its accumulation type and streams the packed copy re-reads
///                      sizeof(accum_t<T>).
template <class Bound>
double flash_bytes(const problem& p, const Bound& m, std::size_t elem_bytes, index_t block_q,
                   std::size_t kv_elem_bytes = 0) {
  const double e_kv = static_cast<double>(kv_elem_bytes > 0 ? kv_elem_bytes : elem_bytes);
  const double kv_reads = 2.0 * static_cast<double>(p.batch) * static_cast<double>(p.heads) *
                          static_cast<double>(p.head_dim) * kv_rows_visited(m, p, block_q);
  return static_cast<double>(elem_bytes) * 2.0 * q_elements(p) + e_kv * kv_reads;
}

/// Bytes one thread of a flash schedule keeps live, in the accumulation type: the Q tile and the O accumulator
/// (block_q × d each), the K and V tiles (block_kv × d each), the score tile (block_q × block_kv) and the running
/// max and sum (block_q each): a · (2·Bq·d + 2·Bkv·d + Bq·Bkv + 2·Bq). Independent of s_q and s_kv.
inline double flash_working_set_bytes(const problem& p, std::size_t accum_bytes, tile_shape tile = {}) {
  const double bq = static_cast<double>(tile.q), bkv = static_cast<double>(tile.kv);
  const double d = static_cast<double>(p.head_dim);
  return static_cast<double>(accum_bytes) * (2.0 * bq * d + 2.0 * bkv * d + bq * bkv + 2.0 * bq);
}

/// One line of the memory table: the naive S×S scores (per head and for every head) against the flash working
/// set of `threads` threads.
struct memory_row {
  double naive_per_head = 0;  ///< bytes of one head's S×S scores
  double naive_total = 0;     ///< bytes of every head's S×S scores
  double flash_total = 0;     ///< bytes of the flash working set of all threads
  /// How many times less memory the flash schedule needs than the batched naive pipeline.
  double reduction() const { return flash_total > 0 ? naive_total / flash_total : 0.0; }
};

/// The memory table line of a problem.
/// @param p           the problem's sizes.
/// @param accum_bytes sizeof(accum_t<T>).
/// @param tile        the flash schedule's q and kv tile edges.
/// @param threads     threads of the flash schedule, each with its own tiles.
inline memory_row memory(const problem& p, std::size_t accum_bytes, tile_shape tile = {}, int threads = 1) {
  memory_row r;
  r.naive_per_head = naive_scores_bytes_per_head(p, accum_bytes);
  r.naive_total = naive_scores_bytes_total(p, accum_bytes);
  r.flash_total = static_cast<double>(std::max(threads, 1)) * flash_working_set_bytes(p, accum_bytes, tile);
  return r;
}

/// Arithmetic intensity, FLOPs per byte (0 when no bytes move).
inline double intensity(double flop, double bytes) { return bytes > 0 ? flop / bytes : 0.0; }

/// The attainable FLOP rate of the roofline model, min(peak, intensity × bandwidth).
inline double attainable(double intensity, double peak_flops, double bandwidth) {
  return std::min(peak_flops, intensity * bandwidth);
}

}  // namespace cost
}  // namespace fusedattn
