/// @file merge.cuh
/// merge_partials on the GPU: the same merge of two (O, lse) partial results as dist/merge.hpp, with the same
/// −inf and NaN rules, over strided views in device memory, on a stream. Include from a .cu file (nvcc).
#pragma once

#if !defined(__CUDACC__)
#error "fusedattn/dist/merge.cuh must be compiled by nvcc (a .cu file)"
#endif

#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>

#include <cuda_runtime.h>

#include "../backends/cuda/device_types.cuh"
#include "../backends/cuda/error.cuh"
#include "merge.hpp"

namespace fusedattn {
namespace cuda {

namespace detail {

/// One warp per row: lane 0's weights are the row's (every lane forms them alike), lanes stride over head_dim.
template <class EA, class EB, class EO, class W>
__global__ void merge_rows_kernel(tensor_ref<const EA> a, lse_ref<const float> la, tensor_ref<const EB> b,
                                  lse_ref<const float> lb, tensor_ref<EO> o, lse_ref<float> lo) {
  using cuda_backend::narrow;
  using cuda_backend::widen;
  const index_t warps_per_block = blockDim.x / 32;
  const index_t row = index_t(blockIdx.x) * warps_per_block + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const index_t rows = o.dims.b * o.dims.h * o.dims.s;
  if (row >= rows) return;
  const index_t i = row % o.dims.s, h = row / o.dims.s % o.dims.h, bb = row / o.dims.s / o.dims.h;
  const merge_row_weights<W> w = merge_weights<W>(la.row(bb, h)[i], lb.row(bb, h)[i]);
  const EA* pa = a.row(bb, h, i);
  const EB* pb = b.row(bb, h, i);
  EO* po = o.row(bb, h, i);
  for (index_t c = lane; c < o.dims.d; c += 32) {
    W x = 0;
    if (w.use_a) x += w.wa * static_cast<W>(widen(pa[c]));
    if (w.use_b) x += w.wb * static_cast<W>(widen(pb[c]));
    po[c] = narrow<EO>(x);
  }
  if (lane == 0) lo.row(bb, h)[i] = static_cast<float>(w.lse);
}

/// The union of `count` parts (part p's row at parts + p · elems + row · d, its lse at lses[p · rows + row]) into o
/// and, when not null, lse: one thread per V consecutive columns of a row. V is 16 bytes of elements when parts and
/// outputs have one element size, rows are 16-byte aligned and head_dim is a multiple of V (head_dim 128 in bf16: 16
/// threads a row), else 1; o's head_dim is contiguous (attend validated it). Every thread forms the row's merged_lse
/// and weights alike and sums the parts in the same order, so the results do not depend on V.
template <class EP, class EO, class W, int V>
__global__ void merge_parts_kernel(const EP* parts, const float* lses, int count, tensor_ref<EO> o, float* lse) {
  static_assert(V == 1 || (sizeof(EP) == sizeof(EO) && V * sizeof(EP) == 16), "one 16-byte vector in, one out");
  struct alignas(V * sizeof(EP)) in_vec {
    EP at[V];
  };
  struct alignas(V * sizeof(EO)) out_vec {
    EO at[V];
  };
  using cuda_backend::narrow;
  using cuda_backend::widen;
  const dims4 d = o.dims;
  const index_t per_row = d.d / V, rows = d.b * d.h * d.s, elems = rows * d.d;
  const index_t t = index_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const index_t row = t / per_row;
  if (row >= rows) return;
  const index_t c = (t % per_row) * V;
  const index_t i = row % d.s, h = row / d.s % d.h, b = row / d.s / d.h;
  const W neg_inf = -std::numeric_limits<W>::infinity();
  const W l = merged_lse<W>(lses + row, rows, count);
  W x[V] = {};
  for (int p = 0; p < count && l != neg_inf; ++p) {
    const W lp = static_cast<W>(lses[p * rows + row]);
    if (lp == neg_inf) continue;  // saw no key: O not read
    const W w = exp(lp - l);
    const in_vec a = *reinterpret_cast<const in_vec*>(parts + p * elems + row * d.d + c);
#pragma unroll
    for (int j = 0; j < V; ++j) x[j] += w * static_cast<W>(widen(a.at[j]));
  }
  out_vec y;
#pragma unroll
  for (int j = 0; j < V; ++j) y.at[j] = narrow<EO>(x[j]);
  *reinterpret_cast<out_vec*>(o.row(b, h, i) + c) = y;
  if (lse != nullptr && c == 0) lse[row] = static_cast<float>(l);
}

template <class T>
tensor_ref<cuda_backend::device_t<T>> to_device_type(const tensor_ref<T>& t) {
  using E = cuda_backend::device_t<T>;
  using C = std::conditional_t<std::is_const_v<T>, const E, E>;
  return {reinterpret_cast<C*>(t.data), t.dims, t.stride};
}

}  // namespace detail

/// merge_partials (dist/merge.hpp) on device memory, enqueued on `stream` (asynchronous: a kernel fault shows at the
/// next synchronisation). The weights are formed in float (double when any view is double).
/// @return ok, errc::invalid_argument as the CPU version (nothing enqueued), or errc::backend_error.
template <class TA, class TB, class TO>
status merge_partials(const tensor_ref<TA>& o_a, const lse_ref<const float>& lse_a, const tensor_ref<TB>& o_b,
                      const lse_ref<const float>& lse_b, const tensor_ref<TO>& o, const lse_ref<float>& lse,
                      cudaStream_t stream) {
  static_assert(!std::is_const_v<TO>, "merge_partials: o is the output and must not be a view of const elements");
  const dims4 d = o.dims;
  if (d.b < 0 || d.h < 0 || d.s < 0 || d.d < 0) return status::invalid("o.dims has a negative extent");
  if (status st = fusedattn::detail::check_operand("o", o, d); !st) return st;
  if (status st = fusedattn::detail::check_operand("o_a", o_a, d); !st) return st;
  if (status st = fusedattn::detail::check_operand("o_b", o_b, d); !st) return st;
  if (status st = fusedattn::detail::check_lse("lse_a", lse_a, d); !st) return st;
  if (status st = fusedattn::detail::check_lse("lse_b", lse_b, d); !st) return st;
  if (status st = fusedattn::detail::check_lse("lse", lse, d); !st) return st;
  const index_t rows = d.b * d.h * d.s;
  if (rows == 0) return {};
  constexpr int threads = 256;
  constexpr index_t rows_per_block = threads / 32;
  const index_t blocks = (rows + rows_per_block - 1) / rows_per_block;
  using W = std::conditional_t<std::is_same_v<std::remove_const_t<TA>, double> ||
                                   std::is_same_v<std::remove_const_t<TB>, double> || std::is_same_v<TO, double>,
                               double, float>;
  using EA = cuda_backend::device_t<TA>;
  using EB = cuda_backend::device_t<TB>;
  using EO = cuda_backend::device_t<TO>;
  const tensor_ref<const EA> a{reinterpret_cast<const EA*>(o_a.data), o_a.dims, o_a.stride};
  const tensor_ref<const EB> b{reinterpret_cast<const EB*>(o_b.data), o_b.dims, o_b.stride};
  detail::merge_rows_kernel<EA, EB, EO, W><<<static_cast<unsigned>(blocks), threads, 0, stream>>>(
      a, lse_a, b, lse_b, detail::to_device_type(o), lse);
  return cuda_backend::last_launch("fusedattn::cuda::merge_partials");
}

namespace detail {

/// The union of `count` partial results of the same rows in one pass, on `stream`: part p's O at parts + p · the
/// elements of o.dims (laid out [b][h][s][d]), its lse at lses + p · b·h·s ([b][h][s]); into o (any strides) and,
/// when not null, lse ([b][h][s]). merged_lse's rules; weights in float (double when P or TO is double).
template <class P, class TO>
status merge_parts(const P* parts, const float* lses, int count, const tensor_ref<TO>& o, float* lse,
                   cudaStream_t stream) {
  const index_t rows = o.dims.b * o.dims.h * o.dims.s;
  if (rows == 0) return {};
  using W = std::conditional_t<std::is_same_v<P, double> || std::is_same_v<TO, double>, double, float>;
  using EP = cuda_backend::device_t<P>;
  using EO = cuda_backend::device_t<TO>;
  const auto launch = [&](auto width) {
    constexpr int V = decltype(width)::value, threads = 256;
    const index_t blocks = (rows * (o.dims.d / V) + threads - 1) / threads;
    merge_parts_kernel<EP, EO, W, V><<<static_cast<unsigned>(blocks), threads, 0, stream>>>(
        reinterpret_cast<const EP*>(parts), lses, count, to_device_type(o), lse);
    return cuda_backend::last_launch("fusedattn::dist merge_parts");
  };
  if constexpr (sizeof(EP) == sizeof(EO)) {
    constexpr int V = 16 / int(sizeof(EP));
    const auto aligned = [](const void* ptr) { return reinterpret_cast<std::uintptr_t>(ptr) % 16 == 0; };
    const strides4 os = o.stride;
    if (o.dims.d % V == 0 && os.s % V == 0 && os.h % V == 0 && os.b % V == 0 && aligned(o.data) && aligned(parts))
      return launch(std::integral_constant<int, V>{});
  }
  return launch(std::integral_constant<int, 1>{});
}

}  // namespace detail

/// merge_partials on device memory with lse buffers laid out [b][h][s] contiguously.
template <class TA, class TB, class TO>
status merge_partials(const tensor_ref<TA>& o_a, const float* lse_a, const tensor_ref<TB>& o_b, const float* lse_b,
                      const tensor_ref<TO>& o, float* lse, cudaStream_t stream) {
  return cuda::merge_partials(o_a, lse_bhs(lse_a, o.dims), o_b, lse_bhs(lse_b, o.dims), o, lse_bhs(lse, o.dims),
                              stream);
}

}  // namespace cuda
}  // namespace fusedattn
