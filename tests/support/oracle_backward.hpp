/// @file oracle_backward.hpp
/// Gradients of attention by the closed form, as plain loops that use only the mask's per-element rule: the float64
/// oracle (its own forward, every sum in double) and the plain same-precision implementation (the stored O and lse,
/// arithmetic in the accumulation type, results rounded to the storage type) that tolerances are derived from.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include <fusedattn/fusedattn.hpp>

#include "oracle.hpp"

namespace fusedattn::testing {

/// dQ laid out [b][h][i][c], dK and dV [b][h_kv][j][c]; dsink per query head (zeros without sinks).
struct reference_grads {
  std::vector<double> dq, dk, dv;
  std::vector<double> dsink;
};

namespace detail {

/// The closed form for one problem. `o` and `lse` null: the forward is recomputed in Acc (the oracle); otherwise
/// P = exp(s' − lse) and δ = dO·O use the stored values (the plain implementation). With the mask's score modifiers
/// (core/score_mod.hpp), x_ij = scale·q_i·k_j and s'_ij = cap(x_ij) + bias(h, i, j) (s' = x without modifiers); the
/// sink logit of head h joins lse. Per query row i:
///   P_ij = exp(s'_ij − lse_i) on allowed j;  δ_i = dO_i·O_i;  dP_ij = dO_i·v_j;
///   dS_ij = P_ij (dP_ij − δ_i) · cap'(x_ij)  with cap'(x) = 1 − (cap(x) / softcap)² (1 without softcap);
///   dQ_i = scale Σ_j dS_ij k_j;  dK_j += scale dS_ij q_i;  dV_j += P_ij dO_i  (summed over the group's heads);
///   d sink_h −= exp(sink_h − lse_i) δ_i  (summed over batch and rows).
/// A row with no allowed key, or a stored lse of −inf, contributes nothing and gets dQ = 0.
template <class Acc, class T, class Mask>
reference_grads closed_form(const problem& p, const tensor_ref<const T>& q, const tensor_ref<const T>& k,
                            const tensor_ref<const T>& v, const tensor_ref<const T>* o, const tensor_ref<const T>& d_o,
                            const float* lse, const Mask& mask) {
  const index_t d = p.head_dim;
  reference_grads g{std::vector<double>(static_cast<std::size_t>(p.batch * p.heads * p.seq_q * d)),
                    std::vector<double>(static_cast<std::size_t>(p.batch * p.heads_kv * p.seq_kv * d)),
                    std::vector<double>(static_cast<std::size_t>(p.batch * p.heads_kv * p.seq_kv * d)),
                    std::vector<double>(static_cast<std::size_t>(p.heads))};
  std::vector<double> dsink_bh(static_cast<std::size_t>(p.batch * p.heads));  // per (b, h), summed over b below
  const Acc scale = static_cast<Acc>(p.softmax_scale());
  const index_t kv_heads = p.batch * p.heads_kv;
#pragma omp parallel
  {
    std::vector<Acc> s(static_cast<std::size_t>(p.seq_kv)), dq(static_cast<std::size_t>(d));
    std::vector<Acc> cap_grad(static_cast<std::size_t>(p.seq_kv));
    std::vector<Acc> dk(static_cast<std::size_t>(p.seq_kv * d)), dv(static_cast<std::size_t>(p.seq_kv * d));
    std::vector<unsigned char> ok(static_cast<std::size_t>(p.seq_kv));
#pragma omp for schedule(dynamic, 1)
    for (index_t bg = 0; bg < kv_heads; ++bg) {
      const index_t b = bg / p.heads_kv, gk = bg % p.heads_kv;
      std::fill(dk.begin(), dk.end(), Acc(0));
      std::fill(dv.begin(), dv.end(), Acc(0));
      for (index_t h = gk * p.group_size(); h < (gk + 1) * p.group_size(); ++h) {
        const auto head_mask = for_head(mask, b, h);
        const bound_mods mods = oracle_mods(head_mask, 0);
        const Acc sink = mods.sink<Acc>(h);
        for (index_t i = 0; i < p.seq_q; ++i) {
          const T* qi = q.row(b, h, i);
          const T* doi = d_o.row(b, h, i);
          Acc m = sink;
          bool any = false;
          for (index_t j = 0; j < p.seq_kv; ++j) {
            ok[static_cast<std::size_t>(j)] = head_mask.allowed(i, j);
            if (!ok[static_cast<std::size_t>(j)]) continue;
            any = true;
            Acc dot = 0;
            for (index_t c = 0; c < d; ++c) dot += static_cast<Acc>(qi[c]) * static_cast<Acc>(k.row(b, gk, j)[c]);
            const Acc capped = mods.cap(scale * dot);
            cap_grad[static_cast<std::size_t>(j)] = mods.cap_grad(capped);
            s[static_cast<std::size_t>(j)] = capped + mods.bias<Acc>(h, i, j);
            if (s[static_cast<std::size_t>(j)] > m) m = s[static_cast<std::size_t>(j)];
          }
          Acc row_lse = 0, delta = 0;
          if (o) {
            const float stored = lse[(b * p.heads + h) * p.seq_q + i];
            if (stored == -std::numeric_limits<float>::infinity()) any = false;
            row_lse = static_cast<Acc>(stored);
            for (index_t c = 0; c < d; ++c) delta += static_cast<Acc>(doi[c]) * static_cast<Acc>(o->row(b, h, i)[c]);
          } else if (any) {
            Acc l = std::exp(sink - m);
            for (index_t j = 0; j < p.seq_kv; ++j)
              if (ok[static_cast<std::size_t>(j)]) l += std::exp(s[static_cast<std::size_t>(j)] - m);
            row_lse = m + std::log(l);
            std::fill(dq.begin(), dq.end(), Acc(0));  // O_i, in dq for a moment
            for (index_t j = 0; j < p.seq_kv; ++j)
              if (ok[static_cast<std::size_t>(j)]) {
                const Acc pij = std::exp(s[static_cast<std::size_t>(j)] - row_lse);
                for (index_t c = 0; c < d; ++c) dq[static_cast<std::size_t>(c)] += pij * static_cast<Acc>(v.row(b, gk, j)[c]);
              }
            for (index_t c = 0; c < d; ++c) delta += static_cast<Acc>(doi[c]) * dq[static_cast<std::size_t>(c)];
          }
          std::fill(dq.begin(), dq.end(), Acc(0));
          if (any) {
            for (index_t j = 0; j < p.seq_kv; ++j) {
              if (!ok[static_cast<std::size_t>(j)]) continue;
              const T* kj = k.row(b, gk, j);
              const T* vj = v.row(b, gk, j);
              const Acc pij = std::exp(s[static_cast<std::size_t>(j)] - row_lse);
              Acc dpij = 0;
              for (index_t c = 0; c < d; ++c) dpij += static_cast<Acc>(doi[c]) * static_cast<Acc>(vj[c]);
              const Acc dsij = pij * (dpij - delta) * cap_grad[static_cast<std::size_t>(j)];
              for (index_t c = 0; c < d; ++c) {
                dq[static_cast<std::size_t>(c)] += dsij * static_cast<Acc>(kj[c]);
                dk[static_cast<std::size_t>(j * d + c)] += dsij * static_cast<Acc>(qi[c]);
                dv[static_cast<std::size_t>(j * d + c)] += pij * static_cast<Acc>(doi[c]);
              }
            }
          }
          if (any && mods.sink_logits)
            dsink_bh[static_cast<std::size_t>(b * p.heads + h)] -=
                static_cast<double>(std::exp(sink - row_lse) * delta);
          const std::size_t row = static_cast<std::size_t>(((b * p.heads + h) * p.seq_q + i) * d);
          for (index_t c = 0; c < d; ++c)
            g.dq[row + static_cast<std::size_t>(c)] = static_cast<double>(scale * dq[static_cast<std::size_t>(c)]);
        }
      }
      const std::size_t base = static_cast<std::size_t>(bg * p.seq_kv * d);
      for (index_t x = 0; x < p.seq_kv * d; ++x) {
        g.dk[base + static_cast<std::size_t>(x)] = static_cast<double>(scale * dk[static_cast<std::size_t>(x)]);
        g.dv[base + static_cast<std::size_t>(x)] = static_cast<double>(dv[static_cast<std::size_t>(x)]);
      }
    }
  }
  for (index_t b = 0; b < p.batch; ++b)
    for (index_t h = 0; h < p.heads; ++h)
      g.dsink[static_cast<std::size_t>(h)] += dsink_bh[static_cast<std::size_t>(b * p.heads + h)];
  return g;
}

}  // namespace detail

/// The float64 oracle: the exact gradients of L = Σ O∘dO (O recomputed in double from q, k, v and the mask).
template <class T, class Mask>
reference_grads reference_backward(const problem& p, const tensor_ref<const T>& q, const tensor_ref<const T>& k,
                                   const tensor_ref<const T>& v, const tensor_ref<const T>& d_o, const Mask& mask) {
  return detail::closed_form<double>(p, q, k, v, static_cast<const tensor_ref<const T>*>(nullptr), d_o, nullptr, mask);
}

/// The plain same-precision implementation: the closed form in accum_t<T> from the stored O and lse (what a kernel
/// receives), each gradient rounded to T as a kernel's output is.
template <class T, class Mask>
reference_grads plain_backward(const problem& p, const tensor_ref<const T>& q, const tensor_ref<const T>& k,
                               const tensor_ref<const T>& v, const tensor_ref<const T>& o,
                               const tensor_ref<const T>& d_o, const float* lse, const Mask& mask) {
  reference_grads g = detail::closed_form<accum_t<T>>(p, q, k, v, &o, d_o, lse, mask);
  for (auto* x : {&g.dq, &g.dk, &g.dv})
    for (double& e : *x) e = static_cast<double>(static_cast<T>(e));
  return g;
}

}  // namespace fusedattn::testing
