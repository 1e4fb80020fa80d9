/// @file oracle.hpp
/// The independent float64 reference: a plain loop that uses only the mask's per-element rule `allowed(i, j)` and
/// the score modifiers' scalar arithmetic (core/score_mod.hpp). Nothing in it is shared with the kernels' schedules
/// (kv ranges, partial tiles, online softmax).
#pragma once

#include <cmath>
#include <limits>
#include <vector>

#include <fusedattn/fusedattn.hpp>

namespace fusedattn::testing {

/// O and lse of one call in float64, O laid out [b][h][i][c] and lse [b][h][i].
struct reference {
  std::vector<double> o;
  std::vector<double> lse;
};

/// The score modifiers a bound mask carries (none for a mask type without them). Not in a `detail` namespace: tests
/// that use both fusedattn and fusedattn::testing name fusedattn::detail unqualified.
template <class Mask>
auto oracle_mods(const Mask& m, int) -> decltype(bound_mods(mods_of(m))) {
  return mods_of(m);
}
template <class Mask>
bound_mods oracle_mods(const Mask&, long) {
  return {};
}

/// softmax(s'_ij restricted to allowed(i, j), plus the sink logit in the denominator) · v, every sum in double,
/// with s'_ij = mods.apply(scale · q_i·k_j, h, i, j) (= scale · q_i·k_j without modifiers). A row with no allowed key
/// gives O = 0 and lse = −inf, or lse = sink_h with sinks. `Acc` picks the arithmetic: double is the oracle; the storage type's
/// accumulation type gives the "plain same-precision implementation" that tolerances are derived from. `PRound`
/// (default `Acc`) is the type each probability is rounded to before it multiplies V: bf16 gives the plain
/// implementation of kernels that feed P to bf16 dot products (vdpbf16ps, AMX), as PyTorch's bf16 math path does.
/// Rows are independent: with OpenMP, calls of more than 2^22 multiply-adds share their rows among the threads
/// (each row is computed exactly as alone, so the result does not depend on the threads).
template <class Acc = double, class PRound = Acc, class T, class Mask>
reference reference_attention(const problem& p, const tensor_ref<const T>& q, const tensor_ref<const T>& k,
                              const tensor_ref<const T>& v, const Mask& mask) {
  reference r{std::vector<double>(static_cast<std::size_t>(p.batch * p.heads * p.seq_q * p.head_dim)),
              std::vector<double>(static_cast<std::size_t>(p.batch * p.heads * p.seq_q))};
  const Acc scale = static_cast<Acc>(p.softmax_scale());
  const index_t rows = p.batch * p.heads * p.seq_q;
  const bool parallel = static_cast<double>(rows) * static_cast<double>(p.seq_kv) * static_cast<double>(p.head_dim) >
                        static_cast<double>(1 << 22);
  (void)parallel;  // read by the OpenMP pragma only
#pragma omp parallel if (parallel)
  {
    std::vector<Acc> s(static_cast<std::size_t>(p.seq_kv));
    std::vector<Acc> acc(static_cast<std::size_t>(p.head_dim));
#pragma omp for schedule(dynamic, 16)
    for (index_t row = 0; row < rows; ++row) {  // row = (b · heads + h) · seq_q + i
      const index_t i = row % p.seq_q, h = row / p.seq_q % p.heads, b = row / p.seq_q / p.heads;
      const index_t g = p.kv_head(h);
      const auto head_mask = for_head(mask, b, h);
      const bound_mods mods = oracle_mods(head_mask, 0);
      const Acc sink = mods.sink<Acc>(h);
      Acc m = sink;
      for (index_t j = 0; j < p.seq_kv; ++j) {
        if (!head_mask.allowed(i, j)) continue;
        Acc dot = 0;
        for (index_t c = 0; c < p.head_dim; ++c)
          dot += static_cast<Acc>(q.row(b, h, i)[c]) * static_cast<Acc>(k.row(b, g, j)[c]);
        s[j] = mods.apply(scale * dot, h, i, j);
        m = std::max(m, s[j]);
      }
      Acc l = m == -std::numeric_limits<Acc>::infinity() ? Acc(0) : std::exp(sink - m);
      std::fill(acc.begin(), acc.end(), Acc(0));
      for (index_t j = 0; j < p.seq_kv; ++j) {
        if (!head_mask.allowed(i, j)) continue;
        const Acc e = std::exp(s[j] - m);
        l += e;
        const Acc pv = static_cast<Acc>(static_cast<PRound>(e));
        for (index_t c = 0; c < p.head_dim; ++c) acc[c] += pv * static_cast<Acc>(v.row(b, g, j)[c]);
      }
      const std::size_t o_row = static_cast<std::size_t>(row);
      for (index_t c = 0; c < p.head_dim; ++c)
        r.o[o_row * p.head_dim + c] = l > 0 ? static_cast<double>(acc[c] / l) : 0.0;
      r.lse[o_row] = l > 0 ? static_cast<double>(m + std::log(l)) : -std::numeric_limits<double>::infinity();
    }
  }
  return r;
}

}  // namespace fusedattn::testing
