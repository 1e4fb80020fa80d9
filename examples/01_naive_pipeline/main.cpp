// Example 01: the naive three-pass attention pipeline, one step at a time.
//
//   scores  S = Q·Kᵀ                (seq × seq, materialised: this is what flash attention avoids)
//   scale   S = S / √d
//   softmax P = exp(S − rowmax) / rowsum
//   output  O = P·V
//
// The steps are written out with Eigen for one head, then compared with fusedattn's naive kernel
// (policy::cpu_naive) over all heads, and with a float64 loop. Exits non-zero on a mismatch.
// Build: cmake -S . -B build -DCMAKE_BUILD_TYPE=Release && cmake --build build && ./build/example_01_naive_pipeline
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include <Eigen/Core>
#include <fusedattn/fusedattn.hpp>

namespace fa = fusedattn;
using matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

int main() {
  // One batch, 8 heads, 512 tokens, head_dim 64, f32, laid out [batch][head][seq][dim].
  const fa::problem p{1, 8, 8, 512, 512, 64};
  const fa::index_t s = p.seq_q, d = p.head_dim;
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  const std::size_t n = static_cast<std::size_t>(p.batch * p.heads * s * d);
  std::vector<float> q(n), k(n), v(n), o(n);
  for (auto* buf : {&q, &k, &v})
    for (float& x : *buf) x = u(rng);

  // --- The four steps by hand, for head 3. Eigen::Map views the head's rows without copying.
  const fa::index_t head = 3;
  const std::size_t head_offset = static_cast<std::size_t>(head * s * d);
  Eigen::Map<const matrix> qh(&q[head_offset], s, d), kh(&k[head_offset], s, d), vh(&v[head_offset], s, d);
  matrix scores = qh * kh.transpose();                        // step 1: S = Q·Kᵀ  (s × s)
  scores *= static_cast<float>(p.softmax_scale());            // step 2: S = S / √d
  for (fa::index_t i = 0; i < s; ++i) {                       // step 3: softmax per row
    const float row_max = scores.row(i).maxCoeff();           //   subtract the max: exp never overflows
    scores.row(i) = (scores.row(i).array() - row_max).exp().matrix();
    scores.row(i) /= scores.row(i).sum();
  }
  const matrix by_hand = scores * vh;                         // step 4: O = P·V  (s × d)

  // --- The library's naive kernel over all 8 heads (fa::plan: the kernel and scratch, without running it).
  std::printf("plan: %s\n", fa::to_string(fa::plan(fa::policy::cpu_naive{1}, p, fa::bhsd<const float>(q.data(), p.q_dims()),
                                                    fa::bhsd<const float>(k.data(), p.kv_dims()),
                                                    fa::bhsd<const float>(v.data(), p.kv_dims()),
                                                    fa::bhsd(o.data(), p.o_dims())))
                                     .c_str());
  const auto t0 = std::chrono::steady_clock::now();
  const fa::status st = fa::attend(fa::policy::cpu_naive{1}, p, fa::bhsd<const float>(q.data(), p.q_dims()),
                                   fa::bhsd<const float>(k.data(), p.kv_dims()),
                                   fa::bhsd<const float>(v.data(), p.kv_dims()), fa::bhsd(o.data(), p.o_dims()));
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!st) {
    std::fprintf(stderr, "fusedattn: %s\n", st.what());
    return 1;
  }

  // --- A float64 loop for row 100 of head 3: the independent check.
  const fa::index_t i = 100;
  std::vector<double> w(static_cast<std::size_t>(s));
  double m = -INFINITY, l = 0;
  for (fa::index_t j = 0; j < s; ++j) {
    double dot = 0;
    for (fa::index_t c = 0; c < d; ++c) dot += double(qh(i, c)) * double(kh(j, c));
    w[static_cast<std::size_t>(j)] = dot * p.softmax_scale();
    m = std::max(m, w[static_cast<std::size_t>(j)]);
  }
  for (double& x : w) l += (x = std::exp(x - m));
  double err_lib = 0, err_hand = 0;
  for (fa::index_t c = 0; c < d; ++c) {
    double ref = 0;
    for (fa::index_t j = 0; j < s; ++j) ref += w[static_cast<std::size_t>(j)] / l * double(vh(j, c));
    err_lib = std::max(err_lib, std::abs(ref - o[head_offset + static_cast<std::size_t>(i * d + c)]));
    err_hand = std::max(err_hand, std::abs(ref - double(by_hand(i, c))));
  }

  const double flop = 4.0 * p.batch * p.heads * double(s) * s * d;
  const double score_bytes = double(s) * s * sizeof(float);
  std::printf("naive attention (1,8,512,64) f32, 1 thread: %.3f ms, %.2f GFLOP/s\n", secs * 1e3,
              flop / secs * 1e-9);
  std::printf("the S x S score matrix: %.0f KB per head, %.1f MB for all %lld heads\n", score_bytes / 1024,
              score_bytes * double(p.heads) / (1024 * 1024), static_cast<long long>(p.heads));
  std::printf("max |error| vs float64 on one row: library %.3g, by hand %.3g\n", err_lib, err_hand);
  const bool ok = err_lib < 1e-5 && err_hand < 1e-5;
  std::printf("%s\n", ok ? "OK" : "MISMATCH");
  return ok ? 0 : 1;
}
