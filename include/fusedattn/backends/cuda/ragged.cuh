/// @file ragged.cuh
/// What the flash kernels need to run a ragged batch (attend_ragged) in one launch: the call's band mask rebound to
/// one sequence's lengths (ragged_shift, sequence_band), and the walk from a work item to its sequence
/// (ragged_cursor). Q, K, V and O are packed tensors of every sequence's tokens; sequence b owns query rows
/// [cu_q[b], cu_q[b + 1]) and keys [cu_kv[b], cu_kv[b + 1]), and its work items are its q-blocks × heads, sequence after
/// sequence, head after head, the last (under a causal mask, heaviest) q-block of a head first.
#pragma once

#include <cstdint>

#include "../../kernels/mask.hpp"

namespace fusedattn {
namespace cuda_backend {

/// How a band mask's limits and ALiBi's offset move with a sequence's query count nq and key count nk: each bounded
/// value v of the mask bound to (0, 0) becomes v + q·nq + kv·nk (a bottom-right alignment: kv = 1, q = −1; top-left:
/// 0, 0). Read off the mask bound to three pairs of lengths (ragged_shift_of), so every band mask and alignment
/// rebinds the way bind() binds it.
struct ragged_shift {
  int lo_q = 0, lo_kv = 0, hi_q = 0, hi_kv = 0, alibi_q = 0, alibi_kv = 0;
};

/// The shift of a mask bound by `bind_len(nq, nk)` (a band_mask for those lengths): its limits at (1, 0) and (0, 1)
/// against (0, 0).
template <class BindLen>
ragged_shift ragged_shift_of(BindLen&& bind_len) {
  const band_mask m0 = bind_len(index_t(0), index_t(0)), mq = bind_len(index_t(1), index_t(0)),
                  mk = bind_len(index_t(0), index_t(1));
  const auto step = [](index_t from, index_t to) {
    return from == band_mask::unbounded || from == -band_mask::unbounded ? 0 : int(to - from);
  };
  return {step(m0.lo, mq.lo),   step(m0.lo, mk.lo),   step(m0.hi, mq.hi),
          step(m0.hi, mk.hi),   int(mq.mods.alibi_offset - m0.mods.alibi_offset),
          int(mk.mods.alibi_offset - m0.mods.alibi_offset)};
}

/// The call's mask `m` (bound to lengths (0, 0)) bound to a sequence of nq query rows and nk keys.
__host__ __device__ __forceinline__ band_mask sequence_band(const band_mask& m, const ragged_shift& s, int nq, int nk) {
  band_mask r = m;
  r.seq_q = nq;
  r.seq_kv = nk;
  if (m.lo != -band_mask::unbounded) r.lo = m.lo + index_t(s.lo_q) * nq + index_t(s.lo_kv) * nk;
  if (m.hi != band_mask::unbounded) r.hi = m.hi + index_t(s.hi_q) * nq + index_t(s.hi_kv) * nk;
  r.mods.alibi_offset = m.mods.alibi_offset + index_t(s.alibi_q) * nq + index_t(s.alibi_kv) * nk;
  return r;
}

/// Work items of a ragged batch with `block_m`-row q-blocks: sequence b's are [start, start + heads · q_blocks).
/// seek(x) moves forward to the sequence of item x (x never decreases between calls), reading the offsets as it
/// goes; a thread walking its items x, x + stride, ... reads each offset once.
struct ragged_cursor {
  int b = -1, start = 0, q_blocks = 0;
  int q0 = 0, nq = 0;  ///< sequence b's first query row and row count
  int k0 = 0, nk = 0;  ///< its first key and key count (when seek is given cu_kv)
  __device__ __forceinline__ void seek(const int* cu_q, int heads, int block_m, int x, const int* cu_kv = nullptr) {
    if (x < start + heads * q_blocks) return;
    do {
      start += heads * q_blocks;
      ++b;
      q0 = cu_q[b];
      nq = cu_q[b + 1] - q0;
      q_blocks = (nq + block_m - 1) / block_m;
    } while (x >= start + heads * q_blocks);
    if (cu_kv != nullptr) k0 = cu_kv[b], nk = cu_kv[b + 1] - k0;
  }
  /// Item x's head and q-block (seek(x) first).
  __device__ __forceinline__ int head(int x) const { return (x - start) / q_blocks; }
  __device__ __forceinline__ int m_block(int x) const { return q_blocks - 1 - (x - start) % q_blocks; }
};

/// The work items of a ragged batch (host side): Σ_b ⌈nq_b / block_m⌉ · heads.
inline index_t ragged_items(const std::int32_t* cu_q, index_t sequences, index_t heads, int block_m) {
  index_t items = 0;
  for (index_t b = 0; b < sequences; ++b) items += (index_t(cu_q[b + 1] - cu_q[b]) + block_m - 1) / block_m;
  return items * heads;
}

}  // namespace cuda_backend
}  // namespace fusedattn
