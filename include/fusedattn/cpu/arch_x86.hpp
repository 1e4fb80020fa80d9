/// @file arch_x86.hpp
/// fusedattn's own CPU arch tags beside xsimd's: `cpu::avx512`, `cpu::avx512bf16` and `cpu::amx` (kernels compiled
/// for their instruction set whatever the program's -m flags, chosen only where CPUID says the CPU has it) and
/// `cpu::best` (the best set of the running CPU, picked at run time). CPUID and the AMX permission request are
/// here; the kernels are in x86_kernels.hpp.
#pragma once

#include <cerrno>
#include <cstring>
#include <string>
#include <type_traits>

#include <xsimd/xsimd.hpp>

#include "../core/status.hpp"
#include "../core/types.hpp"
#include "simd.hpp"

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__)) && !defined(__CUDACC__)
/// 1 where fusedattn compiles its own x86 kernel sets (GCC or clang on x86, host code): their functions carry the
/// instruction set in a target attribute, so they build without -m flags and run only where CPUID allows them.
#define FUSEDATTN_X86_KERNELS 1
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
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
  bool amx_bf16 = false;    ///< avx512bf16, AMX-TILE and AMX-BF16, with OS support for the tile state (the
                            ///< process's permission to use it is a separate request: amx_permission)
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
    const bool os_tiles = (xcr0_lo & 0x60000u) == 0x60000u;  // XTILECFG and XTILEDATA
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
    r.amx_bf16 = r.avx512bf16 && os_tiles && amx_tile && amx_bf16;
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

/// The process's permission to use the AMX tile data (Linux: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)),
/// requested once per process on first use (thread-safe: a function-local static); later calls return the first
/// answer. ok, or errc::unsupported with the system's reason (the errno text); unsupported off Linux.
inline const status& amx_permission() {
  static const status answer = []() -> status {
#if FUSEDATTN_X86_KERNELS && defined(__linux__)
    constexpr long arch_req_xcomp_perm = 0x1023, xfeature_xtiledata = 18;  // <asm/prctl.h>, the XSAVE component
    if (syscall(SYS_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata) == 0) return {};
    const int err = errno;
    return {errc::unsupported, std::string("AMX: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) failed: ") +
                                   std::strerror(err)};
#else
    return {errc::unsupported, "AMX: fusedattn requests the tile permission on Linux only"};
#endif
  }();
  return answer;
}

/// avx512bf16 plus AMX-BF16: with bf16 K and V (Q and O in bf16, or in f32: then Q is rounded to bf16 as it is
/// packed), Q·Kᵀ and P·V run on TDPBF16PS tiles (bf16 pairs, f32 accumulation; P rounded to bf16), the softmax on
/// the AVX-512 f32 kernels; other storage types run avx512's f32 kernels. Available where CPUID reports AMX-TILE,
/// AMX-BF16 and AVX512-BF16 and the OS grants the tile permission (amx_permission, asked on first use).
struct amx {
  static constexpr bool runtime_checked = true;
  static constexpr bool supported() noexcept { return FUSEDATTN_X86_KERNELS == 1; }
#if defined(FUSEDATTN_AMX_EMULATE)
  // Test builds: the tile instructions are emulated in scalar code (x86_kernels.hpp), so AVX512-BF16 suffices.
  static bool available() noexcept { return supported() && x86_cpu().avx512bf16; }
#else
  static bool available() noexcept { return supported() && x86_cpu().amx_bf16 && amx_permission().ok(); }
#endif
  static constexpr const char* name() noexcept { return "amx"; }
};

/// ok where this process can run code of `Arch` (cpu::arch_available), else errc::unsupported with the reason:
/// for cpu::amx on a CPU with AMX, the OS's answer to the permission request.
template <class Arch>
status arch_status() {
  if (arch_available<Arch>()) return {};
  if constexpr (std::is_same<Arch, amx>::value)
    if (x86_cpu().amx_bf16 && !amx_permission().ok()) return amx_permission();
  return {errc::unsupported, std::string("this CPU cannot run the ") + Arch::name() +
                                 " code of policy::cpu<Arch>; pick an arch it supports"};
}

/// The best kernel set the running CPU supports, chosen at run time per call (cpu::with_best_arch in
/// x86_kernels.hpp): amx where the CPU has it (for all-bf16 storage; other storage on the AVX-512 f32 kernels),
/// else avx512bf16 where its vdpbf16ps outruns the FMAs, else avx512; on AArch64 built for FEAT_BF16, neon_bf16
/// where the CPU has it (arm_kernels.hpp); else the compiled xsimd arch (compiled_arch) when the CPU has it, else
/// the portable scalar path. fa::plan names the arch chosen. Parts
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
/// cpu::best's pick on a CPU with AMX: all-bf16 storage on the AMX set; mixed storage keeps the f32 computation of
/// its contract (the f32 set), as every other storage type.
struct amx_for_bf16 : amx {};
/// The AMX set: the bf16-pair layouts, Q·Kᵀ and P·V on tiles (x86_kernels.hpp, qk_tile_amx / pv_tile_amx).
struct x86_amx_set {
  static constexpr bool runtime_checked = true;
  static constexpr bool supported() noexcept { return FUSEDATTN_X86_KERNELS == 1; }
  static bool available() noexcept { return amx::available(); }
  static constexpr const char* name() noexcept { return "amx"; }
};
}  // namespace detail

/// Whether the tile loop under `Arch` packs Q, K and V as bf16 pairs (for vdpbf16ps or AMX tiles).
template <class Arch>
inline constexpr bool packs_bf16_pairs_v =
    FUSEDATTN_X86_KERNELS == 1 &&
    (std::is_same<Arch, detail::x86_bf16_set>::value || std::is_same<Arch, detail::x86_amx_set>::value);
/// Whether the tile loop under `Arch` runs fusedattn's own AVX-512 kernels (f32, bf16 pairs or AMX tiles).
template <class Arch>
inline constexpr bool is_x86_set_v =
    FUSEDATTN_X86_KERNELS == 1 && (std::is_same<Arch, detail::x86_f32_set>::value || packs_bf16_pairs_v<Arch>);

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
template <class T, class TKV>
struct tile_arch<T, TKV, amx> {
  using type = std::conditional_t<
      !(std::is_same<accum_t<T>, float>::value && FUSEDATTN_X86_KERNELS == 1), compiled_arch,
      std::conditional_t<std::is_same<std::remove_cv_t<TKV>, Eigen::bfloat16>::value, detail::x86_amx_set,
                         detail::x86_f32_set>>;
};
template <class T, class TKV>
struct tile_arch<T, TKV, detail::amx_for_bf16> {
  using type = std::conditional_t<std::is_same<std::remove_cv_t<T>, Eigen::bfloat16>::value,
                                  typename tile_arch<T, TKV, amx>::type, typename tile_arch<T, TKV, avx512>::type>;
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
/// The AMX set's blocking: x86_shape with the Q tile padded to 16 rows (a tile's rows), for the scratch.
struct x86_amx_shape : x86_shape {
  static constexpr index_t mr = 16;
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
struct simd<Acc, amx> : simd<Acc, compiled_arch> {};
template <class Acc>
struct simd<Acc, detail::x86_amx_set> : simd<Acc, compiled_arch> {};
template <class Acc>
struct simd<Acc, detail::amx_for_bf16> : simd<Acc, compiled_arch> {};

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
template <class Acc>
struct kernel_shape<Acc, amx> : kernel_shape<Acc, avx512> {};
template <class Acc>
struct kernel_shape<Acc, detail::amx_for_bf16> : kernel_shape<Acc, avx512> {};
template <class Acc>
struct kernel_shape<Acc, detail::x86_amx_set>
    : std::conditional_t<std::is_same<Acc, float>::value, x86_amx_shape, kernel_shape<Acc, compiled_arch>> {};
#else
template <class Acc>
struct kernel_shape<Acc, avx512> : kernel_shape<Acc, compiled_arch> {};
template <class Acc>
struct kernel_shape<Acc, avx512bf16> : kernel_shape<Acc, compiled_arch> {};
template <class Acc>
struct kernel_shape<Acc, amx> : kernel_shape<Acc, compiled_arch> {};
template <class Acc>
struct kernel_shape<Acc, detail::amx_for_bf16> : kernel_shape<Acc, compiled_arch> {};
#endif

}  // namespace cpu
}  // namespace fusedattn

#include "arm_kernels.hpp"  // the Arm bf16 tag (cpu::neon_bf16) and its kernel set, beside these
