// Ragged (variable-length) prefill on policy::cuda: fa::attend_ragged over packed Q/K/V/O ([token][head][d], bf16,
// 32 query heads) located by cu_seqlens, the device offsets passed with their host mirrors (ragged_batch::
// with_host_offsets, so nothing is read back and the stream is not synchronised), beside the dense kernel
// (fa::attend, bshd views) on about the same token count as a batch of equal sequences of the mean length.
//
// Shapes: GQA 32/8 at head_dim 128 and MHA 32/32 at head_dim 64; masks causal bottom-right (`causal`, with q = kv
// lengths n(n+1)/2 allowed pairs a sequence) and none (`dense`, n² pairs). Ragged batches (q = kv lengths), drawn
// with the LCG below, which bench/peers/torch_peer.py --ragged repeats:
//   state ← state·1664525 + 1013904223 (mod 2^32), a draw in [lo, hi] = lo + (state >> 8) mod (hi − lo + 1)
//   uniform: 16 × 1024                                                                       (16384 tokens)
//   mixed:   seed 2, lengths in [128, 4096] drawn until the total reaches 16384:
//            726 1482 2926 354 3487 2252 3817 2579                                         (8 seqs, 17623 tokens)
//   short:   seed 3, 64 lengths in [64, 512]                                                    (17939 tokens):
//            197 287 466 409 454 119 461 236 322 113 127 397 235 469 501 189 236 461 447 206 83 194 382 137
//            486 172 449 158 72 74 219 286 101 366 229 113 333 119 311 68 390 92 493 425 80 225 197 397 95 221
//            487 221 494 424 144 200 237 312 387 275 275 466 376 342
// The dense partner of a set of n sequences and T tokens is problem{n, 32, h_kv, L, L, d} with L = round(T / n).
//
// FLOPs are counted per sequence, 4·d·heads·(allowed (i, j) pairs). Each row's time is the median over 7 rounds of
// the mean per call of N calls queued between two cudaEvents (N such that a round lasts about 20 ms; 3 warm-up calls
// first), the calls alternating between two copies of Q/K/V. One line per row:
//   ragged/bf16/<uniform|mixed|short>/<causal|dense>/h32_hkv8_d128   <µs per call>  <TFLOP/s>  ratio <r>  maxdiff <x>
//   ragged_dense/bf16/<set>/<mask>/h32_hkv8_d128                      <µs per call>  <TFLOP/s>  (dense plan)
// ratio = the ragged row's TFLOP/s over its dense partner's. maxdiff: once per ragged row, the largest |O_ragged −
// O_ref| over every output (NaN counts as inf), with the reference's largest |entry| beside it; O_ref is the dense
// batch call where the shapes coincide (uniform: the same 16 × 1024 tokens) and one dense batch-1 call per
// sequence elsewhere. A maxdiff above 0.02 is flagged MISMATCH and makes the exit code 2.
//   fusedattn_bench_ragged [--json FILE]    FILE: one JSON object per row and line (name, kernel, set, dtype, mask,
//                                           sequences, tokens, h, h_kv, d, flop, us, best_us, tflops, and on the
//                                           ragged rows ratio, max_abs_diff, ref_max_abs; 1e30 for inf or NaN)
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include <fusedattn/fusedattn.hpp>

#include "fill.cuh"

namespace fa = fusedattn;
using T = Eigen::bfloat16;
using E = __nv_bfloat16;

namespace {

constexpr int kHeads = 32;
constexpr double kMismatch = 0.02;

/// out[0] = max |a − b| (NaN as inf), out[1] = max |b| over n values, as float bits (non-negative floats order as
/// their unsigned bits); out must hold zeros on entry.
__global__ void max_diff_kernel(const E* a, const E* b, std::size_t n, unsigned* out) {
  float d = 0.f, m = 0.f;
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n; i += std::size_t(gridDim.x) * blockDim.x) {
    const float x = __bfloat162float(a[i]), y = __bfloat162float(b[i]);
    const float e = fabsf(x - y);
    d = fmaxf(d, e != e ? INFINITY : e);
    m = fmaxf(m, fabsf(y) != fabsf(y) ? INFINITY : fabsf(y));
  }
  for (int off = 16; off > 0; off >>= 1) {
    d = fmaxf(d, __shfl_xor_sync(0xffffffffu, d, off));
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
  }
  if ((threadIdx.x & 31) == 0) {
    atomicMax(&out[0], __float_as_uint(d));
    atomicMax(&out[1], __float_as_uint(m));
  }
}

bool ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) std::fprintf(stderr, "bench_ragged: %s: %s\n", what, cudaGetErrorString(e));
  return e == cudaSuccess;
}

/// The lengths generator shared with bench/peers/torch_peer.py --ragged (see the file's comment).
struct lcg {
  std::uint32_t state;
  int draw(int lo, int hi) {
    state = state * 1664525u + 1013904223u;
    return lo + int((state >> 8) % std::uint32_t(hi - lo + 1));
  }
};

struct ragged_set {
  const char* name;
  std::vector<std::int32_t> lens;
};

std::vector<ragged_set> make_sets() {
  std::vector<ragged_set> sets;
  sets.push_back({"uniform", std::vector<std::int32_t>(16, 1024)});
  {
    lcg g{2};
    ragged_set s{"mixed", {}};
    for (long total = 0; total < 16384;) total += s.lens.emplace_back(g.draw(128, 4096));
    sets.push_back(s);
  }
  {
    lcg g{3};
    ragged_set s{"short", {}};
    for (int i = 0; i < 64; ++i) s.lens.push_back(g.draw(64, 512));
    sets.push_back(s);
  }
  return sets;
}

/// Allowed (i, j) pairs of one sequence of n query rows and n keys.
double pairs(long n, bool causal) { return causal ? 0.5 * double(n) * double(n + 1) : double(n) * double(n); }

/// Median µs per call of call(copy) (and the best round in *best): 3 warm-up calls, a calibration call, then 7 rounds
/// of N calls queued between two events on `stream`, N such that a round lasts about 20 ms.
template <class F>
double time_us(cudaStream_t stream, F&& call, int copies, double* best) {
  for (int i = 0; i < 3; ++i) call(i % copies);
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  float ms = 0;
  cudaEventRecord(a, stream);
  call(0);
  cudaEventRecord(b, stream);
  cudaEventSynchronize(b);
  cudaEventElapsedTime(&ms, a, b);
  const int n = std::clamp(int(std::ceil(20.0 / std::max(ms, 1e-3f))), 3, 500);
  std::vector<double> per_call;
  for (int round = 0; round < 7; ++round) {
    cudaEventRecord(a, stream);
    for (int i = 0; i < n; ++i) call((round * n + i) % copies);
    cudaEventRecord(b, stream);
    cudaEventSynchronize(b);
    cudaEventElapsedTime(&ms, a, b);
    per_call.push_back(1000.0 * ms / n);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(per_call.begin(), per_call.end());
  *best = per_call.front();
  return per_call[per_call.size() / 2];
}

/// Device buffers: `copies` copies of Q, K, V (the calls alternate between them), O and a reference O; every buffer
/// holds `tokens` tokens, enough for any set and its dense partner.
struct buffers {
  int copies = 2;
  std::size_t q_elems = 0, kv_elems = 0;
  E* qkv = nullptr;  // per copy: Q, then K, then V
  E* o = nullptr;
  E* o_ref = nullptr;
  unsigned* diff = nullptr;
  E* q(int c) const { return qkv + std::size_t(c) * (q_elems + 2 * kv_elems); }
  E* k(int c) const { return q(c) + q_elems; }
  E* v(int c) const { return k(c) + kv_elems; }
};

FILE* json = nullptr;
bool mismatch = false;

void json_row(const std::string& name, const char* kernel, const ragged_set& s, const char* mask, long tokens, int h_kv,
              int d, double flop, double us, double best, const char* extra) {
  if (!json) return;
  std::fprintf(json,
               "{\"name\":\"%s\",\"kernel\":\"%s\",\"set\":\"%s\",\"dtype\":\"bf16\",\"mask\":\"%s\",\"sequences\":%zu,"
               "\"tokens\":%ld,\"h\":%d,\"h_kv\":%d,\"d\":%d,\"flop\":%.6g,\"us\":%.3f,\"best_us\":%.3f,\"tflops\":%.2f%s}\n",
               name.c_str(), kernel, s.name, mask, s.lens.size(), tokens, kHeads, h_kv, d, flop, us, best,
               flop / us * 1e-6, extra);
  std::fflush(json);
}

/// The ragged row and its dense partner for one set, shape and mask.
template <class Mask>
void run_rows(cudaStream_t stream, const buffers& buf, const ragged_set& s, int h_kv, int d, const Mask& mask,
              bool causal) {
  const int n = int(s.lens.size());
  std::vector<std::int32_t> cu(std::size_t(n) + 1, 0);
  for (int i = 0; i < n; ++i) cu[std::size_t(i) + 1] = cu[std::size_t(i)] + s.lens[std::size_t(i)];
  const long total = cu.back();
  const long len = std::lround(double(total) / n);
  double flop = 0;
  for (std::int32_t l : s.lens) flop += 4.0 * d * kHeads * pairs(l, causal);
  const double dense_flop = 4.0 * d * kHeads * n * pairs(len, causal);
  const char* mask_name = causal ? "causal" : "dense";
  char shape[64];
  std::snprintf(shape, sizeof shape, "h%d_hkv%d_d%d", kHeads, h_kv, d);
  const std::string ragged_name = std::string("ragged/bf16/") + s.name + "/" + mask_name + "/" + shape;
  const std::string dense_name = std::string("ragged_dense/bf16/") + s.name + "/" + mask_name + "/" + shape;

  std::int32_t* d_cu = nullptr;
  if (!ok(cudaMalloc(&d_cu, cu.size() * sizeof(std::int32_t)), "cudaMalloc(cu_seqlens)")) return;
  cudaMemcpy(d_cu, cu.data(), cu.size() * sizeof(std::int32_t), cudaMemcpyHostToDevice);

  const fa::policy::cuda pol{stream};
  const fa::problem pr{1, kHeads, h_kv, total, total, d};
  const fa::ragged_batch rb = fa::ragged_batch{n, d_cu, d_cu}.with_host_offsets(cu.data(), cu.data());
  fa::status ragged_status, dense_status;
  auto ragged_call = [&](int c, E* out) {
    const fa::status st = fa::attend_ragged(
        pol, pr, rb, fa::bshd<const T>(reinterpret_cast<const T*>(buf.q(c)), pr.q_dims()),
        fa::bshd<const T>(reinterpret_cast<const T*>(buf.k(c)), pr.kv_dims()),
        fa::bshd<const T>(reinterpret_cast<const T*>(buf.v(c)), pr.kv_dims()),
        fa::bshd(reinterpret_cast<T*>(out), pr.o_dims()), mask);
    if (!st && ragged_status) ragged_status = st;
  };
  const fa::problem pd{n, kHeads, h_kv, len, len, d};
  auto dense_call = [&](int c, E* out) {
    const fa::status st = fa::attend(pol, pd, fa::bshd<const T>(reinterpret_cast<const T*>(buf.q(c)), pd.q_dims()),
                                     fa::bshd<const T>(reinterpret_cast<const T*>(buf.k(c)), pd.kv_dims()),
                                     fa::bshd<const T>(reinterpret_cast<const T*>(buf.v(c)), pd.kv_dims()),
                                     fa::bshd(reinterpret_cast<T*>(out), pd.o_dims()), mask);
    if (!st && dense_status) dense_status = st;
  };

  // The check, once: the ragged O against the dense batch call (uniform: the same tokens) or against one dense call
  // per sequence, both on copy 0.
  const bool uniform = std::all_of(s.lens.begin(), s.lens.end(), [&](std::int32_t l) { return l == s.lens[0]; });
  const std::size_t o_elems = std::size_t(total) * kHeads * d;
  cudaMemsetAsync(buf.o, 0xff, o_elems * sizeof(E), stream);  // NaNs: an output the call leaves unwritten shows
  cudaMemsetAsync(buf.o_ref, 0, o_elems * sizeof(E), stream);
  ragged_call(0, buf.o);
  fa::status ref_status;
  if (uniform) {
    dense_call(0, buf.o_ref);
    ref_status = dense_status;
  } else {
    for (int i = 0; i < n && ref_status; ++i) {
      const fa::problem p1{1, kHeads, h_kv, s.lens[std::size_t(i)], s.lens[std::size_t(i)], d};
      const std::size_t q0 = std::size_t(cu[std::size_t(i)]) * kHeads * d, k0 = std::size_t(cu[std::size_t(i)]) * h_kv * d;
      const fa::status st = fa::attend(pol, p1, fa::bshd<const T>(reinterpret_cast<const T*>(buf.q(0) + q0), p1.q_dims()),
                                       fa::bshd<const T>(reinterpret_cast<const T*>(buf.k(0) + k0), p1.kv_dims()),
                                       fa::bshd<const T>(reinterpret_cast<const T*>(buf.v(0) + k0), p1.kv_dims()),
                                       fa::bshd(reinterpret_cast<T*>(buf.o_ref + q0), p1.o_dims()), mask);
      if (!st) ref_status = st;
    }
  }
  cudaMemsetAsync(buf.diff, 0, 2 * sizeof(unsigned), stream);
  max_diff_kernel<<<1024, 256, 0, stream>>>(buf.o, buf.o_ref, o_elems, buf.diff);
  unsigned bits[2] = {0, 0};
  cudaMemcpyAsync(bits, buf.diff, sizeof bits, cudaMemcpyDeviceToHost, stream);
  const bool synced = ok(cudaStreamSynchronize(stream), "the check");
  float diff = 0, ref_max = 0;
  std::memcpy(&diff, &bits[0], sizeof diff);
  std::memcpy(&ref_max, &bits[1], sizeof ref_max);
  if (!synced || !ragged_status || !ref_status) {
    std::printf("%-44s failed: %s\n", ragged_name.c_str(),
                !ragged_status ? ragged_status.what() : !ref_status ? ref_status.what() : "a CUDA error");
    mismatch = true;
    cudaFree(d_cu);
    return;
  }

  double ragged_best = 0, dense_best = 0;
  const double ragged_us = time_us(stream, [&](int c) { ragged_call(c, buf.o); }, buf.copies, &ragged_best);
  const double dense_us = time_us(stream, [&](int c) { dense_call(c, buf.o_ref); }, buf.copies, &dense_best);
  const bool launched = ok(cudaStreamSynchronize(stream), "the timed calls");
  const double ragged_tf = flop / ragged_us * 1e-6, dense_tf = dense_flop / dense_us * 1e-6;
  const bool bad = !(double(diff) <= kMismatch);
  mismatch |= bad || !launched || !ragged_status || !dense_status;
  std::printf("%-44s %10.1f us %7.1f TFLOP/s  ratio %5.3f  maxdiff %.3g (|O_ref| <= %.3g, vs %s)%s\n",
              ragged_name.c_str(), ragged_us, ragged_tf, ragged_tf / dense_tf, diff, ref_max,
              uniform ? "the dense batch" : "dense per sequence", bad ? "  MISMATCH" : "");
  const T* pool = reinterpret_cast<const T*>(buf.q(0));
  std::printf("%-44s %10.1f us %7.1f TFLOP/s  (b%d_s%ld: %s)\n", dense_name.c_str(), dense_us, dense_tf, n, len,
              fa::to_string(fa::plan(pol, pd, fa::bshd<const T>(pool, pd.q_dims()), fa::bshd<const T>(pool, pd.kv_dims()),
                                     fa::bshd<const T>(pool, pd.kv_dims()),
                                     fa::bshd(reinterpret_cast<T*>(buf.o_ref), pd.o_dims()), mask))
                  .c_str());
  if (!ragged_status) std::printf("  attend_ragged: %s\n", ragged_status.what());
  if (!dense_status) std::printf("  attend: %s\n", dense_status.what());
  std::fflush(stdout);
  char extra[160];
  std::snprintf(extra, sizeof extra, ",\"ratio\":%.4f,\"max_abs_diff\":%.4g,\"ref_max_abs\":%.4g", ragged_tf / dense_tf,
                std::isfinite(diff) ? double(diff) : 1e30, std::isfinite(ref_max) ? double(ref_max) : 1e30);
  json_row(ragged_name, "ragged", s, mask_name, total, h_kv, d, flop, ragged_us, ragged_best, extra);
  json_row(dense_name, "ragged_dense", s, mask_name, long(n) * len, h_kv, d, dense_flop, dense_us, dense_best, "");
  cudaFree(d_cu);
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--json") == 0 && i + 1 < argc) {
      json = std::fopen(argv[++i], "w");
      if (!json) {
        std::fprintf(stderr, "bench_ragged: cannot write %s\n", argv[i]);
        return 1;
      }
    } else {
      std::fprintf(stderr, "usage: %s [--json FILE]\n", argv[0]);
      return 1;
    }
  }
  const std::vector<ragged_set> sets = make_sets();
  long tokens = 0;  // the largest set or dense partner
  for (const ragged_set& s : sets) {
    long total = 0;
    for (std::int32_t l : s.lens) total += l;
    const long n = long(s.lens.size());
    tokens = std::max({tokens, total, n * std::lround(double(total) / double(n))});
  }
  cudaDeviceProp prop{};
  if (!ok(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties")) return 1;
  std::printf("# device %s, %d SMs, L2 %d MB\n", prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20);
  for (const ragged_set& s : sets) {
    long total = 0;
    std::string list;
    for (std::int32_t l : s.lens) {
      total += l;
      list += " " + std::to_string(l);
    }
    std::printf("# %s: %zu sequences, %ld tokens:%s\n", s.name, s.lens.size(), total, list.c_str());
  }
  cudaStream_t stream = nullptr;
  if (!ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate")) return 1;
  buffers buf;
  buf.q_elems = std::size_t(tokens) * kHeads * 128;  // head_dim 128, the widest; MHA at 64 needs as much
  buf.kv_elems = buf.q_elems;                        // room for MHA (h_kv = 32)
  const std::size_t per_copy = buf.q_elems + 2 * buf.kv_elems;
  if (!ok(cudaMalloc(&buf.qkv, per_copy * buf.copies * sizeof(E)), "cudaMalloc(qkv)") ||
      !ok(cudaMalloc(&buf.o, buf.q_elems * sizeof(E)), "cudaMalloc(o)") ||
      !ok(cudaMalloc(&buf.o_ref, buf.q_elems * sizeof(E)), "cudaMalloc(o_ref)") ||
      !ok(cudaMalloc(&buf.diff, 2 * sizeof(unsigned)), "cudaMalloc(diff)"))
    return 1;
  fill_kernel<<<4096, 256, 0, stream>>>(buf.qkv, per_copy * buf.copies, 12345u);
  if (!ok(cudaStreamSynchronize(stream), "fill")) return 1;

  struct shape {
    int h_kv, d;
  };
  for (const shape& sh : {shape{8, 128}, shape{32, 64}})
    for (const ragged_set& s : sets) {
      run_rows(stream, buf, s, sh.h_kv, sh.d, fa::causal{fa::align::bottom_right}, true);
      run_rows(stream, buf, s, sh.h_kv, sh.d, fa::dense{}, false);
    }
  cudaFree(buf.qkv);
  cudaFree(buf.o);
  cudaFree(buf.o_ref);
  cudaFree(buf.diff);
  cudaStreamDestroy(stream);
  if (json) std::fclose(json);
  if (!ok(cudaGetLastError(), "last error")) return 1;
  if (mismatch) std::printf("# a row failed or its maxdiff exceeds %.2g\n", kMismatch);
  return mismatch ? 2 : 0;
}
