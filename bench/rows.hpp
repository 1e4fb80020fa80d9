/// @file rows.hpp
/// What one bench row is (kernel, scalar type, mask, score modifier, shape, threads), the default row sets, the
/// timing loop every row body uses (time_calls), and the generic row body that times `attend` under any policy and
/// sets the counters every row carries. Bench-only code.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <variant>
#include <vector>

#include <benchmark/benchmark.h>

#include <fusedattn/fusedattn.hpp>

namespace fusedattn::bench {

/// Sizes of one row, in the problem's notation.
struct shape {
  index_t b = 1, h = 1, h_kv = 1, s_q = 1, s_kv = 1, d = 1;
  problem to_problem() const { return {b, h, h_kv, s_q, s_kv, d}; }
};

/// Square multi-head shape (B, H, S, D) as the leaderboard writes it.
inline shape square(index_t b, index_t h, index_t s, index_t d) { return {b, h, h, s, s, d}; }

/// "b1_h8_s512_d64", spelling out h_kv, s_q and s_kv only when they differ.
std::string shape_name(const shape& sh);

/// Storage types the bench rows use (bf16: the flash rows of register_bf16_flash_rows only).
enum class scalar { f32, f16, bf16 };
/// Masks the bench rows use.
enum class mask_kind { dense, causal };
/// Score modifiers a bench row may add to its mask (the modifier rows of rows_modifiers.cpp).
enum class score_mod { none, softcap, alibi, sinks };

const char* scalar_label(scalar s);
const char* mask_label(mask_kind m);
/// "softcap", "alibi", "sinks" ("" for none).
const char* score_mod_label(score_mod m);
/// The band masks a bench row may use (block-sparse rows live in fusedattn-sparsity).
using band_choice = std::variant<dense, causal, window>;
/// The user-facing mask of a kind.
band_choice to_mask(mask_kind m);

/// One row before registration: the kernel's name is added by the registering function.
struct row_spec {
  shape sh;
  scalar type = scalar::f32;
  mask_kind mask = mask_kind::dense;
  int threads = 1;
  score_mod mod = score_mod::none;
};

/// "kernel/f32/dense/b1_h8_s512_d64/threads:1"; a row with a modifier has "dense+softcap" for its mask.
std::string row_name(const std::string& kernel, const row_spec& r);
/// The row label, "f16 causal"; a row with a modifier has "f32 dense+softcap".
std::string row_label(const row_spec& r);

/// A row's score modifier bound to the problem's query heads: softcap cap 30, ALiBi slopes 2^(−8(h+1)/H), sink
/// logit 1 for every head.
class row_modifier {
 public:
  row_modifier(score_mod mod, index_t heads);
  /// f(m) for a row without a modifier, else f(m | the modifier).
  template <class Mask, class F>
  auto apply(const Mask& m, F&& f) const {
    switch (mod_) {
      case score_mod::softcap: return f(m | softcap{30.0f});
      case score_mod::alibi: return f(m | alibi{slopes_.data()});
      case score_mod::sinks: return f(m | sinks{logits_.data()});
      case score_mod::none: break;
    }
    return f(m);
  }

 private:
  score_mod mod_;
  std::vector<float> slopes_, logits_;
};

/// The leaderboard configurations (B, H, S, D) of the seed documents.
std::vector<shape> leaderboard_shapes();
/// The assignment's naive-vs-flash configurations: S = 128, 512, 1024 with 8 heads and D = 64.
std::vector<shape> assignment_shapes();

/// Which rows a run registers.
struct plan {
  bool full = false;  ///< false: the quick default set (README command 1); true: every combination
  int max_threads = 1;
};

/// The rows every kernel runs, shape-major so that the kernels of one problem run next to each other.
/// Quick: the leaderboard dense in f32 (1 and all threads) and f16 (all threads), the assignment shapes in f32,
/// dense and causal, 1 thread. Full: leaderboard and assignment × {f32, f16} × {dense, causal} × {1, all threads}.
std::vector<row_spec> kernel_rows(const plan& pl);

/// Sets the counters of a row: b h h_kv s_q s_kv d threads density flop bytes bytes_min, and the rates FLOP/s and
/// B/s (modelled bytes over real time).
void set_counters(benchmark::State& state, const problem& p, int threads, double density, double flop, double bytes,
                  double bytes_min);

/// Fills `n` values with uniform numbers in [-1, 1) from a fixed seed (a bench wants repeatable inputs).
void fill_uniform(float* x, std::size_t n, std::uint64_t seed);

/// Q, K, V and O of a problem in B·H·S·D layout, Q/K/V random, O zero.
template <class T>
struct operands {
  std::vector<T> q, k, v, o;
  explicit operands(const problem& p, std::uint64_t seed = 1) {
    const auto nq = static_cast<std::size_t>(cost::q_elements(p));
    const auto nkv = static_cast<std::size_t>(cost::kv_elements(p));
    std::vector<float> tmp(std::max(nq, nkv));
    auto fill = [&](std::vector<T>& dst, std::size_t n, std::uint64_t s) {
      fill_uniform(tmp.data(), n, s);
      dst.resize(n);
      for (std::size_t i = 0; i < n; ++i) dst[i] = static_cast<T>(tmp[i]);
    };
    fill(q, nq, seed);
    fill(k, nkv, seed + 1);
    fill(v, nkv, seed + 2);
    o.assign(nq, T(0.0f));
  }
};

/// How a policy's kernel is modelled: its row-name prefix, the fraction of score entries it computes, and its
/// modelled traffic. Specialised per policy next to the policy's row registration.
template <class Policy>
struct kernel_model;

/// The naive three-pass kernel computes every score entry and moves the S×S matrix naive_score_passes times.
template <>
struct kernel_model<policy::cpu_naive> {
  static constexpr const char* name = "naive";
  static policy::cpu_naive make(int threads) { return policy::cpu_naive{threads}; }
  static double density(const band_mask&, const problem&) { return 1.0; }
  template <class T>
  static double bytes(const problem& p, const band_mask&) {
    return cost::naive_bytes(p, sizeof(T), sizeof(accum_t<T>));
  }
};

/// The flash kernel computes the allowed score entries only (whole tiles on the mask's edges are ignored) and
/// re-reads its packed K/V copy (accumulation type) once per q-tile; the q-tile is the kernel's own heuristic.
template <class Arch>
struct kernel_model<policy::cpu<Arch>> {
  static constexpr const char* name = "flash";
  static policy::cpu<Arch> make(int threads) {
    policy::cpu<Arch> pol;
    pol.threads = threads;
    return pol;
  }
  static double density(const band_mask& m, const problem& p) { return cost::density(m, p); }
  template <class T>
  static double bytes(const problem& p, const band_mask& m) {
    const index_t q_tile = cpu::choose_tiles({}, p.head_dim, p.seq_q, p.seq_kv).q;
    return cost::flash_bytes(p, m, sizeof(T), q_tile, sizeof(accum_t<T>));
  }
};

/// Times `call` (returning a status) over the state's iterations after one untimed call: the untimed call touches
/// the kernel's scratch and the operands once, so that a row timed by a single long iteration does not time
/// first-touch page faults. `out`, the calls' output, is kept from being optimised away. A failing call skips the
/// row with the status's message: false when the untimed call failed (nothing timed, the row sets no counters);
/// a failure inside the loop ends it and gives true, as a success does.
template <class Call, class Out>
bool time_calls(benchmark::State& state, Call&& call, const Out* const out) {
  if (const status st = call(); !st) {
    state.SkipWithError(st.what());
    return false;
  }
  for (auto _ : state) {
    const status st = call();
    if (!st) {
      state.SkipWithError(st.what());
      break;
    }
    benchmark::DoNotOptimize(out);
    benchmark::ClobberMemory();
  }
  return true;
}

/// The row body: times `attend(Policy, ...)` on one problem and mask, with the row's score modifier if any, real
/// time, and sets the counters.
template <class Policy, class T>
void attention_row(benchmark::State& state, row_spec r) {
  using model = kernel_model<Policy>;
  const problem p = r.sh.to_problem();
  const band_choice mask = to_mask(r.mask);
  const band_mask bound = std::visit([&](const auto& m) { return bind(m, p); }, mask);
  const row_modifier mod(r.mod, p.heads);
  operands<T> x(p);
  const Policy pol = model::make(r.threads);
  const auto q = bhsd<const T>(x.q.data(), p.q_dims()), k = bhsd<const T>(x.k.data(), p.kv_dims()),
             v = bhsd<const T>(x.v.data(), p.kv_dims());
  const auto o = bhsd(x.o.data(), p.o_dims());
  // f(the row's mask with its modifier).
  const auto with_mask = [&](const auto& f) {
    return std::visit([&](const auto& m) { return mod.apply(m, f); }, mask);
  };
  // The kernel this group of rows runs (fa::plan), once per kernel and storage type, on stderr.
  const kernel_plan pl = with_mask([&](const auto& m) { return fusedattn::plan(pol, p, q, k, v, o, m); });
  static bool plan_printed = false;
  if (!plan_printed) {
    plan_printed = true;
    std::fprintf(stderr, "plan of the %s %s rows (first: %s): %s\n", model::name, scalar_name<T>(),
                 row_label(r).c_str(), fusedattn::to_string(pl).c_str());
  }
  // Rows on the bf16 dot-product kernels (vdpbf16ps or AMX tiles) are drawn against the bf16 peak.
  const bool bf16_dot =
      pl.kernel.find("<avx512bf16>") != std::string::npos || pl.kernel.find("<amx>") != std::string::npos;
  const auto call = [&] { return with_mask([&](const auto& m) { return attend(pol, p, q, k, v, o, m); }); };
  if (!time_calls(state, call, x.o.data())) return;
  const double density = model::density(bound, p);
  set_counters(state, p, r.threads, density, cost::flops(p, density), model::template bytes<T>(p, bound),
               cost::compulsory_bytes(p, sizeof(T)));
  state.counters["bf16_dot"] = bf16_dot ? 1 : 0;
  state.SetLabel(row_label(r));
}

/// Registers one row of a policy's kernel (an f32 row as float, an f16 row as Eigen::half), real time, microseconds.
/// Instantiated once per kernel in its own file (rows_naive.cpp, rows_flash.cpp) so the kernels compile in parallel.
template <class Policy>
void register_row(const row_spec& r) {
  const std::string name = row_name(kernel_model<Policy>::name, r);
  benchmark::internal::Benchmark* b =
      r.type == scalar::f32   ? benchmark::RegisterBenchmark(name.c_str(), attention_row<Policy, float>, r)
      : r.type == scalar::f16 ? benchmark::RegisterBenchmark(name.c_str(), attention_row<Policy, Eigen::half>, r)
                              : benchmark::RegisterBenchmark(name.c_str(), attention_row<Policy, Eigen::bfloat16>, r);
  b->UseRealTime()->Unit(benchmark::kMicrosecond);
}

/// The naive kernel's row (policy::cpu_naive), from rows_naive.cpp.
void register_naive_row(const row_spec& r);
/// The flash kernel's row (policy::cpu<> on the compiler's best xsimd arch), from rows_flash.cpp.
void register_flash_row(const row_spec& r);
/// The bf16 flash rows (flash/bf16/..., all-bf16 storage) beside the f32 rows of the same shapes, from
/// rows_flash.cpp: policy::cpu<cpu::avx512bf16> (vdpbf16ps) where the CPU has AVX512-BF16, else policy::cpu<>;
/// and flash_amx/bf16/... (policy::cpu_amx, AMX tiles) where the CPU has AMX.
/// Quick: the leaderboard shapes with S >= 512, dense, 1 and all threads; full: dense and causal.
void register_bf16_flash_rows(const plan& pl);
/// The backward pass's rows (flash_bwd/..., attend_backward on policy::cpu<>), from rows_backward.cpp: S 1024–4096,
/// head_dim 64 and 128, dense and causal, 1 and all threads; f32 (quick), f32 and f16 (full).
void register_backward_rows(const plan& pl);

}  // namespace fusedattn::bench
