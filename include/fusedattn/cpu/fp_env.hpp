/// @file fp_env.hpp
/// The floating-point mode the CPU kernels run in: an RAII guard that sets flush-to-zero and denormals-are-zero
/// on the calling thread and restores the previous mode on exit. Not a general FP-environment API.
#pragma once

#include <cstdint>

#if defined(__SSE__) || defined(_M_X64)
#include <xmmintrin.h>
#define FUSEDATTN_FP_ENV_MXCSR 1
#elif defined(__aarch64__) && defined(__GNUC__)
#define FUSEDATTN_FP_ENV_FPCR 1
#endif

namespace fusedattn {
namespace cpu {

/// Flush-to-zero and denormals-are-zero for the lifetime of the object, on the thread that constructs it (each
/// OpenMP worker needs its own: the mode is per thread). Subnormal inputs of every arithmetic instruction then
/// read as 0 and subnormal results are written as 0, so no instruction takes the slow microcoded path for them
/// (docs/design.md, Numerics: "Subnormals"). The destructor restores the thread's previous mode exactly.
///   x86 (SSE): MXCSR bits FTZ (15) and DAZ (6), which govern SSE/AVX/AVX-512 arithmetic; x87 code is unaffected.
///   aarch64:   FPCR bit FZ (24), which flushes both inputs and results.
///   elsewhere: no effect (subnormals keep their value and their cost).
class flush_denormals_scope {
 public:
  flush_denormals_scope() {
#if defined(FUSEDATTN_FP_ENV_MXCSR)
    saved_ = _mm_getcsr();
    _mm_setcsr(saved_ | mxcsr_ftz | mxcsr_daz);
#elif defined(FUSEDATTN_FP_ENV_FPCR)
    std::uint64_t fpcr = 0;
    __asm__ __volatile__("mrs %0, fpcr" : "=r"(fpcr));
    saved_ = fpcr;
    __asm__ __volatile__("msr fpcr, %0" : : "r"(fpcr | fpcr_fz));
#endif
  }
  ~flush_denormals_scope() {
#if defined(FUSEDATTN_FP_ENV_MXCSR)
    _mm_setcsr(saved_);
#elif defined(FUSEDATTN_FP_ENV_FPCR)
    __asm__ __volatile__("msr fpcr, %0" : : "r"(saved_));
#endif
  }
  flush_denormals_scope(const flush_denormals_scope&) = delete;
  flush_denormals_scope& operator=(const flush_denormals_scope&) = delete;

 private:
#if defined(FUSEDATTN_FP_ENV_MXCSR)
  static constexpr unsigned mxcsr_ftz = 1u << 15;  ///< flush subnormal results to zero
  static constexpr unsigned mxcsr_daz = 1u << 6;   ///< read subnormal inputs as zero
  unsigned saved_ = 0;
#elif defined(FUSEDATTN_FP_ENV_FPCR)
  static constexpr std::uint64_t fpcr_fz = std::uint64_t(1) << 24;  ///< flush-to-zero, inputs and results
  std::uint64_t saved_ = 0;
#endif
};

}  // namespace cpu
}  // namespace fusedattn
