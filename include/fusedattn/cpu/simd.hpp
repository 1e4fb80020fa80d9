/// @file simd.hpp
/// The vector operations the CPU micro-kernels use, as one small traits struct per (scalar, arch):
/// xsimd::batch<Acc, Arch> for every xsimd arch, and plain scalars for `scalar_arch` (the portable reference path).
/// Not a general SIMD layer: only what the flash kernels need.
#pragma once

#include <cmath>
#include <cstdint>
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

/// True for fusedattn's own arch tags (cpu/arch_x86.hpp: run-time checked, not xsimd arches).
template <class Arch, class = void>
struct is_runtime_arch : std::false_type {};
template <class Arch>
struct is_runtime_arch<Arch, std::enable_if_t<Arch::runtime_checked>> : std::true_type {};

/// True when `Arch` is an xsimd arch with 32 vector registers: AVX-512, and NEON on AArch64 (v0–v31).
template <class Arch>
constexpr bool has_32_registers() {
#if XSIMD_WITH_AVX512F
  return std::is_base_of<xsimd::avx512f, Arch>::value;
#elif XSIMD_WITH_NEON64
  return std::is_base_of<xsimd::neon64, Arch>::value;
#else
  return false;
#endif
}

/// Whether the CPU running this process can execute code compiled for `Arch`.
template <class Arch>
bool arch_available() {
  if constexpr (std::is_same<Arch, scalar_arch>::value) {
    return true;
  } else if constexpr (is_runtime_arch<Arch>::value) {
    return Arch::available();
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
  /// a > b ? a : b lane by lane: b when either is NaN (x86 max semantics, and the scalar path's). The softmax
  /// relies on it: max(x, acc) skips a NaN x, max(lo, x) keeps it.
  static type max(const type& a, const type& b) {
#if XSIMD_WITH_NEON64
    // NEON's FMAX returns NaN when either operand is NaN: compare and select instead.
    if constexpr (std::is_base_of<xsimd::neon64, Arch>::value) return xsimd::select(a > b, a, b);
#endif
    return xsimd::max(a, b);
  }
  static type mul(const type& a, const type& b) { return a * b; }
  static type add(const type& a, const type& b) { return a + b; }
  static type sub(const type& a, const type& b) { return a - b; }
  /// 2^x for x <= 0 (the softmax only exponentiates t − max), with 2^−inf = 0 and 2^NaN = NaN.
  /// Float: cpu::exp2_nonpositive; double: cpu::exp2_nonpositive_f64.
  static type exp2(const type& x);
  static Acc reduce_add(const type& x) { return xsimd::hadd(x); }
  static Acc reduce_max(const type& x) {
#if XSIMD_WITH_AVX512F
    if constexpr (std::is_base_of<xsimd::avx512f, Arch>::value) {
      if constexpr (std::is_same<Acc, float>::value) return _mm512_reduce_max_ps(x);
      else return _mm512_reduce_max_pd(x);
    }
#endif
#if XSIMD_WITH_NEON64
    if constexpr (std::is_base_of<xsimd::neon64, Arch>::value) {
      if constexpr (std::is_same<Acc, float>::value) return vmaxvq_f32(x);
      else return vmaxvq_f64(x);
    }
#endif
    alignas(64) Acc lanes[type::size];
    x.store_unaligned(lanes);
    Acc m = lanes[0];
    for (std::size_t i = 1; i < type::size; ++i) m = lanes[i] > m ? lanes[i] : m;
    return m;
  }
};

/// 2^x for x <= 0 on float vectors, about 2 ulp: x = n + f with n = round(x), f in [−1/2, 1/2];
/// 2^f by its degree-6 Taylor polynomial in f·ln2 (truncation < 1.3e−7 relative); 2^n built in the exponent bits.
/// x is clamped at −127 first, where 2^n has a zero exponent field and the result is exactly 0 (so −inf gives 0);
/// the clamp max(−127, x) keeps a NaN x (simd::max returns its second operand), and NaN flows through to the result.
template <class Arch>
inline xsimd::batch<float, Arch> exp2_nonpositive(xsimd::batch<float, Arch> x) {
  using vec = xsimd::batch<float, Arch>;
  using ivec = xsimd::batch<std::int32_t, Arch>;
  constexpr float min_exponent = -127.0f;  // 2^n with n = −127 is encoded as the bit pattern 0, i.e. 0.0f
  constexpr int exponent_bias = 127, mantissa_bits = 23;
  constexpr float shifter = 12582912.0f + exponent_bias;  // 1.5 · 2^23 + 127
  // c_k = ln2^k / k!, k = 6 .. 1
  constexpr float c6 = 1.5403530393381609e-4f, c5 = 1.3333558146428443e-3f, c4 = 9.6181291076284772e-3f,
                  c3 = 5.5504108664821580e-2f, c2 = 2.4022650695910071e-1f, c1 = 6.9314718055994531e-1f;
  x = simd<float, Arch>::max(vec(min_exponent), x);
  // n = round(x) by the shifter trick: x + 1.5·2^23 + 127 lies in [2^23, 2^24), where floats are integers, so the
  // sum holds n + 127 in its low mantissa bits; shifting those bits into the exponent field gives 2^n directly.
  const vec shifted = x + vec(shifter);
  const vec n = shifted - vec(shifter);
  const vec f = x - n;
  vec p = xsimd::fma(vec(c6), f, vec(c5));
  p = xsimd::fma(p, f, vec(c4));
  p = xsimd::fma(p, f, vec(c3));
  p = xsimd::fma(p, f, vec(c2));
  p = xsimd::fma(p, f, vec(c1));
  p = xsimd::fma(p, f, vec(1.0f));
  const ivec bits = xsimd::bitwise_cast<ivec>(shifted) << mantissa_bits;
  return p * xsimd::bitwise_cast<vec>(bits);
}

/// 2^x for x <= 0 on double vectors by xsimd::exp2, without undefined behaviour: xsimd converts round(x) to int64
/// before it selects 0 for x below its range, and that conversion is undefined for −inf and NaN (UBSan's
/// float-cast-overflow). So x is clamped at −1075 first, max(x, −1075), where 2^x rounds to 0 already (the
/// smallest subnormal is 2^−1074) and which also maps NaN to −1075 (simd::max returns its second operand); the
/// NaN is then put back by a select, so 2^NaN = NaN as on the other paths. Bitwise the same as xsimd::exp2 for
/// every x that is not NaN.
template <class Arch>
inline xsimd::batch<double, Arch> exp2_nonpositive_f64(const xsimd::batch<double, Arch>& x) {
  using vec = xsimd::batch<double, Arch>;
  constexpr double min_exponent = -1075.0;  // 2^−1075 rounds to 0 (half the smallest subnormal, ties to even)
  const vec p = xsimd::exp2(simd<double, Arch>::max(x, vec(min_exponent)));
  return xsimd::select(xsimd::isnan(x), x, p);
}

template <class Acc, class Arch>
inline typename simd<Acc, Arch>::type simd<Acc, Arch>::exp2(const type& x) {
  if constexpr (std::is_same<Acc, float>::value) {
    return exp2_nonpositive<Arch>(x);
  } else {
    return exp2_nonpositive_f64<Arch>(x);
  }
}

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

/// Register blocking of the micro-kernels for one arch. Q·Kᵀ keeps `qk_mr` query rows × `qk_nr` vectors of keys
/// in accumulators, P·V `pv_mr` rows × `pv_nr` vectors of head_dim columns.
/// 32-register arches (AVX-512): Q·Kᵀ 4 × 4 (16 accumulators, a Kᵀ panel of 64 keys), P·V 12 × 2 (24
/// accumulators + 2 streamed V vectors + 1 broadcast): each V vector feeds 12 FMAs, and a packed V chunk of
/// 2 vectors (32 floats) × 256 keys is 32 KB, so it stays in the 48 KB L1 while every row block of the tile reads
/// it (a 4-vector chunk is 64 KB and streamed from L2 once per row block). On one thread 4 × 4 runs as fast (Sapphire
/// Rapids class Xeon, Zen 5); with 16 threads on the Xeon 12 × 2 is faster. AArch64 NEON (32 registers of 4 floats)
/// takes the same blocking.
/// 16-register arches: 4 × 2 for both; the scalar path 4 × 4 scalars.
template <class Acc, class Arch>
struct kernel_shape {
  static constexpr index_t width = simd<Acc, Arch>::width;
  static constexpr bool wide = has_32_registers<Arch>();
  static constexpr bool scalar = std::is_same<Arch, scalar_arch>::value;
  static constexpr index_t qk_mr = 4;
  static constexpr index_t qk_nr = (wide || scalar) ? 4 : 2;
  static constexpr index_t pv_mr = wide ? 12 : 4;
  static constexpr index_t pv_nr = wide ? 2 : (scalar ? 4 : 2);
  /// Key columns one Q·Kᵀ micro-tile covers; packed Kᵀ panels are this wide.
  static constexpr index_t cols = qk_nr * width;
  /// Head_dim columns one P·V micro-tile covers; packed V chunks are this wide.
  static constexpr index_t vw = pv_nr * width;
  /// Row padding of the scratch tiles (the larger row block).
  static constexpr index_t mr = qk_mr > pv_mr ? qk_mr : pv_mr;
};

/// How the tile loop packs Q, K and V for one arch. Kernel sets whose Q·Kᵀ and P·V run on bf16 pairs specialise it
/// beside their kernels (x86_kernels.hpp, arm_kernels.hpp) with `pairs` true and their prepare_q_pairs,
/// pack_k_pairs and pack_v_pair_row; every other arch packs them as Acc.
template <class Arch>
struct pair_packers {
  static constexpr bool pairs = false;
};

}  // namespace cpu
}  // namespace fusedattn

#include "arch_x86.hpp"  // fusedattn's own arch tags, read as these traits by the generic code
