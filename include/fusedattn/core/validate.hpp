/// @file validate.hpp
/// The checks every entry point runs before it touches memory. Each failure names the offending field and
/// its value. Backends add their own checks (device pointers, supported head dims) after these.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>

#include "../kernels/block_sparse.hpp"
#include "../kernels/mask.hpp"
#include "../kernels/modifiers.hpp"
#include "problem.hpp"
#include "status.hpp"
#include "tensor.hpp"

namespace fusedattn {
namespace detail {

inline std::string str(index_t v) { return std::to_string(v); }

/// True when [p, p + bytes) does not wrap around the end of the address space.
inline bool fits_address_space(const void* p, index_t bytes) {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  return static_cast<std::uintptr_t>(bytes) <= std::numeric_limits<std::uintptr_t>::max() - a;
}

/// A double in its shortest form that reads back as the same value ("-1e-300", "0.1", "1e+300", "nan", "inf"),
/// for messages.
inline std::string str_double(double v) {
  if (std::isnan(v)) return std::signbit(v) ? "-nan" : "nan";
  if (std::isinf(v)) return v < 0 ? "-inf" : "inf";
  char buf[32];
  for (int digits = 1; digits <= 17; ++digits) {
    std::snprintf(buf, sizeof buf, "%.*g", digits, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  return buf;
}

/// Checks one operand view against the extents the problem implies. A view with a zero extent holds no element:
/// its data pointer may be null.
template <class T>
status check_operand(const char* name, const tensor_ref<T>& t, dims4 want) {
  const std::string n = name;
  const index_t got[4] = {t.dims.b, t.dims.h, t.dims.s, t.dims.d};
  const index_t exp[4] = {want.b, want.h, want.s, want.d};
  const char* field[4] = {"b", "h", "s", "d"};
  const char* from[4] = {"batch", "heads", "seq", "head_dim"};
  for (int i = 0; i < 4; ++i)
    if (got[i] != exp[i])
      return status::invalid(n + ".dims." + field[i] + " is " + str(got[i]) + " but the problem's " + from[i] +
                             " implies " + str(exp[i]));
  const bool empty = t.dims.b == 0 || t.dims.h == 0 || t.dims.s == 0 || t.dims.d == 0;
  if (t.data == nullptr && !empty) return status::invalid(n + ".data is null");
  if (t.stride.d != 1)
    return status::invalid(n + ".stride.d is " + str(t.stride.d) + "; the head dimension must be contiguous (stride 1)");
  const index_t s[3] = {t.stride.b, t.stride.h, t.stride.s};
  for (int i = 0; i < 3; ++i)
    if (s[i] < 0) return status::invalid(n + ".stride." + field[i] + " is " + str(s[i]) + "; strides must be >= 0");
  if (empty) return {};
  // The largest element offset must be representable.
  index_t total = 0, part = 0;
  const index_t ext[3] = {t.dims.b - 1, t.dims.h - 1, t.dims.s - 1};
  for (int i = 0; i < 3; ++i) {
    if (!mul_ok(ext[i], s[i], part) || part > INT64_MAX - total - t.dims.d)
      return status::invalid(n + ": the extents and strides address beyond 2^63 elements");
    total += part;
  }
  // Extra checks: the span in bytes must be representable, and the view must not run past the end of the
  // address space (so that the byte-range overlap tests below cannot wrap).
  const index_t span = total + t.dims.d;
  if (span > INT64_MAX / static_cast<index_t>(sizeof(T)))
    return status::invalid(n + ": the extents and strides span " + str(span) + " elements, beyond 2^63 bytes");
  if (!fits_address_space(t.data, span * static_cast<index_t>(sizeof(T))))
    return status::invalid(n + ": the view runs past the end of the address space");
  return {};
}

/// True when two byte ranges [a, a + na) and [b, b + nb) overlap.
inline bool overlaps(const void* a, index_t na, const void* b, index_t nb) {
  const auto pa = reinterpret_cast<std::uintptr_t>(a), pb = reinterpret_cast<std::uintptr_t>(b);
  return pa < pb + static_cast<std::uintptr_t>(nb) && pb < pa + static_cast<std::uintptr_t>(na);
}

/// min |x·s + r| over the integers x with |x| <= n (x != 0 when `nonzero`); s >= 0, n >= 0, |r| <= INT64_MAX.
/// Every candidate x has the sign opposite to r's, so x·s + r cannot overflow when |x·s| and |r| fit.
inline index_t min_abs_affine(index_t s, index_t n, index_t r, bool nonzero) {
  if (r < 0) r = -r;  // |x·s − r| over x equals |(−x)·s + r|: the same set, mirrored
  index_t best = INT64_MAX;
  const auto consider = [&](index_t x) {
    if (x < -n || x > 0 || (nonzero && x == 0)) return;
    const index_t val = r + x * s;  // r >= 0, x·s <= 0
    best = std::min(best, val < 0 ? -val : val);
  };
  if (s == 0) {
    if (!nonzero) return r;
    return n > 0 ? r : INT64_MAX;
  }
  const index_t q = r / s;
  consider(-std::min(q, n));
  consider(-std::min(q + (r % s != 0), n));
  consider(-1);
  consider(0);
  return best;
}

/// Whether the rows of a view are pairwise disjoint (every two distinct (b, h, s) rows at least d elements apart),
/// share memory, or could not be decided (see rows_disjoint).
enum class rows_overlap { disjoint, shared, unproven };

/// Exact test of whether two distinct rows of `t` share an element. Rows (b, h, s) start at b·sb + h·sh + s·ss
/// and hold d contiguous elements; they are disjoint iff every non-zero difference vector (x, y, z) with
/// |x| < B, |y| < H, |z| < S gives |x·sb + y·sh + z·ss| >= d. First the quick sufficient test (each outer stride
/// steps past everything the inner axes cover, the layouts of bhsd / bshd and their slices); when it fails, the
/// exact search: the axis with the most rows is minimised in closed form for every difference of the other two
/// (at most 2^22 pairs); beyond that the answer is `unproven`, which attend() refuses.
/// Preconditions: check_operand passed (non-negative strides, offsets within int64).
template <class T>
rows_overlap rows_disjoint(const tensor_ref<T>& t) {
  index_t ext[3] = {t.dims.b, t.dims.h, t.dims.s}, st[3] = {t.stride.b, t.stride.h, t.stride.s};
  if (ext[0] == 0 || ext[1] == 0 || ext[2] == 0 || t.dims.d == 0) return rows_overlap::disjoint;
  {
    index_t e[3] = {ext[0], ext[1], ext[2]}, s[3] = {st[0], st[1], st[2]};
    for (int i = 0; i < 3; ++i)
      for (int j = i + 1; j < 3; ++j)
        if (s[j] < s[i] || (s[j] == s[i] && e[j] < e[i])) {
          std::swap(s[i], s[j]);
          std::swap(e[i], e[j]);
        }
    index_t covered = t.dims.d;  // elements spanned by the inner axes
    bool nested = true;
    for (int i = 0; i < 3 && nested; ++i) {
      if (e[i] <= 1) continue;
      if (s[i] < covered) nested = false;
      else covered = s[i] * (e[i] - 1) + covered;
    }
    if (nested) return rows_overlap::disjoint;
  }
  // Axis 0 becomes the one with the most rows (closed form); axes 1 and 2 are enumerated.
  int big = 0;
  for (int i = 1; i < 3; ++i)
    if (ext[i] > ext[big]) big = i;
  std::swap(ext[0], ext[big]);
  std::swap(st[0], st[big]);
  const index_t pairs_limit = index_t(1) << 22;
  if (ext[1] > pairs_limit / (2 * ext[2] - 1)) return rows_overlap::unproven;
  // (y, z) and (−y, −z) give the same |difference|: y >= 0 only, and for y = 0, z >= 0 only.
  for (index_t y = 0; y < ext[1]; ++y)
    for (index_t z = y == 0 ? 0 : -(ext[2] - 1); z < ext[2]; ++z) {
      const index_t r = y * st[1] + z * st[2];  // both terms within the view's validated span
      if (min_abs_affine(st[0], ext[0] - 1, r, y == 0 && z == 0) < t.dims.d) return rows_overlap::shared;
    }
  return rows_overlap::disjoint;
}

inline status check_mask(const dense&) { return {}; }
inline status check_mask(const causal& c) {
  if (c.alignment != align::top_left && c.alignment != align::bottom_right)
    return status::invalid("causal.alignment is not a valid fusedattn::align value");
  return {};
}
inline status check_mask(const window& w) {
  if (w.left < 0) return status::invalid("window.left is " + str(w.left) + "; it must be >= 0");
  if (w.right < 0) return status::invalid("window.right is " + str(w.right) + "; it must be >= 0");
  if (w.alignment != align::top_left && w.alignment != align::bottom_right)
    return status::invalid("window.alignment is not a valid fusedattn::align value");
  return {};
}

/// The modifiers' own checks (the values behind the pointers are not read: they may live on a device).
inline status check_mods(const score_mods& m) {
  if (m.has_softcap && !(std::isfinite(m.softcap) && m.softcap >= std::numeric_limits<float>::min()))
    return status::invalid("softcap.cap is " + str_double(m.softcap) + "; it must be a finite, positive, normal float");
  if (m.has_alibi && !m.alibi_slopes) return status::invalid("alibi.slopes is null; it must point to heads floats");
  if (m.has_sinks && !m.sink_logits) return status::invalid("sinks.logits is null; it must point to heads floats");
  if (m.alibi_alignment != align::top_left && m.alibi_alignment != align::bottom_right)
    return status::invalid("alibi.alignment is not a valid fusedattn::align value");
  return {};
}

/// Masks whose check does not depend on the problem (block_sparse's does: see block_sparse.hpp).
template <class Mask>
status check_mask(const Mask& m, const problem&) {
  return check_mask(m);
}
/// A mask with score modifiers: the mask's check, then the modifiers'.
template <class Mask>
status check_mask(const modified<Mask>& m, const problem& p) {
  if (status st = check_mask(m.mask, p); !st) return st;
  return check_mods(m.mods);
}

/// The scale must survive conversion to the accumulation type of T as a finite, positive, normal number.
template <class T>
status check_scale(const problem& p) {
  using acc = accum_t<T>;
  if (p.scale) {
    const acc scale_acc = static_cast<acc>(*p.scale);
    if (!(std::isfinite(scale_acc) && scale_acc >= std::numeric_limits<acc>::min()))
      return status::invalid("problem.scale is " + str_double(*p.scale) + "; it is not a finite positive " +
                             "normal " + scalar_name<acc>() + " (the accumulation type of " + scalar_name<T>() + ")");
  }
  return {};
}

}  // namespace detail

/// Longest seq_q or seq_kv any kernel accepts (2^48): every index the kernels derive from a sequence length
/// (tile counts, padded panels, key chunks) then stays far inside int64.
inline constexpr index_t max_seq_len = index_t(1) << 48;

/// Checks the problem alone: non-negative sizes (batch, heads, seq_q or seq_kv may be 0: see attend), head_dim
/// in [1, max_head_dim], heads divisible by heads_kv, element counts within int64, scale.
inline status validate(const problem& p) {
  using detail::str;
  const index_t v[6] = {p.batch, p.heads, p.heads_kv, p.seq_q, p.seq_kv, p.head_dim};
  const char* n[6] = {"batch", "heads", "heads_kv", "seq_q", "seq_kv", "head_dim"};
  for (int i = 0; i < 6; ++i)
    if (v[i] < 0) return status::invalid(std::string("problem.") + n[i] + " is " + str(v[i]) + "; it must be >= 0");
  if (p.head_dim == 0) return status::invalid("problem.head_dim is 0; it must be positive");
  if (p.heads_kv == 0 && p.heads > 0)
    return status::invalid("problem.heads_kv is 0; it must be positive when problem.heads (" + str(p.heads) +
                           ") is");
  if (p.heads_kv > 0 && p.heads % p.heads_kv != 0)
    return status::invalid("problem.heads (" + str(p.heads) + ") is not a multiple of problem.heads_kv (" +
                           str(p.heads_kv) + ")");
  if (p.head_dim > max_head_dim)
    return status::invalid("problem.head_dim is " + str(p.head_dim) + "; the largest supported is " +
                           str(max_head_dim));
  if (p.scale && !(std::isfinite(*p.scale) && *p.scale > 0))
    return status::invalid("problem.scale is " + detail::str_double(*p.scale) + "; it must be finite and positive");
  index_t n_q = 0, n_kv = 0;
  if (!detail::mul_ok(p.batch, p.heads, n_q) || !detail::mul_ok(n_q, p.seq_q, n_q) ||
      !detail::mul_ok(n_q, p.head_dim, n_q) || !detail::mul_ok(p.batch, p.heads_kv, n_kv) ||
      !detail::mul_ok(n_kv, p.seq_kv, n_kv) || !detail::mul_ok(n_kv, p.head_dim, n_kv))
    return status::invalid("problem: batch * heads * seq * head_dim overflows 64 bits");
  return {};
}

/// Checks a whole call: the problem, the four views (pointers, extents, unit head-dim stride, non-negative
/// strides), the mask, that O has no two rows on the same memory, that O and lse overlap no input, and the
/// sequence lengths (at most max_seq_len).
/// Returns the first failure found; nothing is read or written.
template <class T, class Mask>
status validate(const problem& p, const tensor_ref<const T>& q, const tensor_ref<const T>& k,
                const tensor_ref<const T>& v, const tensor_ref<T>& o, const Mask& mask, const float* lse) {
  static_assert(is_supported_scalar_v<T>,
                "fusedattn supports float, double, Eigen::half and Eigen::bfloat16 for Q, K, V and O");
  if (status st = validate(p); !st) return st;
  if (status st = detail::check_operand("q", q, p.q_dims()); !st) return st;
  if (status st = detail::check_operand("k", k, p.kv_dims()); !st) return st;
  if (status st = detail::check_operand("v", v, p.kv_dims()); !st) return st;
  if (status st = detail::check_operand("o", o, p.o_dims()); !st) return st;
  if (status st = detail::check_mask(mask, p); !st) return st;
  // Extra checks: the scale must survive conversion to the accumulation type as a normal number (the CPU
  // kernels flush subnormals to zero, docs/design.md Numerics), and lse must be addressable.
  if (status st = detail::check_scale<T>(p); !st) return st;
  if (lse) {
    index_t lse_bytes = 0;
    if (!detail::mul_ok(p.lse_size(), static_cast<index_t>(sizeof(float)), lse_bytes) ||
        !detail::fits_address_space(lse, lse_bytes))
      return status::invalid("lse: " + detail::str(p.lse_size()) + " floats do not fit in the address space");
  }
  switch (detail::rows_disjoint(o)) {
    case detail::rows_overlap::disjoint: break;
    case detail::rows_overlap::shared: return status::invalid("o: its strides make distinct rows share memory");
    case detail::rows_overlap::unproven:
      return status::invalid("o: its strides are not nested (some outer stride is smaller than what the inner axes "
                             "span) and its rows are too many to prove exactly that none share memory");
  }
  const index_t bytes_o = span_elements(o) * static_cast<index_t>(sizeof(T));
  const tensor_ref<const T>* in[3] = {&q, &k, &v};
  const char* in_name[3] = {"q", "k", "v"};
  for (int i = 0; i < 3; ++i) {
    const index_t bytes_in = span_elements(*in[i]) * static_cast<index_t>(sizeof(T));
    if (detail::overlaps(o.data, bytes_o, in[i]->data, bytes_in))
      return status::invalid(std::string("o overlaps ") + in_name[i] + "; the output must not alias an input");
    if (lse && detail::overlaps(lse, p.lse_size() * index_t(sizeof(float)), in[i]->data, bytes_in))
      return status::invalid(std::string("lse overlaps ") + in_name[i]);
  }
  if (lse && detail::overlaps(lse, p.lse_size() * index_t(sizeof(float)), o.data, bytes_o)) return status::invalid("lse overlaps o");
  if (p.seq_q > max_seq_len)
    return status::invalid("problem.seq_q is " + detail::str(p.seq_q) + "; the longest supported is 2^48");
  if (p.seq_kv > max_seq_len)
    return status::invalid("problem.seq_kv is " + detail::str(p.seq_kv) + "; the longest supported is 2^48");
  return {};
}

namespace detail {
/// Detects a `threads` member (every CPU policy has one).
template <class Policy, class = void>
struct has_threads : std::false_type {};
template <class Policy>
struct has_threads<Policy, std::void_t<decltype(std::declval<const Policy&>().threads)>> : std::true_type {};
}  // namespace detail

/// Checks the policy alone: a CPU policy's thread count must be >= 1. Runs for every policy, so a new CPU
/// policy is covered as soon as it has a `threads` member.
template <class Policy>
status validate_policy(const Policy& pol) {
  if constexpr (detail::has_threads<Policy>::value) {
    if (pol.threads <= 0)
      return status::invalid("policy.threads is " + std::to_string(pol.threads) + "; it must be >= 1");
  }
  (void)pol;
  return {};
}

}  // namespace fusedattn
