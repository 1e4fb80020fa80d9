/// @file naive.cuh
/// The naive three-pass pipeline on the GPU, the leaderboard's way: pack Q, K, V to contiguous B·H·S·D, then
///   S = Q·Kᵀ   (cuBLAS strided-batched GEMM, one batch per (b, h_kv): the group's query heads are adjacent rows),
///   P = softmax(mods(scale·S) + mask) row by row (one kernel, with the score modifiers and the sink of
///       core/score_mod.hpp; also writes lse),
///   O = P·V    (cuBLAS strided-batched GEMM), unpacked to O's strides and type.
/// S is materialised (b·h·s_q·s_kv scores). f16/bf16 multiply on tensor cores with f32 scores and P rounded to the
/// input type; f32 and f64 run in full precision (no TF32). Not the fused kernel: that is flash.cuh.
/// Numerics as on the CPU (docs/design.md): the row max propagates NaN, and when V holds an inf or NaN the P·V GEMM's
/// result is replaced by a plain sum over each row's allowed keys (plain_pv_kernel), so 0·inf never reaches O.
#pragma once

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <type_traits>
#include <vector>

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "../../core/problem.hpp"
#include "../../core/status.hpp"
#include "../../core/tensor.hpp"
#include "../../kernels/mask.hpp"
#include "device_types.cuh"
#include "head_mask.cuh"
#include "error.cuh"
#include "scratch.cuh"

namespace fusedattn {
namespace cuda_backend {

/// Types of the naive pipeline for a device element type `E`: scores and output accumulate in `acc`.
template <class E>
struct naive_types {
  using acc = float;
  static constexpr cudaDataType_t elem = std::is_same_v<E, __half> ? CUDA_R_16F
                                         : std::is_same_v<E, __nv_bfloat16> ? CUDA_R_16BF
                                                                            : CUDA_R_32F;
  static constexpr cudaDataType_t acc_type = CUDA_R_32F;
  static constexpr cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
};
template <>
struct naive_types<double> {
  using acc = double;
  static constexpr cudaDataType_t elem = CUDA_R_64F;
  static constexpr cudaDataType_t acc_type = CUDA_R_64F;
  static constexpr cublasComputeType_t compute = CUBLAS_COMPUTE_64F;
};

/// dst[b][h][s][d] (contiguous) = src(b, h, s, d), converted; with `nonfinite`, sets *nonfinite to 1 when a value
/// is ±inf or NaN.
template <class Src, class Dst>
__global__ void pack_kernel(const tensor_ref<const Src> src, Dst* dst, index_t n, int* nonfinite = nullptr) {
  const dims4 d = src.dims;
  for (index_t e = blockIdx.x * index_t(blockDim.x) + threadIdx.x; e < n; e += index_t(gridDim.x) * blockDim.x) {
    const index_t c = e % d.d, s = (e / d.d) % d.s, bh = e / (d.d * d.s);
    const auto x = widen(src.row(bh / d.h, bh % d.h, s)[c]);
    dst[e] = narrow<Dst>(x);
    if (nonfinite != nullptr && !isfinite(x)) *nonfinite = 1;
  }
}

/// dst(b, h, s, d) = src[b][h][s][d] (contiguous), rounded to the output type.
template <class Src, class Dst>
__global__ void unpack_kernel(const Src* src, const tensor_ref<Dst> dst, index_t n) {
  const dims4 d = dst.dims;
  for (index_t e = blockIdx.x * index_t(blockDim.x) + threadIdx.x; e < n; e += index_t(gridDim.x) * blockDim.x) {
    const index_t c = e % d.d, s = (e / d.d) % d.s, bh = e / (d.d * d.s);
    dst.row(bh / d.h, bh % d.h, s)[c] = narrow<Dst>(src[e]);
  }
}

/// Threads of one softmax block (one block per score row).
inline constexpr int softmax_threads = 256;

/// Block-wide reduction of one value per thread with `op`; every thread gets the result.
template <class A, class Op>
__device__ A block_reduce(A x, Op op, A* scratch) {
  for (int o = 16; o > 0; o /= 2) x = op(x, __shfl_xor_sync(0xffffffffu, x, o));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // scratch may still be read by the previous reduction
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  x = scratch[0];
  for (int w = 1; w < softmax_threads / 32; ++w) x = op(x, scratch[w]);
  return x;
}

/// max(a, b) that propagates NaN (fmax drops it, and a row of NaN logits would pass for one that sees no key).
template <class A>
__device__ __forceinline__ A max_nan(A a, A b) {
  return a != a ? a : b != b ? b : fmax(a, b);
}

/// Row r = (b·heads + h)·s_q + i of S (s_kv scores): with t_j = mods.apply(scale·s_j, h, i, j) (= scale·s_j without
/// score modifiers) and the sink logit σ_h (−inf without sinks), p_j = exp(t_j − m) / (exp(σ_h − m) + Σ over allowed
/// j), 0 where the mask forbids, m = max(σ_h, max over allowed j of t_j); lse = m + log(exp(σ_h − m) + Σ) (−inf and
/// P = 0 for a row that sees no key and no sink; NaN P and lse for a row with a NaN logit).
template <class A, class P, class Mask>
__global__ void __launch_bounds__(softmax_threads) softmax_kernel(const A* s, P* p, float* lse, const Mask all_heads,
                                                                  index_t heads, A scale) {
  __shared__ A scratch[softmax_threads / 32];
  const index_t r = blockIdx.x, i = r % all_heads.seq_q, n = all_heads.seq_kv, bh = r / all_heads.seq_q;
  const index_t h = bh % heads;
  const Mask mask = head_mask(all_heads, bh / heads, h);
  const bound_mods& mods = mods_of(mask);
  const bool modified = mods.changes_scores();
  const auto logit = [&](index_t j) { return modified ? mods.apply(scale * s[r * n + j], h, i, j) : scale * s[r * n + j]; };
  P* p_row = p + r * n;
  const A neg_inf = -INFINITY;
  const A sink = mods.sink<A>(h);
  // m = max over allowed j of t_j, and the sink
  A m = neg_inf;
  for (index_t j = threadIdx.x; j < n; j += softmax_threads)
    if (mask.allowed(i, j)) m = max_nan(m, logit(j));
  m = max_nan(block_reduce(m, [](A a, A b) { return max_nan(a, b); }, scratch), sink);
  // l = exp(σ − m) + Σ exp(t_j − m)
  A l = 0;
  if (m != neg_inf)
    for (index_t j = threadIdx.x; j < n; j += softmax_threads)
      if (mask.allowed(i, j)) l += exp(logit(j) - m);
  l = block_reduce(l, [](A a, A b) { return a + b; }, scratch);
  if (sink != neg_inf) l += exp(sink - m);
  // l = 0: the row sees no key (or only −inf logits); l = NaN: a NaN logit, which P and lse carry on.
  const A inv_l = l != 0 ? A(1) / l : A(0);
  for (index_t j = threadIdx.x; j < n; j += softmax_threads)
    p_row[j] = narrow<P>(mask.allowed(i, j) && l != 0 ? exp(logit(j) - m) * inv_l : A(0));
  if (lse != nullptr && threadIdx.x == 0) lse[r] = l != 0 ? static_cast<float>(m + log(l)) : -INFINITY;
}

/// Where V holds an inf or NaN (*nonfinite set by pack_kernel; otherwise every block returns at once): row r of O,
/// o[r][c] = Σ_j p[r][j]·v[b, h_kv][j][c] over the keys row r's mask allows only, replacing the P·V GEMM's row
/// (in which the masked keys' p = 0 met their V: 0·inf = NaN). One block per row, a thread per column.
template <class A, class E, class Mask>
__global__ void plain_pv_kernel(const E* p, const E* v, A* o, const int* nonfinite, const Mask all_heads,
                                index_t heads, index_t group, index_t head_dim) {
  if (*nonfinite == 0) return;
  const index_t r = blockIdx.x, i = r % all_heads.seq_q, n = all_heads.seq_kv, bh = r / all_heads.seq_q;
  const index_t b = bh / heads, h = bh % heads;
  const Mask mask = head_mask(all_heads, b, h);
  const E* p_row = p + r * n;
  const E* v_head = v + (b * (heads / group) + h / group) * n * head_dim;
  for (index_t c = threadIdx.x; c < head_dim; c += blockDim.x) {
    A sum = 0;
    for (index_t j = 0; j < n; ++j)
      if (mask.allowed(i, j)) sum += static_cast<A>(widen(p_row[j])) * static_cast<A>(widen(v_head[j * head_dim + c]));
    o[r * head_dim + c] = sum;
  }
}

/// The cuBLAS handle of this host thread for the current device, created on first use. A first use inside a stream
/// capture creates it in the thread's relaxed capture mode: cublasCreate allocates and frees device memory, which
/// the global and thread-local modes forbid while a stream is captured (cudaErrorStreamCaptureUnsupported), and
/// which belongs to the handle, not to the graph.
inline status cublas_handle(cublasHandle_t& out) {
  struct handles {
    std::vector<cublasHandle_t> by_device;
    ~handles() {
      for (cublasHandle_t hnd : by_device)
        if (hnd != nullptr) cublasDestroy(hnd);
    }
  };
  thread_local handles cache;
  int device = 0;
  if (status st = from_cuda(cudaGetDevice(&device), "cudaGetDevice"); !st) return st;
  if (cache.by_device.size() <= std::size_t(device)) cache.by_device.resize(std::size_t(device) + 1, nullptr);
  if (cache.by_device[std::size_t(device)] == nullptr) {
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    if (status st = from_cuda(cudaThreadExchangeStreamCaptureMode(&mode), "cudaThreadExchangeStreamCaptureMode"); !st)
      return st;
    const cublasStatus_t created = cublasCreate(&cache.by_device[std::size_t(device)]);
    cudaThreadExchangeStreamCaptureMode(&mode);  // the thread's mode back
    if (status st = from_cublas(created, "cublasCreate"); !st) {
      cache.by_device[std::size_t(device)] = nullptr;
      return st;
    }
  }
  out = cache.by_device[std::size_t(device)];
  return {};
}

/// Stream-ordered scratch buffers from scratch_pool, freed (in stream order) when it goes out of scope.
class scratch_arena {
 public:
  explicit scratch_arena(cudaStream_t stream) : stream_(stream) {}
  scratch_arena(const scratch_arena&) = delete;
  scratch_arena& operator=(const scratch_arena&) = delete;
  ~scratch_arena() {
    for (void* ptr : blocks_) cudaFreeAsync(ptr, stream_);
  }
  template <class X>
  status allocate(X*& out, index_t count, const char* what) {
    void* ptr = nullptr;
    if (status st = scratch_allocate(ptr, std::size_t(count) * sizeof(X), stream_, "cudaMallocFromPoolAsync"); !st)
      return {st.code(), std::string("CUDA scratch: cannot allocate ") + what + " (" +
                             std::to_string(count * index_t(sizeof(X))) + " bytes): " + st.what()};
    blocks_.push_back(ptr);
    out = static_cast<X*>(ptr);
    return {};
  }

 private:
  cudaStream_t stream_;
  std::vector<void*> blocks_;
};

/// Launch shape of the element-wise pack/unpack kernels.
inline dim3 elementwise_grid(index_t n) {
  constexpr index_t threads = 256, max_blocks = 65535;
  const index_t blocks = (n + threads - 1) / threads;
  return dim3(unsigned(blocks < max_blocks ? blocks : max_blocks));
}

/// Device scratch bytes of naive_attention for storage type `T`: packed Q, K, V (the input type), S and the unpacked O
/// (the accumulation type), P (the input type) and a flag; SIZE_MAX when the count overflows.
template <class T>
std::size_t naive_scratch_bytes(const problem& pr) {
  using E = device_t<T>;
  using A = typename naive_types<E>::acc;
  // Σ of products of non-negative extents, each term and the sum checked.
  std::size_t total = sizeof(int);
  bool overflow = false;
  const auto add = [&](std::initializer_list<index_t> factors, std::size_t bytes) {
    std::size_t x = bytes;
    for (index_t f : factors) overflow = overflow || __builtin_mul_overflow(x, std::size_t(f), &x);
    overflow = overflow || __builtin_add_overflow(total, x, &total);
  };
  add({pr.batch, pr.heads, pr.seq_q, pr.head_dim}, sizeof(E) + sizeof(A));   // packed Q, unpacked O
  add({pr.batch, pr.heads_kv, pr.seq_kv, pr.head_dim}, 2 * sizeof(E));       // packed K, V
  add({pr.batch, pr.heads, pr.seq_q, pr.seq_kv}, sizeof(A) + sizeof(E));     // S, P
  return overflow ? SIZE_MAX : total;
}

/// The naive pipeline for storage type `T` (device twin `E`); see the file comment.
template <class T, class Mask>
status naive_attention(const problem& pr, const tensor_ref<const T>& q, const tensor_ref<const T>& k,
                       const tensor_ref<const T>& v, const tensor_ref<T>& o, const Mask& mask, float* lse,
                       cudaStream_t stream) {
  using E = device_t<T>;
  using types = naive_types<E>;
  using A = typename types::acc;
  constexpr index_t max_int = 0x7fffffff;
  const index_t group = pr.group_size(), rows = group * pr.seq_q;  // score rows per GEMM batch
  if (rows > max_int || pr.seq_kv > max_int || pr.head_dim > max_int || pr.batch * pr.heads_kv > max_int ||
      pr.batch * pr.heads * pr.seq_q > max_int)
    return {errc::unsupported, "naive CUDA pipeline: a GEMM extent exceeds 2^31 - 1"};
  if (naive_scratch_bytes<T>(pr) == SIZE_MAX)
    return {errc::out_of_memory, "naive CUDA pipeline: its scratch (S and P: batch * heads * seq_q * seq_kv scores) "
                                 "exceeds the address space"};

  cublasHandle_t handle = nullptr;
  if (status st = cublas_handle(handle); !st) return st;
  if (status st = from_cublas(cublasSetStream(handle, stream), "cublasSetStream"); !st) return st;

  const index_t n_q = pr.batch * pr.heads * pr.seq_q * pr.head_dim;
  const index_t n_kv = pr.batch * pr.heads_kv * pr.seq_kv * pr.head_dim;
  const index_t n_s = pr.batch * pr.heads * pr.seq_q * pr.seq_kv;
  scratch_arena arena(stream);
  E *qc = nullptr, *kc = nullptr, *vc = nullptr, *pc = nullptr;
  A *sc = nullptr, *oc = nullptr;
  if (status st = arena.allocate(qc, n_q, "packed Q"); !st) return st;
  if (status st = arena.allocate(kc, n_kv, "packed K"); !st) return st;
  if (status st = arena.allocate(vc, n_kv, "packed V"); !st) return st;
  if (status st = arena.allocate(sc, n_s, "scores S"); !st) return st;
  if (status st = arena.allocate(pc, n_s, "probabilities P"); !st) return st;
  if (status st = arena.allocate(oc, n_q, "unpacked O"); !st) return st;
  int* v_nonfinite = nullptr;
  if (status st = arena.allocate(v_nonfinite, 1, "non-finite V flag"); !st) return st;
  if (status st = from_cuda(cudaMemsetAsync(v_nonfinite, 0, sizeof(int), stream), "cudaMemsetAsync(non-finite V flag)");
      !st)
    return st;

  const tensor_ref<const E> qe{reinterpret_cast<const E*>(q.data), q.dims, q.stride};
  const tensor_ref<const E> ke{reinterpret_cast<const E*>(k.data), k.dims, k.stride};
  const tensor_ref<const E> ve{reinterpret_cast<const E*>(v.data), v.dims, v.stride};
  const tensor_ref<E> oe{reinterpret_cast<E*>(o.data), o.dims, o.stride};
  pack_kernel<<<elementwise_grid(n_q), 256, 0, stream>>>(qe, qc, n_q);
  pack_kernel<<<elementwise_grid(n_kv), 256, 0, stream>>>(ke, kc, n_kv);
  pack_kernel<<<elementwise_grid(n_kv), 256, 0, stream>>>(ve, vc, n_kv, v_nonfinite);
  if (status st = last_launch("pack_kernel"); !st) return st;

  // S and the unpacked O are zero-filled first although the GEMMs (beta = 0) write every element: compute-sanitizer's
  // initcheck does not see the stores of cuBLAS's Hopper GEMM kernels and would report the softmax and unpack
  // kernels' reads as reads of uninitialised memory. The memsets cost less than a quarter of the pipeline's traffic.
  if (status st = from_cuda(cudaMemsetAsync(sc, 0, std::size_t(n_s) * sizeof(A), stream), "cudaMemsetAsync(scores S)");
      !st)
    return st;
  if (status st = from_cuda(cudaMemsetAsync(oc, 0, std::size_t(n_q) * sizeof(A), stream), "cudaMemsetAsync(O)"); !st)
    return st;
  // Column-major view: S_batchᵀ (s_kv × rows) = K_cmᵀ · Q_cm, with K_cm (d × s_kv) and Q_cm (d × rows).
  const A one = 1, zero = 0;
  const int d = int(pr.head_dim), n_kv_rows = int(pr.seq_kv), n_rows = int(rows), batches = int(pr.batch * pr.heads_kv);
  if (status st = from_cublas(
          cublasGemmStridedBatchedEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, n_kv_rows, n_rows, d, &one, kc, types::elem, d,
                                     pr.seq_kv * pr.head_dim, qc, types::elem, d, rows * pr.head_dim, &zero, sc,
                                     types::acc_type, n_kv_rows, rows * pr.seq_kv, batches, types::compute,
                                     CUBLAS_GEMM_DEFAULT),
          "cublasGemmStridedBatchedEx(Q·Kᵀ)");
      !st)
    return st;

  softmax_kernel<A, E, Mask><<<unsigned(pr.batch * pr.heads * pr.seq_q), softmax_threads, 0, stream>>>(
      sc, pc, lse, mask, pr.heads, static_cast<A>(pr.softmax_scale()));
  if (status st = last_launch("softmax_kernel"); !st) return st;

  // Column-major view: O_batchᵀ (d × rows) = V_cm (d × s_kv) · P_cm (s_kv × rows).
  if (status st = from_cublas(
          cublasGemmStridedBatchedEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, d, n_rows, n_kv_rows, &one, vc, types::elem, d,
                                     pr.seq_kv * pr.head_dim, pc, types::elem, n_kv_rows, rows * pr.seq_kv, &zero, oc,
                                     types::acc_type, d, rows * pr.head_dim, batches, types::compute,
                                     CUBLAS_GEMM_DEFAULT),
          "cublasGemmStridedBatchedEx(P·V)");
      !st)
    return st;

  plain_pv_kernel<A, E, Mask><<<unsigned(pr.batch * pr.heads * pr.seq_q), 128, 0, stream>>>(
      pc, vc, oc, v_nonfinite, mask, pr.heads, group, pr.head_dim);
  if (status st = last_launch("plain_pv_kernel"); !st) return st;

  unpack_kernel<<<elementwise_grid(n_q), 256, 0, stream>>>(static_cast<const A*>(oc), oe, n_q);
  return last_launch("unpack_kernel");
}

}  // namespace cuda_backend
}  // namespace fusedattn
