/// @file device_types.cuh
/// The device twin of each storage type (Eigen::half → __half, Eigen::bfloat16 → __nv_bfloat16; same bits) and
/// the float conversions the kernels use. Nothing else.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "../../core/types.hpp"

namespace fusedattn {
namespace cuda_backend {

/// The type the device code reads and writes for a storage type `T`.
template <class T>
struct device_twin {
  using type = T;
};
template <>
struct device_twin<Eigen::half> {
  using type = __half;
};
template <>
struct device_twin<Eigen::bfloat16> {
  using type = __nv_bfloat16;
};
template <class T>
using device_t = typename device_twin<std::remove_cv_t<T>>::type;

static_assert(sizeof(__half) == sizeof(Eigen::half) && sizeof(__nv_bfloat16) == sizeof(Eigen::bfloat16),
              "the device twins must have the storage types' size");

/// Widening to the accumulation type and rounding back (round to nearest even).
__device__ __forceinline__ float widen(__half x) { return __half2float(x); }
__device__ __forceinline__ float widen(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float widen(float x) { return x; }
__device__ __forceinline__ double widen(double x) { return x; }

template <class E>
struct narrow_to;
template <>
struct narrow_to<__half> {
  template <class A>
  __device__ __forceinline__ static __half from(A x) { return __float2half_rn(static_cast<float>(x)); }
};
template <>
struct narrow_to<__nv_bfloat16> {
  template <class A>
  __device__ __forceinline__ static __nv_bfloat16 from(A x) { return __float2bfloat16_rn(static_cast<float>(x)); }
};
template <>
struct narrow_to<float> {
  template <class A>
  __device__ __forceinline__ static float from(A x) { return static_cast<float>(x); }
};
template <>
struct narrow_to<double> {
  template <class A>
  __device__ __forceinline__ static double from(A x) { return static_cast<double>(x); }
};
/// `x` rounded to the device type `E`.
template <class E, class A>
__device__ __forceinline__ E narrow(A x) {
  return narrow_to<E>::from(x);
}

}  // namespace cuda_backend
}  // namespace fusedattn
