// Times attend_backward on policy::cuda (bf16; B·H = 16·16; S 1024-8192; head_dim 64 and 128; dense and causal) and
// prints one JSON line per shape and mode: TFLOP/s by 10·B·H·S²·D (halved for causal); impl "fusedattn" is the
// default deterministic call, "fusedattn-atomic" the same with policy::cuda::deterministic = false.
// `bench/peers/torch_peer.py --device cuda --backward --filter _bwd/ --iters REPS` times PyTorch SDPA's backward
// (flash and cuDNN) on the same shapes, its rows carrying these keys too. Usage: fusedattn_bench_backward [reps].
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <cuda_runtime.h>

#include <fusedattn/fusedattn.hpp>

namespace fa = fusedattn;
using T = Eigen::bfloat16;
using E = __nv_bfloat16;

namespace {

/// Deterministic pseudo-random values in [-1, 1] (a hash of the index and seed).
__global__ void fill_kernel(E* x, long long n, unsigned seed) {
  for (long long i = blockIdx.x * 256ll + threadIdx.x; i < n; i += 256ll * gridDim.x) {
    unsigned h = unsigned(i) * 2654435761u ^ seed * 0x9e3779b9u;
    h ^= h >> 16;
    h *= 0x85ebca6bu;
    h ^= h >> 13;
    x[i] = __float2bfloat16(float(h & 0xffffu) / 32767.5f - 1.f);
  }
}

bool check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return true;
  std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
  return false;
}

}  // namespace

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 10;
  const int batch = 16, heads = 16;
  for (int d : {64, 128})
    for (long long s : {1024ll, 2048ll, 4096ll, 8192ll})
      for (bool causal : {false, true}) {
        const fa::problem p{batch, heads, heads, s, s, d};
        const long long n = batch * heads * s * d;
        E* buf = nullptr;
        float* lse = nullptr;
        if (!check(cudaMalloc(&buf, sizeof(E) * n * 8), "cudaMalloc") ||
            !check(cudaMalloc(&lse, sizeof(float) * batch * heads * s), "cudaMalloc"))
          return 1;
        for (int x = 0; x < 8; ++x) fill_kernel<<<1024, 256>>>(buf + x * n, n, 17u + x);
        T* base = reinterpret_cast<T*>(buf);
        auto in = [&](int x) { return fa::bhsd<const T>(base + x * n, p.q_dims()); };
        auto out = [&](int x) { return fa::bhsd<T>(base + x * n, p.q_dims()); };
        const fa::any_mask mask = causal ? fa::any_mask{fa::causal{}} : fa::any_mask{fa::dense{}};
        const fa::status fwd = fa::attend(fa::policy::cuda{}, p, in(0), in(1), in(2), out(3), mask, lse);
        for (bool deterministic : {true, false}) {
          fa::status st = fwd;
          fa::policy::cuda pol;
          pol.deterministic = deterministic;
          const auto backward = [&] {
            return fa::attend_backward(pol, p, in(0), in(1), in(2), in(3), in(4), lse, out(5), out(6), out(7), mask);
          };
          for (int w = 0; w < 2 && st; ++w) st = backward();
          cudaEvent_t e0, e1;
          cudaEventCreate(&e0);
          cudaEventCreate(&e1);
          cudaEventRecord(e0);
          for (int r = 0; r < reps && st; ++r) st = backward();
          cudaEventRecord(e1);
          if (!check(cudaEventSynchronize(e1), "backward")) return 1;
          float ms = 0;
          cudaEventElapsedTime(&ms, e0, e1);
          ms /= float(reps);
          const double flops = 10.0 * batch * heads * double(s) * double(s) * d * (causal ? 0.5 : 1.0);
          if (!st) std::printf("{\"error\": \"%s\"}\n", st.what());
          else
            std::printf("{\"impl\": \"%s\", \"dtype\": \"bf16\", \"batch\": %d, \"heads\": %d, \"seq\": %lld, "
                        "\"head_dim\": %d, \"causal\": %s, \"ms\": %.4f, \"tflops\": %.1f}\n",
                        deterministic ? "fusedattn" : "fusedattn-atomic", batch, heads, s, d, causal ? "true" : "false",
                        ms, flops / (ms * 1e-3) / 1e12);
          std::fflush(stdout);
          cudaEventDestroy(e0);
          cudaEventDestroy(e1);
        }
        cudaFree(buf);
        cudaFree(lse);
      }
  return 0;
}
