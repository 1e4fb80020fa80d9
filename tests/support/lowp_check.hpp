/// @file lowp_check.hpp
/// The low-precision accuracy rule shared by test_lowp and test_amx: a plain f32 implementation's error against
/// float64 (its output rounded to the output type), its lse error, the bf16 half-ulp floor, and the rule's check.
#pragma once

#include <algorithm>
#include <cmath>
#include <type_traits>
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

/// The error the rule counts from for kernels that feed P to bf16 dot products: the largest of a plain f32
/// implementation's error, that of the same implementation with each probability rounded to bf16 before P·V (the
/// same-precision plain implementation, as PyTorch's bf16 math path), both with the output rounded to bf16, and
/// bf16_half_ulp. q, k, v, mask: the inputs the kernel read, in any storage type.
template <class T, class Mask>
double bf16_plain_error(const problem& p, const tensor_ref<const T>& q, const tensor_ref<const T>& k,
                        const tensor_ref<const T>& v, const Mask& mask, const reference& plain,
                        const reference& exact) {
  const reference rounded_p = reference_attention<float, Eigen::bfloat16>(p, q, k, v, mask);
  return std::max({plain_error<Eigen::bfloat16>(plain, exact), plain_error<Eigen::bfloat16>(rounded_p, exact),
                   bf16_half_ulp(exact)});
}

/// The rule on O alone: max |o − exact| within 2x `plain_err` + 1e-7 (a NaN anywhere in O is an infinite error).
template <class Out>
void check_lowp_output(const tensor_ref<Out>& o, const reference& exact, double plain_err) {
  const double err = max_abs_error(o, exact.o);
  INFO("max error " << err << ", plain implementation rounded to the output type " << plain_err);
  CHECK(err <= 2.0 * plain_err + 1e-7);
}

/// The low-precision rule on one call's outputs: O (`o`, a view of Out) within 2x the error of a plain f32
/// implementation rounded to Out (for bf16 output at least `bf16_err`, bf16_plain_error's value) + 1e-7, and lse
/// within 2x the plain lse error + lse_floor. exact / plain: the float64 and f32 references on the inputs the kernel
/// read.
template <class Out>
void check_lowp_rule(const tensor_ref<Out>& o, const std::vector<float>& lse, const reference& exact,
                     const reference& plain, double lse_floor, double bf16_err = 0) {
  double plain_err = plain_error<Out>(plain, exact);
  if (std::is_same<Out, Eigen::bfloat16>::value) plain_err = std::max(plain_err, bf16_err);
  check_lowp_output(o, exact, plain_err);
  const double lse_err = max_lse_error(lse, exact.lse), plain_lse = plain_lse_error(plain, exact);
  INFO("lse error " << lse_err << ", plain " << plain_lse);
  CHECK(lse_err <= 2.0 * plain_lse + lse_floor);
}

}  // namespace testing
}  // namespace fusedattn
