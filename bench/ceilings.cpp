// The roofs of the roofline: an FMA loop whose accumulators stay in registers, and a triad over large arrays.
#include "ceilings.hpp"

#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include <xsimd/xsimd.hpp>

#include <fusedattn/cpu/x86_kernels.hpp>

namespace fusedattn::bench {
namespace {

using clock_type = std::chrono::steady_clock;
using batch = xsimd::batch<float>;

/// Independent FMA chains per thread. One chain issues an FMA only when the previous one retires, so keeping
/// both FMA pipes busy needs latency (4 cycles on Zen 4/5 and recent Intel) × pipes (2) = 8 chains; 16 leaves
/// headroom and still fits AVX-512's 32 registers with the two operands. AVX2 and SSE have 16 registers: 12 chains.
constexpr int accumulators = batch::size >= 16 ? 16 : 12;
constexpr int lanes = static_cast<int>(batch::size);
/// FMA steps per chain in one timed call; the caller scales the call count to the target duration.
constexpr std::int64_t steps_per_call = 1 << 20;
/// Wall time one repetition of the FMA loop aims at.
constexpr double fma_target_seconds = 0.05;

/// Runs `calls` × steps_per_call FMA steps on every chain: acc = acc · x + y, a contraction towards
/// y / (1 − x) that never overflows nor goes denormal. Returns a value that depends on every chain.
float fma_chains(std::int64_t calls) {
  const batch x(0.999999f), y(1e-3f);
  batch acc[accumulators];
  for (int a = 0; a < accumulators; ++a) acc[a] = batch(static_cast<float>(a + 1));
  for (std::int64_t c = 0; c < calls; ++c)
    for (std::int64_t s = 0; s < steps_per_call; ++s) {
#pragma GCC unroll 16
      for (int a = 0; a < accumulators; ++a) acc[a] = xsimd::fma(acc[a], x, y);
    }
  batch sum(0.0f);
  for (int a = 0; a < accumulators; ++a) sum += acc[a];
  return xsimd::hadd(sum);
}

/// Runs `body(t)` on `threads` threads released together; returns the wall seconds until the last one ends.
template <class Body>
double timed_parallel(int threads, Body body) {
  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      ready.fetch_add(1);
      while (!go.load(std::memory_order_acquire)) std::this_thread::yield();
      body(t);
    });
  while (ready.load() < threads) std::this_thread::yield();
  const auto t0 = clock_type::now();
  go.store(true, std::memory_order_release);
  for (auto& th : pool) th.join();
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

volatile float sink;  // keeps the FMA chains' results observable

/// CPU time of the calling thread, in seconds.
double thread_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

}  // namespace

fma_loop_info fma_info() { return {xsimd::default_arch::name(), lanes, accumulators}; }

double measure_peak_flops(int threads, int repeats) {
  const double flop_per_call = 2.0 * lanes * accumulators * static_cast<double>(steps_per_call);
  // Calibrate the call count on one thread so that a repetition lasts about fma_target_seconds.
  const double t0 = thread_cpu_seconds();
  sink = fma_chains(1);
  const double one = std::max(1e-6, thread_cpu_seconds() - t0);
  const std::int64_t calls = std::max<std::int64_t>(1, static_cast<std::int64_t>(fma_target_seconds / one));
  const double flop_per_thread = flop_per_call * static_cast<double>(calls);
  double best = 0;
  for (int r = 0; r < repeats; ++r) {
    // Each thread times its own work on its CPU-time clock, so time spent descheduled (other jobs on the
    // machine) does not count; the peak of `threads` threads is the sum of their rates.
    std::vector<double> rate(static_cast<std::size_t>(threads), 0.0);
    timed_parallel(threads, [&](int t) {
      const double c0 = thread_cpu_seconds();
      sink = fma_chains(calls);
      rate[static_cast<std::size_t>(t)] = flop_per_thread / std::max(1e-9, thread_cpu_seconds() - c0);
    });
    double total = 0;
    for (double x : rate) total += x;
    best = std::max(best, total);
  }
  return best;
}

double measure_bf16_peak_flops(int threads, int repeats) {
#if FUSEDATTN_X86_KERNELS
  if (!cpu::avx512bf16::available()) return 0;
  constexpr std::int64_t iters_per_call = std::int64_t(1) << 20;
  constexpr double flop_per_iter = 24.0 * 64.0;  // 24 chains × (16 lanes × 2 products × multiply-add)
  const double t0 = thread_cpu_seconds();
  sink = cpu::x86::dpbf16_chains(iters_per_call, 0.5f);
  const double one = std::max(1e-6, thread_cpu_seconds() - t0);
  const std::int64_t iters =
      iters_per_call * std::max<std::int64_t>(1, static_cast<std::int64_t>(fma_target_seconds / one));
  const double flop_per_thread = flop_per_iter * static_cast<double>(iters);
  double best = 0;
  for (int r = 0; r < repeats; ++r) {
    std::vector<double> rate(static_cast<std::size_t>(threads), 0.0);
    timed_parallel(threads, [&](int t) {
      const double c0 = thread_cpu_seconds();
      sink = cpu::x86::dpbf16_chains(iters, 0.5f);
      rate[static_cast<std::size_t>(t)] = flop_per_thread / std::max(1e-9, thread_cpu_seconds() - c0);
    });
    double total = 0;
    for (double x : rate) total += x;
    best = std::max(best, total);
  }
  return best;
#else
  (void)threads, (void)repeats;
  return 0;
#endif
}

double measure_bandwidth(int threads, std::size_t array_bytes, int repeats) {
  const std::size_t n = array_bytes / sizeof(float);
  std::unique_ptr<float[]> a(new float[n]), b(new float[n]), c(new float[n]);
  const float s = 3.0f;
  auto part = [&](int t, std::size_t& i0, std::size_t& i1) {
    i0 = n * static_cast<std::size_t>(t) / static_cast<std::size_t>(threads);
    i1 = n * static_cast<std::size_t>(t + 1) / static_cast<std::size_t>(threads);
  };
  // First touch by the thread that later streams the range (page placement), with values that are not zero.
  timed_parallel(threads, [&](int t) {
    std::size_t i0, i1;
    part(t, i0, i1);
    for (std::size_t i = i0; i < i1; ++i) {
      a[i] = 0.5f;
      b[i] = 1.0f + static_cast<float>(i & 7);
      c[i] = 2.0f;
    }
  });
  double best = 0;
  for (int r = 0; r < repeats; ++r) {
    const double seconds = timed_parallel(threads, [&](int t) {
      std::size_t i0, i1;
      part(t, i0, i1);
      float* __restrict pa = a.get();
      const float* __restrict pb = b.get();
      const float* __restrict pc = c.get();
      for (std::size_t i = i0; i < i1; ++i) pa[i] = pb[i] + s * pc[i];
    });
    best = std::max(best, 3.0 * static_cast<double>(n * sizeof(float)) / seconds);
  }
  sink = a[n / 2];
  return best;
}

std::size_t reported_llc_bytes() {
#if defined(_SC_LEVEL3_CACHE_SIZE)
  const long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
  if (l3 > 0) return static_cast<std::size_t>(l3);
#endif
#if defined(_SC_LEVEL2_CACHE_SIZE)
  const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
  if (l2 > 0) return static_cast<std::size_t>(l2);
#endif
  return 0;
}

}  // namespace fusedattn::bench
