/// @file simd.hpp
/// The vector operations the CPU micro-kernels use, as one small traits struct per (scalar, arch):
/// xsimd::batch<Acc, Arch> for every xsimd arch, and plain scalars for `scalar_arch` (the portable reference path).
/// Not a general SIMD layer: only what the flash kernels need.
#pragma once

#include <cmath>
#include <limits>
#include <type_traits>

#include <xsimd/xsimd.hpp>

#include "../core/types.hpp"

namespace fusedattn {

/// The portable scalar "arch": the micro-kernels run on plain scalars. Every SIMD backend is tested against it.
struct scalar_arch {
  static constexpr bool supported() noexcept { return true; }
  static constexpr bool available() noexcept { return true; }
  static constexpr const char* name() noexcept { return "scalar"; }
};

namespace cpu {

/// True when `Arch` is an xsimd AVX-512 arch (32 vector registers).
template <class Arch>
constexpr bool has_32_registers() {
#if XSIMD_WITH_AVX512F
  return std::is_base_of<xsimd::avx512f, Arch>::value;
#else
  return false;
#endif
}

/// Whether the CPU running this process can execute code compiled for `Arch`.
template <class Arch>
bool arch_available() {
  if constexpr (std::is_same<Arch, scalar_arch>::value) {
    return true;
  } else {
    return Arch::version() <= xsimd::available_architectures().best;
  }
}

/// Vector operations on `Acc` (float or double) for one xsimd arch.
template <class Acc, class Arch>
struct simd {
  static_assert(Arch::supported(),
                "fusedattn: the compiler does not target this xsimd arch; add the matching -m flags (e.g. -mavx512f) "
                "or pick another arch");
  using type = xsimd::batch<Acc, Arch>;
  static constexpr index_t width = static_cast<index_t>(type::size);

  static type load(const Acc* p) { return type::load_unaligned(p); }
  static void store(Acc* p, const type& x) { x.store_unaligned(p); }
  static type broadcast(Acc x) { return type(x); }
  /// a·b + c
  static type fma(const type& a, const type& b, const type& c) { return xsimd::fma(a, b, c); }
  static type max(const type& a, const type& b) { return xsimd::max(a, b); }
  static type mul(const type& a, const type& b) { return a * b; }
  static type add(const type& a, const type& b) { return a + b; }
  static type sub(const type& a, const type& b) { return a - b; }
  /// 2^x, with 2^−inf = 0.
  static type exp2(const type& x) { return xsimd::exp2(x); }
  static Acc reduce_add(const type& x) { return xsimd::hadd(x); }
  static Acc reduce_max(const type& x) {
    alignas(64) Acc lanes[type::size];
    x.store_unaligned(lanes);
    Acc m = lanes[0];
    for (std::size_t i = 1; i < type::size; ++i) m = lanes[i] > m ? lanes[i] : m;
    return m;
  }
};

/// The portable scalar path: one lane.
template <class Acc>
struct simd<Acc, scalar_arch> {
  using type = Acc;
  static constexpr index_t width = 1;

  static type load(const Acc* p) { return *p; }
  static void store(Acc* p, const type& x) { *p = x; }
  static type broadcast(Acc x) { return x; }
  static type fma(const type& a, const type& b, const type& c) { return a * b + c; }
  static type max(const type& a, const type& b) { return a > b ? a : b; }
  static type mul(const type& a, const type& b) { return a * b; }
  static type add(const type& a, const type& b) { return a + b; }
  static type sub(const type& a, const type& b) { return a - b; }
  static type exp2(const type& x) { return std::exp2(x); }
  static Acc reduce_add(const type& x) { return x; }
  static Acc reduce_max(const type& x) { return x; }
};

/// Register blocking of the micro-kernels for one arch: `mr` query rows × `nr` vectors of keys (Q·Kᵀ) or of
/// head_dim columns (P·V) stay in registers. 32-register arches (AVX-512) hold a 4 × 4 block of accumulators,
/// 16-register arches a 4 × 2 block; the scalar path a 4 × 4 block of scalars.
template <class Acc, class Arch>
struct kernel_shape {
  static constexpr index_t width = simd<Acc, Arch>::width;
  static constexpr index_t mr = 4;
  static constexpr index_t nr = (has_32_registers<Arch>() || std::is_same<Arch, scalar_arch>::value) ? 4 : 2;
  /// Key columns one Q·Kᵀ micro-tile covers; packed K tiles are padded to a multiple of it.
  static constexpr index_t cols = nr * width;
};

}  // namespace cpu
}  // namespace fusedattn
