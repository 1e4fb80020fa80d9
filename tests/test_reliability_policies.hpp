/// @file test_reliability_policies.hpp
/// The one list of CPU policies that the reliability tests and the fuzz harness run, with what each promises
/// about memory. Add a new CPU policy here and every reliability test and the fuzzer cover it.
#pragma once

#include <tuple>

#include <fusedattn/fusedattn.hpp>

namespace fusedattn::testing {

/// Every CPU policy. Each has an `int threads` member.
using cpu_policies = std::tuple<policy::cpu_naive>;

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
const char* policy_name() {
  return "cpu";
}
template <>
inline const char* policy_name<policy::cpu_naive>() {
  return "cpu_naive";
}

/// Calls `f(Policy{})` for every CPU policy, in list order.
template <class F>
void for_each_cpu_policy(F&& f) {
  std::apply([&](auto... pol) { (f(pol), ...); }, cpu_policies{});
}

}  // namespace fusedattn::testing
