/// @file comm.hpp
/// The communicator concept fusedattn/dist runs on, and what a sharded attention call is told: how the sequence is
/// cut into shards (layout), which schedule runs (strategy) and its options. No engine here: dist/mpi.hpp (MPI) and
/// dist/nccl.hpp (NCCL) are the two real ones.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "../core/problem.hpp"
#include "../core/status.hpp"
#include "../core/types.hpp"

namespace fusedattn {
namespace dist {

/// A communicator is any type with these members (every rank calls them in the same order):
/// @code
///   int rank() const;                     // 0 .. size() − 1
///   int size() const;                     // number of ranks (>= 1)
///   using request = ...;                  // one exchange in flight
///   // Starts sending `bytes` bytes at `send` to rank `to` and receiving as many into `recv` from rank `from`;
///   // returns at once. `stream` is the compute stream for stream-ordered engines (NCCL), nullptr otherwise: the
///   // transfer then starts after the work enqueued on it so far.
///   status start_exchange(const void* send, int to, void* recv, int from, std::size_t bytes, request& r, void* stream);
///   // Completes the exchange: afterwards (MPI) or for the work enqueued on `stream` afterwards (NCCL) `recv`
///   // holds the data and `send` may be reused.
///   status wait(request& r, void* stream);
///   // Element-wise minimum over the ranks of `count` values, in place; blocking on every engine.
///   status all_reduce_min(std::int64_t* values, int count);
/// @endcode
/// A failing communicator call returns errc::backend_error with the engine's text.

/// How the global sequence (of queries and of keys alike) is cut into the ranks' shards.
enum class layout {
  contiguous,  ///< rank r holds rows [r·S/N, (r+1)·S/N)
  zigzag,      ///< the sequence cut into 2N chunks of S/(2N) rows; rank r holds chunks r and 2N−1−r, in that order
               ///< (causal work is then the same on every rank)
};

/// Which schedule a sharded call runs.
enum class strategy {
  automatic,   ///< all_gather when heads_kv < heads (GQA / MQA: K and V are smaller than Q and O), else ring
  ring,        ///< K/V shards rotate around the ring, N steps; each step's transfer overlaps the step's compute
  all_gather,  ///< every rank gathers every K/V shard first, then computes its queries against them
};

/// Parts of the schedule to run. Both on (the default) for a result; switching one off leaves the result wrong and
/// is for measuring only: compute alone (every step computes on the shard already held) and communication alone
/// tell how much of the transfer the compute hides.
struct run_parts {
  bool compute = true;
  bool communicate = true;
};

/// Options of a sharded call.
struct options {
  dist::layout layout = dist::layout::zigzag;
  dist::strategy strategy = dist::strategy::automatic;
  run_parts parts{};
};

/// Host seconds a sharded call spent, for benches: `total`, and `waiting` blocked on transfers that the compute
/// did not hide (host-blocking engines such as MPI; stream-ordered engines wait on the device and report 0).
struct timings {
  double total = 0;
  double waiting = 0;
};

/// Half-open range of global rows.
struct row_range {
  index_t begin = 0;
  index_t end = 0;
  index_t size() const { return end - begin; }
};

/// The global rows of the `part`-th piece of rank `rank`'s shard (part 0 or 1; contiguous has one piece, part 1
/// is then empty), for a sequence of `seq` rows over `ranks` ranks. Local row x of the shard is global row
/// begin + x of piece 0 for x < piece 0's size, then of piece 1. `seq` must be a multiple of ranks (contiguous) or
/// 2·ranks (zigzag): dist::attend refuses other lengths.
inline row_range shard_piece(dist::layout l, index_t seq, int ranks, int rank, int part) {
  if (l == layout::contiguous) {
    const index_t n = seq / ranks;
    return part == 0 ? row_range{rank * n, (rank + 1) * n} : row_range{0, 0};
  }
  const index_t c = seq / (2 * index_t(ranks));
  const index_t chunk = part == 0 ? index_t(rank) : 2 * index_t(ranks) - 1 - rank;
  return {chunk * c, (chunk + 1) * c};
}

/// Rows of one rank's shard (the same for every rank).
inline index_t shard_rows(index_t seq, int ranks) { return ranks > 0 ? seq / ranks : 0; }

inline const char* layout_name(dist::layout l) { return l == layout::contiguous ? "contiguous" : "zigzag"; }
inline const char* strategy_name(dist::strategy s) {
  return s == strategy::ring ? "ring" : s == strategy::all_gather ? "all_gather" : "automatic";
}

}  // namespace dist
}  // namespace fusedattn
