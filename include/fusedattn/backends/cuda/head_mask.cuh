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

}  // namespace cuda_backend
}  // namespace fusedattn
