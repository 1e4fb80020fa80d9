/// @file serving.cuh
/// The CUDA side of attend_paged and attend_ragged (dispatch/serving.hpp): the block table, lengths and offsets are
/// validated on the host (the caller's host mirrors, or copies read back from the device), decode shapes run the
/// decode kernel (decode.cuh) on the cache in place, ragged batches of other shapes the Hopper kernel in one launch
/// (ragged.cuh) where it applies, else attend's CUDA kernels one sequence at a time.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "attend_cuda.cuh"
#include "decode.cuh"

namespace fusedattn {
namespace cuda_backend {

/// Refuses a stream being captured into a CUDA graph: a serving call plans its launch (split count, keys per split)
/// from the lengths it reads at call time, so a graph replayed with longer sequences would silently read too few
/// keys. `call` names the entry point.
inline status serving_refuses_capture(cudaStream_t stream, const char* call) {
  bool capturing = false;
  if (status st = stream_capturing(stream, capturing); !st) return st;
  if (capturing)
    return {errc::unsupported, std::string(call) +
                                   " on policy::cuda cannot be captured into a CUDA graph: it plans its launch (split "
                                   "count, keys per split) from the lengths at call time, and a replay with longer "
                                   "sequences would read too few keys"};
  return {};
}

/// Copies `n` int32 values of a device array to `host` on `stream` and waits for them (validation reads them before
/// the call returns; the caller has refused a capturing stream).
inline status table_to_host(const std::int32_t* dev, index_t n, std::vector<std::int32_t>& host, cudaStream_t stream,
                            const char* name) {
  if (status st = check_device_pointer(dev, name); !st) return st;
  try {
    host.resize(static_cast<std::size_t>(n));
  } catch (const std::bad_alloc&) {
    return {errc::out_of_memory, std::string("cannot allocate the host copy of ") + name};
  }
  if (n == 0) return {};
  if (status st = from_cuda(cudaMemcpyAsync(host.data(), dev, std::size_t(n) * sizeof(std::int32_t),
                                            cudaMemcpyDeviceToHost, stream),
                            name);
      !st)
    return st;
  return from_cuda(cudaStreamSynchronize(stream), name);
}

/// Checks a device array and its host mirror before the call plans from the mirror (nothing is read back): the
/// device array (`dev_name`, which the kernel reads) is set and in device memory, the mirror (`host_name`) is not in
/// device memory (the host reads it). Managed memory serves as either.
inline status check_mirror(const std::int32_t* dev, const std::int32_t* host, const char* dev_name,
                           const char* host_name) {
  if (dev == nullptr) return status::invalid(std::string(dev_name) + " is null");
  if (status st = check_device_pointer(dev, dev_name); !st) return st;
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, host) != cudaSuccess) {
    cudaGetLastError();
    return {};
  }
  if (attr.type == cudaMemoryTypeDevice)
    return status::invalid(std::string(host_name) + " is device memory; it must be the host copy of " + dev_name);
  return {};
}

/// attend_paged on policy::cuda after validation (tables checked on the host, mirrors or copies): the decode kernel
/// on the cache in place (it reads the device block table and lengths). `bind_len(L)` is the call's mask bound to seq_q rows and L keys; `max_len` the longest sequence.
template <class T, class KV, class BindLen>
status attend_paged(const policy::cuda& pol, const problem& p, const tensor_ref<const T>& q, const KV& kv,
                    const tensor_ref<T>& o, BindLen&& bind_len, float* lse, index_t max_len) {
  if (status st = check_device_pointers(q, q, q, o, lse, bind_len(index_t(0)).mods); !st) return st;
  if (status st = check_device_pointer(kv.k, "kv.k"); !st) return st;
  if (status st = check_device_pointer(kv.v, "kv.v"); !st) return st;
  if (status st = decode_applies<T>(p); !st)
    return {errc::unsupported, std::string("attend_paged on policy::cuda runs decode shapes only: ") + st.what()};
  if (status st = decode_views_fit(q, o); !st) return st;
  if (!decode_aligned(kv.k, {kv.stride.page, kv.stride.head, kv.stride.token}) ||
      !decode_aligned(kv.v, {kv.stride.page, kv.stride.head, kv.stride.token}))
    return {errc::unsupported, "cuda.decode needs 16-byte aligned pools with strides that are multiples of 8"};
  if (p.batch == 0 || p.heads == 0 || p.seq_q == 0) return {};
  decode_params dp = decode_io(p, q, o, lse, p.heads * p.seq_q, p.seq_q, 1);
  decode_band(bind_len, p.seq_q, dp);
  dp.kv.k = kv.k;
  dp.kv.v = kv.v;
  dp.kv.page = kv.stride.page;
  dp.kv.head = kv.stride.head;
  dp.kv.token = kv.stride.token;
  dp.kv.block_table = kv.block_table;
  dp.kv.blocks_per_seq = kv.blocks_per_seq;
  dp.kv.page_size = int(kv.page_size);
  dp.kv.seq_lens = kv.seq_lens;
  return launch_decode<T>(p, dp, max_len, static_cast<cudaStream_t>(pol.stream));
}

/// A ragged batch of 16-bit Q, K, V, O on the Hopper kernel in one launch (launch_flash_hopper_ragged), or
/// errc::unsupported (nothing launched) where it does not apply: not a Hopper with sm_90a code, a head_dim outside 64
/// (without score modifiers) and 72–256 in steps of 8, views that are not 16-byte aligned with unit column strides,
/// or extents past flash_grid_fits. `cu_q` is the host's view of the query offsets, `dev_cu_q` and `dev_cu_kv` the
/// device arrays the kernel reads.
template <class T, class BindLen>
status attend_ragged_hopper(const problem& p, index_t sequences, const std::int32_t* cu_q, const std::int32_t* dev_cu_q,
                            const std::int32_t* dev_cu_kv, const tensor_ref<const T>& q, const tensor_ref<const T>& k,
                            const tensor_ref<const T>& v, const tensor_ref<T>& o, BindLen&& bind_len, float* lse,
                            cudaStream_t stream) {
  using E = device_t<T>;
  const status no{errc::unsupported, "the Hopper kernel does not take this ragged batch"};
  if constexpr (!(std::is_same_v<E, __half> || std::is_same_v<E, __nv_bfloat16>)) {
    return no;
  } else {
    const band_mask m0 = bind_len(index_t(0), index_t(0));
    const bool mods = m0.mods.any();
    const index_t d = p.head_dim;
    const bool fits = d % 8 == 0 && ((d == 64 && !mods) || (d >= 72 && d <= 256));
    if (!fits || !flash_grid_fits(p).ok() || q.stride.d != 1 || k.stride.d != 1 || v.stride.d != 1 || o.stride.d != 1 ||
        !flash_aligned(q) || !flash_aligned(k) || !flash_aligned(v) || !flash_aligned(o) || !hopper_flash_ready(stream))
      return no;
    flash_params_t<band_mask> fp = flash_params_of(p, q, k, v, o, m0, lse);
    fp.cu_q = dev_cu_q;
    fp.cu_kv = dev_cu_kv;
    fp.shift = ragged_shift_of(bind_len);
    const auto run = [&](auto tile, auto with_mods) {
      return launch_flash_hopper_ragged<E, decltype(tile), decltype(with_mods)::value>(fp, cu_q, sequences, stream);
    };
    if (d == 64) {  // the tiles plain attend takes for the same token count (hopper_takes_turns_tile)
      int multiprocessors = 0;
      if (status st = device_multiprocessors(multiprocessors); !st) return st;
      if (hopper_takes_turns_tile(m0, 1, p.heads, p.seq_q, multiprocessors))
        return run(typename hopper_turns_tile<64>::type{}, std::false_type{});
      return run(typename hopper_whole_row_tile<64>::type{}, std::false_type{});
    }
    const auto by_width = [&](auto with_mods) {
      if (d <= 128) return run(typename hopper_default_tile<128>::type{}, with_mods);
      if (d <= 192) return run(typename hopper_default_tile<192>::type{}, with_mods);
      return run(typename hopper_default_tile<256>::type{}, with_mods);
    };
    return mods ? by_width(std::true_type{}) : by_width(std::false_type{});
  }
}

/// attend_ragged on policy::cuda after validation (offsets checked on the host: cu_q, cu_kv, mirrors or copies; the
/// device arrays are dev_cu_q and dev_cu_kv). Every sequence with the same query count n and a decode shape: one
/// decode launch over the packed K/V. Otherwise the Hopper kernel in one launch (attend_ragged_hopper), or where it
/// does not apply attend's CUDA kernels one sequence at a time (flash where it applies), each sequence's lse copied
/// into its place. `bind_len(n, L)` binds the mask to n rows and L keys.
template <class T, class BindLen>
status attend_ragged(const policy::cuda& pol, const problem& p, index_t sequences, const std::int32_t* cu_q,
                     const std::int32_t* cu_kv, const std::int32_t* dev_cu_q, const std::int32_t* dev_cu_kv, const tensor_ref<const T>& q,
                     const tensor_ref<const T>& k, const tensor_ref<const T>& v, const tensor_ref<T>& o,
                     BindLen&& bind_len, float* lse) {
  if (status st = check_device_pointers(q, k, v, o, lse, bind_len(index_t(1), index_t(0)).mods); !st) return st;
  const auto stream = static_cast<cudaStream_t>(pol.stream);
  const index_t n = cu_q[1] - cu_q[0];
  bool uniform = n > 0;
  index_t max_kv = 0;
  for (index_t b = 0; b < sequences; ++b) {
    uniform = uniform && cu_q[b + 1] - cu_q[b] == n;
    max_kv = std::max<index_t>(max_kv, cu_kv[b + 1] - cu_kv[b]);
  }
  problem pb = p;
  pb.batch = sequences;
  pb.seq_q = uniform ? n : 1;
  pb.seq_kv = max_kv;
  const bool views_fit = decode_aligned(k.data, {k.stride.h, k.stride.s}) && decode_aligned(v.data, {v.stride.h, v.stride.s}) &&
                         k.stride.d == 1 && v.stride.d == 1 && k.stride.h == v.stride.h && k.stride.s == v.stride.s;
  if (uniform && p.heads > 0 && views_fit && decode_applies<T>(pb)) {
    const tensor_ref<const T> qb{q.data, pb.q_dims(), {n * q.stride.s, q.stride.h, q.stride.s, 1}};
    const tensor_ref<T> ob{o.data, pb.o_dims(), {n * o.stride.s, o.stride.h, o.stride.s, 1}};
    if (decode_views_fit(qb, ob)) {
      decode_params dp = decode_io(pb, qb, ob, lse, n, p.seq_q, 1);  // lse [h][token], token = b·n + i
      decode_band([&](index_t len) { return bind_len(n, len); }, n, dp);
      dp.kv.k = k.data;
      dp.kv.v = v.data;
      dp.kv.head = k.stride.h;
      dp.kv.token = k.stride.s;
      dp.kv.cu = dev_cu_kv;
      return launch_decode<T>(pb, dp, max_kv, stream);
    }
  }
  // The Hopper kernel takes the whole batch in one launch where it applies (and the policy asks for no other kernel).
  if (pol.kernel == policy::cuda_kernel::automatic || pol.kernel == policy::cuda_kernel::flash)
    if (status st = attend_ragged_hopper<T>(p, sequences, cu_q, dev_cu_q, dev_cu_kv, q, k, v, o, bind_len, lse, stream);
        st.code() != errc::unsupported)
      return st;
  // One call per sequence; an lse staging buffer of heads × the longest query count.
  index_t max_q = 0;
  for (index_t b = 0; b < sequences; ++b) max_q = std::max<index_t>(max_q, cu_q[b + 1] - cu_q[b]);
  struct owner {
    void* ptr = nullptr;
    cudaStream_t stream;
    ~owner() {
      if (ptr != nullptr) cudaFreeAsync(ptr, stream);
    }
  } stage{nullptr, stream};
  if (lse != nullptr && max_q > 0)
    if (status st = scratch_allocate(stage.ptr, std::size_t(p.heads * max_q) * sizeof(float), stream,
                                     "cudaMallocFromPoolAsync(ragged lse staging)");
        !st)
      return st;
  for (index_t b = 0; b < sequences; ++b) {
    const index_t q0 = cu_q[b], nq = cu_q[b + 1] - q0, k0 = cu_kv[b], nk = cu_kv[b + 1] - k0;
    if (nq == 0) continue;
    problem ps = p;
    ps.seq_q = nq;
    ps.seq_kv = nk;
    const tensor_ref<const T> qs{q.row(0, 0, q0), ps.q_dims(), q.stride};
    const tensor_ref<const T> ks{nk > 0 ? k.row(0, 0, k0) : k.data, ps.kv_dims(), k.stride};
    const tensor_ref<const T> vs{nk > 0 ? v.row(0, 0, k0) : v.data, ps.kv_dims(), v.stride};
    const tensor_ref<T> os{o.row(0, 0, q0), ps.o_dims(), o.stride};
    float* lse_s = lse != nullptr ? static_cast<float*>(stage.ptr) : nullptr;
    if (status st = attend(pol, ps, qs, ks, vs, os, bind_len(nq, nk), lse_s); !st) return st;
    if (lse != nullptr)  // [h][nq] → [h][token]
      if (status st = from_cuda(cudaMemcpy2DAsync(lse + q0, std::size_t(p.seq_q) * sizeof(float), lse_s,
                                                  std::size_t(nq) * sizeof(float), std::size_t(nq) * sizeof(float),
                                                  std::size_t(p.heads), cudaMemcpyDeviceToDevice, stream),
                                "cudaMemcpy2DAsync(ragged lse)");
          !st)
        return st;
  }
  return {};
}

}  // namespace cuda_backend
}  // namespace fusedattn
