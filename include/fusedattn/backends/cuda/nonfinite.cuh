/// @file nonfinite.cuh
/// The flash kernels' guard of the numerical contract for V (docs/design.md, Numerics): a scan of 16-bit values (a V
/// tile in shared memory, O in global memory) for ±inf and NaN, and the plain P·V of one key tile that replaces the
/// tensor-core product on a partial tile whose V holds one (a key whose probability is 0 adds nothing: 0·inf never
/// happens). No kernels here.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "mma.cuh"

namespace fusedattn {
namespace cuda_backend {

/// True when one of the 16-bit values this thread reads of the `Elems` at `tile` (16-byte chunks part, part + parts,
/// ...) is ±inf or NaN: its exponent field is all ones (f16: 5 bits, bf16: 8). `tile` is 16-byte aligned.
template <class E, int Elems>
__device__ __forceinline__ bool has_nonfinite(const E* tile, int part, int parts) {
  static_assert(Elems % 8 == 0, "the scan reads 16-byte chunks of eight values");
  constexpr std::uint32_t lo = std::is_same_v<E, __half> ? 0x7c00u : 0x7f80u, hi = lo << 16;
  const uint4* chunks = reinterpret_cast<const uint4*>(tile);
  std::uint32_t bad = 0;
  for (int i = part; i < Elems / 8; i += parts) {
    const uint4 x = chunks[i];
    const std::uint32_t w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) bad |= ((w[e] & lo) == lo) | ((w[e] & hi) == hi);
  }
  return bad != 0;
}

/// O += P·V for one key tile of `BN` keys, on the CUDA cores, for one 16-row m-tile of a warp: `acc` is this thread's
/// part of O (m16n8 accumulator tiles: acc[n][e] is row g + 8·(e / 2), column n·8 + 2t + e % 2, lane = 4g + t), `pk`
/// its packed P (pk[n][r]: keys n·8 + 2t and n·8 + 2t + 1 of row g + 8r, the A fragments of the tensor-core product),
/// V element (key j, column c) is `v_at(j, c)`. The product of a key whose P is 0 — masked, or underflowed — is not
/// formed: a NaN or inf in its V row reaches no row that gives it no weight. One key a step, its two probabilities
/// fetched from the thread of the quad that holds them; slow (it runs only where the tensor cores would have
/// multiplied a 0 by a non-finite value).
template <class E, int BN, int D, class VAt>
__device__ __forceinline__ void plain_pv(float (&acc)[D / 8][4], const std::uint32_t (&pk)[BN / 8][2], int lane,
                                         const VAt& v_at) {
  const int t = lane % 4;
#pragma unroll 1
  for (int j = 0; j < BN; ++j) {
    std::uint32_t mine[2] = {0u, 0u};  // pk of key tile j / 8 (a register array: indexed by constants only)
#pragma unroll
    for (int n = 0; n < BN / 8; ++n)
      if (n == j / 8) mine[0] = pk[n][0], mine[1] = pk[n][1];
    const int owner = (lane & ~3) | ((j % 8) / 2);
    float p[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) p[r] = mma_type<E>::unpack(__shfl_sync(0xffffffffu, mine[r], owner), j % 2);
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float v = v_at(j, n * 8 + 2 * t + e);
        acc[n][e] = p[0] != 0.f ? fmaf(p[0], v, acc[n][e]) : acc[n][e];
        acc[n][2 + e] = p[1] != 0.f ? fmaf(p[1], v, acc[n][2 + e]) : acc[n][2 + e];
      }
  }
}

}  // namespace cuda_backend
}  // namespace fusedattn
