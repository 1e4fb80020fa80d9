// Example 01: the naive three-pass attention pipeline, checked against a float64 loop.
// Build: cmake -S . -B build && cmake --build build && ./build/example_01_naive_pipeline
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include <fusedattn/fusedattn.hpp>

namespace fa = fusedattn;

int main() {
  // One batch, 8 heads, 512 tokens, head_dim 64, f32, laid out [batch][head][seq][dim].
  const fa::problem p{1, 8, 8, 512, 512, 64};
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  const std::size_t n = static_cast<std::size_t>(p.batch * p.heads * p.seq_q * p.head_dim);
  std::vector<float> q(n), k(n), v(n), o(n);
  for (auto* buf : {&q, &k, &v})
    for (float& x : *buf) x = u(rng);

  const auto t0 = std::chrono::steady_clock::now();
  const fa::status st = fa::attend(fa::policy::cpu_naive{1}, p, fa::bhsd<const float>(q.data(), p.q_dims()),
                                   fa::bhsd<const float>(k.data(), p.kv_dims()),
                                   fa::bhsd<const float>(v.data(), p.kv_dims()), fa::bhsd(o.data(), p.o_dims()));
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!st) {
    std::fprintf(stderr, "fusedattn: %s\n", st.what());
    return 1;
  }

  // Float64 reference for head 3, row 100: softmax(q·kᵀ/√d)·v, written out by hand.
  const fa::index_t h = 3, i = 100, d = p.head_dim, s = p.seq_kv;
  const float* qi = &q[static_cast<std::size_t>((h * p.seq_q + i) * d)];
  std::vector<double> w(static_cast<std::size_t>(s));
  double m = -INFINITY, l = 0;
  for (fa::index_t j = 0; j < s; ++j) {
    double dot = 0;
    for (fa::index_t c = 0; c < d; ++c) dot += double(qi[c]) * k[static_cast<std::size_t>((h * s + j) * d + c)];
    w[static_cast<std::size_t>(j)] = dot * p.softmax_scale();
    m = std::max(m, w[static_cast<std::size_t>(j)]);
  }
  for (double& x : w) l += (x = std::exp(x - m));
  double err = 0;
  for (fa::index_t c = 0; c < d; ++c) {
    double ref = 0;
    for (fa::index_t j = 0; j < s; ++j) ref += w[static_cast<std::size_t>(j)] / l * v[static_cast<std::size_t>((h * s + j) * d + c)];
    err = std::max(err, std::abs(ref - o[static_cast<std::size_t>((h * p.seq_q + i) * d + c)]));
  }

  const double flop = 4.0 * p.batch * p.heads * double(p.seq_q) * p.seq_kv * p.head_dim;
  const double score_bytes = double(p.seq_q) * p.seq_kv * sizeof(float);
  std::printf("naive attention (1,8,512,64) f32: %.3f ms, %.2f GFLOP/s\n", secs * 1e3, flop / secs * 1e-9);
  std::printf("the S x S score matrix: %.0f KB per head, %.1f MB for all %lld heads\n", score_bytes / 1024,
              score_bytes * p.heads / (1024 * 1024), static_cast<long long>(p.heads));
  std::printf("max |error| vs float64 on one row: %.3g\n", err);
  return err < 1e-5 ? 0 : 1;
}
