// Example 13, NCCL version: one attention sharded over the GPUs of one host, one MPI process per GPU (MPI only
// bootstraps NCCL: rank 0's ncclUniqueId is broadcast, then ncclCommInitRank). Each process holds a zigzag shard of
// Q, K and V in device memory; dist::attend with policy::cuda rotates the K/V shards with grouped ncclSend/ncclRecv
// on a communication stream while the flash kernel computes on the previous shard, and merges by lse.
//   mpirun -np 2 ./example_13_context_parallel_nccl          check against one GPU on the same inputs (bf16,
//                                                             TransformerEngine's tolerance 2.5e-2); exit 1 on a mismatch
//   mpirun -np 2 ./example_13_context_parallel_nccl --bench  causal, 32 heads, head_dim 128, bf16, S 32k-256k:
//        [--seq 32768,65536] [--reps 5] [--json out.jsonl]   scaling efficiency, communication hidden / exposed
//   mpirun -np 2 ./example_13_context_parallel_nccl --backward [--seq ..] [--reps ..]   the same for the backward pass
//   mpirun -np 2 ./example_13_context_parallel_nccl --pieces [--seq ..] [--reps ..]     one ring step's kernel and
//                                                             transfer timed alone and together (cudaEvent)
#include <cuda_runtime.h>
#include <mpi.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <fusedattn/fusedattn.hpp>
#include <fusedattn/dist/cuda.cuh>
#include <fusedattn/dist/nccl.hpp>

namespace fa = fusedattn;
namespace dist = fusedattn::dist;
using bf16 = Eigen::bfloat16;

namespace {

#define CHECK_CUDA(call)                                                                    \
  do {                                                                                      \
    const cudaError_t e_ = (call);                                                          \
    if (e_ != cudaSuccess) {                                                                \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      MPI_Abort(MPI_COMM_WORLD, 1);                                                         \
    }                                                                                       \
  } while (0)

/// A value in [-1, 1] from (seed, tensor, b, h, global row, column): the same on every rank, without host copies.
__device__ float hashed(unsigned seed, unsigned tensor, fa::index_t b, fa::index_t h, fa::index_t row, fa::index_t c) {
  unsigned long long x = (seed * 0x9E3779B97F4A7C15ull) ^ (tensor * 0xBF58476D1CE4E5B9ull) ^
                         ((unsigned long long)b << 56) ^ ((unsigned long long)h << 40) ^ ((unsigned long long)row << 12) ^
                         (unsigned long long)c;
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 31;
  return float(x >> 40) / float(1ull << 23) - 1.0f;
}

/// Fills a (b, h, rows, d) B·H·S·D buffer whose local row x is global row first + x (x < n0), else second + x − n0.
__global__ void fill_rows(__nv_bfloat16* out, fa::dims4 d, unsigned seed, unsigned tensor, fa::index_t first,
                          fa::index_t n0, fa::index_t second) {
  const fa::index_t row = blockIdx.x;
  const fa::index_t x = row % d.s, h = row / d.s % d.h, b = row / d.s / d.h;
  const fa::index_t g = x < n0 ? first + x : second + x - n0;
  for (fa::index_t c = threadIdx.x; c < d.d; c += blockDim.x)
    out[row * d.d + c] = __float2bfloat16_rn(hashed(seed, tensor, b, h, g, c));
}

/// A device buffer of `n` bf16 filled for `rank`'s zigzag shard (whole sequence: ranks = 1).
bf16* make_operand(fa::dims4 d_whole, int ranks, int rank, unsigned tensor) {
  fa::dims4 d = d_whole;
  d.s = dist::shard_rows(d_whole.s, ranks);
  bf16* p = nullptr;
  CHECK_CUDA(cudaMalloc(&p, std::size_t(d.b * d.h * d.s * d.d) * sizeof(bf16)));
  const dist::row_range a = dist::shard_piece(dist::layout::zigzag, d_whole.s, ranks, rank, 0);
  const dist::row_range b = ranks == 1 ? dist::row_range{d_whole.s, d_whole.s}
                                       : dist::shard_piece(dist::layout::zigzag, d_whole.s, ranks, rank, 1);
  const fa::index_t first = ranks == 1 ? 0 : a.begin, n0 = ranks == 1 ? d_whole.s : a.size();
  fill_rows<<<unsigned(d.b * d.h * d.s), 128>>>(reinterpret_cast<__nv_bfloat16*>(p), d, 2026u, tensor, first, n0, b.begin);
  CHECK_CUDA(cudaGetLastError());
  return p;
}

double median(std::vector<double> x) {
  std::sort(x.begin(), x.end());
  return x[x.size() / 2];
}

struct shard_set {
  fa::problem whole, local;
  bf16 *q = nullptr, *k = nullptr, *v = nullptr, *o = nullptr;
  float* lse = nullptr;
  shard_set(const fa::problem& p, int ranks, int rank) : whole(p), local(p) {
    local.seq_q = dist::shard_rows(p.seq_q, ranks);
    local.seq_kv = dist::shard_rows(p.seq_kv, ranks);
    q = make_operand(p.q_dims(), ranks, rank, 0);
    k = make_operand(p.kv_dims(), ranks, rank, 1);
    v = make_operand(p.kv_dims(), ranks, rank, 2);
    CHECK_CUDA(cudaMalloc(&o, std::size_t(local.batch * local.heads * local.seq_q * local.head_dim) * sizeof(bf16)));
    CHECK_CUDA(cudaMalloc(&lse, std::size_t(local.lse_size()) * sizeof(float)));
  }
  ~shard_set() {
    for (void* x : {(void*)q, (void*)k, (void*)v, (void*)o, (void*)lse}) cudaFree(x);
  }
  /// One GPU's forward over the whole sequence (a shard_set of one rank), with lse.
  fa::status run_one(cudaStream_t stream) {
    return fa::attend(fa::policy::cuda{stream}, whole, fa::bhsd<const bf16>(q, whole.q_dims()),
                      fa::bhsd<const bf16>(k, whole.kv_dims()), fa::bhsd<const bf16>(v, whole.kv_dims()),
                      fa::bhsd(o, whole.o_dims()), fa::causal{}, lse);
  }
  fa::status run(dist::nccl_comm& comm, cudaStream_t stream, dist::options opt) {
    return dist::attend(comm, fa::policy::cuda{stream}, whole, fa::bhsd<const bf16>(q, local.q_dims()),
                        fa::bhsd<const bf16>(k, local.kv_dims()), fa::bhsd<const bf16>(v, local.kv_dims()),
                        fa::bhsd(o, local.o_dims()), fa::causal{}, lse, opt);
  }
};

int check(dist::nccl_comm& comm, cudaStream_t stream) {
  const int n = comm.size(), r = comm.rank();
  int failures = 0;
  // MHA through the ring, GQA 32:8 through the all-gather; causal, head_dim 128, bf16.
  const fa::problem cases[2] = {{1, 16, 16, 8192, 8192, 128}, {1, 32, 8, 4096, 4096, 128}};
  for (const fa::problem& p : cases) {
    shard_set sh(p, n, r);
    const fa::status st = sh.run(comm, stream, {});
    if (!st) {
      std::fprintf(stderr, "rank %d: %s\n", r, st.what());
      return 1;
    }
    // One GPU over the whole sequence, on the same inputs.
    shard_set one(p, 1, 0);
    const fa::status st1 = fa::attend(fa::policy::cuda{stream}, p, fa::bhsd<const bf16>(one.q, p.q_dims()),
                                      fa::bhsd<const bf16>(one.k, p.kv_dims()), fa::bhsd<const bf16>(one.v, p.kv_dims()),
                                      fa::bhsd(one.o, p.o_dims()), fa::causal{}, one.lse);
    if (!st1) {
      std::fprintf(stderr, "rank %d: %s\n", r, st1.what());
      return 1;
    }
    CHECK_CUDA(cudaStreamSynchronize(stream));
    std::vector<bf16> got(std::size_t(sh.local.batch * sh.local.heads * sh.local.seq_q * p.head_dim));
    std::vector<bf16> want(std::size_t(p.batch * p.heads * p.seq_q * p.head_dim));
    std::vector<float> got_lse(std::size_t(sh.local.lse_size())), want_lse(std::size_t(p.lse_size()));
    CHECK_CUDA(cudaMemcpy(got.data(), sh.o, got.size() * sizeof(bf16), cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(want.data(), one.o, want.size() * sizeof(bf16), cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(got_lse.data(), sh.lse, got_lse.size() * sizeof(float), cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(want_lse.data(), one.lse, want_lse.size() * sizeof(float), cudaMemcpyDeviceToHost));
    const double tol = 2.5e-2;
    double err = 0, lse_err = 0;
    long long bad = 0;
    const fa::index_t lq = sh.local.seq_q;
    for (fa::index_t h = 0; h < p.heads; ++h)
      for (fa::index_t x = 0; x < lq; ++x) {
        const dist::row_range a = dist::shard_piece(dist::layout::zigzag, p.seq_q, n, r, 0);
        const fa::index_t g = x < a.size() ? a.begin + x
                                           : dist::shard_piece(dist::layout::zigzag, p.seq_q, n, r, 1).begin + x - a.size();
        for (fa::index_t c = 0; c < p.head_dim; ++c) {
          const double y = float(got[std::size_t((h * lq + x) * p.head_dim + c)]);
          const double w = float(want[std::size_t((h * p.seq_q + g) * p.head_dim + c)]);
          err = std::max(err, std::abs(y - w));
          if (!(std::abs(y - w) <= tol + tol * std::abs(w))) ++bad;
        }
        lse_err = std::max(lse_err, double(std::abs(got_lse[std::size_t(h * lq + x)] - want_lse[std::size_t(h * p.seq_q + g)])));
      }
    MPI_Allreduce(MPI_IN_PLACE, &err, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    MPI_Allreduce(MPI_IN_PLACE, &lse_err, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    MPI_Allreduce(MPI_IN_PLACE, &bad, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
    if (r == 0)
      std::printf("%d GPUs, causal, heads %lld:%lld, S %lld, d 128, bf16: max |O - one GPU| %.2e (%lld beyond "
                  "atol = rtol = 2.5e-2), max lse difference %.2e\n",
                  n, (long long)p.heads, (long long)p.heads_kv, (long long)p.seq_q, err, bad, lse_err);
    failures += bad > 0 || lse_err > tol;
  }
  if (r == 0) std::printf("%s\n", failures == 0 ? "match" : "MISMATCH");
  return failures == 0 ? 0 : 1;
}

/// Seconds of one `call` on `stream`, timed with CUDA events: a warm-up call, then the median of `reps` calls.
template <class Call>
double event_median(cudaStream_t stream, int reps, Call call) {
  cudaEvent_t e0, e1;
  CHECK_CUDA(cudaEventCreate(&e0));
  CHECK_CUDA(cudaEventCreate(&e1));
  std::vector<double> t;
  for (int i = 0; i <= reps; ++i) {
    CHECK_CUDA(cudaEventRecord(e0, stream));
    call();
    CHECK_CUDA(cudaEventRecord(e1, stream));
    CHECK_CUDA(cudaEventSynchronize(e1));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
    if (i > 0) t.push_back(ms * 1e-3);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return median(t);
}

int bench(dist::nccl_comm& comm, cudaStream_t stream, const std::vector<long long>& seqs, int reps, const char* json) {
  const int n = comm.size(), r = comm.rank();
  FILE* out = (r == 0 && json) ? std::fopen(json, "a") : nullptr;
  if (r == 0)
    std::printf("%-7s %-3s %-10s %-10s %-11s %-10s %-7s %-11s %-9s\n", "S", "N", "t1_ms", "tN_ms", "compute_ms",
                "comm_ms", "eff_%", "exposed_ms", "hidden_%");
  for (long long s : seqs) {
    const fa::problem p{1, 32, 32, s, s, 128};
    // One GPU over the whole sequence (rank 0), timed with events: warm-up, then the median of `reps` calls.
    double t1 = 0;
    if (r == 0) {
      shard_set one(p, 1, 0);
      t1 = event_median(stream, reps, [&] {
        const fa::status st = fa::attend(fa::policy::cuda{stream}, p, fa::bhsd<const bf16>(one.q, p.q_dims()),
                                         fa::bhsd<const bf16>(one.k, p.kv_dims()), fa::bhsd<const bf16>(one.v, p.kv_dims()),
                                         fa::bhsd(one.o, p.o_dims()), fa::causal{}, one.lse);
        if (!st) std::fprintf(stderr, "one GPU: %s\n", st.what());
      });
    }
    MPI_Barrier(MPI_COMM_WORLD);
    shard_set sh(p, n, r);
    // Each dist call ends synchronised (every rank agrees on success), so host time brackets it; the slowest rank's.
    auto timed = [&](dist::run_parts parts) {
      std::vector<double> t;
      for (int i = 0; i <= reps; ++i) {
        MPI_Barrier(MPI_COMM_WORLD);
        const auto t0 = std::chrono::steady_clock::now();
        const fa::status st = sh.run(comm, stream, {dist::layout::zigzag, dist::strategy::ring, parts});
        double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (!st) std::fprintf(stderr, "rank %d: %s\n", r, st.what());
        MPI_Allreduce(MPI_IN_PLACE, &dt, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
        if (i > 0) t.push_back(dt);
      }
      return median(t);
    };
    const double tn = timed({true, true}), tc = timed({true, false}), tm = timed({false, true});
    if (r == 0) {
      const double exposed = std::max(0.0, tn - tc);
      const double hidden = tm > 0 ? std::max(0.0, 1.0 - exposed / tm) : 1.0;
      const double eff = t1 / (n * tn);
      std::printf("%-7lld %-3d %-10.2f %-10.2f %-11.2f %-10.2f %-7.1f %-11.2f %-9.1f\n", s, n, t1 * 1e3, tn * 1e3,
                  tc * 1e3, tm * 1e3, 100.0 * eff, exposed * 1e3, 100.0 * hidden);
      if (out)
        std::fprintf(out,
                     "{\"seq\": %lld, \"gpus\": %d, \"heads\": 32, \"head_dim\": 128, \"dtype\": \"bf16\", \"mask\": "
                     "\"causal\", \"layout\": \"zigzag\", \"t1_s\": %.6f, \"tN_s\": %.6f, \"compute_only_s\": %.6f, "
                     "\"comm_only_s\": %.6f, \"efficiency\": %.4f, \"exposed_comm_s\": %.6f, \"hidden_fraction\": "
                     "%.4f}\n",
                     s, n, t1, tn, tc, tm, eff, exposed, hidden);
    }
  }
  if (out) std::fclose(out);
  return 0;
}

/// The backward pass at the bench's shapes: one GPU's fa::attend_backward over the whole sequence against
/// dist::attend_backward over N GPUs (zigzag ring), event-timed / host-timed as the forward rows.
int bench_backward(dist::nccl_comm& comm, cudaStream_t stream, const std::vector<long long>& seqs, int reps) {
  const int n = comm.size(), r = comm.rank();
  if (r == 0) std::printf("%-7s %-3s %-10s %-10s %-7s (backward)\n", "S", "N", "t1_ms", "tN_ms", "eff_%");
  for (long long s : seqs) {
    const fa::problem p{1, 32, 32, s, s, 128};
    auto grads = [](const fa::problem& lp, bf16*& a, bf16*& b, bf16*& c, bf16*& d) {
      for (bf16** x : {&a, &b, &c, &d})
        CHECK_CUDA(cudaMalloc(x, std::size_t(lp.batch * lp.heads * lp.seq_q * lp.head_dim) * sizeof(bf16)));
    };
    double t1 = 0;
    if (r == 0) {
      shard_set one(p, 1, 0);
      if (const fa::status st = one.run_one(stream); !st) {
        std::fprintf(stderr, "one GPU: %s\n", st.what());
        MPI_Abort(MPI_COMM_WORLD, 1);
      }
      bf16 *d_o, *dq, *dk, *dv;
      grads(p, d_o, dq, dk, dv);
      CHECK_CUDA(cudaMemcpyAsync(d_o, one.q, std::size_t(p.batch * p.heads * p.seq_q * p.head_dim) * sizeof(bf16),
                                 cudaMemcpyDeviceToDevice, stream));
      t1 = event_median(stream, reps, [&] {
        const fa::status st = fa::attend_backward(
            fa::policy::cuda{stream}, p, fa::bhsd<const bf16>(one.q, p.q_dims()), fa::bhsd<const bf16>(one.k, p.kv_dims()),
            fa::bhsd<const bf16>(one.v, p.kv_dims()), fa::bhsd<const bf16>(one.o, p.o_dims()),
            fa::bhsd<const bf16>(d_o, p.o_dims()), one.lse, fa::bhsd(dq, p.q_dims()), fa::bhsd(dk, p.kv_dims()),
            fa::bhsd(dv, p.kv_dims()), fa::causal{});
        if (!st) std::fprintf(stderr, "one GPU backward: %s\n", st.what());
      });
      for (void* x : {(void*)d_o, (void*)dq, (void*)dk, (void*)dv}) cudaFree(x);
    }
    MPI_Barrier(MPI_COMM_WORLD);
    shard_set sh(p, n, r);
    if (!sh.run(comm, stream, {})) return 1;
    bf16 *d_o, *dq, *dk, *dv;
    grads(sh.local, d_o, dq, dk, dv);
    const fa::problem& lp = sh.local;
    CHECK_CUDA(cudaMemcpyAsync(d_o, sh.q, std::size_t(lp.batch * lp.heads * lp.seq_q * lp.head_dim) * sizeof(bf16),
                               cudaMemcpyDeviceToDevice, stream));
    std::vector<double> t;
    for (int i = 0; i <= reps; ++i) {
      MPI_Barrier(MPI_COMM_WORLD);
      const auto t0 = std::chrono::steady_clock::now();
      const fa::status st = dist::attend_backward(
          comm, fa::policy::cuda{stream}, p, fa::bhsd<const bf16>(sh.q, lp.q_dims()), fa::bhsd<const bf16>(sh.k, lp.kv_dims()),
          fa::bhsd<const bf16>(sh.v, lp.kv_dims()), fa::bhsd<const bf16>(sh.o, lp.o_dims()),
          fa::bhsd<const bf16>(d_o, lp.o_dims()), sh.lse, fa::bhsd(dq, lp.q_dims()), fa::bhsd(dk, lp.kv_dims()),
          fa::bhsd(dv, lp.kv_dims()), fa::causal{}, {dist::layout::zigzag, dist::strategy::ring, {}});
      double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (!st) std::fprintf(stderr, "rank %d backward: %s\n", r, st.what());
      MPI_Allreduce(MPI_IN_PLACE, &dt, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
      if (i > 0) t.push_back(dt);
    }
    for (void* x : {(void*)d_o, (void*)dq, (void*)dk, (void*)dv}) cudaFree(x);
    const double tn = median(t);
    if (r == 0) std::printf("%-7lld %-3d %-10.2f %-10.2f %-7.1f (backward)\n", s, n, t1 * 1e3, tn * 1e3, 100.0 * t1 / (n * tn));
  }
  return 0;
}

/// One ring step's pieces, event-timed on every rank (rank 0 prints the slowest rank's medians): the flash kernel
/// of a step alone, the K/V shard's transfer alone, and both at once as the ring runs them (the transfer started
/// first on the engine's high-priority stream, the kernel right after): does the transfer slow the kernel by more
/// than its own length? Two step shapes: a zigzag off-diagonal step (dense, lq × lkv/2) and the diagonal
/// (causal, lq × lkv).
int bench_pieces(dist::nccl_comm& comm, cudaStream_t stream, const std::vector<long long>& seqs, int reps) {
  const int n = comm.size(), r = comm.rank();
  if (n < 2) return 0;
  if (r == 0)
    std::printf("%-7s %-3s %-9s %-12s %-12s %-16s %-12s\n", "S", "N", "step", "kernel_ms", "xfer_ms",
                "kernel+xfer_ms", "together_ms");
  for (long long s : seqs) {
    const fa::problem p{1, 32, 32, s, s, 128};
    shard_set sh(p, n, r);
    const fa::problem& lp = sh.local;
    const fa::index_t kv_elems = lp.batch * lp.heads_kv * lp.seq_kv * lp.head_dim;
    bf16 *send = nullptr, *recv = nullptr;
    CHECK_CUDA(cudaMalloc(&send, std::size_t(2 * kv_elems) * sizeof(bf16)));
    CHECK_CUDA(cudaMalloc(&recv, std::size_t(2 * kv_elems) * sizeof(bf16)));
    CHECK_CUDA(cudaMemcpyAsync(send, sh.k, std::size_t(kv_elems) * sizeof(bf16), cudaMemcpyDeviceToDevice, stream));
    CHECK_CUDA(cudaMemcpyAsync(send + kv_elems, sh.v, std::size_t(kv_elems) * sizeof(bf16), cudaMemcpyDeviceToDevice, stream));
    cudaEvent_t e0, ek, e1;
    for (cudaEvent_t* e : {&e0, &ek, &e1}) CHECK_CUDA(cudaEventCreate(e));
    for (int shape = 0; shape < 2; ++shape) {
      fa::problem bp = lp;
      if (shape == 0) bp.seq_kv = lp.seq_kv / 2;
      auto kernel = [&] {
        const fa::status st =
            shape == 0 ? fa::attend(fa::policy::cuda{stream}, bp, fa::bhsd<const bf16>(sh.q, bp.q_dims()),
                                    fa::bhsd<const bf16>(sh.k, bp.kv_dims()), fa::bhsd<const bf16>(sh.v, bp.kv_dims()),
                                    fa::bhsd(sh.o, bp.o_dims()), fa::dense{}, sh.lse)
                       : fa::attend(fa::policy::cuda{stream}, bp, fa::bhsd<const bf16>(sh.q, bp.q_dims()),
                                    fa::bhsd<const bf16>(sh.k, bp.kv_dims()), fa::bhsd<const bf16>(sh.v, bp.kv_dims()),
                                    fa::bhsd(sh.o, bp.o_dims()), fa::causal{}, sh.lse);
        if (!st) std::fprintf(stderr, "rank %d: %s\n", r, st.what());
      };
      // mode 0: kernel alone; 1: transfer alone; 2: both (transfer first, as the ring starts them).
      double med[3][2] = {};
      for (int mode = 0; mode < 3; ++mode) {
        std::vector<double> ta, tb;
        for (int i = 0; i <= reps; ++i) {
          CHECK_CUDA(cudaStreamSynchronize(stream));
          MPI_Barrier(MPI_COMM_WORLD);
          dist::nccl_comm::request req{};
          CHECK_CUDA(cudaEventRecord(e0, stream));
          if (mode >= 1) {
            const fa::status st = comm.start_exchange(send, (r + 1) % n, recv, (r - 1 + n) % n,
                                                      std::size_t(2 * kv_elems) * sizeof(bf16), req, stream);
            if (!st) std::fprintf(stderr, "rank %d: %s\n", r, st.what());
          }
          if (mode != 1) kernel();
          CHECK_CUDA(cudaEventRecord(ek, stream));
          if (mode >= 1) (void)comm.wait(req, stream);
          CHECK_CUDA(cudaEventRecord(e1, stream));
          CHECK_CUDA(cudaEventSynchronize(e1));
          float a = 0, b = 0;
          CHECK_CUDA(cudaEventElapsedTime(&a, e0, ek));
          CHECK_CUDA(cudaEventElapsedTime(&b, e0, e1));
          double ab[2] = {a * 1e-3, b * 1e-3};
          MPI_Allreduce(MPI_IN_PLACE, ab, 2, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
          if (i > 0) ta.push_back(ab[0]), tb.push_back(ab[1]);
        }
        med[mode][0] = median(ta);
        med[mode][1] = median(tb);
      }
      if (r == 0)
        std::printf("%-7lld %-3d %-9s %-12.3f %-12.3f %-16.3f %-12.3f\n", s, n, shape == 0 ? "dense" : "diagonal",
                    med[0][0] * 1e3, med[1][1] * 1e3, med[2][0] * 1e3, med[2][1] * 1e3);
    }
    for (cudaEvent_t e : {e0, ek, e1}) cudaEventDestroy(e);
    cudaFree(send);
    cudaFree(recv);
  }
  return 0;
}

std::vector<long long> parse_list(const char* s) {
  std::vector<long long> out;
  for (const char* p = s; *p;) {
    out.push_back(std::atoll(p));
    const char* comma = std::strchr(p, ',');
    if (!comma) break;
    p = comma + 1;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, size = 1, devices = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices < size) {
    if (rank == 0) std::printf("%d processes need %d GPUs; %d here: skipped\n", size, size, devices);
    MPI_Finalize();
    return 77;
  }
  CHECK_CUDA(cudaSetDevice(rank));  // one host: rank r drives GPU r
  ncclUniqueId id;
  if (rank == 0) ncclGetUniqueId(&id);
  MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD);
  ncclComm_t nc;
  if (ncclCommInitRank(&nc, size, id, rank) != ncclSuccess) {
    std::fprintf(stderr, "rank %d: ncclCommInitRank failed\n", rank);
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  int rc = 0;
  {
    dist::nccl_comm comm(nc);
    if (!comm.ok()) {
      std::fprintf(stderr, "rank %d: %s\n", rank, comm.ok().what());
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
    cudaStream_t stream;
    CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    bool bench_mode = false, backward_mode = false, pieces_mode = false;
    std::vector<long long> seqs = {32768, 65536, 131072, 262144};
    int reps = 5;
    const char* json = nullptr;
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "--bench") bench_mode = true;
      else if (a == "--backward") backward_mode = true;
      else if (a == "--pieces") pieces_mode = true;
      else if (a == "--seq" && i + 1 < argc) seqs = parse_list(argv[++i]);
      else if (a == "--reps" && i + 1 < argc) reps = std::atoi(argv[++i]);
      else if (a == "--json" && i + 1 < argc) json = argv[++i];
    }
    rc = pieces_mode     ? bench_pieces(comm, stream, seqs, reps)
         : backward_mode ? bench_backward(comm, stream, seqs, reps)
         : bench_mode    ? bench(comm, stream, seqs, reps, json)
                         : check(comm, stream);
    CHECK_CUDA(cudaStreamSynchronize(stream));
    cudaStreamDestroy(stream);
  }
  ncclCommDestroy(nc);
  MPI_Finalize();
  return rc;
}
