/// @file dist_support.hpp
/// Helpers of the fusedattn/dist tests: cutting a whole-sequence operand into one rank's shard (and back), and the
/// tolerance of a result merged from several lse-weighted parts.
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

#include <fusedattn/dist/comm.hpp>

#include "support/data.hpp"

namespace fusedattn::testing {

/// Rank `rank`'s shard of a whole-sequence operand `whole` (b, h, S, d), copied into a contiguous B·H·S·D buffer.
template <class T>
std::vector<T> shard_of(const tensor_ref<const T>& whole, dist::layout l, int ranks, int rank) {
  const dims4 d = whole.dims;
  const index_t rows = dist::shard_rows(d.s, ranks);
  std::vector<T> out(static_cast<std::size_t>(d.b * d.h * rows * d.d));
  for (index_t b = 0; b < d.b; ++b)
    for (index_t h = 0; h < d.h; ++h) {
      index_t local = 0;
      for (int part = 0; part < 2; ++part) {
        const dist::row_range rr = dist::shard_piece(l, d.s, ranks, rank, part);
        for (index_t i = rr.begin; i < rr.end; ++i, ++local)
          std::copy(whole.row(b, h, i), whole.row(b, h, i) + d.d,
                    out.begin() + static_cast<std::ptrdiff_t>(((b * d.h + h) * rows + local) * d.d));
      }
    }
  return out;
}

/// The global row of local row `local` of rank `rank`'s shard.
inline index_t global_row(dist::layout l, index_t seq, int ranks, int rank, index_t local) {
  const dist::row_range first = dist::shard_piece(l, seq, ranks, rank, 0);
  if (local < first.size()) return first.begin + local;
  return dist::shard_piece(l, seq, ranks, rank, 1).begin + (local - first.size());
}

/// Rows of a whole-sequence reference laid out [b][h][i][c] (c < d), taken in the order of rank `rank`'s shard.
inline std::vector<double> shard_rows_of(const std::vector<double>& whole, const problem& p, index_t d,
                                         dist::layout l, int ranks, int rank) {
  const index_t rows = dist::shard_rows(p.seq_q, ranks);
  std::vector<double> out(static_cast<std::size_t>(p.batch * p.heads * rows * d));
  for (index_t bh = 0; bh < p.batch * p.heads; ++bh)
    for (index_t x = 0; x < rows; ++x) {
      const index_t g = global_row(l, p.seq_q, ranks, rank, x);
      for (index_t c = 0; c < d; ++c)
        out[static_cast<std::size_t>((bh * rows + x) * d + c)] = whole[static_cast<std::size_t>((bh * p.seq_q + g) * d + c)];
    }
  return out;
}

/// What merging `parts` lse-weighted parts adds to one call's error: each part's O rounded to T, and each weight
/// exp(lse_part − lse) formed from float lse values (relative error about |lse| · float epsilon; |O| <= max |v| = 1
/// for inputs in [−1, 1]).
template <class T>
double merge_allowance(int parts, double max_abs_lse) {
  const double eps_f = static_cast<double>(Eigen::NumTraits<float>::epsilon());
  return parts * (epsilon<T>() + 4.0 * eps_f * (1.0 + max_abs_lse));
}

/// Largest finite |lse| of a reference.
inline double max_abs_finite(const std::vector<double>& v) {
  double m = 0;
  for (double x : v)
    if (std::isfinite(x)) m = std::max(m, std::abs(x));
  return m;
}

}  // namespace fusedattn::testing
