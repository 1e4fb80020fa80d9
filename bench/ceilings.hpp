/// @file ceilings.hpp
/// The roofs of the roofline, measured on the running machine: the f32 FMA peak (a register-resident FMA loop
/// per thread), the bf16 dot-product peak where the CPU has AVX512-BF16, and the memory bandwidth (a STREAM-style triad over arrays far larger than the last-level cache).
/// Not a model: these are timings, best of a few repetitions.
#pragma once

#include <cstddef>
#include <string>

namespace fusedattn::bench {

/// The measured roofs for one thread count.
struct ceiling {
  int threads = 1;
  double peak_flops = 0;  ///< f32 FLOP/s of the FMA loop (an FMA counts 2 FLOPs)
  double bf16_peak_flops = 0;  ///< FLOP/s of the vdpbf16ps loop (16 lanes × 2 products × 2); 0 without AVX512-BF16
  double bandwidth = 0;   ///< bytes/s of the triad a = b + s·c, counting 3 arrays (STREAM convention)
};

/// Facts about the FMA loop, for the printout: SIMD instruction set, f32 lanes, independent accumulators.
struct fma_loop_info {
  std::string arch;
  int lanes = 1;
  int accumulators = 1;
};
fma_loop_info fma_info();

/// f32 FLOP/s of `threads` threads each running the FMA loop (best of `repeats`): the sum of the threads' rates,
/// each on its own CPU-time clock, so that other jobs sharing the machine do not lower the peak.
double measure_peak_flops(int threads, int repeats = 5);

/// FLOP/s of `threads` threads each running the bf16 dot-product loop (vdpbf16ps, 24 independent chains, each
/// instruction 64 FLOPs), best of `repeats`, each thread on its CPU-time clock; 0 where the CPU has no AVX512-BF16.
/// The roof of the bf16 flash rows (their Q·Kᵀ and P·V run on this instruction).
double measure_bf16_peak_flops(int threads, int repeats = 5);

/// Triad bytes/s of `threads` threads over three arrays of `array_bytes` each (best of `repeats`), on wall time
/// (bandwidth is shared, so a busy machine lowers it: the figure is what the rows could get at that moment).
double measure_bandwidth(int threads, std::size_t array_bytes, int repeats = 5);

/// Bytes of the last-level cache the OS reports (0 when unknown). In a VM this is often the whole socket's L3,
/// of which one core reaches only its own slice.
std::size_t reported_llc_bytes();

}  // namespace fusedattn::bench
