/// @file fill.cuh
/// Deterministic inputs for the GPU bench binaries: a hash of the index and a seed, as bf16 values in [−1, 1).
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_bf16.h>

namespace {

/// x[i] for i < n, by a grid-stride loop.
__global__ void fill_kernel(__nv_bfloat16* x, std::size_t n, std::uint32_t seed) {
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n; i += std::size_t(gridDim.x) * blockDim.x) {
    std::uint32_t h = std::uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    x[i] = __float2bfloat16(float(h & 0xffff) / 32768.f - 1.f);
  }
}

}  // namespace
