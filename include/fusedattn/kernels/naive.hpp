/// @file naive.hpp
/// The naive three-pass attention of the seed assignment, kept as the teaching baseline:
///   S = Q·Kᵀ (Eigen GEMM) → S = scale·S, masked entries = −inf → P = softmax(S) row by row → O = P·V (Eigen GEMM),
/// with the seq_q × seq_kv matrix S really materialised per (batch, head), so its memory traffic is what the
/// roofline shows. It is not the test oracle (that is tests/support/oracle.hpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <new>
#include <string>
#include <vector>

#include <Eigen/Core>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "../core/problem.hpp"
#include "../core/status.hpp"
#include "../core/tensor.hpp"
#include "../core/types.hpp"
#include "../cpu/fp_env.hpp"
#include "mask.hpp"

namespace fusedattn {
namespace kernels {

/// Row-major dynamic matrix in the accumulation type.
template <class Acc>
using matrix = Eigen::Matrix<Acc, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

/// Copies rows [0, s) of head (b, h) of `t` into `m` (s × d), converting to the accumulation type.
template <class T, class Acc>
void load_head(const tensor_ref<const T>& t, index_t b, index_t h, matrix<Acc>& m) {
  for (index_t i = 0; i < t.dims.s; ++i) {
    const T* r = t.row(b, h, i);
    for (index_t c = 0; c < t.dims.d; ++c) m(i, c) = static_cast<Acc>(r[c]);
  }
}

/// Working memory of one (batch, head) of the naive kernel: Q, K, V, O tiles and the S×S scores.
template <class Acc>
struct naive_workspace {
  matrix<Acc> q, k, v, s, o;
  void resize(const problem& p) {
    q.resize(p.seq_q, p.head_dim);
    k.resize(p.seq_kv, p.head_dim);
    v.resize(p.seq_kv, p.head_dim);
    s.resize(p.seq_q, p.seq_kv);
    o.resize(p.seq_q, p.head_dim);
  }
};

/// Bytes the naive kernel allocates per thread: the S×S scores plus Q, K, V and O in the accumulation type.
/// Saturates at INT64_MAX (never overflows), which fa::plan and attend() report as an absurd size.
template <class T>
index_t naive_workspace_bytes(const problem& p) {
  using detail::add_sat;
  using detail::mul_sat;
  const index_t elements = add_sat(mul_sat(p.seq_q, p.seq_kv),
                                   mul_sat(2, add_sat(mul_sat(p.seq_q, p.head_dim), mul_sat(p.seq_kv, p.head_dim))));
  return mul_sat(static_cast<index_t>(sizeof(accum_t<T>)), elements);
}

/// One (batch, head) of the three-pass pipeline. `ws` is sized by naive_workspace::resize.
template <class T, class Mask>
void naive_head(const problem& p, const tensor_ref<const T>& q, const tensor_ref<const T>& k,
                const tensor_ref<const T>& v, const tensor_ref<T>& o, const Mask& mask, float* lse, index_t b,
                index_t h, naive_workspace<accum_t<T>>& ws) {
  using Acc = accum_t<T>;
  const auto head_mask = for_head(mask, b, h);
  const index_t h_kv = p.kv_head(h);
  load_head(q, b, h, ws.q);
  load_head(k, b, h_kv, ws.k);
  load_head(v, b, h_kv, ws.v);

  // Pass 1: S = Q·Kᵀ (seq_q × seq_kv), materialised.
  ws.s.noalias() = ws.q * ws.k.transpose();

  // Pass 2: S = scale·S, or with score modifiers S = softcap(scale·S) + alibi(h, i, j) (core/score_mod.hpp);
  // entries the mask forbids become −inf.
  const Acc scale = static_cast<Acc>(p.softmax_scale());
  const Acc neg_inf = -std::numeric_limits<Acc>::infinity();
  const bound_mods& mods = mods_of(head_mask);
  if (mods.changes_scores()) {
    for (index_t i = 0; i < p.seq_q; ++i)
      for (index_t j = 0; j < p.seq_kv; ++j)
        ws.s(i, j) = head_mask.allowed(i, j) ? mods.apply(scale * ws.s(i, j), h, i, j) : neg_inf;
  } else {
    for (index_t i = 0; i < p.seq_q; ++i)
      for (index_t j = 0; j < p.seq_kv; ++j) ws.s(i, j) = head_mask.allowed(i, j) ? scale * ws.s(i, j) : neg_inf;
  }

  // Pass 3: stable softmax per row: m = max(max_j S, sink), P = exp(S − m), l = Σ_j P + exp(sink − m), P = P / l
  // (the sink logit of head h joins the denominator only; −inf when sinks are off).
  // A row with no allowed key has m = −inf: its P row is 0 and its lse −inf (never NaN), or the sink's logit. A NaN
  // score makes m NaN (PropagateNaN), so the row's P, O and lse become NaN rather than the row passing for fully
  // masked.
  const Acc sink = mods.sink<Acc>(h);
  for (index_t i = 0; i < p.seq_q; ++i) {
    auto row = ws.s.row(i);
    const Acc row_max = row.template maxCoeff<Eigen::PropagateNaN>();
    if (row_max == neg_inf) {
      row.setZero();
      if (lse) lse[(b * p.heads + h) * p.seq_q + i] = static_cast<float>(sink);
      continue;
    }
    const Acc m = sink > row_max ? sink : row_max;  // a NaN row_max stays
    row = (row.array() - m).exp();
    const Acc l = row.sum() + std::exp(sink - m);
    row /= l;
    if (lse) lse[(b * p.heads + h) * p.seq_q + i] = static_cast<float>(m + std::log(l));
  }

  // Pass 4: O = P·V (seq_q × head_dim), converted to the storage type. A GEMM multiplies masked P entries
  // (exactly 0) by V too, and 0·NaN = NaN; so when V holds a NaN or an infinity, O is summed row by row over
  // the allowed keys only, and the non-finite value reaches just the rows that attend its key.
  if (ws.v.allFinite()) {
    ws.o.noalias() = ws.s * ws.v;
  } else {
    ws.o.setZero();
    for (index_t i = 0; i < p.seq_q; ++i)
      for (index_t j = 0; j < p.seq_kv; ++j)
        if (head_mask.allowed(i, j)) ws.o.row(i) += ws.s(i, j) * ws.v.row(j);
  }
  for (index_t i = 0; i < p.seq_q; ++i) {
    T* r = o.row(b, h, i);
    for (index_t c = 0; c < p.head_dim; ++c) r[c] = static_cast<T>(ws.o(i, c));
  }
}

/// Naive attention over every (batch, head), `threads` of them at a time (OpenMP when available), on exactly
/// min(threads, batch · heads) threads whatever the build defines (EIGEN_DONT_PARALLELIZE or not); results are
/// bitwise the same for every thread count.
/// Preconditions: the call was validated (see validate.hpp). Allocates naive_workspace_bytes per thread and
/// reports out_of_memory, with nothing written, when that fails.
template <class T, class Mask>
status naive_attention(const problem& p, const tensor_ref<const T>& q, const tensor_ref<const T>& k,
                       const tensor_ref<const T>& v, const tensor_ref<T>& o, const Mask& mask, float* lse,
                       int threads) {
  using Acc = accum_t<T>;
  const index_t heads_total = p.batch * p.heads;
  const int n_threads = static_cast<int>(std::max<index_t>(1, std::min<index_t>(threads, heads_total)));
  std::vector<naive_workspace<Acc>> ws(static_cast<std::size_t>(n_threads));
  try {
    for (auto& w : ws) w.resize(p);
  } catch (const std::bad_alloc&) {
    return {errc::out_of_memory, "naive: cannot allocate the " + std::to_string(p.seq_q) + " x " +
                                     std::to_string(p.seq_kv) + " score matrix per thread"};
  }
#if defined(_OPENMP)
#pragma omp parallel num_threads(n_threads)
#endif
  {
    // Exactly n_threads threads: Eigen opens an OpenMP team of its own inside each GEMM when it sees one thread
    // (a team of 1, or no team) unless EIGEN_DONT_PARALLELIZE is defined. This task's nested parallelism is
    // switched off here (both ICVs are per task: the caller's settings are untouched), so every GEMM runs on the
    // thread that computes its head, with the same blocking for any thread count: results are bitwise the same.
#if defined(_OPENMP)
    omp_set_max_active_levels(omp_get_active_level());
    omp_set_num_threads(1);
#endif
    // Subnormals flushed to zero on every worker thread, its FP mode restored on exit (fp_env.hpp).
    const cpu::flush_denormals_scope flush_denormals;
#if defined(_OPENMP)
    auto& w = ws[static_cast<std::size_t>(omp_get_thread_num())];
#pragma omp for schedule(static)
#else
    auto& w = ws[0];
#endif
    for (index_t bh = 0; bh < heads_total; ++bh) naive_head(p, q, k, v, o, mask, lse, bh / p.heads, bh % p.heads, w);
  }
  return {};
}

}  // namespace kernels
}  // namespace fusedattn
