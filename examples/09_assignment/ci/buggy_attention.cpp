// Wrong my_attention() kernels that CI plugs into the harness, which must then FAIL: each is a bug students
// really write. One tiled online-softmax kernel; ASSIGNMENT_BUG (a compile definition) picks the bug:
//   0 none (this kernel is correct: the harness must PASS it, so the failures below come from the bugs alone)
//   1 keys_512       the key loop stops at 512 keys (a kernel tested only at S <= 512)
//   2 no_max         exp(s) without subtracting the running row max: overflows on large logits
//   3 causal_strict  the causal test j < i instead of j <= i: a query never sees its own key
//   4 tail_tile      only whole 64-key tiles are visited: the last partial tile is dropped
#include <algorithm>
#include <cmath>
#include <vector>

#include "../my_attention.hpp"

#ifndef ASSIGNMENT_BUG
#error "compile with -DASSIGNMENT_BUG=0..4"
#endif

namespace {
constexpr int kv_tile = 64;
}

void my_attention(const float* q, const float* k, const float* v, float* o, const attention_problem& p) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(p.dim));
  const long heads_total = long(p.batch) * p.heads;
  const long q_head = long(p.seq_q) * p.dim, kv_head = long(p.seq_kv) * p.dim;
#if ASSIGNMENT_BUG == 1
  const int seq_kv = std::min(p.seq_kv, 512);
#elif ASSIGNMENT_BUG == 4
  const int seq_kv = p.seq_kv / kv_tile * kv_tile;
#else
  const int seq_kv = p.seq_kv;
#endif
  for (long bh = 0; bh < heads_total; ++bh) {
    std::vector<float> s(kv_tile), acc(static_cast<std::size_t>(p.dim));
    for (int i = 0; i < p.seq_q; ++i) {
      const float* qi = q + bh * q_head + long(i) * p.dim;
      float m = -INFINITY, l = 0;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int j0 = 0; j0 < seq_kv; j0 += kv_tile) {
        const int j1 = std::min(j0 + kv_tile, seq_kv);
        // Scores of this tile; masked keys get -inf.
        float tile_max = -INFINITY;
        for (int j = j0; j < j1; ++j) {
#if ASSIGNMENT_BUG == 3
          const bool allowed = !p.causal || j < i;
#else
          const bool allowed = !p.causal || j <= i;
#endif
          float dot = 0;
          const float* kj = k + bh * kv_head + long(j) * p.dim;
          for (int c = 0; c < p.dim; ++c) dot += qi[c] * kj[c];
          s[j - j0] = allowed ? dot * scale : -INFINITY;
          tile_max = std::max(tile_max, s[j - j0]);
        }
        if (tile_max == -INFINITY) continue;  // the whole tile is masked
        // Online softmax: new max, rescale what was summed so far, add this tile.
#if ASSIGNMENT_BUG == 2
        const float m_new = 0.0f;
#else
        const float m_new = std::max(m, tile_max);
#endif
        const float correction = std::exp(m - m_new);
        l *= correction;
        for (float& a : acc) a *= correction;
        for (int j = j0; j < j1; ++j) {
          const float e = std::exp(s[j - j0] - m_new);
          l += e;
          const float* vj = v + bh * kv_head + long(j) * p.dim;
          for (int c = 0; c < p.dim; ++c) acc[c] += e * vj[c];
        }
        m = m_new;
      }
      float* oi = o + bh * q_head + long(i) * p.dim;
      for (int c = 0; c < p.dim; ++c) oi[c] = acc[c] / l;
    }
  }
}
