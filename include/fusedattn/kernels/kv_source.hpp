/// @file kv_source.hpp
/// Where the CPU kernels read K and V from: a KV source answers "the K row and the V row of key j of kv head h of
/// sequence b" and "how many keys sequence b holds". A strided tensor, a paged cache and a ragged batch are the
/// kinds; the tile loop and the decode kernel read every row through one, so neither knows which it reads.
#pragma once

#include <cstdint>

#include "../core/tensor.hpp"
#include "../core/types.hpp"

namespace fusedattn {

/// Element strides of a page pool: page, kv head, token (the head_dim stride is 1).
struct page_strides {
  index_t page = 0;
  index_t head = 0;
  index_t token = 0;
};

namespace kernels {

// The interface every KV source offers (T is the storage type):
//   const T* k_row(b, h_kv, j), v_row(b, h_kv, j)   head_dim contiguous values of key j;
//   index_t length(b)                               keys of sequence b;
//   index_t run(j)                                  keys from j on that sit at one stride from each other:
//                                                   rows j .. j + run(j) − 1 of any (b, h_kv) are
//                                                   k_row(b, h_kv, j) + x · k_stride(), 0 <= x < run(j)
//                                                   (and the same for V with v_stride());
//   index_t k_stride(), v_stride()                  the row strides within a run, in elements.

/// K and V as two strided (batch, kv head, key, head_dim) views: every sequence has dims.s keys, and one run
/// spans all of them.
template <class T>
struct strided_kv {
  tensor_ref<const T> k;
  tensor_ref<const T> v;

  const T* k_row(index_t b, index_t h, index_t j) const { return k.row(b, h, j); }
  const T* v_row(index_t b, index_t h, index_t j) const { return v.row(b, h, j); }
  index_t length(index_t /*b*/) const { return k.dims.s; }
  index_t run(index_t j) const { return k.dims.s - j; }
  index_t k_stride() const { return k.stride.s; }
  index_t v_stride() const { return v.stride.s; }
};

/// K and V in pages of `page_size` tokens, addressed per sequence by a row of the block table: key j of sequence
/// b lives in page block_table[b · blocks_per_seq + j / page_size], at token j % page_size. Runs end at page
/// boundaries. The indices were validated (serving.hpp); nothing here checks them.
template <class T>
struct paged_rows {
  const T* k = nullptr;
  const T* v = nullptr;
  page_strides stride{};  ///< shared by the K and the V pool
  index_t page_size = 0;
  const std::int32_t* block_table = nullptr;
  index_t blocks_per_seq = 0;
  const std::int32_t* seq_lens = nullptr;

  index_t offset(index_t b, index_t h, index_t j) const {
    const index_t page = block_table[b * blocks_per_seq + j / page_size];
    return page * stride.page + h * stride.head + (j % page_size) * stride.token;
  }
  const T* k_row(index_t b, index_t h, index_t j) const { return k + offset(b, h, j); }
  const T* v_row(index_t b, index_t h, index_t j) const { return v + offset(b, h, j); }
  index_t length(index_t b) const { return seq_lens[b]; }
  index_t run(index_t j) const { return page_size - j % page_size; }
  index_t k_stride() const { return stride.token; }
  index_t v_stride() const { return stride.token; }

  /// The same cache seen as a batch of one: sequence b only (its block-table row and length).
  paged_rows sequence(index_t b) const {
    paged_rows s = *this;
    s.block_table = block_table + b * blocks_per_seq;
    s.seq_lens = seq_lens + b;
    return s;
  }
};

/// Sequences packed end to end (a ragged batch): sequence b holds keys [cu[b], cu[b + 1]) of the strided views'
/// key axis (batch extent 1). The offsets were validated (serving.hpp).
template <class T>
struct ragged_kv {
  tensor_ref<const T> k;
  tensor_ref<const T> v;
  const std::int32_t* cu = nullptr;

  const T* k_row(index_t b, index_t h, index_t j) const { return k.row(0, h, cu[b] + j); }
  const T* v_row(index_t b, index_t h, index_t j) const { return v.row(0, h, cu[b] + j); }
  index_t length(index_t b) const { return cu[b + 1] - cu[b]; }
  index_t run(index_t j) const { return k.dims.s - j; }
  index_t k_stride() const { return k.stride.s; }
  index_t v_stride() const { return v.stride.s; }
};

}  // namespace kernels
}  // namespace fusedattn
