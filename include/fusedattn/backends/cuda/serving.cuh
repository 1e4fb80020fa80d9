/// @file serving.cuh
/// The CUDA side of attend_paged and attend_ragged (dispatch/serving.hpp): the block table, lengths and offsets are
/// copied to the host for validation, decode shapes run the decode kernel (decode.cuh) on the cache in place, and
/// ragged batches of other shapes run attend's CUDA kernels one sequence at a time.
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

/// Copies `n` int32 values of a device array to `host` on `stream` and waits for them; refused while the stream is
/// being captured into a CUDA graph (validation reads them before the call returns).
inline status table_to_host(const std::int32_t* dev, index_t n, std::vector<std::int32_t>& host, cudaStream_t stream,
                            const char* name) {
  if (status st = check_device_pointer(dev, name); !st) return st;
  bool capturing = false;
  if (status st = stream_capturing(stream, capturing); !st) return st;
  if (capturing)
    return {errc::unsupported, std::string("policy::cuda's serving calls read ") + name +
                                   " on the host to validate it, which a CUDA graph capture cannot do"};
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

/// attend_paged on policy::cuda after validation (tables checked on their host copies): the decode kernel on the
/// cache in place. `bind_len(L)` is the call's mask bound to seq_q rows and L keys; `max_len` the longest sequence.
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

/// attend_ragged on policy::cuda after validation (offsets checked on their host copies cu_q, cu_kv; the device
/// arrays are dev_cu_kv). Every sequence with the same query count n and a decode shape: one decode launch over the
/// packed K/V. Otherwise attend's CUDA kernels run one sequence at a time (flash where it applies), each sequence's
/// lse copied into its place. `bind_len(n, L)` binds the mask to n rows and L keys.
template <class T, class BindLen>
status attend_ragged(const policy::cuda& pol, const problem& p, index_t sequences, const std::int32_t* cu_q,
                     const std::int32_t* cu_kv, const std::int32_t* dev_cu_kv, const tensor_ref<const T>& q,
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
