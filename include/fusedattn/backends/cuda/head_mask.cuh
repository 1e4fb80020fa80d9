/// @file head_mask.cuh
/// The bound mask one (batch, head) of a kernel uses: a band is the same for every head; a block-sparse layout may
/// hold one pattern per batch entry and head. Device-side selection only.
#pragma once

#include "../../kernels/block_sparse.hpp"
#include "../../kernels/mask.hpp"

namespace fusedattn {
namespace cuda_backend {

__device__ __forceinline__ const band_mask& head_mask(const band_mask& m, index_t, index_t) { return m; }
__device__ __forceinline__ block_sparse_mask head_mask(const block_sparse_mask& m, index_t b, index_t h) {
  return for_head(m, b, h);
}

/// Whether a tile that lies inside one of the mask's segments needs per-element masking. A band's segment is its
/// kv_range, whose edges are diagonal, so the full test stays; a block-sparse segment is a run of listed blocks, so
/// only the element rule `within` (and the end of the keys) can still cut the tile: no search of the layout.
__device__ __forceinline__ bool partial_inside_segment(const band_mask& m, index_t q0, index_t q1, index_t k0,
                                                       index_t k1) {
  return m.is_partial(q0, q1, k0, k1);
}
__device__ __forceinline__ bool partial_inside_segment(const block_sparse_mask& m, index_t q0, index_t q1, index_t k0,
                                                       index_t k1) {
  return m.band.is_partial(q0, q1, k0, k1);
}

}  // namespace cuda_backend
}  // namespace fusedattn
