/// @file lowp_check.hpp
/// The low-precision accuracy rule's pieces shared by test_lowp and test_amx: a plain f32 implementation's error
/// against float64 (its output rounded to the output type), its lse error, and the bf16 half-ulp floor.
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

#include "check.hpp"

namespace fusedattn {
namespace testing {

/// Max |o − ref| of a plain f32 implementation on the same inputs, its output rounded to `Out`.
template <class Out>
double plain_error(const reference& plain, const reference& exact) {
  double err = 0;
  for (std::size_t i = 0; i < plain.o.size(); ++i)
    err = std::max(err, std::abs(static_cast<double>(static_cast<Out>(plain.o[i])) - exact.o[i]));
  return err;
}

/// Max lse error of a plain f32 implementation against float64.
inline double plain_lse_error(const reference& plain, const reference& exact) {
  std::vector<float> lse(plain.lse.begin(), plain.lse.end());
  return max_lse_error(lse, exact.lse);
}

/// Half an ulp of bf16 at the largest |O| of the float64 result: what rounding alone may cost a plain implementation
/// whose output is bf16. The kernels that round P to bf16 (vdpbf16ps, AMX) may land one such rounding on the other
/// side of a midpoint; the 2x rule counts from at least this floor.
inline double bf16_half_ulp(const reference& exact) {
  double big = 0;
  for (double x : exact.o) big = std::max(big, std::abs(x));
  return big > 0 ? std::ldexp(1.0, std::ilogb(big) - 8) : 0.0;
}

}  // namespace testing
}  // namespace fusedattn
