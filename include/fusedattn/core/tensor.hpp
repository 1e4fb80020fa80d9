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
template <class T>
tensor_ref<T> bhsd(T* data, dims4 d) {
  return {data, d, {d.h * d.s * d.d, d.s * d.d, d.d, 1}};
}
/// A view of contiguous memory laid out [batch][seq][heads][head_dim] (the layout of a fused QKV projection).
template <class T>
tensor_ref<T> bshd(T* data, dims4 d) {
  return {data, d, {d.s * d.h * d.d, d.d, d.h * d.d, 1}};
}
/// A view with explicit strides in elements (any layout, e.g. a slice of a larger buffer).
template <class T>
tensor_ref<T> strided(T* data, dims4 d, strides4 s) {
  return {data, d, s};
}

/// Total elements of the smallest buffer that holds every element of `t` (0 when any extent is 0).
/// Assumes non-negative strides, which validation enforces.
template <class T>
index_t span_elements(const tensor_ref<T>& t) {
  if (t.dims.b <= 0 || t.dims.h <= 0 || t.dims.s <= 0 || t.dims.d <= 0) return 0;
  return (t.dims.b - 1) * t.stride.b + (t.dims.h - 1) * t.stride.h + (t.dims.s - 1) * t.stride.s +
         (t.dims.d - 1) * t.stride.d + 1;
}

}  // namespace fusedattn
