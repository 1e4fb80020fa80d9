/// @file problem.hpp
/// The sizes of one attention call: batch, heads (query and key/value), sequence lengths, head dimension
/// and softmax scale. Plain data; the checks live in validate.hpp.
#pragma once

#include <cmath>
#include <optional>

#include "types.hpp"

namespace fusedattn {

/// Largest head dimension any kernel accepts (the CPU kernels keep one row of Q and of the accumulator
/// in registers or L1 per micro-tile, sized for this bound).
inline constexpr index_t max_head_dim = 512;

/// The four extents of one operand, in logical order (batch, heads, sequence, head_dim).
struct dims4 {
  index_t b, h, s, d;
};

/// One attention problem: O[b,h,i,:] = softmax_j(scale · Q[b,h,i,:]·K[b,g(h),j,:]) · V[b,g(h),j,:],
/// where g(h) = h / (heads / heads_kv) maps a query head to its key/value head (GQA, MQA when heads_kv = 1).
struct problem {
  index_t batch = 1;
  index_t heads = 1;
  index_t heads_kv = 1;  ///< must divide `heads`; equal to it for plain multi-head attention
  index_t seq_q = 1;
  index_t seq_kv = 1;
  index_t head_dim = 1;
  std::optional<double> scale{};  ///< softmax scale; 1/sqrt(head_dim) when empty

  /// The scale actually applied.
  double softmax_scale() const { return scale ? *scale : 1.0 / std::sqrt(static_cast<double>(head_dim)); }
  /// Query heads sharing one key/value head.
  index_t group_size() const { return heads_kv > 0 ? heads / heads_kv : 0; }
  /// The key/value head that query head `h` reads.
  index_t kv_head(index_t h) const { return h / group_size(); }

  dims4 q_dims() const { return {batch, heads, seq_q, head_dim}; }
  dims4 kv_dims() const { return {batch, heads_kv, seq_kv, head_dim}; }
  dims4 o_dims() const { return q_dims(); }
  /// Number of log-sum-exp values (one per batch, head and query row), laid out [b][h][s_q].
  index_t lse_size() const { return batch * heads * seq_q; }
};

}  // namespace fusedattn
