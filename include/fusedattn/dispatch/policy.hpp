/// @file policy.hpp
/// Execution policies: where and how `attend` runs. Every policy is always declared, so user code compiles
/// on every build; a policy whose backend is not compiled in makes `attend` return errc::unsupported.
#pragma once

#include <thread>

#include "../config.hpp"

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace fusedattn {

/// Threads a CPU policy uses when not told: OpenMP's maximum, else the hardware's, else 1.
inline int default_threads() {
#if defined(_OPENMP)
  return omp_get_max_threads();
#else
  const unsigned n = std::thread::hardware_concurrency();
  return n > 0 ? static_cast<int>(n) : 1;
#endif
}

namespace policy {

/// The naive three-pass pipeline on the CPU (Eigen GEMMs, materialised scores); the teaching baseline.
/// `threads` (>= 1) splits the (batch, head) pairs.
struct cpu_naive {
  int threads = default_threads();
};

/// Which CUDA kernel `policy::cuda` runs.
enum class cuda_kernel {
  automatic,  ///< flash where it applies (f16/bf16, head_dim 64 or 128, 16-byte aligned rows), else naive
  flash,      ///< the fused tensor-core kernel; errc::unsupported where it does not apply
  naive,      ///< the three-pass pipeline: cuBLAS Q·Kᵀ, softmax over the materialised scores, cuBLAS P·V
};

/// The CUDA backend. `stream` is a cudaStream_t (nullptr: the default stream); pointers must be device memory.
struct cuda {
  void* stream = nullptr;
  cuda_kernel kernel = cuda_kernel::automatic;
};

/// The Ascend shim. `stream` is an aclrtStream.
struct ascend {
  void* stream = nullptr;
};

}  // namespace policy
}  // namespace fusedattn
