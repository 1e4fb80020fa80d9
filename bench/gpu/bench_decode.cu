// GQA decode on policy::cuda (cuda.decode): GB/s of K+V read for batch 1, 8, 64 × S_kv 4096, 32768, 131072, 32 query
// heads / 8 kv heads, head_dim 128, bf16, one query row per sequence, bottom-right causal; contiguous K/V (attend)
// and paged caches of 16 and 64 tokens a page in vLLM's layout with shuffled block tables (attend_paged, passed the
// host mirrors of the block table and lengths, as a serving engine keeps them, so nothing is read back). Each call
// reads another copy of the cache (copies spanning at least 1 GiB) so that L2 holds none of it. One line per row:
//   decode/bf16/<contig|paged16|paged64>/b{B}_h32_hkv8_skv{S}_d128  <µs per call>  <GB/s>
// `bench/peers/torch_peer.py --device cuda --decode` times PyTorch's SDPA (cuDNN, flash) on the same shapes, in the
// same way, as rows decode/bf16/torch_<cudnn|flash>/... (fusedattn-bench's JSON schema, with GB/s). A first line
// gives the card's read roof in the same run (a streaming read of 8 GiB).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <random>
#include <vector>

#include <cuda_runtime.h>

#include <fusedattn/fusedattn.hpp>

#include "fill.cuh"

namespace fa = fusedattn;
using T = Eigen::bfloat16;
using E = __nv_bfloat16;

namespace {

/// The read roof: a grid-stride loop of 16-byte streaming loads (ld.global.cs) over `n` chunks, XOR-reduced so that
/// nothing is optimised away; `sink` is written only for an impossible sum.
__global__ void read_kernel(const uint4* x, std::size_t n, unsigned* sink) {
  unsigned acc = 0;
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n; i += std::size_t(gridDim.x) * blockDim.x) {
    const uint4 v = __ldcs(x + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) *sink = acc;
}

bool ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) std::fprintf(stderr, "bench_decode: %s: %s\n", what, cudaGetErrorString(e));
  return e == cudaSuccess;
}

/// Times `call(copy)` over `copies` rotating copies: 3 warm-up rounds, then the mean of `iters` calls; microseconds.
template <class F>
double time_calls(F&& call, int copies, int iters) {
  for (int i = 0; i < 3 * copies && i < 3 * 8; ++i) call(i % copies);
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  cudaEventRecord(a);
  for (int i = 0; i < iters; ++i) call(i % copies);
  cudaEventRecord(b);
  cudaEventSynchronize(b);
  float ms = 0;
  cudaEventElapsedTime(&ms, a, b);
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return 1000.0 * ms / iters;
}

}  // namespace

int main() {
  constexpr int heads = 32, heads_kv = 8, d = 128;
  const std::size_t budget = std::size_t(40) << 30;  // elements of K and V together, at most (80 GiB)
  E* pool = nullptr;
  if (!ok(cudaMalloc(&pool, budget * sizeof(E)), "cudaMalloc(pool)")) return 1;
  fill_kernel<<<4096, 256>>>(pool, budget, 12345u);
  E *q = nullptr, *o = nullptr;
  const std::size_t q_elems = std::size_t(64) * heads * d;
  if (!ok(cudaMalloc(&q, q_elems * sizeof(E)), "cudaMalloc(q)") || !ok(cudaMalloc(&o, q_elems * sizeof(E)), "cudaMalloc(o)"))
    return 1;
  fill_kernel<<<256, 256>>>(q, q_elems, 777u);
  if (!ok(cudaDeviceSynchronize(), "fill")) return 1;
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  std::printf("# device %s, %d SMs\n", prop.name, prop.multiProcessorCount);
  {  // the card's read roof in this run: 8 GiB of the pool read once per call, the best of three grid sizes
    unsigned* sink = nullptr;
    if (!ok(cudaMalloc(&sink, sizeof(unsigned)), "cudaMalloc(sink)")) return 1;
    const std::size_t chunks = (std::size_t(8) << 30) / sizeof(uint4);
    double best = 0;
    for (int per_sm : {4, 8, 16}) {
      const int blocks = per_sm * prop.multiProcessorCount;
      const double us = time_calls([&](int) { read_kernel<<<blocks, 512>>>(reinterpret_cast<const uint4*>(pool), chunks, sink); }, 1, 10);
      best = std::max(best, double(chunks) * sizeof(uint4) / us * 1e-3);
    }
    std::printf("# read roof %.1f GB/s (grid-stride ld.global.cs over 8 GiB)\n", best);
    cudaFree(sink);
  }
  std::mt19937_64 rng(1);
  for (int batch : {1, 8, 64})
    for (int s_kv : {4096, 32768, 131072}) {
      const std::size_t per_copy = std::size_t(batch) * heads_kv * s_kv * d;  // elements of K (and of V)
      const int copies = int(std::max<std::size_t>(1, std::min<std::size_t>(8, ((std::size_t(1) << 30) / sizeof(E) + 2 * per_copy - 1) / (2 * per_copy))));
      if (2 * per_copy * copies > budget) {
        std::printf("# b%d s%d does not fit\n", batch, s_kv);
        continue;
      }
      const double bytes = 2.0 * double(per_copy) * sizeof(E);
      const fa::problem p{batch, heads, heads_kv, 1, s_kv, d};
      const auto qv = fa::bhsd<const T>(reinterpret_cast<const T*>(q), p.q_dims());
      const auto ov = fa::bhsd(reinterpret_cast<T*>(o), p.o_dims());
      const fa::causal mask{fa::align::bottom_right};
      char name[128];
      {  // contiguous
        auto call = [&](int c) {
          const T* k = reinterpret_cast<const T*>(pool + 2 * per_copy * c);
          const T* v = k + per_copy;
          const fa::status st = fa::attend(fa::policy::cuda{}, p, qv, fa::bhsd(k, p.kv_dims()), fa::bhsd(v, p.kv_dims()),
                                           ov, mask);
          if (!st) std::fprintf(stderr, "attend: %s\n", st.what());
        };
        const double us = time_calls(call, copies, 20);
        std::snprintf(name, sizeof name, "decode/bf16/contig/b%d_h%d_hkv%d_skv%d_d%d", batch, heads, heads_kv, s_kv, d);
        std::printf("%-52s %10.1f us %8.1f GB/s  (%s)\n", name, us, bytes / us * 1e-3,
                    fa::to_string(fa::plan(fa::policy::cuda{}, p, qv, fa::bhsd(reinterpret_cast<const T*>(pool), p.kv_dims()),
                                           fa::bhsd(reinterpret_cast<const T*>(pool + per_copy), p.kv_dims()), ov, mask))
                        .c_str());
      }
      for (int page : {16, 64}) {  // paged, vLLM layout [page][token][kv_head][d], shuffled block table
        const int blocks = s_kv / page;
        const std::size_t pages = std::size_t(batch) * blocks;
        std::vector<std::int32_t> table(pages), lens(std::size_t(batch), s_kv);
        std::iota(table.begin(), table.end(), 0);
        std::shuffle(table.begin(), table.end(), rng);
        std::int32_t *dt = nullptr, *dl = nullptr;
        cudaMalloc(&dt, table.size() * sizeof(std::int32_t));
        cudaMalloc(&dl, lens.size() * sizeof(std::int32_t));
        cudaMemcpy(dt, table.data(), table.size() * sizeof(std::int32_t), cudaMemcpyHostToDevice);
        cudaMemcpy(dl, lens.data(), lens.size() * sizeof(std::int32_t), cudaMemcpyHostToDevice);
        auto call = [&](int c) {
          const T* k = reinterpret_cast<const T*>(pool + 2 * per_copy * c);
          const T* v = k + per_copy;
          const auto kv = fa::paged<const T>(k, v, fa::index_t(pages), page, heads_kv, d, fa::page_layout::nhd, dt, blocks, dl)
                              .with_host_tables(table.data(), lens.data());
          const fa::status st = fa::attend_paged(fa::policy::cuda{}, p, qv, kv, ov, mask);
          if (!st) std::fprintf(stderr, "attend_paged: %s\n", st.what());
        };
        const double us = time_calls(call, copies, 20);
        std::snprintf(name, sizeof name, "decode/bf16/paged%d/b%d_h%d_hkv%d_skv%d_d%d", page, batch, heads, heads_kv, s_kv, d);
        std::printf("%-52s %10.1f us %8.1f GB/s\n", name, us, bytes / us * 1e-3);
        cudaFree(dt);
        cudaFree(dl);
      }
      std::fflush(stdout);
    }
  cudaFree(pool);
  cudaFree(q);
  cudaFree(o);
  return ok(cudaGetLastError(), "last error") ? 0 : 1;
}
