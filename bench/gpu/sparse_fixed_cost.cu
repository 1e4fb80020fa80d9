// Where block-sparse time goes: block-sparse flash (device layout) against dense flash, f16, (1, 16, S, 128),
// 128 × 512 blocks, a random pattern per head; CUDA events, 5 warm-up calls, median of 60.
//   fusedattn_sparse_fixed_cost          sparsity 0.9 at S 4096 and 10000: dense, sparse, sparse on mma.sync
//   fusedattn_sparse_fixed_cost sweep    S 10000 at sparsity 1, 0.95, 0.9, 0.85, 0.8, 0.6, 0.2 (0 to 16 of 20
//                                        blocks per row): time against blocks per row gives the fixed part
//   fusedattn_sparse_fixed_cost tiles    S 10000, sparsity 0.9 on the other Hopper tiles (launch_flash_hopper)
//   fusedattn_sparse_fixed_cost host     S 10000, sparsity 0.9: the host's share of a call (its runtime calls one by
//                                        one; a call's host time, queued and behind a busy device; a call timed as
//                                        the bench does against the same call behind a spin kernel), for dense,
//                                        the device layout and the layout copied per call
// Figures: docs/PERFORMANCE.md, CUDA. Built with FUSEDATTN_BENCH_TILE_SWEEP=ON.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include <fusedattn/fusedattn.hpp>

#include "flash_params_fill.cuh"

namespace fa = fusedattn;
namespace cb = fusedattn::cuda_backend;
namespace fab = fusedattn::bench;
using T = Eigen::half;

namespace {

void check(cudaError_t e) {
  if (e != cudaSuccess) {
    std::printf("%s\n", cudaGetErrorString(e));
    std::exit(1);
  }
}
void check(const fa::status& st) {
  if (!st) {
    std::printf("%s\n", st.what());
    std::exit(1);
  }
}

/// Spins one thread for `cycles` clock cycles: queued before a timed call, it hides the host's work for the call.
__global__ void spin(long long cycles) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
}

/// Median ms of `f()` between two events (5 warm-up calls, 60 timed). With `spin_cycles` > 0 the events are queued
/// behind a spin kernel of that many cycles, so the host's work for the call is done before the first event: the
/// GPU's time for the call alone.
template <class F>
double median_ms(F f, long long spin_cycles = 0) {
  cudaEvent_t a, b;
  check(cudaEventCreate(&a));
  check(cudaEventCreate(&b));
  for (int i = 0; i < 5; ++i) f();
  std::vector<float> ms;
  for (int i = 0; i < 60; ++i) {
    if (spin_cycles > 0) spin<<<1, 1>>>(spin_cycles);
    check(cudaEventRecord(a));
    f();
    check(cudaEventRecord(b));
    check(cudaEventSynchronize(b));
    float t = 0;
    check(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

struct operands {
  fa::problem p;
  T *q = nullptr, *k = nullptr, *v = nullptr, *o = nullptr;
  float* lse = nullptr;
  explicit operands(int h, int s) : p{1, h, h, s, s, 128} {
    const std::size_t n = std::size_t(h) * s * 128;
    std::vector<T> host(n);
    std::mt19937 rng{static_cast<unsigned>(s)};
    std::normal_distribution<float> normal(0.f, 1.f);
    for (T** x : {&q, &k, &v, &o}) check(cudaMalloc(reinterpret_cast<void**>(x), n * sizeof(T)));
    check(cudaMalloc(reinterpret_cast<void**>(&lse), std::size_t(h) * s * sizeof(float)));
    for (T* x : {q, k, v}) {
      for (T& e : host) e = T(normal(rng));
      check(cudaMemcpy(x, host.data(), n * sizeof(T), cudaMemcpyHostToDevice));
    }
  }
  ~operands() {
    for (void* x : {static_cast<void*>(q), static_cast<void*>(k), static_cast<void*>(v), static_cast<void*>(o),
                    static_cast<void*>(lse)})
      cudaFree(x);
  }
  fa::tensor_ref<const T> in(const T* x) const { return fa::bhsd(x, p.q_dims()); }
  template <class Mask>
  double time(fa::policy::cuda_kernel kernel, const Mask& mask) const {
    const fa::policy::cuda pol{nullptr, kernel};
    return median_ms([&] { check(fa::attend(pol, p, in(q), in(k), in(v), fa::bhsd(o, p.o_dims()), mask, lse)); });
  }
};

/// Host microseconds of `f()`, averaged over `n` runs.
template <class F>
double host_us(F f, int n) {
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < n; ++i) f();
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / n;
}

fa::block_layout layout_for(int h, int s, double sparsity) {
  return fa::random_layout(fa::block_geometry{s, s, 128, 512, 1, h}, sparsity, 42);
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  constexpr int h = 16;
  constexpr auto flash = fa::policy::cuda_kernel::flash;
  if (mode == "sweep") {
    const operands x(h, 10000);
    const double dense = x.time(flash, fa::dense{});
    for (double sparsity : {1.0, 0.95, 0.9, 0.85, 0.8, 0.6, 0.2}) {
      const fa::block_layout layout = layout_for(h, 10000, sparsity);
      fa::cuda::device_block_layout dev;
      check(fa::cuda::upload(layout, dev));
      const double ms = x.time(flash, fa::cuda::device_block_sparse{dev});
      std::printf("S 10000 sparsity %.2f (density %.3f): sparse %.4f ms, dense %.4f ms, %.2fx\n", sparsity,
                  layout.density(), ms, dense, dense / ms);
    }
    return 0;
  }
  if (mode == "tiles") {
    const operands x(h, 10000);
    const fa::block_layout layout = layout_for(h, 10000, 0.9);
    fa::cuda::device_block_layout dev;
    check(fa::cuda::upload(layout, dev));
    const fa::block_sparse_mask m = fa::cuda::bind(fa::cuda::device_block_sparse{dev}, x.p).mask;
    const fa::strides4 st = fa::bhsd(x.o, x.p.o_dims()).stride;
    const float scale_log2 = float(x.p.softmax_scale() * 1.4426950408889634);
    const double dense = x.time(flash, fa::dense{});
    // The tiles' parameters (head_dim 0: the tile's 128).
    cb::flash_params_t<fa::block_sparse_mask> fp =
        fab::fill_flash_params(x.q, x.k, x.v, x.o, x.lse, st, 1, h, 10000, scale_log2, m);
    const auto tile = [&](auto t, const char* label) {
      using Tile = decltype(t);
      const double ms = median_ms([&] { check(cb::launch_flash_hopper<__half, Tile>(fp, nullptr)); });
      std::printf("S 10000 sparsity 0.90, hopper tile %-12s %.4f ms (dense %.4f ms, %.2fx)\n", label, ms, dense,
                  dense / ms);
    };
    tile(cb::hopper_tile<128, 128, 1>{}, "wg2 n128 b1");
    tile(cb::hopper_tile<128, 64, 2>{}, "wg2 n64 b2");
    tile(cb::hopper_tile<128, 64, 2, 1>{}, "wg1 n64 b2");
    tile(cb::hopper_tile<128, 128, 1, 1>{}, "wg1 n128 b1");
    return 0;
  }
  if (mode == "host") {
    const operands x(h, 10000);
    const fa::block_layout layout = layout_for(h, 10000, 0.9);
    fa::cuda::device_block_layout dev;
    check(fa::cuda::upload(layout, dev));
    const fa::policy::cuda pol{nullptr, flash};
    const auto call = [&](const auto& mask) {
      return [&x, &pol, mask] {
        check(fa::attend(pol, x.p, x.in(x.q), x.in(x.k), x.in(x.v), fa::bhsd(x.o, x.p.o_dims()), mask, x.lse));
      };
    };
    const auto dense = call(fa::dense{});
    const auto sparse = call(fa::cuda::device_block_sparse{dev});
    const auto copied = call(fa::block_sparse{layout});
    // The runtime calls of one call, one by one (2000 runs each).
    using tile = cb::hopper_default_tile<128>::type;
    const auto kernel = cb::flash_hopper_ws_kernel<__half, tile, fa::block_sparse_mask>;
    cudaPointerAttributes attr{};
    int device = 0, count = 0;
    CUtensorMap map{};
    int order[3] = {};
    std::printf("host us: cudaPointerGetAttributes %.3f, cudaFuncSetAttribute %.3f, cudaGetDevice + "
                "cudaDeviceGetAttribute %.3f, cudaStreamIsCapturing %.3f, tensor map %.3f, empty launch %.3f\n",
                host_us([&] { check(cudaPointerGetAttributes(&attr, x.q)); }, 2000),
                host_us([&] { check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                         tile::ws_smem_bytes)); }, 2000),
                host_us([&] {
                  check(cudaGetDevice(&device));
                  check(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
                }, 2000),
                host_us([&] {
                  cudaStreamCaptureStatus c{};
                  check(cudaStreamIsCapturing(nullptr, &c));
                }, 2000),
                host_us([&] {
                  if (!cb::make_tile_map(map, order, x.k, false, 128, 10000, h, 1, fa::bhsd(x.k, x.p.kv_dims()).stride,
                                         128))
                    std::exit(1);
                }, 2000),
                host_us([&] { spin<<<1, 1>>>(0); }, 2000));
    check(cudaDeviceSynchronize());
    const auto line = [&](const char* name, const auto& f) {
      for (int i = 0; i < 5; ++i) f();  // the first calls set up the scratch pool (a one-time cost)
      check(cudaDeviceSynchronize());
      const double queued = host_us(f, 50);
      check(cudaDeviceSynchronize());
      std::vector<double> busy;  // one call's host time behind a ~1 ms spin kernel
      for (int i = 0; i < 21; ++i) {
        spin<<<1, 1>>>(2000000);
        busy.push_back(host_us(f, 1));
        check(cudaDeviceSynchronize());
      }
      std::sort(busy.begin(), busy.end());
      const double bench = median_ms(f), gpu = median_ms(f, 1000000);
      std::printf("%-22s host %6.1f us a call (50 queued), %6.1f us behind a busy device; per call %.4f ms as the "
                  "bench times it, %.4f ms behind a spin kernel\n",
                  name, queued, busy[busy.size() / 2], bench, gpu);
    };
    line("dense", dense);
    line("sparse, device layout", sparse);
    line("sparse, layout copied", copied);
    return 0;
  }
  for (int s : {4096, 10000}) {
    const operands x(h, s);
    const fa::block_layout layout = layout_for(h, s, 0.9);
    fa::cuda::device_block_layout dev;
    check(fa::cuda::upload(layout, dev));
    const double dense = x.time(flash, fa::dense{});
    const double sparse = x.time(flash, fa::cuda::device_block_sparse{dev});
    const double portable = x.time(fa::policy::cuda_kernel::flash_mma_sync, fa::cuda::device_block_sparse{dev});
    std::printf("S %5d sparsity 0.90: dense %.4f ms, sparse %.4f ms (%.2fx), sparse on mma.sync %.4f ms\n", s, dense,
                sparse, dense / sparse, portable);
  }
  return 0;
}
