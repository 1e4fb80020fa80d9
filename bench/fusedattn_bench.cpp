// fusedattn-bench: times the kernels on the leaderboard shapes. Google Benchmark flags work as usual.
#include <random>
#include <string>
#include <vector>

#include <benchmark/benchmark.h>

#include <fusedattn/fusedattn.hpp>

namespace fa = fusedattn;

namespace {

struct shape {
  fa::index_t b, h, s, d;
};

/// The leaderboard configurations (B, H, S, D) of the seed documents.
const shape leaderboard[] = {{1, 1, 128, 64},  {1, 1, 512, 64},  {1, 1, 1024, 64}, {1, 1, 2048, 64},
                             {1, 8, 512, 64},  {1, 12, 512, 64}, {1, 32, 512, 64}};

template <class T>
void naive_row(benchmark::State& state, shape sh) {
  const fa::problem p{sh.b, sh.h, sh.h, sh.s, sh.s, sh.d};
  std::mt19937 rng(42);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  std::vector<T> q(static_cast<std::size_t>(sh.b * sh.h * sh.s * sh.d)), k(q.size()), v(q.size()), o(q.size());
  for (auto* buf : {&q, &k, &v})
    for (auto& x : *buf) x = static_cast<T>(u(rng));
  for (auto _ : state) {
    const fa::status st = fa::attend(fa::policy::cpu_naive{1}, p, fa::bhsd<const T>(q.data(), p.q_dims()),
                                     fa::bhsd<const T>(k.data(), p.kv_dims()),
                                     fa::bhsd<const T>(v.data(), p.kv_dims()), fa::bhsd(o.data(), p.o_dims()));
    if (!st) state.SkipWithError(st.what());
    benchmark::DoNotOptimize(o.data());
  }
  const double flop = 4.0 * sh.b * sh.h * double(sh.s) * sh.s * sh.d;
  state.counters["flop"] = flop;
  state.counters["FLOP/s"] = benchmark::Counter(flop, benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel(std::string(fa::scalar_name<T>()) + " dense");
}

}  // namespace

int main(int argc, char** argv) {
  for (const shape& sh : leaderboard) {
    const std::string n = "/b" + std::to_string(sh.b) + "_h" + std::to_string(sh.h) + "_s" + std::to_string(sh.s) +
                          "_d" + std::to_string(sh.d) + "/threads:1";
    benchmark::RegisterBenchmark(("naive/f32" + n).c_str(), naive_row<float>, sh)->Unit(benchmark::kMicrosecond);
  }
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
