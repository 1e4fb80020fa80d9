/// @file ragged.hpp
/// The offsets of a ragged test batch (sequences packed end to end): cumulative query and key offsets from
/// per-sequence lengths, and the batch-1 problem whose seq_q / seq_kv are the totals.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include <fusedattn/fusedattn.hpp>

namespace fusedattn {
namespace testing {

/// cu_q / cu_kv: the first token of each sequence and the total; p: batch 1, seq_q / seq_kv the totals.
struct ragged_offsets {
  problem p;
  std::vector<std::int32_t> cu_q, cu_kv;

  ragged_offsets(index_t heads, index_t heads_kv, index_t d, const std::vector<std::int32_t>& len_q,
                 const std::vector<std::int32_t>& len_kv) {
    cu_q.push_back(0);
    cu_kv.push_back(0);
    for (std::size_t b = 0; b < len_q.size(); ++b) {
      cu_q.push_back(cu_q.back() + len_q[b]);
      cu_kv.push_back(cu_kv.back() + len_kv[b]);
    }
    p = {1, heads, heads_kv, cu_q.back(), cu_kv.back(), d};
  }
  ragged_batch batch() const { return {static_cast<index_t>(cu_q.size()) - 1, cu_q.data(), cu_kv.data()}; }
};

}  // namespace testing
}  // namespace fusedattn
