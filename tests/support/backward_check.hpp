/// @file backward_check.hpp
/// Catch2 helpers of the backward-pass tests (CPU, CUDA, sharded): one case's inputs and outputs, and the check of
/// a gradient against the float64 closed form with FlashAttention's tolerance rule.
#pragma once

#include <algorithm>
#include <cmath>
#include <random>
#include <type_traits>
#include <vector>

#include <catch2/catch.hpp>

#include "check.hpp"
#include "data.hpp"
#include "oracle_backward.hpp"

namespace fusedattn::testing {

/// Inputs and outputs of one backward call: q, k, v, dO random; O and lse from the forward; dQ, dK, dV filled
/// with a sentinel pattern.
template <class T>
struct backward_case {
  problem p;
  operand<T> q, k, v, o, d_o, dq, dk, dv;
  std::vector<float> lse;
  backward_case(const problem& pr, layout l, std::mt19937_64& rng)
      : p(pr), q(pr.q_dims(), l), k(pr.kv_dims(), l), v(pr.kv_dims(), l), o(pr.o_dims(), l), d_o(pr.o_dims(), l),
        dq(pr.q_dims(), l), dk(pr.kv_dims(), l), dv(pr.kv_dims(), l),
        lse(static_cast<std::size_t>(pr.lse_size()), 123.0f) {
    q.fill(rng);
    k.fill(rng);
    v.fill(rng);
    d_o.fill(rng);
    o.fill(rng, 7.0, 9.0);
    for (operand<T>* g : {&dq, &dk, &dv}) g->fill(rng, 7.0, 9.0);
  }
  /// O and lse by the forward pass (the CPU flash kernel).
  template <class Mask>
  void forward(const Mask& mask) {
    const status st = attend(policy::cpu<>{2}, p, q.cview(), k.cview(), v.cview(), o.view, mask, lse.data());
    INFO(st.what());
    REQUIRE(st.ok());
  }
  /// attend_backward with `pol` on this case's host buffers.
  template <class Policy, class Mask>
  status backward(const Policy& pol, const Mask& mask) {
    return attend_backward(pol, p, q.cview(), k.cview(), v.cview(), o.cview(), d_o.cview(), lse.data(), dq.view,
                           dk.view, dv.view, mask);
  }
};

/// Largest |x| of a reference.
inline double max_magnitude(const std::vector<double>& x) {
  double m = 0;
  for (double e : x) m = std::max(m, std::abs(e));
  return m;
}

/// Max |a − b| over two references of the same size.
inline double max_difference(const std::vector<double>& a, const std::vector<double>& b) {
  double m = 0;
  for (std::size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}

/// FlashAttention's rule for one gradient: 2 × the plain same-precision implementation's error against the float64
/// oracle, plus a floor relative to the gradient's size: a few units of roundoff of T (the plain error can be
/// lucky) and `extra`, what a caller's schedule adds on top of one call (the sharded tests' merge).
template <class T>
double gradient_tolerance(const std::vector<double>& oracle, const std::vector<double>& plain, double extra = 0) {
  return 2.0 * max_difference(plain, oracle) + (8.0 * epsilon<T>() + extra) * std::max(1.0, max_magnitude(oracle));
}

/// One gradient against the oracle within gradient_tolerance.
template <class T>
void check_gradient(const char* name, const tensor_ref<T>& got, const std::vector<double>& oracle,
                    const std::vector<double>& plain) {
  const double tol = gradient_tolerance<std::remove_const_t<T>>(oracle, plain);
  const double err = max_abs_error(got, oracle);
  INFO(name << ": error " << err << " plain error " << max_difference(plain, oracle) << " tolerance " << tol);
  CHECK(err <= tol);
}

/// dQ, dK and dV of case `c` (written by the backward under test) against the float64 oracle; `plain(p, q, k, v, o,
/// d_o, lse, bound)` is the plain implementation whose error sets the tolerance (plain_backward, or a kernel's own
/// rounding model).
template <class T, class Plain>
void check_gradients(const backward_case<T>& c, const any_mask& mask, Plain&& plain) {
  std::visit(
      [&](const auto& m) {
        const auto bound = bind(m, c.p);
        const reference_grads ref =
            reference_backward(c.p, c.q.cview(), c.k.cview(), c.v.cview(), c.d_o.cview(), bound);
        const reference_grads pl =
            plain(c.p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.cview(), c.d_o.cview(), c.lse.data(), bound);
        check_gradient("dq", c.dq.view, ref.dq, pl.dq);
        check_gradient("dk", c.dk.view, ref.dk, pl.dk);
        check_gradient("dv", c.dv.view, ref.dv, pl.dv);
      },
      mask);
}

}  // namespace fusedattn::testing
