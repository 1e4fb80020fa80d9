/// @file merge.hpp
/// The exact merge of two partial attention results over disjoint key sets, (O_a, lse_a) and (O_b, lse_b), into
/// the result over their union: the step every split-KV, ring or context-parallel attention ends with. CPU only;
/// the CUDA version is dist/merge.cuh. Not a communicator: it only combines buffers it is given.
#pragma once

#include <cmath>
#include <limits>
#include <string>
#include <type_traits>

#include "../core/online_softmax.hpp"
#include "../core/problem.hpp"
#include "../core/status.hpp"
#include "../core/tensor.hpp"
#include "../core/types.hpp"
#include "../core/validate.hpp"

namespace fusedattn {

/// A strided view of log-sum-exp values, one per (batch, head, query row); the row stride is 1.
/// `attend` writes lse contiguous as [b][h][s] (lse_bhs); a slice of rows of such a buffer keeps its strides.
template <class F>
struct lse_ref {
  F* data = nullptr;
  index_t b = 0, h = 0, s = 0;    ///< extents
  index_t stride_b = 0, stride_h = 0;  ///< in elements

  /// Pointer to the lse of (b, h, row 0).
  FUSEDATTN_HOST_DEVICE F* row(index_t ib, index_t ih) const { return data + ib * stride_b + ih * stride_h; }
  operator lse_ref<const F>() const { return {data, b, h, s, stride_b, stride_h}; }
};

/// A view of `d.b · d.h · d.s` contiguous lse values laid out [b][h][s], as `attend` writes them (d.d is unused).
template <class F>
lse_ref<F> lse_bhs(F* data, dims4 d) {
  return {data, d.b, d.h, d.s, d.h * d.s, d.s};
}

// merge_weights (the weights of one row's (O, lse) merge) is core/online_softmax.hpp's, shared with the kernels.

/// The lse of the union of `count` partial results of one row, part i's lse at l[i · stride] (natural log):
/// m + log Σ exp(l_i − m) over the parts with l_i ≠ −inf, m the largest; −inf when every part is −inf (no key
/// seen); NaN when any part is NaN (or +inf, through inf − inf). Part i's weight in the union's O is then
/// exp(l_i − lse), a part with l_i = −inf left out (its O not read): the same rules as merge_weights, for any
/// number of parts in one pass. Host/device-clean.
template <class W>
FUSEDATTN_HOST_DEVICE inline W merged_lse(const float* l, index_t stride, int count) {
  const W neg_inf = -std::numeric_limits<W>::infinity();
  W m = neg_inf;
  for (int i = 0; i < count; ++i) {
    const W x = static_cast<W>(l[i * stride]);
    if (x != x) return x;  // NaN: it reaches the whole row
    m = x > m ? x : m;
  }
  if (m == neg_inf) return m;
  W sum = 0;
  for (int i = 0; i < count; ++i) {
    const W x = static_cast<W>(l[i * stride]);
    if (x != neg_inf) sum += exp(x - m);
  }
  return m + log(sum);
}

namespace detail {

template <class F>
status check_lse(const char* name, const lse_ref<F>& l, dims4 want) {
  const std::string n = name;
  if (l.data == nullptr) return status::invalid(n + ".data is null");
  if (l.b != want.b || l.h != want.h || l.s != want.s)
    return status::invalid(n + " extents are (" + str(l.b) + ", " + str(l.h) + ", " + str(l.s) + ") but o's are (" +
                           str(want.b) + ", " + str(want.h) + ", " + str(want.s) + ")");
  if (l.stride_b < 0 || l.stride_h < 0)
    return status::invalid(n + ".stride_b / stride_h are " + str(l.stride_b) + " / " + str(l.stride_h) +
                           "; strides must be >= 0");
  return {};
}

}  // namespace detail

/// Merges two partial results computed over disjoint key sets of the same queries:
/// lse = log(exp(lse_a) + exp(lse_b)) and O = exp(lse_a − lse)·O_a + exp(lse_b − lse)·O_b, per row.
///
/// @param o_a, lse_a  the first part (any supported scalar type; lse natural log, as `attend` returns it)
/// @param o_b, lse_b  the second part (its own scalar type)
/// @param o, lse      the union (its own scalar type; a float accumulator keeps a long chain of merges exact to
///                    float). `o` may be `o_a` or `o_b` itself and `lse` may be `lse_a` or `lse_b` itself (an
///                    in-place merge); any other overlap is not allowed.
/// @param threads     OpenMP threads over the (batch, head) rows (>= 1).
/// A part whose lse is −inf saw no key and contributes nothing (its O is not read); both −inf give O = 0 and
/// lse = −inf, as `attend` writes for a row that sees no key. A NaN in either lse makes the row's O and lse NaN; a
/// NaN in O reaches the elements it is in. The weights are formed in double.
/// @return ok, or errc::invalid_argument naming the field (null data, extents that differ from o's, head_dim
///         stride not 1, negative strides, threads < 1); nothing is written then.
template <class TA, class TB, class TO>
status merge_partials(const tensor_ref<TA>& o_a, const lse_ref<const float>& lse_a, const tensor_ref<TB>& o_b,
                      const lse_ref<const float>& lse_b, const tensor_ref<TO>& o, const lse_ref<float>& lse,
                      int threads = 1) {
  static_assert(!std::is_const_v<TO>, "merge_partials: o is the output and must not be a view of const elements");
  static_assert(is_supported_scalar_v<TA> && is_supported_scalar_v<TB> && is_supported_scalar_v<TO>,
                "merge_partials takes float, double, Eigen::half and Eigen::bfloat16 views");
  if (threads < 1) return status::invalid("threads is " + std::to_string(threads) + "; it must be >= 1");
  const dims4 d = o.dims;
  if (d.b < 0 || d.h < 0 || d.s < 0 || d.d < 0)
    return status::invalid("o.dims has a negative extent (" + detail::str(d.b) + ", " + detail::str(d.h) + ", " +
                           detail::str(d.s) + ", " + detail::str(d.d) + ")");
  if (status st = detail::check_operand("o", o, d); !st) return st;
  if (status st = detail::check_operand("o_a", o_a, d); !st) return st;
  if (status st = detail::check_operand("o_b", o_b, d); !st) return st;
  if (status st = detail::check_lse("lse_a", lse_a, d); !st) return st;
  if (status st = detail::check_lse("lse_b", lse_b, d); !st) return st;
  if (status st = detail::check_lse("lse", lse, d); !st) return st;
  const index_t rows = d.b * d.h;
  (void)threads;  // read by the OpenMP pragma only
#if defined(_OPENMP)
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
#endif
  for (index_t bh = 0; bh < rows; ++bh) {
    const index_t ib = bh / d.h, ih = bh % d.h;
    const float* la = lse_a.row(ib, ih);
    const float* lb = lse_b.row(ib, ih);
    float* lo = lse.row(ib, ih);
    for (index_t i = 0; i < d.s; ++i) {
      const merge_row_weights<double> w = merge_weights<double>(la[i], lb[i]);
      const auto* a = o_a.row(ib, ih, i);
      const auto* b = o_b.row(ib, ih, i);
      TO* out = o.row(ib, ih, i);
      // Element by element: each o[c] is formed from a[c] and b[c] before it is stored, so in place is safe.
      for (index_t c = 0; c < d.d; ++c) {
        double x = 0;
        if (w.use_a) x += w.wa * static_cast<double>(a[c]);
        if (w.use_b) x += w.wb * static_cast<double>(b[c]);
        out[c] = static_cast<TO>(x);
      }
      lo[i] = static_cast<float>(w.lse);
    }
  }
  return {};
}

/// merge_partials with lse buffers laid out [b][h][s] contiguously, as `attend` writes them.
template <class TA, class TB, class TO>
status merge_partials(const tensor_ref<TA>& o_a, const float* lse_a, const tensor_ref<TB>& o_b, const float* lse_b,
                      const tensor_ref<TO>& o, float* lse, int threads = 1) {
  return merge_partials(o_a, lse_bhs(lse_a, o.dims), o_b, lse_bhs(lse_b, o.dims), o, lse_bhs(lse, o.dims), threads);
}

}  // namespace fusedattn
