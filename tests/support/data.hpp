/// @file data.hpp
/// Test inputs: buffers of random values in a chosen layout (B·H·S·D, B·S·H·D or a padded, non-contiguous view),
/// fresh seeds per case, error measures and tolerances derived from a plain same-precision implementation.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <fusedattn/fusedattn.hpp>

#include "oracle.hpp"

namespace fusedattn::testing {

/// A fresh seed per call; tests CAPTURE it so a failure can be replayed: with FUSEDATTN_TEST_SEED set (decimal or
/// 0x hex), every call returns that seed, so the failing case draws the inputs it drew before.
inline std::uint64_t fresh_seed() {
  if (const char* fixed = std::getenv("FUSEDATTN_TEST_SEED")) return std::strtoull(fixed, nullptr, 0);
  static std::random_device rd;
  return (static_cast<std::uint64_t>(rd()) << 32) ^ rd();
}

enum class layout { bhsd, bshd, padded, padded16 };
inline const char* layout_name(layout l) {
  return l == layout::bhsd ? "bhsd" : l == layout::bshd ? "bshd" : l == layout::padded ? "padded" : "padded16";
}

/// Owns the memory of one operand and views it in the requested layout. `padded` inserts gaps after every
/// row and every head, so strides are not the contiguous ones; `padded16` does the same with gaps of 8, 16 and 24
/// elements, so every stride stays a multiple of 8 elements (16 bytes of a 16-bit type: what the CUDA flash
/// kernels and their TMA copies take).
template <class T>
struct operand {
  std::vector<T> buf;
  tensor_ref<T> view;

  operand(dims4 d, layout l) {
    switch (l) {
      case layout::bhsd:
        buf.resize(static_cast<std::size_t>(d.b * d.h * d.s * d.d));
        view = bhsd(buf.data(), d);
        break;
      case layout::bshd:
        buf.resize(static_cast<std::size_t>(d.b * d.h * d.s * d.d));
        view = bshd(buf.data(), d);
        break;
      case layout::padded: {
        const strides4 st{(d.h * (d.s * (d.d + 3) + 5)) + 7, d.s * (d.d + 3) + 5, d.d + 3, 1};
        buf.resize(static_cast<std::size_t>(d.b * st.b));
        view = strided(buf.data(), d, st);
        break;
      }
      case layout::padded16: {
        const strides4 st{(d.h * (d.s * (d.d + 8) + 16)) + 24, d.s * (d.d + 8) + 16, d.d + 8, 1};
        buf.resize(static_cast<std::size_t>(d.b * st.b));
        view = strided(buf.data(), d, st);
        break;
      }
    }
  }
  operand(const operand&) = delete;
  operand& operator=(const operand&) = delete;

  /// Every byte of the buffer (gaps included) gets a random value in [lo, hi].
  void fill(std::mt19937_64& rng, double lo = -1.0, double hi = 1.0) {
    std::uniform_real_distribution<double> u(lo, hi);
    for (auto& x : buf) x = static_cast<T>(u(rng));
  }
  tensor_ref<const T> cview() const { return view; }
};

/// Q, K, V, O of one problem, filled with random inputs; O is filled with a sentinel pattern.
template <class T>
struct attention_case {
  problem p;
  operand<T> q, k, v, o;
  attention_case(const problem& pr, layout l, std::mt19937_64& rng)
      : p(pr), q(pr.q_dims(), l), k(pr.kv_dims(), l), v(pr.kv_dims(), l), o(pr.o_dims(), l) {
    q.fill(rng);
    k.fill(rng);
    v.fill(rng);
    o.fill(rng, 7.0, 9.0);
  }
};

/// Max |o − ref| over every element of the view (ref laid out [b][h][i][c]).
template <class T>
double max_abs_error(const tensor_ref<T>& o, const std::vector<double>& ref) {
  double err = 0;
  const dims4 d = o.dims;
  for (index_t b = 0; b < d.b; ++b)
    for (index_t h = 0; h < d.h; ++h)
      for (index_t i = 0; i < d.s; ++i)
        for (index_t c = 0; c < d.d; ++c) {
          const double x = static_cast<double>(o.row(b, h, i)[c]);
          const double r = ref[static_cast<std::size_t>(((b * d.h + h) * d.s + i) * d.d + c)];
          const double e = std::isnan(x) ? std::numeric_limits<double>::infinity() : std::abs(x - r);
          err = std::max(err, e);
        }
  return err;
}

/// Max |lse − ref|; both −inf counts as equal, one −inf as infinite error.
inline double max_lse_error(const std::vector<float>& lse, const std::vector<double>& ref) {
  double err = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    const double x = lse[i], r = ref[i];
    if (std::isinf(r) && x == r) continue;
    const double e = std::isnan(x) || std::isinf(x) || std::isinf(r) ? std::numeric_limits<double>::infinity()
                                                                     : std::abs(x - r);
    err = std::max(err, e);
  }
  return err;
}

/// Unit roundoff of a storage type.
template <class T>
double epsilon() {
  return static_cast<double>(Eigen::NumTraits<T>::epsilon());
}

/// Tolerance for a kernel's output error: 2 × the error of the plain same-precision implementation against the
/// float64 oracle, plus a floor of a few units of roundoff of the storage type (the plain error can be lucky).
template <class T>
double output_tolerance(double plain_error) {
  return 2.0 * plain_error + 8.0 * epsilon<T>();
}

/// The float64 oracle and the plain same-precision implementation on one case, and the tolerance they give.
struct expected {
  reference ref;
  double tolerance = 0;
  double lse_tolerance = 0;
};
template <class T, class Mask>
expected expect(const attention_case<T>& c, const Mask& bound) {
  expected e{reference_attention<double>(c.p, c.q.cview(), c.k.cview(), c.v.cview(), bound)};
  const reference plain = reference_attention<accum_t<T>>(c.p, c.q.cview(), c.k.cview(), c.v.cview(), bound);
  // The plain implementation's output is rounded to T like a kernel's would be.
  std::vector<double> plain_o(plain.o.size());
  for (std::size_t i = 0; i < plain.o.size(); ++i) plain_o[i] = static_cast<double>(static_cast<T>(plain.o[i]));
  double plain_err = 0;
  for (std::size_t i = 0; i < plain_o.size(); ++i) plain_err = std::max(plain_err, std::abs(plain_o[i] - e.ref.o[i]));
  e.tolerance = output_tolerance<T>(plain_err);
  // In double the plain implementation is the oracle itself (error 0): the floor then also allows the rounding of a
  // different summation order over the keys and the head_dim columns (about ε·√n).
  if (std::is_same<accum_t<T>, double>::value) {
    const double n = static_cast<double>(c.p.seq_kv + c.p.head_dim);
    e.tolerance = std::max(e.tolerance, 8.0 * epsilon<T>() * std::sqrt(n));
  }
  std::vector<float> plain_lse(plain.lse.begin(), plain.lse.end());
  e.lse_tolerance = 2.0 * max_lse_error(plain_lse, e.ref.lse) + 64.0 * static_cast<double>(Eigen::NumTraits<float>::epsilon());
  return e;
}

/// True when every element of the buffer still holds its original value (nothing was written).
template <class T>
bool unchanged(const std::vector<T>& now, const std::vector<T>& before) {
  return std::equal(now.begin(), now.end(), before.begin(), before.end(), [](const T& a, const T& b) {
    return static_cast<double>(a) == static_cast<double>(b);
  });
}

}  // namespace fusedattn::testing
