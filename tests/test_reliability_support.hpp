/// @file test_reliability_support.hpp
/// Shared by tests/test_reliability.cpp and tests/fuzz/fuzz_attend.cpp: the one list of CPU policies they run
/// (add a new CPU policy here and every reliability test and the fuzzer cover it), what each promises about
/// memory, and the rounding bounds that widen oracle tolerances for ill-conditioned inputs (large logits).
#pragma once

#include <algorithm>
#include <cmath>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include <fusedattn/fusedattn.hpp>

namespace fusedattn::testing {

/// Every CPU policy: the naive kernel, flash on the build's default SIMD arch, and flash's portable scalar path.
/// Each has an `int threads` member.
using cpu_policies = std::tuple<policy::cpu_naive, policy::cpu<>, policy::cpu_scalar>;

/// Number of CPU policies in the list.
inline constexpr std::size_t num_cpu_policies = std::tuple_size_v<cpu_policies>;

/// A policy of type `Policy` that runs on `threads` threads.
template <class Policy>
Policy make_policy(int threads) {
  Policy pol{};
  pol.threads = threads;
  return pol;
}

/// Whether a policy's scratch memory grows at most linearly in the sequence lengths (a flash kernel), rather
/// than materialising the seq_q × seq_kv scores (the naive kernel).
template <class Policy>
inline constexpr bool linear_memory = true;
template <>
inline constexpr bool linear_memory<policy::cpu_naive> = false;

/// A short name for messages.
template <class Policy>
struct policy_namer;
template <>
struct policy_namer<policy::cpu_naive> {
  static std::string name() { return "cpu_naive"; }
};
template <class Arch>
struct policy_namer<policy::cpu<Arch>> {
  static std::string name() { return std::string("cpu<") + Arch::name() + ">"; }
};
template <class Policy>
std::string policy_name() {
  return policy_namer<Policy>::name();
}

/// True for the flash policies (policy::cpu<Arch>), which take tile sizes.
template <class Policy>
inline constexpr bool is_flash_policy = false;
template <class Arch>
inline constexpr bool is_flash_policy<policy::cpu<Arch>> = true;

/// Policies with a known gap in NaN propagation (docs/design.md, Numerics): their NaN checks are reported
/// (CHECK_NOFAIL) but do not fail the suite. None today: the flash kernel propagates NaN as specified since the
/// reliability fix (before it, a NaN in a Q row was dropped, a NaN in a K row left lse finite, and a NaN in V
/// reached rows whose mask excludes that key). Specialise to true for a new policy that does not yet.
template <class Policy>
inline constexpr bool nan_propagation_known_gap = false;

/// Sets a policy's tile sizes when it has them (the flash policies); a no-op otherwise.
template <class Policy>
void set_tiles(Policy& pol, tile_sizes tiles) {
  if constexpr (is_flash_policy<Policy>) pol.tiles = tiles;
}

/// Calls `f(Policy{})` for every CPU policy, in list order.
template <class F>
void for_each_cpu_policy(F&& f) {
  std::apply([&](auto... pol) { (f(pol), ...); }, cpu_policies{});
}

/// Magnitudes that bound how far a correct kernel may drift from the oracle through rounding of the logits.
struct rounding_bounds {
  double logit = 0;      ///< max |scale · q_i·k_j| over allowed pairs
  double logit_abs = 0;  ///< max scale · Σ_c |q_ic·k_jc| over allowed pairs (bounds a dot product's rounding)
  double value = 0;      ///< max |v|
};

/// Computes rounding_bounds in double (O(allowed pairs · head_dim): meant for test-sized problems), over the
/// finite values only (outputs that a NaN or inf input reaches are checked for being non-finite, not compared).
template <class T, class Mask>
rounding_bounds measure_rounding_bounds(const problem& p, const tensor_ref<const T>& q, const tensor_ref<const T>& k,
                                        const tensor_ref<const T>& v, const Mask& mask) {
  rounding_bounds r;
  const double scale = p.softmax_scale();
  for (index_t b = 0; b < p.batch; ++b)
    for (index_t h = 0; h < p.heads; ++h) {
      const auto& head_mask = for_head(mask, b, h);  // a per-head block_sparse layout: this (b, h)'s pattern
      for (index_t i = 0; i < p.seq_q; ++i)
        for (index_t j = 0; j < p.seq_kv; ++j) {
          if (!head_mask.allowed(i, j)) continue;
          double dot = 0, dot_abs = 0;
          for (index_t c = 0; c < p.head_dim; ++c) {
            const double x = static_cast<double>(q.row(b, h, i)[c]) * static_cast<double>(k.row(b, p.kv_head(h), j)[c]);
            dot += x;
            dot_abs += std::abs(x);
          }
          if (!std::isfinite(dot_abs)) continue;  // a NaN or inf input: that output is not compared
          r.logit = std::max(r.logit, std::abs(scale * dot));
          r.logit_abs = std::max(r.logit_abs, scale * dot_abs);
        }
    }
  for (index_t b = 0; b < p.batch; ++b)
    for (index_t g = 0; g < p.heads_kv; ++g)
      for (index_t j = 0; j < p.seq_kv; ++j)
        for (index_t c = 0; c < p.head_dim; ++c) {
          const double x = std::abs(static_cast<double>(v.row(b, g, j)[c]));
          if (std::isfinite(x)) r.value = std::max(r.value, x);
        }
  return r;
}

/// How much a correct kernel may perturb each logit s, beyond what the plain same-precision implementation of
/// check.hpp shows (docs/design.md, Numerics):
///   exact_dots: inputs whose partial dot products are exact (values on a coarse grid): a few roundings of s
///               itself (scale, log2 e, the running max), |δs| <= 4·u·|s|;
///   general:    any inputs: the dot product's own rounding too, |δs| <= (4 + d)·u·scale·Σ|q||k| (Higham's γ_d).
enum class logit_rounding { exact_dots, general };

/// Tolerances for O (absolute) and lse (absolute) widened by the logit rounding `mode` allows. O moves by at most
/// 2·max|δs|·max|v|, lse by max|δs| plus the rounding of lse itself to float. `Acc` is the accumulation type.
template <class Acc>
std::pair<double, double> widen_tolerances(double o_tol, double lse_tol, const rounding_bounds& r, logit_rounding mode,
                                           index_t head_dim) {
  const double u = static_cast<double>(Eigen::NumTraits<Acc>::epsilon()) / 2;
  const double u_f = static_cast<double>(Eigen::NumTraits<float>::epsilon()) / 2;
  const double ds = mode == logit_rounding::exact_dots ? 4 * u * r.logit
                                                       : (4 + static_cast<double>(head_dim)) * u * r.logit_abs;
  return {o_tol + 2 * ds * r.value, lse_tol + ds + 2 * u_f * r.logit};
}

}  // namespace fusedattn::testing
