/// @file serving.hpp
/// Serving entry points: `attend_paged` (queries against a paged KV cache addressed by a block table, vLLM /
/// FlashInfer style) and `attend_ragged` (sequences of different lengths packed end to end, located by cumulative
/// offsets). Both validate everything first and run on policy::cpu<Arch> and policy::cuda (decode shapes on
/// cuda.decode; ragged prefill in one Hopper launch, elsewhere one sequence at a time); other policies return
/// unsupported. On the CPU flash
/// policies both also take f32 Q and O with K and V in f16 or bf16 (a 16-bit KV cache), widened exactly as read.
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../core/problem.hpp"
#include "../core/status.hpp"
#include "../core/tensor.hpp"
#include "../core/validate.hpp"
#include "../kernels/flash.hpp"
#include "../kernels/kv_source.hpp"
#include "../kernels/mask.hpp"
#include "../kernels/modifiers.hpp"
#include "attend.hpp"
#include "kv_storage.hpp"
#include "policy.hpp"

#if FUSEDATTN_WITH_CUDA
#include "../backends/cuda/serving.cuh"
#endif

namespace fusedattn {

/// How a page of a paged KV cache is laid out.
enum class page_layout {
  hnd,  ///< [page][kv_head][token][head_dim] (FlashInfer's HND; the tokens of one head are contiguous)
  nhd,  ///< [page][token][kv_head][head_dim] (vLLM / FlashInfer NHD; the heads of one token are contiguous)
};

/// The strides of a pool of `page_size`-token pages of `heads_kv` heads of `head_dim` values in a layout.
inline page_strides page_strides_of(page_layout layout, index_t page_size, index_t heads_kv, index_t head_dim) {
  const index_t page = page_size * heads_kv * head_dim;
  return layout == page_layout::hnd ? page_strides{page, page_size * head_dim, head_dim}
                                    : page_strides{page, head_dim, heads_kv * head_dim};
}

/// A paged KV cache, viewed (nothing owned): K and V pools of `pages` pages of `page_size` tokens each, with the
/// same strides; sequence b holds seq_lens[b] keys, key j in page block_table[b · blocks_per_seq + j / page_size]
/// at token j % page_size. Only the first ceil(seq_lens[b] / page_size) entries of a block-table row are read.
///
/// Host mirrors (optional, each on its own): host_block_table and host_seq_lens are host copies of block_table and
/// seq_lens, the same values in the same layout, as a serving engine keeps them anyway. On policy::cuda, where the
/// tables are device memory, a call validates a mirror (page ids, lengths: the checks it makes on the tables) and
/// plans its launch from it, reads nothing back from the device and does not synchronise the stream; the kernel
/// still reads the device table, so the two must agree (the call cannot tell). A table without a mirror is copied
/// to the host and the stream synchronised. On the CPU policies the tables are host memory already: a mirror, when
/// set, is compared with its table (the entries the call reads) and a difference is refused by name.
template <class T>
struct paged_kv {
  T* k = nullptr;                             ///< K pool
  T* v = nullptr;                             ///< V pool (may be the same allocation as K, interleaved)
  index_t pages = 0;                          ///< pages in each pool
  index_t page_size = 0;                      ///< tokens per page: a multiple of 8 from 8 to 256
  page_strides stride{};                      ///< element strides of page, kv head and token (head_dim: 1)
  const std::int32_t* block_table = nullptr;  ///< [batch][blocks_per_seq] page ids
  index_t blocks_per_seq = 0;                 ///< block-table row length
  const std::int32_t* seq_lens = nullptr;     ///< [batch] keys per sequence
  const std::int32_t* host_block_table = nullptr;  ///< optional host mirror of block_table (see above)
  const std::int32_t* host_seq_lens = nullptr;     ///< optional host mirror of seq_lens (see above)

  /// A const view of the same cache (mirrors included).
  operator paged_kv<const T>() const {
    return {k, v, pages, page_size, stride, block_table, blocks_per_seq, seq_lens, host_block_table, host_seq_lens};
  }

  /// The same view with host mirrors of the block table and the lengths (either may be null: no mirror).
  paged_kv with_host_tables(const std::int32_t* host_table, const std::int32_t* host_lens) const {
    paged_kv r = *this;
    r.host_block_table = host_table;
    r.host_seq_lens = host_lens;
    return r;
  }
};

/// A paged_kv view of pools laid out [page][kv_head][token][d] (hnd) or [page][token][kv_head][d] (nhd).
template <class T>
paged_kv<T> paged(T* k, T* v, index_t pages, index_t page_size, index_t heads_kv, index_t head_dim,
                  page_layout layout, const std::int32_t* block_table, index_t blocks_per_seq,
                  const std::int32_t* seq_lens) {
  return {k,           v, pages, page_size, page_strides_of(layout, page_size, heads_kv, head_dim),
          block_table, blocks_per_seq, seq_lens};
}

/// A ragged batch: `sequences` sequences packed end to end; sequence b has query tokens
/// [cu_seqlens_q[b], cu_seqlens_q[b + 1]) and keys [cu_seqlens_kv[b], cu_seqlens_kv[b + 1]). Both arrays hold
/// sequences + 1 non-decreasing offsets from 0 to the total.
///
/// Host mirrors (optional, each on its own): host_cu_seqlens_q and host_cu_seqlens_kv are host copies of the two
/// offset arrays, with paged_kv's mirror contract: on policy::cuda a mirror is validated and planned from, nothing is
/// read back and the stream is not synchronised (the kernels read the device arrays, so the two must agree); on the
/// CPU policies a mirror is compared with its array and a difference is refused by name.
struct ragged_batch {
  index_t sequences = 0;
  const std::int32_t* cu_seqlens_q = nullptr;       ///< [sequences + 1] query offsets
  const std::int32_t* cu_seqlens_kv = nullptr;      ///< [sequences + 1] key offsets
  const std::int32_t* host_cu_seqlens_q = nullptr;  ///< optional host mirror of cu_seqlens_q
  const std::int32_t* host_cu_seqlens_kv = nullptr; ///< optional host mirror of cu_seqlens_kv

  /// The same batch with host mirrors of the offsets (either may be null: no mirror).
  ragged_batch with_host_offsets(const std::int32_t* host_q, const std::int32_t* host_kv) const {
    ragged_batch r = *this;
    r.host_cu_seqlens_q = host_q;
    r.host_cu_seqlens_kv = host_kv;
    return r;
  }
};

namespace detail {

/// Band masks are the ones a serving call takes (each sequence binds its own lengths), with or without score
/// modifiers.
template <class Mask>
inline constexpr bool is_band_mask_v =
    std::is_same<Mask, dense>::value || std::is_same<Mask, causal>::value || std::is_same<Mask, window>::value;
template <class Mask>
struct is_serving_mask : std::bool_constant<is_band_mask_v<Mask>> {};
template <class Mask>
struct is_serving_mask<modified<Mask>> : std::bool_constant<is_band_mask_v<Mask>> {};

/// Whether a policy is policy::cpu<Arch> (the flash kernels).
template <class Policy>
struct is_cpu_flash : std::false_type {};
template <class Arch>
struct is_cpu_flash<policy::cpu<Arch>> : std::true_type {};

/// Whether rows_disjoint's answer (a bool, or a rows_overlap verdict) proves the rows disjoint.
template <class R>
bool proven_disjoint(R r) {
  if constexpr (std::is_same<R, bool>::value) return r;
  else return r == R::disjoint;
}

/// Elements spanned by one pool of a paged cache.
inline index_t pool_span(index_t pages, index_t page_size, index_t heads_kv, index_t d, const page_strides& s) {
  return (pages - 1) * s.page + (heads_kv - 1) * s.head + (page_size - 1) * s.token + d;
}

/// Checks a paged cache against a problem: pools, page size, strides, block table, lengths and page ids. The tables
/// are read through kv.block_table and kv.seq_lens (host memory), named `table_name` and `lens_name`.
template <class T>
status check_paged(const problem& p, const paged_kv<const T>& kv, const char* table_name = "kv.block_table",
                   const char* lens_name = "kv.seq_lens") {
  const std::string table_field = table_name, lens_field = lens_name;
  if (!kv.k) return status::invalid("kv.k is null");
  if (!kv.v) return status::invalid("kv.v is null");
  if (kv.page_size < 8 || kv.page_size > 256 || kv.page_size % 8 != 0)
    return status::invalid("kv.page_size is " + str(kv.page_size) + "; it must be a multiple of 8 from 8 to 256");
  if (kv.pages <= 0) return status::invalid("kv.pages is " + str(kv.pages) + "; it must be positive");
  const index_t st[3] = {kv.stride.page, kv.stride.head, kv.stride.token};
  const char* st_name[3] = {"page", "head", "token"};
  for (int i = 0; i < 3; ++i)
    if (st[i] < 0) return status::invalid(std::string("kv.stride.") + st_name[i] + " is " + str(st[i]) + "; strides must be >= 0");
  index_t a = 0, b = 0, c = 0;
  if (!mul_ok(kv.pages, kv.stride.page, a) || !mul_ok(p.heads_kv, kv.stride.head, b) ||
      !mul_ok(kv.page_size, kv.stride.token, c) || a > INT64_MAX / 4 || b > INT64_MAX / 4 || c > INT64_MAX / 4)
    return status::invalid("kv: the pages and strides address beyond 2^63 elements");
  const index_t span = pool_span(kv.pages, kv.page_size, p.heads_kv, p.head_dim, kv.stride);
  if (!fits_address_space(kv.k, span * index_t(sizeof(T))) || !fits_address_space(kv.v, span * index_t(sizeof(T))))
    return status::invalid("kv: the pools run past the end of the address space");
  if (!kv.block_table) return status::invalid(table_field + " is null");
  if (!kv.seq_lens) return status::invalid(lens_field + " is null");
  if (kv.blocks_per_seq <= 0)
    return status::invalid("kv.blocks_per_seq is " + str(kv.blocks_per_seq) + "; it must be positive");
  index_t capacity = 0;
  if (!mul_ok(kv.blocks_per_seq, kv.page_size, capacity) || capacity < p.seq_kv)
    return status::invalid("kv.blocks_per_seq is " + str(kv.blocks_per_seq) + ": the block table is too short for " +
                           "problem.seq_kv = " + str(p.seq_kv) + " keys in pages of " + str(kv.page_size));
  for (index_t s = 0; s < p.batch; ++s) {
    const index_t len = kv.seq_lens[s];
    const std::string at = "[" + str(s) + "]";
    if (len < 0) return status::invalid(lens_field + at + " is " + str(len) + "; it must be >= 0");
    if (len > capacity)
      return status::invalid(lens_field + at + " is " + str(len) + ", beyond the sequence's pages: " +
                             str(kv.blocks_per_seq) + " block-table entries of " + str(kv.page_size) + " tokens");
    if (len > p.seq_kv)
      return status::invalid(lens_field + at + " is " + str(len) + ", beyond problem.seq_kv = " + str(p.seq_kv));
    for (index_t j = 0; j < (len + kv.page_size - 1) / kv.page_size; ++j) {
      const index_t page = kv.block_table[s * kv.blocks_per_seq + j];
      if (page < 0 || page >= kv.pages)
        return status::invalid(table_field + at + "[" + str(j) + "] is " + str(page) +
                               "; page ids must be in [0, kv.pages = " + str(kv.pages) + ")");
    }
  }
  return {};
}

/// The CPU policies' mirror check (after check_paged passed on the tables): each host mirror that is set holds its
/// table's values where the call reads them (every length; the first ceil(len / page_size) entries of each row).
template <class T>
status check_paged_mirrors(const problem& p, const paged_kv<const T>& kv) {
  const std::string hint = "; a host mirror must hold the same values as its table";
  for (index_t s = 0; s < p.batch; ++s) {
    const std::string at = "[" + str(s) + "]";
    if (kv.host_seq_lens && kv.host_seq_lens[s] != kv.seq_lens[s])
      return status::invalid("kv.host_seq_lens" + at + " is " + str(kv.host_seq_lens[s]) + " but kv.seq_lens" + at +
                             " is " + str(kv.seq_lens[s]) + hint);
    if (kv.host_block_table)
      for (index_t j = 0; j < (index_t(kv.seq_lens[s]) + kv.page_size - 1) / kv.page_size; ++j) {
        const index_t e = s * kv.blocks_per_seq + j;
        if (kv.host_block_table[e] != kv.block_table[e])
          return status::invalid("kv.host_block_table" + at + "[" + str(j) + "] is " + str(kv.host_block_table[e]) +
                                 " but kv.block_table" + at + "[" + str(j) + "] is " + str(kv.block_table[e]) + hint);
      }
  }
  return {};
}

/// Checks cumulative offsets: n + 1 values, 0 first, non-decreasing, `total` last.
inline status check_offsets(const char* name, const std::int32_t* cu, index_t n, index_t total, const char* total_name) {
  const std::string f = std::string("ragged.") + name;
  if (!cu) return status::invalid(f + " is null");
  if (cu[0] != 0) return status::invalid(f + "[0] is " + str(cu[0]) + "; it must be 0");
  for (index_t b = 1; b <= n; ++b)
    if (cu[b] < cu[b - 1])
      return status::invalid(f + "[" + str(b) + "] is " + str(cu[b]) + ", below " + name + "[" + str(b - 1) +
                             "] = " + str(cu[b - 1]) + "; offsets must be non-decreasing");
  if (cu[n] != total)
    return status::invalid(f + "[" + str(n) + "] is " + str(cu[n]) + " but " + total_name + " (the total) is " +
                           str(total));
  return {};
}

/// The CPU policies' check of an offsets mirror (after check_offsets passed on `cu`): null, or the same n + 1 values.
inline status check_offsets_mirror(const char* name, const std::int32_t* cu, const std::int32_t* mirror, index_t n) {
  if (!mirror) return {};
  for (index_t b = 0; b <= n; ++b)
    if (mirror[b] != cu[b])
      return status::invalid(std::string("ragged.host_") + name + "[" + str(b) + "] is " + str(mirror[b]) +
                             " but ragged." + name + "[" + str(b) + "] is " + str(cu[b]) +
                             "; a host mirror must hold the same values as its array");
  return {};
}

#if FUSEDATTN_WITH_CUDA
/// policy::cuda: where the host reads the device int32 array `dev` (named `dev_name`) from, written to `out`: its host
/// mirror `mirror` (named `mirror_name`) where set, after cuda_backend::check_mirror (nothing read back); else, when
/// `dev` is set and `n` > 0, `copy`, which receives its first `n` values read back on `stream` (the stream
/// synchronised); else `dev` itself.
inline status host_readable(const std::int32_t* dev, const std::int32_t* mirror, index_t n,
                            std::vector<std::int32_t>& copy, cudaStream_t stream, const char* dev_name,
                            const char* mirror_name, const std::int32_t*& out) {
  out = dev;
  if (mirror) {
    if (status st = cuda_backend::check_mirror(dev, mirror, dev_name, mirror_name); !st) return st;
    out = mirror;
  } else if (dev && n > 0) {
    if (status st = cuda_backend::table_to_host(dev, n, copy, stream, dev_name); !st) return st;
    out = copy.data();
  }
  return {};
}
#endif

/// The band mask of one sequence of a serving call, bound to its own lengths.
template <class Mask>
band_mask bind_sequence(const Mask& mask, const problem& p, index_t seq_q, index_t seq_kv) {
  problem ps = p;
  ps.batch = 1;
  ps.seq_q = seq_q;
  ps.seq_kv = seq_kv;
  return bind(mask, ps);
}

/// Writes O = 0 and lse = −inf (head h's sink logit with sinks) for rows [0, seq_q) of every head of batch entry b
/// (a sequence without keys).
template <class T>
void write_empty(const problem& p, const tensor_ref<T>& o, index_t b, index_t seq_q, float* lse, index_t lse_row0,
                 index_t lse_head_stride, const bound_mods& mods) {
  for (index_t h = 0; h < p.heads; ++h)
    for (index_t i = 0; i < seq_q; ++i) {
      T* row = o.row(b, h, i);
      for (index_t c = 0; c < p.head_dim; ++c) row[c] = T(0.0f);
      if (lse) lse[h * lse_head_stride + lse_row0 + i] = mods.sink<float>(h);
    }
}

/// attend_paged with Q and O of type T and the cache of type KV (T, or f16/bf16 beside f32 Q/O: mixed storage,
/// the CPU flash policies only; the decode kernel and the tile loop read KV rows in their type and widen them).
template <class Policy, class T, class KV, class Mask>
status attend_paged_impl(const Policy& pol, const problem& p, const tensor_ref<const T>& q,
                         const paged_kv<const KV>& kv, const tensor_ref<T>& o, const Mask& mask, float* lse) {
  static_assert(is_serving_mask<Mask>::value,
                "fusedattn: attend_paged takes dense, causal or window masks (optionally with score modifiers)");
  static_assert(is_supported_scalar_v<T>,
                "fusedattn supports float, double, Eigen::half and Eigen::bfloat16 for Q, K, V and O");
  constexpr bool mixed = !std::is_same<T, KV>::value;
  if (status st = validate_policy(pol); !st) return st;
  if (status st = validate(p); !st) return st;
  if (status st = check_operand("q", q, p.q_dims()); !st) return st;
  if (status st = check_operand("o", o, p.o_dims()); !st) return st;
  if (status st = check_mask(mask, p); !st) return st;
  if constexpr (mixed && !is_cpu_flash<Policy>::value) {
    return mixed_unsupported();
  } else {
    // The cache with host-readable tables: on policy::cuda each table is its host mirror or a copy from the device.
    paged_kv<const KV> kv_host = kv;
    const char* table_name = "kv.block_table";
    const char* lens_name = "kv.seq_lens";
#if FUSEDATTN_WITH_CUDA
    std::vector<std::int32_t> table_copy, lens_copy;
    if constexpr (std::is_same<Policy, policy::cuda>::value) {
      const auto stream = static_cast<cudaStream_t>(pol.stream);
      if (status st = cuda_backend::serving_refuses_capture(stream, "attend_paged"); !st) return st;
      if (status st = host_readable(kv.seq_lens, kv.host_seq_lens, p.batch, lens_copy, stream, "kv.seq_lens",
                                    "kv.host_seq_lens", kv_host.seq_lens);
          !st)
        return st;
      index_t entries = 0;  // the block table's entries (none to copy where the shape gives no positive count)
      if (kv.blocks_per_seq <= 0 || !mul_ok(p.batch, kv.blocks_per_seq, entries)) entries = 0;
      if (status st = host_readable(kv.block_table, kv.host_block_table, entries, table_copy, stream,
                                    "kv.block_table", "kv.host_block_table", kv_host.block_table);
          !st)
        return st;
      if (kv.host_seq_lens) lens_name = "kv.host_seq_lens";
      if (kv.host_block_table) table_name = "kv.host_block_table";
    }
#endif
    if (status st = check_paged(p, kv_host, table_name, lens_name); !st) return st;
    if constexpr (!std::is_same<Policy, policy::cuda>::value) {
      if (status st = check_paged_mirrors(p, kv); !st) return st;
    }
    if (!proven_disjoint(rows_disjoint(o)))
      return status::invalid("o: its strides make distinct rows share memory (or could not be proven not to)");
    const index_t bytes_o = span_elements(o) * index_t(sizeof(T));
    const index_t bytes_q = span_elements(q) * index_t(sizeof(T));
    const index_t bytes_pool =
        pool_span(kv.pages, kv.page_size, p.heads_kv, p.head_dim, kv.stride) * index_t(sizeof(KV));
    const index_t bytes_lse = p.lse_size() * index_t(sizeof(float));
    if (overlaps(o.data, bytes_o, q.data, bytes_q))
      return status::invalid("o overlaps q; the output must not alias an input");
    if (overlaps(o.data, bytes_o, kv.k, bytes_pool))
      return status::invalid("o overlaps kv.k; the output must not alias an input");
    if (overlaps(o.data, bytes_o, kv.v, bytes_pool))
      return status::invalid("o overlaps kv.v; the output must not alias an input");
    if (lse) {
      if (!fits_address_space(lse, bytes_lse)) return status::invalid("lse: does not fit in the address space");
      const std::pair<const void*, index_t> others[4] = {
          {q.data, bytes_q}, {o.data, bytes_o}, {kv.k, bytes_pool}, {kv.v, bytes_pool}};
      const char* names[4] = {"q", "o", "kv.k", "kv.v"};
      for (int i = 0; i < 4; ++i)
        if (overlaps(lse, bytes_lse, others[i].first, others[i].second))
          return status::invalid(std::string("lse overlaps ") + names[i]);
    }
    if constexpr (std::is_same<Policy, policy::cuda>::value) {
#if FUSEDATTN_WITH_CUDA
      index_t max_len = 0;
      for (index_t b = 0; b < p.batch; ++b) max_len = std::max<index_t>(max_len, kv_host.seq_lens[b]);
      return cuda_backend::attend_paged<T>(
          pol, p, q, kv, o, [&](index_t len) { return bind_sequence(mask, p, p.seq_q, len); }, lse, max_len);
#else
      return {errc::unsupported, "fusedattn was built without CUDA support (FUSEDATTN_WITH_CUDA is off)"};
#endif
    } else if constexpr (!is_cpu_flash<Policy>::value) {
      return {errc::unsupported, "attend_paged runs on policy::cpu<Arch> and policy::cuda only"};
    } else {
      const kernels::paged_rows<KV> rows{kv.k, kv.v, kv.stride, kv.page_size, kv.block_table, kv.blocks_per_seq,
                                        kv.seq_lens};
      if (kernels::use_decode_kernel<band_mask>(p, pol.tiles)) {
        if (!cpu::arch_available<typename Policy::arch>())
          return {errc::unsupported, std::string("this CPU cannot run the ") + Policy::arch::name() +
                                         " code of policy::cpu<Arch>; pick an arch it supports"};
        return kernels::decode_attention<T, typename Policy::arch>(
            p, q, rows, o, [&](index_t b) { return bind_sequence(mask, p, p.seq_q, kv.seq_lens[b]); }, lse,
            pol.threads);
      }
      // Longer query blocks: the tile loop, one sequence at a time (each has its own length and mask).
      for (index_t b = 0; b < p.batch; ++b) {
        const index_t len = kv.seq_lens[b];
        if (len == 0) {
          write_empty(p, o, b, p.seq_q, lse, b * p.heads * p.seq_q, p.seq_q, bind_sequence(mask, p, p.seq_q, 0).mods);
          continue;
        }
        problem pb = p;
        pb.batch = 1;
        pb.seq_kv = len;
        const tensor_ref<const T> qb{q.row(b, 0, 0), pb.q_dims(), q.stride};
        const tensor_ref<T> ob{o.row(b, 0, 0), pb.o_dims(), o.stride};
        if (status st = kernels::flash_attention_kv<T, typename Policy::arch>(
                pb, qb, rows.sequence(b), ob, bind(mask, pb), lse ? lse + b * p.heads * p.seq_q : nullptr, pol.threads,
                pol.tiles);
            !st)
          return st;
      }
      return {};
    }
  }
}

/// One sequence of a ragged call: attend's kernel for its storage, as attend would run it (the plan's checks
/// first). With f32 Q/O and 16-bit K/V, the CPU flash kernel over a strided KV source (kv_storage.hpp's attend).
template <class Policy, class T, class KV, class Bound>
status run_sequence(const Policy& pol, const problem& p, const tensor_ref<const T>& q, const tensor_ref<const KV>& k,
                    const tensor_ref<const KV>& v, const tensor_ref<T>& o, const Bound& mask, float* lse) {
  if constexpr (std::is_same<T, KV>::value) {
    return run(pol, p, q, k, v, o, mask, lse);
  } else {
    const tensor_ref<const float> k32{nullptr, k.dims, k.stride}, v32{nullptr, v.dims, v.stride};
    if (status st = plan_run(pol, p, q, k32, v32, o, mask, lse).st; !st) return st;
    if (nothing_to_compute(p)) return {};
    return kernels::flash_attention_kv<float, typename Policy::arch>(p, q, kernels::strided_kv<KV>{k, v}, o, mask,
                                                                     lse, pol.threads, pol.tiles);
  }
}

/// attend_ragged with Q and O of type T and K and V of type KV (as attend_paged_impl).
template <class Policy, class T, class KV, class Mask>
status attend_ragged_impl(const Policy& pol, const problem& p, const ragged_batch& rb, const tensor_ref<const T>& q,
                          const tensor_ref<const KV>& k, const tensor_ref<const KV>& v, const tensor_ref<T>& o,
                          const Mask& mask, float* lse) {
  static_assert(is_serving_mask<Mask>::value,
                "fusedattn: attend_ragged takes dense, causal or window masks (optionally with score modifiers)");
  constexpr bool mixed = !std::is_same<T, KV>::value;
  if (status st = validate_policy(pol); !st) return st;
  if (p.batch != 1)
    return status::invalid("problem.batch is " + str(p.batch) +
                           "; a ragged call packs its sequences along seq (batch must be 1)");
  if constexpr (mixed) {
    if (status st = validate_mixed(p, q, k, v, o, mask, lse); !st) return st;
  } else {
    if (status st = validate(p, q, k, v, o, mask, lse); !st) return st;
  }
  if constexpr (mixed && !is_cpu_flash<Policy>::value) {
    return mixed_unsupported();
  } else {
    if (rb.sequences <= 0)
      return status::invalid("ragged.sequences is " + str(rb.sequences) + "; it must be positive");
    // Offsets the host can read: on policy::cuda each array is its host mirror or a copy from the device.
    ragged_batch rb_host = rb;
    const char* q_name = "cu_seqlens_q";
    const char* kv_name = "cu_seqlens_kv";
#if FUSEDATTN_WITH_CUDA
    std::vector<std::int32_t> cu_q_copy, cu_kv_copy;
    if constexpr (std::is_same<Policy, policy::cuda>::value) {
      const auto stream = static_cast<cudaStream_t>(pol.stream);
      if (status st = cuda_backend::serving_refuses_capture(stream, "attend_ragged"); !st) return st;
      if (status st = host_readable(rb.cu_seqlens_q, rb.host_cu_seqlens_q, rb.sequences + 1, cu_q_copy, stream,
                                    "ragged.cu_seqlens_q", "ragged.host_cu_seqlens_q", rb_host.cu_seqlens_q);
          !st)
        return st;
      if (status st = host_readable(rb.cu_seqlens_kv, rb.host_cu_seqlens_kv, rb.sequences + 1, cu_kv_copy, stream,
                                    "ragged.cu_seqlens_kv", "ragged.host_cu_seqlens_kv", rb_host.cu_seqlens_kv);
          !st)
        return st;
      if (rb.host_cu_seqlens_q) q_name = "host_cu_seqlens_q";
      if (rb.host_cu_seqlens_kv) kv_name = "host_cu_seqlens_kv";
    }
#endif
    if (status st = check_offsets(q_name, rb_host.cu_seqlens_q, rb.sequences, p.seq_q, "problem.seq_q"); !st)
      return st;
    if (status st = check_offsets(kv_name, rb_host.cu_seqlens_kv, rb.sequences, p.seq_kv, "problem.seq_kv"); !st)
      return st;
    if constexpr (!std::is_same<Policy, policy::cuda>::value) {
      if (status st = check_offsets_mirror("cu_seqlens_q", rb.cu_seqlens_q, rb.host_cu_seqlens_q, rb.sequences); !st)
        return st;
      if (status st = check_offsets_mirror("cu_seqlens_kv", rb.cu_seqlens_kv, rb.host_cu_seqlens_kv, rb.sequences);
          !st)
        return st;
    }
    constexpr bool flash = is_cpu_flash<Policy>::value;
    constexpr bool naive = std::is_same<Policy, policy::cpu_naive>::value;
    if constexpr (std::is_same<Policy, policy::cuda>::value) {
#if FUSEDATTN_WITH_CUDA
      return cuda_backend::attend_ragged<T>(
          pol, p, rb.sequences, rb_host.cu_seqlens_q, rb_host.cu_seqlens_kv, rb.cu_seqlens_q, rb.cu_seqlens_kv, q, k, v, o,
          [&](index_t nq, index_t nk) { return bind_sequence(mask, p, nq, nk); }, lse);
#else
      return {errc::unsupported, "fusedattn was built without CUDA support (FUSEDATTN_WITH_CUDA is off)"};
#endif
    } else if constexpr (!flash && !naive) {
      return {errc::unsupported, "attend_ragged runs on policy::cpu<Arch>, policy::cpu_naive and policy::cuda only"};
    } else {
      const std::int32_t* cu_q = rb.cu_seqlens_q;
      const std::int32_t* cu_kv = rb.cu_seqlens_kv;
      std::vector<float> lse_seq;
      if constexpr (flash) {
        // Every sequence has n query rows: the batch as (sequences, heads, n, d) views and a ragged KV source.
        const index_t n = cu_q[1] - cu_q[0];
        bool uniform = true;
        for (index_t b = 1; b < rb.sequences; ++b) uniform &= cu_q[b + 1] - cu_q[b] == n;
        problem pb = p;
        pb.batch = rb.sequences;
        pb.seq_q = n;
        if (uniform && n > 0 && kernels::use_decode_kernel<band_mask>(pb, pol.tiles)) {
          if (!cpu::arch_available<typename Policy::arch>())
            return {errc::unsupported, std::string("this CPU cannot run the ") + Policy::arch::name() +
                                           " code of policy::cpu<Arch>; pick an arch it supports"};
          pb.seq_kv = 0;
          for (index_t b = 0; b < rb.sequences; ++b) pb.seq_kv = std::max<index_t>(pb.seq_kv, cu_kv[b + 1] - cu_kv[b]);
          const tensor_ref<const T> qb{q.data, pb.q_dims(), {n * q.stride.s, q.stride.h, q.stride.s, 1}};
          const tensor_ref<T> ob{o.data, pb.o_dims(), {n * o.stride.s, o.stride.h, o.stride.s, 1}};
          const kernels::ragged_kv<KV> src{k, v, cu_kv};
          try {
            if (lse) lse_seq.resize(static_cast<std::size_t>(pb.lse_size()));
          } catch (const std::bad_alloc&) {
            return {errc::out_of_memory, "attend_ragged: cannot allocate the lse staging buffer"};
          }
          if (status st = kernels::decode_attention<T, typename Policy::arch>(
                  pb, qb, src, ob,
                  [&](index_t b) { return bind_sequence(mask, p, n, cu_kv[b + 1] - cu_kv[b]); },
                  lse ? lse_seq.data() : nullptr, pol.threads);
              !st)
            return st;
          if (lse)  // [b][h][i] → [h][token]
            for (index_t b = 0; b < rb.sequences; ++b)
              for (index_t h = 0; h < p.heads; ++h)
                for (index_t i = 0; i < n; ++i)
                  lse[h * p.seq_q + cu_q[b] + i] = lse_seq[static_cast<std::size_t>((b * p.heads + h) * n + i)];
          return {};
        }
      }
      // One call per sequence, each with its own lengths.
      for (index_t b = 0; b < rb.sequences; ++b) {
        const index_t q0 = cu_q[b], nq = cu_q[b + 1] - q0, k0 = cu_kv[b], nk = cu_kv[b + 1] - k0;
        if (nq == 0) continue;
        const tensor_ref<T> ob{o.row(0, 0, q0), {1, p.heads, nq, p.head_dim}, o.stride};
        if (nk == 0) {
          write_empty(p, ob, 0, nq, lse, q0, p.seq_q, bind_sequence(mask, p, nq, 0).mods);
          continue;
        }
        problem pb = p;
        pb.seq_q = nq;
        pb.seq_kv = nk;
        const tensor_ref<const T> qb{q.row(0, 0, q0), pb.q_dims(), q.stride};
        const tensor_ref<const KV> kb{k.row(0, 0, k0), pb.kv_dims(), k.stride};
        const tensor_ref<const KV> vb{v.row(0, 0, k0), pb.kv_dims(), v.stride};
        try {
          if (lse) lse_seq.resize(static_cast<std::size_t>(pb.lse_size()));
        } catch (const std::bad_alloc&) {
          return {errc::out_of_memory, "attend_ragged: cannot allocate the lse staging buffer"};
        }
        if (status st = run_sequence(pol, pb, qb, kb, vb, ob, bind(mask, pb), lse ? lse_seq.data() : nullptr); !st)
          return st;
        if (lse)
          for (index_t h = 0; h < p.heads; ++h)
            for (index_t i = 0; i < nq; ++i) lse[h * p.seq_q + q0 + i] = lse_seq[static_cast<std::size_t>(h * nq + i)];
      }
      return {};
    }
  }
}

}  // namespace detail

/// Attention of p.seq_q query rows per sequence against a paged KV cache: for sequence b,
/// O[b,h,i,:] = softmax_j(scale · Q[b,h,i,:]·K_b[j]) · V_b[j] over its kv.seq_lens[b] keys, with the mask bound
/// to (p.seq_q, seq_lens[b]) (so causal{align::bottom_right} puts the queries at the end of each sequence: decode
/// with seq_q = 1, chunked prefill and speculative decode with seq_q > 1). GQA as in attend.
///
/// @param pol   policy::cpu<Arch>{threads, tiles}, or policy::cuda{stream} (every pointer device memory except the
///              host mirrors; the call validates the block table and lengths on the host and plans its launch from
///              them: from kv.host_block_table / kv.host_seq_lens where set, with nothing read back and no
///              synchronisation, otherwise from copies read back with the stream synchronised; a stream being
///              captured into a CUDA graph is refused (errc::unsupported), with or without mirrors, since the plan
///              fixed at capture would read too few keys on a replay with longer sequences; f16/bf16, head_dim
///              64/128/256, group size × seq_q <= 16, score modifiers too: other shapes return
///              errc::unsupported); other policies return errc::unsupported.
/// @param p     batch = sequences, heads, heads_kv, seq_q = query rows per sequence, seq_kv = the most keys a
///              sequence holds (every seq_lens[b] <= seq_kv <= blocks_per_seq · page_size), head_dim, scale.
/// @param q     (batch, heads, seq_q, head_dim) view; o the same shape, not overlapping any input.
/// @param kv    the cache (see paged_kv); pools of heads_kv heads of head_dim values per token; optional host
///              mirrors of its tables (policy::cuda plans from them; the CPU policies check them against the tables).
/// @param mask  dense{}, causal{align}, window{left, right, align}, each optionally with score modifiers
///              (`mask | fa::softcap{cap} | fa::alibi{slopes, align} | fa::sinks{logits}`; ALiBi's alignment, like
///              the mask's, is bound to each sequence's own lengths).
/// @param lse   optional, batch·heads·seq_q floats [b][h][i]; a row that sees no key gets O = 0, lse = −inf (the
///              head's sink logit with sinks).
/// Decode-shaped calls (at most cpu::decode_max_rows query rows per kv head, default tiles) read K and V in place
/// and split each sequence's keys across the threads; longer ones run the tile loop per sequence.
/// The overload for f32 q and o with a paged_kv of Eigen::half or Eigen::bfloat16 (a 16-bit KV cache) runs on the
/// CPU flash policies only (others return errc::unsupported); K and V rows are widened to f32 exactly as they are
/// read, so the result is the all-f32 call's on the widened cache.
/// @return ok; errc::invalid_argument naming the field and value (a page id out of range, a length beyond the
///         sequence's pages, a block table too short, a mirror that differs from its table on a CPU policy, ...),
///         nothing written; errc::unsupported;
///         errc::out_of_memory (nothing written).
template <class Policy, class T, class Mask = dense>
status attend_paged(const Policy& pol, const problem& p, tensor_ref<const detail::identity_t<T>> q,
                    const paged_kv<const detail::identity_t<T>>& kv, tensor_ref<T> o, const Mask& mask = {},
                    float* lse = nullptr) {
  return detail::attend_paged_impl<Policy, T, T, Mask>(pol, p, q, kv, o, mask, lse);
}

/// attend_paged for mixed storage: f32 q and o, K and V pools of Eigen::half or Eigen::bfloat16 (see above).
template <class Policy, class KV, class Mask = dense,
          std::enable_if_t<is_half_kv_v<std::remove_const_t<KV>>, int> = 0>
status attend_paged(const Policy& pol, const problem& p, tensor_ref<const float> q, const paged_kv<KV>& kv,
                    tensor_ref<float> o, const Mask& mask = {}, float* lse = nullptr) {
  const paged_kv<const std::remove_const_t<KV>> ckv = kv;  // mirrors included
  return detail::attend_paged_impl<Policy, float, std::remove_const_t<KV>, Mask>(pol, p, q, ckv, o, mask, lse);
}


/// Attention over a ragged batch: sequences packed end to end along the sequence axis of q, k, v and o
/// (views of batch extent 1, e.g. bshd views of [total_tokens][heads][head_dim] buffers). Sequence b attends its
/// own keys only, with the mask bound to its own lengths (its own causal alignment).
///
/// @param pol   policy::cpu<Arch>{}, policy::cpu_naive{}, or policy::cuda{stream} (device pointers except the host
///              mirrors; the offsets are validated and the launch planned on the host, from rb.host_cu_seqlens_q /
///              rb.host_cu_seqlens_kv where set, with nothing read back and no synchronisation, otherwise from copies
///              read back with the stream synchronised; a capturing stream is refused as in attend_paged; every
///              sequence with the same query count and a decode shape runs one cuda.decode launch, anything else
///              attend's CUDA kernels one sequence at a time; score modifiers on both); other policies return
///              errc::unsupported.
/// @param p     batch = 1, seq_q = total query tokens, seq_kv = total keys; heads, heads_kv, head_dim, scale.
/// @param rb    the sequences and their cumulative offsets (rb.cu_seqlens_q ends at p.seq_q, cu_seqlens_kv at
///              p.seq_kv), with optional host mirrors (see ragged_batch).
/// @param mask  as attend_paged's.
/// @param lse   optional, heads·total_q floats laid out [h][token]; a row that sees no key gets O = 0, lse = −inf
///              (the head's sink logit with sinks).
/// Each sequence gives bitwise the result of its own attend call. When every sequence has the same number of
/// query rows and the call is decode-shaped, one decode-kernel call covers the batch (keys split across threads).
/// The overload for f32 q and o with K and V views of Eigen::half or Eigen::bfloat16 runs on the CPU flash
/// policies only (others, cpu_naive included, return errc::unsupported); K and V rows are widened to f32 exactly
/// as they are read.
/// @return ok; errc::invalid_argument naming the field and value (offsets not starting at 0, decreasing, or not
///         ending at the total, a mirror that differs from its array on a CPU policy, ...), nothing written;
///         errc::unsupported; errc::out_of_memory.
template <class Policy, class T, class Mask = dense>
status attend_ragged(const Policy& pol, const problem& p, const ragged_batch& rb,
                     tensor_ref<const detail::identity_t<T>> q, tensor_ref<const detail::identity_t<T>> k,
                     tensor_ref<const detail::identity_t<T>> v, tensor_ref<T> o, const Mask& mask = {},
                     float* lse = nullptr) {
  return detail::attend_ragged_impl<Policy, T, T, Mask>(pol, p, rb, q, k, v, o, mask, lse);
}

/// attend_ragged for mixed storage: f32 q and o, K and V in Eigen::half or Eigen::bfloat16 (see above).
template <class Policy, class KV, class Mask = dense, std::enable_if_t<is_half_kv_v<KV>, int> = 0>
status attend_ragged(const Policy& pol, const problem& p, const ragged_batch& rb, tensor_ref<const float> q,
                     tensor_ref<const KV> k, tensor_ref<const KV> v, tensor_ref<float> o, const Mask& mask = {},
                     float* lse = nullptr) {
  return detail::attend_ragged_impl<Policy, float, KV, Mask>(pol, p, rb, q, k, v, o, mask, lse);
}

}  // namespace fusedattn
