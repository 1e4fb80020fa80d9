/// @file tiles.hpp
/// Tile sizes of the CPU flash kernel: the user-overridable `tile_sizes` and the one heuristic that fills in
/// whatever the user left at 0. Sizes only; the loop that uses them is kernels/tile_loop.hpp.
#pragma once

#include <algorithm>

#include "../core/types.hpp"

namespace fusedattn {

/// Tile sizes of the CPU flash kernel. 0 means "choose by heuristic" (see cpu::choose_tiles).
struct tile_sizes {
  index_t q = 0;         ///< query rows per tile (a q-tile is also cut at every multiple of the mask's q_granule)
  index_t kv = 0;        ///< keys per tile; kv tiles sit on multiples of this
  index_t kv_split = 0;  ///< key chunks merged by log-sum-exp (decode split); 0 heuristic, 1 never split
};

namespace cpu {

/// Query rows per tile: more rows amortise the per-tile work (Q load, finish) and stream each K/V panel for
/// more rows; fewer rows waste less on the diagonal of causal masks, keep Q, S and the accumulator in L2 and give
/// more work items to threads. 64 rows up to head_dim 128, 32 beyond. (128 rows for s_q >= 2048 run as fast on one
/// thread, on Zen 5 and on a Sapphire Rapids class Xeon, and slower with 16 threads on one head: 32 q-tiles for 16
/// threads instead of 64.)
inline constexpr index_t default_q_tile_rows(index_t d) { return d > 128 ? 32 : 64; }
/// Keys per tile: the per-row, per-tile softmax work (reductions, one scalar exp2, the rescale) is amortised over
/// this many keys; the S tile (q rows × keys) stays in L2. 256 up to head_dim 128, 128 beyond.
inline constexpr index_t default_kv_tile_keys(index_t d) { return d <= 128 ? 256 : 128; }
/// Decode split: only when the whole query range is one tile and there are at least this many keys per chunk.
inline constexpr index_t decode_min_chunk_keys = 512;
/// Decode split: the most key chunks (bounds the partial-result buffer at this many times the output).
inline constexpr index_t decode_max_chunks = 32;

/// Decode kernel (kernels/decode.hpp): the most query rows of one kv head (group size × seq_q) it takes; calls
/// with more rows per kv head, explicit tile sizes or a block-sparse mask run the tile loop.
inline constexpr index_t decode_max_rows = 16;
/// Decode kernel: keys per online-softmax step (the S block of every row stays in L1); steps sit on multiples.
inline constexpr index_t decode_block_keys = 64;
/// Decode kernel: keys per chunk of a sequence of `len` keys, a multiple of decode_block_keys. Chunks are the
/// kernel's work items (merged by log-sum-exp), so one sequence uses every thread; the size depends on `len`
/// only (never on the thread count or the other sequences), so results are bitwise the same for any thread count
/// and for a sequence alone or in a batch.
inline constexpr index_t decode_chunk_keys(index_t len) {
  const index_t even = (len + decode_max_chunks - 1) / decode_max_chunks;
  const index_t rounded = (even + decode_block_keys - 1) / decode_block_keys * decode_block_keys;
  return std::max(decode_min_chunk_keys, rounded);
}

/// The tile heuristic: fills every 0 in `user` from head_dim and the sequence lengths. The result depends on
/// the problem only, never on the thread count, so results are identical for any number of threads.
inline constexpr tile_sizes choose_tiles(tile_sizes user, index_t d, index_t s_q, index_t s_kv) {
  tile_sizes t = user;
  if (t.q <= 0) t.q = std::min(default_q_tile_rows(d), s_q);
  if (t.kv <= 0) t.kv = std::min(default_kv_tile_keys(d), s_kv);
  if (t.kv_split <= 0) {
    const bool decode = s_q <= t.q && s_kv >= 2 * decode_min_chunk_keys;
    t.kv_split = decode ? std::min(decode_max_chunks, s_kv / decode_min_chunk_keys) : 1;
  }
  return t;
}

}  // namespace cpu
}  // namespace fusedattn
