// The tile sweep behind flash_default_tile<32>, <96>, <256> (the d64 / d128 defaults timed beside them for
// reference): f16, bhsd, (b, h, s) = (4, 16, 4096), dense and causal; CUDA events after 3 warm-up launches, median
// of 15; each alternative's O against the default tile's (relative L2 difference). The chosen tiles: docs/design.md,
// CUDA. Built with FUSEDATTN_BENCH_TILE_SWEEP=ON (target fusedattn_head_dim_sweep); run with no arguments.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <fusedattn/fusedattn.hpp>

#include "flash_params_fill.cuh"

namespace fa = fusedattn;
namespace cb = fusedattn::cuda_backend;
namespace fab = fusedattn::bench;

#define CK(call)                                                                                \
  do {                                                                                          \
    const cudaError_t e_ = (call);                                                              \
    if (e_ != cudaSuccess) {                                                                    \
      std::printf("%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_));         \
      std::exit(1);                                                                             \
    }                                                                                           \
  } while (0)

__global__ void fill(__half* x, fa::index_t n, unsigned seed) {
  for (fa::index_t i = blockIdx.x * fa::index_t(blockDim.x) + threadIdx.x; i < n; i += fa::index_t(gridDim.x) * blockDim.x) {
    unsigned h = unsigned(i) * 2654435761u ^ seed * 2246822519u;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    x[i] = __float2half(float(h) * (2.0f / 4294967295.0f) - 1.0f);
  }
}

__global__ void sqdiff(const __half* a, const __half* b, fa::index_t n, double* s) {
  double d2 = 0, b2 = 0;
  for (fa::index_t i = blockIdx.x * fa::index_t(blockDim.x) + threadIdx.x; i < n; i += fa::index_t(gridDim.x) * blockDim.x) {
    const double x = __half2float(a[i]), y = __half2float(b[i]);
    d2 += (x - y) * (x - y);
    b2 += y * y;
  }
  atomicAdd(&s[0], d2);
  atomicAdd(&s[1], b2);
}

struct bufs {
  int b, h, s, d;
  __half *q, *k, *v, *o, *o_ref;
  double* sums;
  bufs(int b_, int h_, int s_, int d_) : b(b_), h(h_), s(s_), d(d_) {
    const fa::index_t n = fa::index_t(b) * h * s * d;
    CK(cudaMalloc(&q, n * 2));
    CK(cudaMalloc(&k, n * 2));
    CK(cudaMalloc(&v, n * 2));
    CK(cudaMalloc(&o, n * 2));
    CK(cudaMalloc(&o_ref, n * 2));
    CK(cudaMalloc(&sums, 16));
    fill<<<1024, 256>>>(q, n, 1);
    fill<<<1024, 256>>>(k, n, 2);
    fill<<<1024, 256>>>(v, n, 3);
  }
  ~bufs() { cudaFree(q); cudaFree(k); cudaFree(v); cudaFree(o); cudaFree(o_ref); cudaFree(sums); }
};

template <class Tile>
void time_tile(bufs& x, bool causal, bool is_default, const char* label) {
  const fa::problem p{x.b, x.h, x.h, x.s, x.s, x.d};
  const fa::band_mask m = causal ? fa::bind(fa::causal{}, p) : fa::bind(fa::dense{}, p);
  const fa::strides4 st{fa::index_t(x.h) * x.s * x.d, fa::index_t(x.s) * x.d, x.d, 1};
  const float scale_log2 = float(p.softmax_scale() * 1.4426950408889634);
  // The launch parameters (no lse; head_dim 0: the tile's).
  cb::flash_params fp = fab::fill_flash_params(x.q, x.k, x.v, x.o, nullptr, st, x.b, x.h, x.s, scale_log2, m);
  for (int i = 0; i < 3; ++i)
    if (!cb::launch_flash<__half, Tile>(fp, nullptr)) std::exit(1);
  CK(cudaDeviceSynchronize());
  std::vector<float> ms;
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  for (int r = 0; r < 15; ++r) {
    cudaEventRecord(e0);
    (void)cb::launch_flash<__half, Tile>(fp, nullptr);
    cudaEventRecord(e1);
    CK(cudaEventSynchronize(e1));
    float t = 0;
    cudaEventElapsedTime(&t, e0, e1);
    ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  const double med = ms[ms.size() / 2];
  const double flops = 4.0 * x.b * x.h * double(m.allowed_count()) * x.d;
  const fa::index_t n = fa::index_t(x.b) * x.h * x.s * x.d;
  double rel = 0;
  if (is_default) {
    CK(cudaMemcpy(x.o_ref, x.o, n * 2, cudaMemcpyDeviceToDevice));
  } else {
    CK(cudaMemset(x.sums, 0, 16));
    sqdiff<<<512, 256>>>(x.o, x.o_ref, n, x.sums);
    double h[2];
    CK(cudaMemcpy(h, x.sums, 16, cudaMemcpyDeviceToHost));
    rel = std::sqrt(h[0] / h[1]);
  }
  std::printf("d=%3d %-6s %-28s smem %3d KB %8.3f ms %7.1f TFLOP/s%s", x.d, causal ? "causal" : "dense", label,
              int(Tile::smem_elems * 2 / 1024), med, flops / (med * 1e-3) / 1e12, is_default ? "  (default)\n" : "");
  if (!is_default) std::printf("  rel diff vs default %.1e%s\n", rel, rel < 1e-2 ? "" : " MISMATCH");
}


int main() {
  for (bool causal : {false, true}) {
    {
      bufs x(4, 16, 4096, 32);
      time_tile<cb::flash_default_tile<32>::type>(x, causal, true, "default");
      time_tile<cb::flash_tile<32, 4, 128, 32, 1>>(x, causal, false, "w4 n128 r32 s1");
      time_tile<cb::flash_tile<32, 4, 64, 32, 2>>(x, causal, false, "w4 n64 r32 s2");
      time_tile<cb::flash_tile<32, 8, 64, 16, 2>>(x, causal, false, "w8 n64 r16 s2");
    }
    {
      bufs x(4, 16, 4096, 64);
      time_tile<cb::flash_default_tile<64>::type>(x, causal, true, "default (reference)");
    }
    {
      bufs x(4, 16, 4096, 96);
      time_tile<cb::flash_default_tile<96>::type>(x, causal, true, "default");
      time_tile<cb::flash_tile<96, 4, 64, 32, 2>>(x, causal, false, "w4 n64 r32 s2");
      time_tile<cb::flash_tile<96, 4, 32, 32, 2>>(x, causal, false, "w4 n32 r32 s2");
      time_tile<cb::flash_tile<96, 8, 64, 16, 2>>(x, causal, false, "w8 n64 r16 s2");
    }
    {
      bufs x(4, 16, 4096, 128);
      time_tile<cb::flash_default_tile<128>::type>(x, causal, true, "default (reference)");
    }
    {
      bufs x(4, 16, 4096, 256);
      time_tile<cb::flash_default_tile<256>::type>(x, causal, true, "default");
      time_tile<cb::flash_tile<256, 4, 32, 16, 2>>(x, causal, false, "w4 n32 r16 s2");
      time_tile<cb::flash_tile<256, 8, 64, 16, 1>>(x, causal, false, "w8 n64 r16 s1 (128 KB)");
      time_tile<cb::flash_tile<256, 4, 64, 16, 2>>(x, causal, false, "w4 n64 r16 s2 (160 KB)");
    }
  }
  return 0;
}
