/// @file config.hpp
/// Build configuration of fusedattn: version, backend switches, the host/device qualifier and the
/// overridable internal assertion. Nothing here depends on Eigen or xsimd.
#pragma once

#include <cstdio>
#include <cstdlib>

#define FUSEDATTN_VERSION_MAJOR 0
#define FUSEDATTN_VERSION_MINOR 1
#define FUSEDATTN_VERSION_PATCH 0

/// Defined to 1 by the build (CMake option FUSEDATTN_WITH_CUDA) when the CUDA backend is compiled in.
#ifndef FUSEDATTN_WITH_CUDA
#define FUSEDATTN_WITH_CUDA 0
#endif
/// Defined to 1 by the build when the Ascend shim is compiled in.
#ifndef FUSEDATTN_WITH_ASCEND
#define FUSEDATTN_WITH_ASCEND 0
#endif

/// Marks functions that the CUDA kernels call too (mask rules, index maths).
#if defined(__CUDACC__)
#define FUSEDATTN_HOST_DEVICE __host__ __device__
#else
#define FUSEDATTN_HOST_DEVICE
#endif

/// Keeps a micro-kernel out of line: its register allocation then does not depend on the loop that calls it
/// (inlined into the tile loop, the Q·Kᵀ and P·V blocks ran ~25% slower for some mask types with GCC 12).
#if defined(__GNUC__) || defined(__clang__)
#define FUSEDATTN_NOINLINE __attribute__((noinline))
#elif defined(_MSC_VER)
#define FUSEDATTN_NOINLINE __declspec(noinline)
#else
#define FUSEDATTN_NOINLINE
#endif

/// Internal invariant check. Bad user input never reaches it: that is reported through `status`.
/// Define FUSEDATTN_ASSERT before including fusedattn to route it elsewhere (a logger, an exception).
#ifndef FUSEDATTN_ASSERT
#if defined(NDEBUG) || defined(__CUDA_ARCH__)
#define FUSEDATTN_ASSERT(cond) ((void)0)
#else
#define FUSEDATTN_ASSERT(cond)                                                                   \
  ((cond) ? (void)0                                                                              \
          : (std::fprintf(stderr, "fusedattn: internal assertion failed: %s (%s:%d)\n", #cond, \
                          __FILE__, __LINE__),                                                   \
             std::abort()))
#endif
#endif

namespace fusedattn {
/// Library version as "major.minor.patch".
inline constexpr const char* version_string = "0.1.0";
}  // namespace fusedattn
