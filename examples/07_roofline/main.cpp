// Example 07: where do the kernels sit on this machine's roofline? The numbers an assignment report asks for.
//   1. the ceilings: f32 FMA peak of one thread (a register-resident FMA loop) and memory bandwidth (a triad over
//      arrays far larger than the last-level cache);
//   2. per kernel and sequence length: FLOPs = 4·b·h·s²·d, the bytes it moves as modelled, not measured (naive:
//      Q, K, V, O plus six trips of the S×S scores; flash: Q and O once, K and V once per q-block), arithmetic
//      intensity AI = FLOPs / bytes, the attainable rate min(peak, AI × bandwidth), the measured rate and the
//      fraction reached;
//   3. how AI moves with S: naive's stays near d/6 FLOP/B whatever S (its traffic grows as S², like its FLOPs);
//      flash's rises with S towards 2·block_q / sizeof(T) (K and V re-read once per q-block).
// The byte models are fusedattn::cost (include/fusedattn/core/cost_model.hpp; derivations in docs/roofline.md).
// Self-check: flash and naive agree to 1e-5 on every shape; exits non-zero otherwise.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include <fusedattn/fusedattn.hpp>
#include <xsimd/xsimd.hpp>

namespace fa = fusedattn;
using clock_type = std::chrono::steady_clock;

namespace {

/// f32 FMA peak of one thread: 16 independent vector accumulators hide the FMA latency; nothing touches memory.
double fma_peak_flops() {
  using batch = xsimd::batch<float>;
  constexpr int chains = 16;
  constexpr long iters = 20'000'000;
  batch acc[chains];
  for (int c = 0; c < chains; ++c) acc[c] = batch(1.0f + 0.001f * float(c));
  const batch a(0.999999f), b(1e-7f);
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    const auto t0 = clock_type::now();
    for (long i = 0; i < iters; ++i)
      for (int c = 0; c < chains; ++c) acc[c] = xsimd::fma(acc[c], a, b);
    const double s = std::chrono::duration<double>(clock_type::now() - t0).count();
    best = std::max(best, 2.0 * batch::size * chains * double(iters) / s);
  }
  float sink = 0;
  for (int c = 0; c < chains; ++c) sink += xsimd::hadd(acc[c]);
  if (sink == 42.0f) std::printf(" ");  // keeps the loop alive
  return best;
}

/// Triad a[i] = b[i] + s·c[i] over 3 × 64 MiB: 12 bytes per element moved (read b, c; write a).
double triad_bandwidth() {
  const std::size_t n = std::size_t(16) << 20;
  std::vector<float> a(n, 0.f), b(n, 1.f), c(n, 2.f);
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    const auto t0 = clock_type::now();
    for (std::size_t i = 0; i < n; ++i) a[i] = b[i] + 0.5f * c[i];
    const double s = std::chrono::duration<double>(clock_type::now() - t0).count();
    best = std::max(best, 12.0 * double(n) / s);
  }
  if (a[n / 2] != 2.0f) std::printf("triad check failed\n");
  return best;
}

template <class F>
double median_seconds(F&& f, int reps) {
  f();
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = clock_type::now();
    f();
    t.push_back(std::chrono::duration<double>(clock_type::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace

int main() {
  const double peak = fma_peak_flops(), bw = triad_bandwidth();
  std::printf("ceilings (1 thread): f32 FMA peak %.1f GFLOP/s, triad bandwidth %.1f GB/s, ridge point %.1f FLOP/B\n\n",
              peak * 1e-9, bw * 1e-9, peak / bw);
  std::printf("bytes are modelled (fusedattn::cost, no cache), not measured: a profiler measures the traffic\n");
  std::printf("%-6s %5s | %9s %10s %8s | %11s %11s %7s  %s\n", "kernel", "S", "GFLOP", "MB model", "AI", "attainable",
              "achieved", "of roof", "bound");

  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  bool ok = true;
  for (fa::index_t s : {128, 1024}) {
    const fa::problem p{1, 8, 8, s, s, 64};
    const std::size_t n = static_cast<std::size_t>(p.heads * s * p.head_dim);
    std::vector<float> q(n), k(n), v(n), o_naive(n), o_flash(n);
    for (auto* buf : {&q, &k, &v})
      for (float& x : *buf) x = u(rng);
    const auto qv = fa::bhsd<const float>(q.data(), p.q_dims()), kv = fa::bhsd<const float>(k.data(), p.kv_dims()),
               vv = fa::bhsd<const float>(v.data(), p.kv_dims());

    const double flop = fa::cost::flops(p);
    const fa::band_mask dense = fa::bind(fa::dense{}, p);
    struct row {
      const char* name;
      double bytes, seconds;
    };
    fa::status st;
    std::printf("plans: %s | %s\n",
                fa::to_string(fa::plan(fa::policy::cpu_naive{1}, p, qv, kv, vv, fa::bhsd(o_naive.data(), p.o_dims()))).c_str(),
                fa::to_string(fa::plan(fa::policy::cpu<>{1}, p, qv, kv, vv, fa::bhsd(o_flash.data(), p.o_dims()))).c_str());
    const row rows[] = {
        {"naive", fa::cost::naive_bytes(p, sizeof(float), sizeof(float)),
         median_seconds([&] { st = fa::attend(fa::policy::cpu_naive{1}, p, qv, kv, vv, fa::bhsd(o_naive.data(), p.o_dims())); }, 5)},
        {"flash", fa::cost::flash_bytes(p, dense, sizeof(float), /*block_q*/ 64),
         median_seconds([&] { st = fa::attend(fa::policy::cpu<>{1}, p, qv, kv, vv, fa::bhsd(o_flash.data(), p.o_dims())); }, 5)},
    };
    if (!st) return std::fprintf(stderr, "fusedattn: %s\n", st.what()), 1;
    for (const row& r : rows) {
      const double ai = fa::cost::intensity(flop, r.bytes);
      const double roof = fa::cost::attainable(ai, peak, bw);
      const double achieved = flop / r.seconds;
      std::printf("%-6s %5lld | %9.3f %10.2f %8.1f | %8.1f GF %8.1f GF %6.0f%%  %s\n", r.name, (long long)s,
                  flop * 1e-9, r.bytes * 1e-6, ai, roof * 1e-9, achieved * 1e-9, 100.0 * achieved / roof,
                  ai * bw < peak ? "memory" : "compute");
    }
    double diff = 0;
    for (std::size_t i = 0; i < n; ++i) diff = std::max(diff, double(std::abs(o_naive[i] - o_flash[i])));
    ok &= diff < 1e-5;
  }
  std::printf("\nnaive's AI stays near d/6 whatever S (its bytes grow as S^2, like its FLOPs); flash's rises towards\n"
              "2*block_q/sizeof(T) as S grows. Rows left of the ridge point are memory-bound on this machine.\n");
  std::printf("%s\n", ok ? "OK" : "MISMATCH");
  return ok ? 0 : 1;
}
