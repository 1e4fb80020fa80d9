/// @file flash_params_fill.cuh
/// The flash launch parameters of the GPU bench's direct tile launches (launch_flash, launch_flash_hopper), filled
/// by field name.
#pragma once

#include <fusedattn/fusedattn.hpp>

namespace fusedattn::bench {

/// Self-attention parameters for one direct tile launch: Q, K, V and O at the given addresses with one shared
/// stride, `lse` (nullptr: none), `batch` × `heads` heads with group 1, seq_q = seq_kv = `seq`, the softmax scale
/// · log2(e), the bound mask, one split. Every other field keeps flash_params_t's initial value: head_dim 0 (the
/// tile's head_dim), no split scratch, no repair flag, not ragged, Hopper tensor maps and schedule left to
/// launch_flash_hopper.
template <class Mask>
cuda_backend::flash_params_t<Mask> fill_flash_params(const void* q, const void* k, const void* v, void* o, float* lse,
                                                     const strides4& stride, int batch, int heads, int seq,
                                                     float scale_log2, const Mask& mask) {
  cuda_backend::flash_params_t<Mask> fp{};
  fp.q = q;
  fp.k = k;
  fp.v = v;
  fp.o = o;
  fp.lse = lse;
  fp.q_stride = fp.k_stride = fp.v_stride = fp.o_stride = stride;
  fp.batch = batch;
  fp.heads = heads;
  fp.group = 1;
  fp.seq_q = fp.seq_kv = seq;
  fp.scale_log2 = scale_log2;
  fp.mask = mask;
  fp.splits = 1;
  return fp;
}

}  // namespace fusedattn::bench
