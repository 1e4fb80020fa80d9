/// @file policy.hpp
/// Execution policies: where and how `attend` runs. Every policy is always declared, so user code compiles
/// on every build; a policy whose backend is not compiled in makes `attend` return errc::unsupported.
#pragma once

#include <thread>

#include <xsimd/xsimd.hpp>

#include "../config.hpp"
#include "../cpu/simd.hpp"
#include "../cpu/tiles.hpp"

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

/// The flash kernel on the CPU: one online-softmax tile loop with micro-kernels on xsimd::batch<float, Arch>
/// (double for double inputs). `Arch` is an xsimd arch the compiler targets (xsimd::avx512f, xsimd::fma3<xsimd::avx2>,
/// xsimd::sse4_2, xsimd::neon64, ...) or scalar_arch for the portable scalar path. `threads` (>= 1) splits
/// (batch, head, q-tile); results are bitwise identical for any thread count. `tiles` overrides the tile heuristic
/// (0 = choose). attend returns errc::unsupported when the running CPU lacks `Arch`.
template <class Arch = xsimd::default_arch>
struct cpu {
  using arch = Arch;
  int threads = default_threads();
  tile_sizes tiles{};
};

/// The portable scalar path of the flash kernel (the reference every SIMD backend is tested against).
using cpu_scalar = cpu<scalar_arch>;
#if XSIMD_WITH_SSE4_2
/// Flash on SSE4.2 (4 floats per vector).
using cpu_sse4_2 = cpu<xsimd::sse4_2>;
#endif
#if XSIMD_WITH_FMA3_AVX2
/// Flash on AVX2 with FMA (8 floats per vector).
using cpu_avx2 = cpu<xsimd::fma3<xsimd::avx2>>;
#endif
#if XSIMD_WITH_AVX512F
/// Flash on AVX-512F (16 floats per vector, 32 registers).
using cpu_avx512 = cpu<xsimd::avx512f>;
#endif
/// Flash on fusedattn's own AVX-512 f32 kernels, built whatever the program's -m flags (cpu/arch_x86.hpp).
using cpu_avx512_runtime = cpu<::fusedattn::cpu::avx512>;
/// Flash on AVX512-BF16: Q·Kᵀ and P·V on vdpbf16ps for bf16 storage (f32 accumulation, softmax in f32), the
/// AVX-512 f32 kernels for the other storage types; built whatever the program's -m flags.
using cpu_avx512bf16 = cpu<::fusedattn::cpu::avx512bf16>;
/// Flash on AMX tiles: Q·Kᵀ and P·V on TDPBF16PS for bf16 K and V (bf16 Q/O, or f32 Q/O with Q rounded to bf16;
/// f32 accumulation, softmax in f32), the AVX-512 f32 kernels for the other storage types; built whatever the
/// program's -m flags, refused (unsupported) where CPUID or the OS's tile permission says no.
using cpu_amx = cpu<::fusedattn::cpu::amx>;
/// Flash on the best kernel set the running CPU supports, chosen at run time (cpu::best): one binary built for
/// generic x86-64 runs the AVX-512, AVX512-BF16 and AMX kernels where the CPU has them. fa::plan names the choice.
using cpu_auto = cpu<::fusedattn::cpu::best>;
#if XSIMD_WITH_NEON64
/// Flash on ARM NEON (AArch64).
using cpu_neon = cpu<xsimd::neon64>;
#endif
/// Flash on Arm's bf16 dot products (cpu/arm_kernels.hpp): Q·Kᵀ and P·V on BFDOT for bf16 storage (f32
/// accumulation, softmax in f32, P rounded to bf16), the NEON kernels for the other storage types. Compiled where
/// the program targets FEAT_BF16 (e.g. -march=armv8.6-a); refused (unsupported) elsewhere and where the running
/// CPU lacks it (Linux: HWCAP2_BF16).
using cpu_neon_bf16 = cpu<::fusedattn::cpu::neon_bf16>;

/// Which CUDA kernel `policy::cuda` runs.
enum class cuda_kernel {
  automatic,  ///< a fused kernel for every call: the tensor-core flash kernel where it applies (f16/bf16, head_dim a
              ///< multiple of 8 up to 256, 16-byte aligned rows and strides that are multiples of 8 elements,
              ///< block-sparse block_q a multiple of its q-tile), GQA decode shapes on cuda.decode, and everything
              ///< else on flash_generic (fa::plan says which, and why); never the naive pipeline
  flash,      ///< the fused tensor-core kernel (wgmma on sm_90 with sm_90a code, else mma.sync); unsupported where it does not apply
  naive,      ///< the three-pass pipeline: cuBLAS Q·Kᵀ, softmax over the materialised scores, cuBLAS P·V (the
              ///< teaching baseline; scratch O(batch·heads·seq_q·seq_kv))
  flash_mma_sync,  ///< flash on the portable sm_80 kernel (mma.sync) even where the Hopper kernel would run
  flash_generic,   ///< the fused CUDA-core kernel (backends/cuda/flash_generic.cuh) on any call, even one the tensor-core
                   ///< kernels take: every storage type (f32 accumulation, f64 in double), alignment, stride, head_dim
                   ///< and block-sparse layout; scratch O(S) (split-KV parts only)
};

/// The CUDA backend. `stream` is a cudaStream_t (nullptr: the default stream); pointers must be device memory.
struct cuda {
  void* stream = nullptr;
  cuda_kernel kernel = cuda_kernel::automatic;
  /// The call runs beside other kernels on the device (dist's ring sets it: its NCCL transfers hold SMs). The Hopper
  /// kernel then launches one block per work item instead of a persistent grid, so a block that waits for a busy
  /// SM delays only its own item, not a whole list of them.
  bool concurrent = false;
  /// attend_backward: true (the default) gives the same bits on every run. false lets the Hopper kernels (sm_90a,
  /// head_dim 128) add each kv tile's share of dQ to an f32 accumulator by atomics instead of running a dQ
  /// kernel of their own: faster, and dQ's last bits then vary with the order the additions land in (dK and dV do
  /// not). Other calls are deterministic either way.
  bool deterministic = true;
};

/// The Ascend shim. `stream` is an aclrtStream.
struct ascend {
  void* stream = nullptr;
};

}  // namespace policy
}  // namespace fusedattn
