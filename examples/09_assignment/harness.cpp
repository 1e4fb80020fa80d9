// Example 09: the assignment harness. It checks my_attention() (my_attention.cpp) against fusedattn and
// benchmarks it against the library's naive and flash kernels.
//   check:  three configurations, max |error| < 1e-3 against fusedattn's naive kernel (itself tested against float64);
//   bench:  (batch, heads, seq, dim) = (1, 8, S, 64) for S = 128, 512, 1024: time, GFLOP/s and the slowdown vs flash.
// Exit code: 0 when every check passes, 1 otherwise.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <random>
#include <vector>

#include <fusedattn/fusedattn.hpp>

#include "my_attention.hpp"

namespace fa = fusedattn;

namespace {

struct config {
  int batch, heads, seq, dim;
};

std::vector<float> random_tensor(std::size_t n, std::mt19937& rng) {
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  std::vector<float> t(n);
  for (float& x : t) x = u(rng);
  return t;
}

/// Runs a fusedattn policy on contiguous [b][h][s][d] buffers.
template <class Policy>
fa::status library_attention(const Policy& pol, const config& c, const std::vector<float>& q,
                             const std::vector<float>& k, const std::vector<float>& v, std::vector<float>& o) {
  const fa::problem p{c.batch, c.heads, c.heads, c.seq, c.seq, c.dim};
  return fa::attend(pol, p, fa::bhsd(q.data(), p.q_dims()), fa::bhsd(k.data(), p.kv_dims()),
                    fa::bhsd(v.data(), p.kv_dims()), fa::bhsd(o.data(), p.o_dims()));
}

/// Median wall time of `f` in seconds over `reps` runs after one warm-up.
double median_seconds(const std::function<void()>& f, int reps) {
  f();
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace

int main() {
  std::mt19937 rng(2026);
  bool all_ok = true;

  std::printf("== correctness: my_attention vs fusedattn (max |error| must be < 1e-3)\n");
  const config checks[] = {{1, 1, 64, 32}, {2, 4, 127, 64}, {1, 8, 300, 80}};
  for (const config& c : checks) {
    const std::size_t n = std::size_t(c.batch) * c.heads * c.seq * c.dim;
    const auto q = random_tensor(n, rng), k = random_tensor(n, rng), v = random_tensor(n, rng);
    std::vector<float> mine(n, std::numeric_limits<float>::quiet_NaN()), ref(n);
    my_attention(q.data(), k.data(), v.data(), mine.data(), c.batch, c.heads, c.seq, c.dim);
    if (const fa::status st = library_attention(fa::policy::cpu_naive{1}, c, q, k, v, ref); !st) {
      std::fprintf(stderr, "fusedattn: %s\n", st.what());
      return 1;
    }
    double err = 0;
    for (std::size_t i = 0; i < n; ++i)
      err = std::max(err, std::isfinite(mine[i]) ? std::abs(double(mine[i]) - ref[i]) : INFINITY);
    const bool ok = err < 1e-3;
    all_ok &= ok;
    std::printf("  (b,h,s,d) = (%d,%d,%d,%d): max error %.3g  %s\n", c.batch, c.heads, c.seq, c.dim, err,
                ok ? "PASS" : "FAIL");
  }
  if (!all_ok) {
    std::printf("FAILED: my_attention() does not match yet (see my_attention.cpp)\n");
    return 1;
  }

  std::printf("== speed, 1 thread, (1, 8, S, 64) f32: median of 5 runs\n");
  std::printf("  %6s %14s %14s %14s %10s\n", "S", "mine GFLOP/s", "naive GFLOP/s", "flash GFLOP/s", "vs flash");
  for (int seq : {128, 512, 1024}) {
    const config c{1, 8, seq, 64};
    const std::size_t n = std::size_t(c.batch) * c.heads * c.seq * c.dim;
    const auto q = random_tensor(n, rng), k = random_tensor(n, rng), v = random_tensor(n, rng);
    std::vector<float> o(n);
    const double flop = 4.0 * c.batch * c.heads * double(seq) * seq * c.dim;
    const double t_mine =
        median_seconds([&] { my_attention(q.data(), k.data(), v.data(), o.data(), 1, 8, seq, 64); }, 5);
    const double t_naive =
        median_seconds([&] { (void)library_attention(fa::policy::cpu_naive{1}, c, q, k, v, o); }, 5);
    const double t_flash = median_seconds([&] { (void)library_attention(fa::policy::cpu<>{1}, c, q, k, v, o); }, 5);
    std::printf("  %6d %14.2f %14.2f %14.2f %9.2fx\n", seq, flop / t_mine * 1e-9, flop / t_naive * 1e-9,
                flop / t_flash * 1e-9, t_mine / t_flash);
  }
  std::printf("PASSED\n");
  return 0;
}
