/// @file arch_x86.hpp
/// fusedattn's own CPU arch tags beside xsimd's: `cpu::avx512` and `cpu::avx512bf16` (kernels compiled for their
/// instruction set whatever the program's -m flags, chosen only where CPUID says the CPU has it) and `cpu::best`
/// (the best kernel set of the running CPU, picked at run time). CPUID detection is here; the kernels are in x86_kernels.hpp.
#pragma once

#include <type_traits>

#include <xsimd/xsimd.hpp>

#include "../core/types.hpp"
#include "simd.hpp"

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__)) && !defined(__CUDACC__)
/// 1 where fusedattn compiles its own x86 kernel sets (GCC or clang on x86, host code): their functions carry the
/// instruction set in a target attribute, so they build without -m flags and run only where CPUID allows them.
#define FUSEDATTN_X86_KERNELS 1
#include <cpuid.h>
#else
#define FUSEDATTN_X86_KERNELS 0
#endif

namespace fusedattn {
namespace cpu {

/// The x86 features fusedattn's own kernel sets need, read once from CPUID (and XGETBV: the OS must save the
/// AVX-512 register state, else the instructions fault even where the CPU has them).
struct x86_features {
  bool avx2_fma = false;    ///< AVX2 + FMA3, with OS support for the YMM state
  bool avx512 = false;      ///< AVX-512 F, BW, DQ, VL, with OS support for the ZMM state
  bool avx512bf16 = false;  ///< the above and AVX512-BF16 (vdpbf16ps, vcvtne2ps2bf16)
  bool avx512fp16 = false;  ///< the above and AVX512-FP16
  bool amx_bf16 = false;    ///< AMX-TILE and AMX-BF16 in CPUID (the OS permission is a separate request)
};

/// The running CPU's features (all false where FUSEDATTN_X86_KERNELS is 0).
inline const x86_features& x86_cpu() {
  static const x86_features f = [] {
    x86_features r;
#if FUSEDATTN_X86_KERNELS
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return r;
    const bool osxsave = (c >> 27) & 1u, fma = (c >> 12) & 1u;
    if (!osxsave || __get_cpuid_max(0, nullptr) < 7) return r;
    unsigned xcr0_lo = 0, xcr0_hi = 0;
    __asm__ volatile("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
    const bool os_ymm = (xcr0_lo & 0x6u) == 0x6u;    // XMM and YMM state
    const bool os_zmm = (xcr0_lo & 0xe6u) == 0xe6u;  // and opmask, ZMM_Hi256, Hi16_ZMM
    __cpuid_count(7, 0, a, b, c, d);
    const bool avx2 = (b >> 5) & 1u, f512 = (b >> 16) & 1u, dq = (b >> 17) & 1u, bw = (b >> 30) & 1u,
               vl = (b >> 31) & 1u, fp16 = (d >> 23) & 1u, amx_bf16 = (d >> 22) & 1u, amx_tile = (d >> 24) & 1u;
    unsigned a1 = 0, b1 = 0, c1 = 0, d1 = 0;
    __cpuid_count(7, 1, a1, b1, c1, d1);
    const bool bf16 = (a1 >> 5) & 1u;
    r.avx2_fma = os_ymm && avx2 && fma;
    r.avx512 = r.avx2_fma && os_zmm && f512 && dq && bw && vl;
    r.avx512bf16 = r.avx512 && bf16;
    r.avx512fp16 = r.avx512 && fp16;
    r.amx_bf16 = amx_tile && amx_bf16;
#endif
    return r;
  }();
  return f;
}

/// The xsimd arch this translation unit is compiled for (its -m flags): what every part of the library that has
/// no kernel of its own for fusedattn's arch tags (decode, backward, score modifiers, f64) runs on under them.
using compiled_arch = xsimd::default_arch;

/// Flash on AVX-512F/BW/DQ/VL with fusedattn's own f32 kernels (16 floats a vector, 32 registers), built whatever
/// the program's -m flags: a program compiled for generic x86-64 runs it where CPUID reports AVX-512.
struct avx512 {
  static constexpr bool runtime_checked = true;
  static constexpr bool supported() noexcept { return FUSEDATTN_X86_KERNELS == 1; }
  static bool available() noexcept { return supported() && x86_cpu().avx512; }
  static constexpr const char* name() noexcept { return "avx512"; }
};

/// avx512 plus AVX512-BF16: with bf16 Q, K, V and O, Q·Kᵀ and P·V run on vdpbf16ps (bf16 pairs, f32
/// accumulation; P rounded to bf16); every other storage type runs avx512's f32 kernels.
struct avx512bf16 {
  static constexpr bool runtime_checked = true;
  static constexpr bool supported() noexcept { return FUSEDATTN_X86_KERNELS == 1; }
  static bool available() noexcept { return supported() && x86_cpu().avx512bf16; }
  static constexpr const char* name() noexcept { return "avx512bf16"; }
};

/// The best kernel set the running CPU supports, chosen at run time per call (cpu::with_best_arch in
/// x86_kernels.hpp): avx512bf16 where its vdpbf16ps outruns the FMAs, else avx512, else the compiled xsimd arch
/// (compiled_arch) when the CPU has it, else the portable scalar path. fa::plan names the arch chosen. Parts
/// without kernels of their own for the tags (backward, f64) run on compiled_arch.
struct best {
  static constexpr bool runtime_checked = true;
  static constexpr bool supported() noexcept { return true; }
  static bool available() noexcept { return true; }
  static constexpr const char* name() noexcept { return "best"; }
};

namespace detail {
/// The internal kernel set of the tile loop for (Q/O storage T, K/V storage TKV) under a user arch tag: f32 FMA
/// kernels on AVX-512, or the vdpbf16ps kernels (bf16 pairs packed along head_dim and along keys).
struct x86_f32_set {
  static constexpr bool runtime_checked = true;
  static constexpr bool supported() noexcept { return FUSEDATTN_X86_KERNELS == 1; }
  static bool available() noexcept { return supported() && x86_cpu().avx512; }
  static constexpr const char* name() noexcept { return "avx512"; }
};
struct x86_bf16_set {
  static constexpr bool runtime_checked = true;
  static constexpr bool supported() noexcept { return FUSEDATTN_X86_KERNELS == 1; }
  static bool available() noexcept { return supported() && x86_cpu().avx512bf16; }
  static constexpr const char* name() noexcept { return "avx512bf16"; }
};
}  // namespace detail

/// Whether the tile loop under `Arch` runs fusedattn's own AVX-512 kernels (f32 or bf16 pairs).
template <class Arch>
inline constexpr bool is_x86_set_v =
    FUSEDATTN_X86_KERNELS == 1 &&
    (std::is_same<Arch, detail::x86_f32_set>::value || std::is_same<Arch, detail::x86_bf16_set>::value);
/// Whether the tile loop under `Arch` packs K and V as bf16 pairs for vdpbf16ps.
template <class Arch>
inline constexpr bool packs_bf16_pairs_v = FUSEDATTN_X86_KERNELS == 1 && std::is_same<Arch, detail::x86_bf16_set>::value;

/// The arch the tile loop runs for storage T (Q, O) and TKV (K, V) under the policy's arch: an xsimd arch or
/// scalar_arch as is; avx512 → the f32 set; avx512bf16 → the bf16 set for all-bf16 storage, else the f32 set;
/// f64 (no own kernels) → compiled_arch.
template <class T, class TKV, class Arch>
struct tile_arch {
  using type = Arch;
};
template <class T, class TKV>
struct tile_arch<T, TKV, avx512> {
  using type = std::conditional_t<std::is_same<accum_t<T>, float>::value && FUSEDATTN_X86_KERNELS == 1,
                                  detail::x86_f32_set, compiled_arch>;
};
template <class T, class TKV>
struct tile_arch<T, TKV, avx512bf16> {
  using type = std::conditional_t<
      !(std::is_same<accum_t<T>, float>::value && FUSEDATTN_X86_KERNELS == 1), compiled_arch,
      std::conditional_t<std::is_same<std::remove_cv_t<T>, Eigen::bfloat16>::value &&
                             std::is_same<std::remove_cv_t<TKV>, Eigen::bfloat16>::value,
                         detail::x86_bf16_set, detail::x86_f32_set>>;
};
template <class T, class TKV, class Arch>
using tile_arch_t = typename tile_arch<T, TKV, Arch>::type;

/// The xsimd arch (or scalar_arch) that stands for `Arch` in the code without kernels for the tags.
template <class Arch>
using xsimd_arch_t = std::conditional_t<is_runtime_arch<Arch>::value, compiled_arch, Arch>;

/// Register blocking of fusedattn's own AVX-512 kernel sets (the same for f32 and bf16 pairs): 16 lanes, Q·Kᵀ
/// 4 rows × 4 vectors (64-key panels), P·V 12 rows × 2 vectors (32-column chunks), as kernel_shape on xsimd's
/// AVX-512 arches.
struct x86_shape {
  static constexpr index_t width = 16;
  static constexpr bool wide = true;
  static constexpr bool scalar = false;
  static constexpr index_t qk_mr = 4;
  static constexpr index_t qk_nr = 4;
  static constexpr index_t pv_mr = 12;
  static constexpr index_t pv_nr = 2;
  static constexpr index_t cols = qk_nr * width;
  static constexpr index_t vw = pv_nr * width;
  static constexpr index_t mr = pv_mr;
};

// Every arch tag reads as compiled_arch to the code without kernels of its own for it; the tile loop's shape is
// x86_shape for float wherever the tag runs the own kernels.
template <class Acc>
struct simd<Acc, avx512> : simd<Acc, compiled_arch> {};
template <class Acc>
struct simd<Acc, avx512bf16> : simd<Acc, compiled_arch> {};
template <class Acc>
struct simd<Acc, best> : simd<Acc, compiled_arch> {};
template <class Acc>
struct simd<Acc, detail::x86_f32_set> : simd<Acc, compiled_arch> {};
template <class Acc>
struct simd<Acc, detail::x86_bf16_set> : simd<Acc, compiled_arch> {};

template <class Acc>
struct kernel_shape<Acc, best> : kernel_shape<Acc, compiled_arch> {};
#if FUSEDATTN_X86_KERNELS
template <class Acc>
struct kernel_shape<Acc, avx512> : std::conditional_t<std::is_same<Acc, float>::value, x86_shape,
                                                      kernel_shape<Acc, compiled_arch>> {};
template <class Acc>
struct kernel_shape<Acc, avx512bf16> : kernel_shape<Acc, avx512> {};
template <class Acc>
struct kernel_shape<Acc, detail::x86_f32_set> : kernel_shape<Acc, avx512> {};
template <class Acc>
struct kernel_shape<Acc, detail::x86_bf16_set> : kernel_shape<Acc, avx512> {};
#else
template <class Acc>
struct kernel_shape<Acc, avx512> : kernel_shape<Acc, compiled_arch> {};
template <class Acc>
struct kernel_shape<Acc, avx512bf16> : kernel_shape<Acc, compiled_arch> {};
#endif

}  // namespace cpu
}  // namespace fusedattn
