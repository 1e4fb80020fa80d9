/// @file head_mask.cuh
/// The device-side names of the mask walk the CUDA kernels use: the bound mask of one (batch, head), the element
/// rule in 32-bit registers, and key_tiles. The walk and the rule themselves are core/mask_walk.hpp's, shared with the
/// CPU; a kernel asks a mask through mask_traits and these functions, never by its type.
#pragma once

#include "../../core/mask_walk.hpp"
#include "../../kernels/block_sparse.hpp"
#include "../../kernels/mask.hpp"

namespace fusedattn {
namespace cuda_backend {

/// The mask of one (batch, head): for_head (a band is the same for every head; a block-sparse layout may hold one
/// pattern per batch entry and head).
template <class Mask>
__device__ __forceinline__ decltype(auto) head_mask(const Mask& m, index_t b, index_t h) {
  return for_head(m, b, h);
}

/// The band rule (core/mask_walk.hpp) in 32-bit arithmetic for the per-tile and per-element tests of the flash
/// loops (rows and keys fit in int: flash_grid_fits): lo and hi are clamped to ±3·2^29, beyond any key − row
/// difference, so the rule is the same and the tests cost 32-bit registers only. band_rule::columns keeps its sums in
/// int: i is below seq_q + 128, so only Q, K and V of 2^30 rows each could take i + seq_kv past 2^31.
struct band32 : band_rule<int> {
  __device__ __forceinline__ explicit band32(const band_mask& m)
      : band_rule<int>{int(m.seq_kv), clamp(m.lo), clamp(m.hi)} {}
  __device__ __forceinline__ static int clamp(index_t v) {
    constexpr index_t bound = index_t(3) << 29;
    return int(v < -bound ? -bound : v > bound ? bound : v);
  }
};
/// The element band of a mask (its `element_band()`: the band itself, a block-sparse mask's `within`) as band32.
template <class Mask>
__device__ __forceinline__ band32 element_rule(const Mask& m) {
  return band32(m.element_band());
}

}  // namespace cuda_backend
}  // namespace fusedattn
