/// @file types.hpp
/// Index type and the scalar types fusedattn accepts (float, double, Eigen::half, Eigen::bfloat16),
/// with their accumulation type and names. Not the tensors themselves: see tensor.hpp.
#pragma once

#include <cstdint>
#include <type_traits>

#include <Eigen/Core>

#include "../config.hpp"

namespace fusedattn {

/// Signed 64-bit index used for every size and stride.
using index_t = std::int64_t;

/// Compile-time facts about a scalar type: whether fusedattn supports it, what it accumulates in and its short name.
template <class T>
struct scalar_traits {
  static constexpr bool supported = false;
};
template <>
struct scalar_traits<float> {
  static constexpr bool supported = true;
  using accum = float;
  static constexpr const char* name = "f32";
};
template <>
struct scalar_traits<double> {
  static constexpr bool supported = true;
  using accum = double;
  static constexpr const char* name = "f64";
};
template <>
struct scalar_traits<Eigen::half> {
  static constexpr bool supported = true;
  using accum = float;
  static constexpr const char* name = "f16";
};
template <>
struct scalar_traits<Eigen::bfloat16> {
  static constexpr bool supported = true;
  using accum = float;
  static constexpr const char* name = "bf16";
};

/// The type a kernel accumulates `T` in: float for float, half and bfloat16; double for double.
template <class T>
using accum_t = typename scalar_traits<std::remove_cv_t<T>>::accum;

/// True when fusedattn kernels accept `T` as the storage type of Q, K, V and O.
template <class T>
inline constexpr bool is_supported_scalar_v = scalar_traits<std::remove_cv_t<T>>::supported;

/// Short name of a scalar type ("f32", "f64", "f16", "bf16").
template <class T>
constexpr const char* scalar_name() {
  return scalar_traits<std::remove_cv_t<T>>::name;
}

namespace detail {
/// a + b into `out`, or false (out untouched) when the sum leaves the int64 range.
inline bool add_ok(index_t a, index_t b, index_t& out) {
  if ((b > 0 && a > INT64_MAX - b) || (b < 0 && a < INT64_MIN - b)) return false;
  out = a + b;
  return true;
}
/// a · b into `out`, or false (out untouched) when the product leaves the int64 range. Any signs.
inline bool mul_ok(index_t a, index_t b, index_t& out) {
  if (a == 0 || b == 0) {
    out = 0;
    return true;
  }
  if ((a == -1 && b == INT64_MIN) || (b == -1 && a == INT64_MIN)) return false;
  const index_t r = static_cast<index_t>(static_cast<std::uint64_t>(a) * static_cast<std::uint64_t>(b));
  if (r / b != a) return false;
  out = r;
  return true;
}
/// a · b, saturated to INT64_MAX (or INT64_MIN) instead of overflowing.
inline index_t mul_sat(index_t a, index_t b) {
  index_t r = 0;
  if (mul_ok(a, b, r)) return r;
  return (a < 0) != (b < 0) ? INT64_MIN : INT64_MAX;
}
/// a + b, saturated to INT64_MAX (or INT64_MIN) instead of overflowing.
inline index_t add_sat(index_t a, index_t b) {
  index_t r = 0;
  if (add_ok(a, b, r)) return r;
  return b < 0 ? INT64_MIN : INT64_MAX;
}

/// Blocks template argument deduction (std::type_identity of C++20).
template <class T>
struct identity {
  using type = T;
};
template <class T>
using identity_t = typename identity<T>::type;
}  // namespace detail

}  // namespace fusedattn
