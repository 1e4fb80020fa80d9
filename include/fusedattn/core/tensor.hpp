/// @file tensor.hpp
/// Non-owning strided 4-D views (batch, head, sequence, head_dim) with makers for the B·H·S·D and B·S·H·D
/// layouts. A view never allocates and never checks; validate.hpp does the checking.
#pragma once

#include <array>

#include "problem.hpp"
#include "types.hpp"

namespace fusedattn {

/// Strides of a 4-D view in elements, in logical order (batch, head, sequence, head_dim).
struct strides4 {
  index_t b, h, s, d;
};

/// A strided view of a (b, h, s, d) tensor. `T` may be const. The head_dim stride must be 1 for the kernels.
template <class T>
struct tensor_ref {
  T* data = nullptr;
  dims4 dims{0, 0, 0, 0};
  strides4 stride{0, 0, 0, 0};

  /// Element offset of (b, h, s, 0).
  FUSEDATTN_HOST_DEVICE index_t offset(index_t b, index_t h, index_t s) const {
    return b * stride.b + h * stride.h + s * stride.s;
  }
  /// Pointer to the first element of row (b, h, s): `dims.d` contiguous values.
  FUSEDATTN_HOST_DEVICE T* row(index_t b, index_t h, index_t s) const { return data + offset(b, h, s); }

  /// A const view of the same memory.
  operator tensor_ref<const T>() const { return {data, dims, stride}; }
};

/// A view of contiguous memory laid out [batch][heads][seq][head_dim] (PyTorch's default for SDPA).
/// Strides are computed with saturating arithmetic: extents whose products leave int64 give a stride of
/// INT64_MAX, which validation rejects ("the extents and strides address beyond 2^63 elements").
template <class T>
tensor_ref<T> bhsd(T* data, dims4 d) {
  using detail::mul_sat;
  return {data, d, {mul_sat(mul_sat(d.h, d.s), d.d), mul_sat(d.s, d.d), d.d, 1}};
}
/// A view of contiguous memory laid out [batch][seq][heads][head_dim] (the layout of a fused QKV projection).
/// Saturating strides, as bhsd.
template <class T>
tensor_ref<T> bshd(T* data, dims4 d) {
  using detail::mul_sat;
  return {data, d, {mul_sat(mul_sat(d.s, d.h), d.d), d.d, mul_sat(d.h, d.d), 1}};
}
/// A view with explicit strides in elements (any layout, e.g. a slice of a larger buffer).
template <class T>
tensor_ref<T> strided(T* data, dims4 d, strides4 s) {
  return {data, d, s};
}

/// Total elements of the smallest buffer that holds every element of `t` (0 when any extent is 0).
/// Meaningful for non-negative strides, which validation enforces; saturates at INT64_MAX (never overflows).
template <class T>
index_t span_elements(const tensor_ref<T>& t) {
  using detail::add_sat;
  using detail::mul_sat;
  if (t.dims.b <= 0 || t.dims.h <= 0 || t.dims.s <= 0 || t.dims.d <= 0) return 0;
  index_t span = 1;
  const index_t ext[4] = {t.dims.b, t.dims.h, t.dims.s, t.dims.d};
  const index_t st[4] = {t.stride.b, t.stride.h, t.stride.s, t.stride.d};
  for (int i = 0; i < 4; ++i) span = add_sat(span, mul_sat(ext[i] - 1, st[i]));
  return span;
}

}  // namespace fusedattn
