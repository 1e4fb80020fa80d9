// Times fusedattn's CUDA kernels (flash with its default tile and, with FUSEDATTN_BENCH_TILE_SWEEP, alternative
// tiles; the naive three-pass pipeline; block-sparse against dense flash; split-KV decode)
// with CUDA events: warm-up, then the median of many runs over rotating input sets. One JSON object per line to the
// file given as argv[1] (default: stdout); a short table to stdout. argv[2] = "sparse" runs the block-sparse suite only,
// "flash" the flash shapes only, "decode" the split-KV calls only (decode shapes without naive, one head of 4096 rows),
// "generic" the CUDA-core kernel (bf16 aligned on tensor cores vs bf16 off alignment on aligned copies and on
// cuda.flash_generic, and f32 on cuda.flash_generic),
// "d64" two, three and four warpgroups on unmasked head_dim 64 (with the tile sweep), "profile" one call each for a
// profiler, "peer DIR" the block-sparse suite with its layouts written to DIR (layout_4096.txt, layout_10000.txt) for
// bench/peers/torch_peer.py --block-sparse, then the default flash on (10,16,1024,128) (1280 items of 128 rows ×
// 1024 keys, as long as the block-sparse items at S 10000). Shapes and figures: docs/PERFORMANCE.md, CUDA section.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include <fusedattn/fusedattn.hpp>

#include "flash_params_fill.cuh"

namespace fa = fusedattn;
namespace cb = fusedattn::cuda_backend;
namespace fab = fusedattn::bench;

namespace {

#define BENCH_CHECK(call)                                                                            \
  do {                                                                                               \
    const cudaError_t e_ = (call);                                                                   \
    if (e_ != cudaSuccess) {                                                                         \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_));    \
      std::exit(1);                                                                                  \
    }                                                                                                \
  } while (0)

/// Fills n values with a hash of the index and a seed, uniform in [-1, 1] (never zeros).
template <class E>
__global__ void fill_random(E* x, fa::index_t n, unsigned seed) {
  for (fa::index_t i = blockIdx.x * fa::index_t(blockDim.x) + threadIdx.x; i < n; i += fa::index_t(gridDim.x) * blockDim.x) {
    unsigned h = unsigned(i) * 2654435761u ^ seed * 2246822519u ^ unsigned(i >> 32) * 3266489917u;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    x[i] = cb::narrow<E>(float(h) * (2.0f / 4294967295.0f) - 1.0f);
  }
}

struct shape {
  int b, h, s, d;
  bool causal;
};

/// Visited score entries (the FLOP count uses them): all for dense, the lower triangle for causal.
double flops(const shape& c) {
  const fa::problem p{c.b, c.h, c.h, c.s, c.s, c.d};
  const fa::band_mask m = c.causal ? fa::bind(fa::causal{}, p) : fa::bind(fa::dense{}, p);
  return 4.0 * c.b * c.h * double(m.allowed_count()) * c.d;
}

/// Device buffers of `sets` input sets (Q, K, V) and one O, bhsd; with `shift` = 1 every view starts one element
/// past its allocation (not 16-byte aligned: the tensor-core kernels do not take it).
template <class T>
struct operands {
  using E = cb::device_t<T>;
  fa::problem p;
  int sets;
  std::vector<E*> q, k, v;
  E* o = nullptr;
  float* lse = nullptr;
  int shift = 0;
  operands(const shape& c, int sets_, int shift_ = 0) : p{c.b, c.h, c.h, c.s, c.s, c.d}, sets(sets_), shift(shift_) {
    const fa::index_t n = fa::index_t(c.b) * c.h * c.s * c.d + shift;
    for (int i = 0; i < sets; ++i) {
      E* x[3];
      for (int j = 0; j < 3; ++j) {
        BENCH_CHECK(cudaMalloc(&x[j], n * sizeof(E)));
        fill_random<<<1024, 256>>>(x[j], n, unsigned(17 * i + j + 1));
      }
      q.push_back(x[0]);
      k.push_back(x[1]);
      v.push_back(x[2]);
    }
    BENCH_CHECK(cudaMalloc(&o, n * sizeof(E)));
    BENCH_CHECK(cudaMalloc(&lse, fa::index_t(c.b) * c.h * c.s * sizeof(float)));
    BENCH_CHECK(cudaDeviceSynchronize());
  }
  ~operands() {
    for (int i = 0; i < sets; ++i) {
      cudaFree(q[i]);
      cudaFree(k[i]);
      cudaFree(v[i]);
    }
    cudaFree(o);
    cudaFree(lse);
  }
  fa::tensor_ref<const T> view(const E* x) const { return fa::bhsd(reinterpret_cast<const T*>(x + shift), p.q_dims()); }
  fa::tensor_ref<T> out() const { return fa::bhsd(reinterpret_cast<T*>(o + shift), p.o_dims()); }
};

/// Median time in ms of `run(set)` over rotating sets: 3 warm-up calls, then repetitions until ~300 ms or 100 runs.
template <class Run>
double median_ms(Run run, int sets) {
  cudaEvent_t start, stop;
  BENCH_CHECK(cudaEventCreate(&start));
  BENCH_CHECK(cudaEventCreate(&stop));
  for (int i = 0; i < 3; ++i) run(i % sets);
  BENCH_CHECK(cudaDeviceSynchronize());
  std::vector<float> ms;
  float total = 0;
  for (int i = 0; i < 100 && (i < 10 || total < 300.f); ++i) {
    BENCH_CHECK(cudaEventRecord(start));
    run(i % sets);
    BENCH_CHECK(cudaEventRecord(stop));
    BENCH_CHECK(cudaEventSynchronize(stop));
    float t = 0;
    BENCH_CHECK(cudaEventElapsedTime(&t, start, stop));
    ms.push_back(t);
    total += t;
  }
  BENCH_CHECK(cudaGetLastError());
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

/// Median time in ms of one call when `calls` calls are queued back to back between two events (the host's launch
/// work then overlaps the previous call's kernel, as in a pipeline): over rotating sets, 3 warm-up rounds, 30 rounds.
template <class Run>
double median_ms_queued(Run run, int sets, int calls) {
  cudaEvent_t start, stop;
  BENCH_CHECK(cudaEventCreate(&start));
  BENCH_CHECK(cudaEventCreate(&stop));
  for (int i = 0; i < 3 * calls; ++i) run(i % sets);
  BENCH_CHECK(cudaDeviceSynchronize());
  std::vector<float> ms;
  for (int round = 0; round < 30; ++round) {
    BENCH_CHECK(cudaEventRecord(start));
    for (int i = 0; i < calls; ++i) run((round * calls + i) % sets);
    BENCH_CHECK(cudaEventRecord(stop));
    BENCH_CHECK(cudaEventSynchronize(stop));
    float t = 0;
    BENCH_CHECK(cudaEventElapsedTime(&t, start, stop));
    ms.push_back(t / float(calls));
  }
  BENCH_CHECK(cudaGetLastError());
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

FILE* json = stdout;

void report(const char* dtype, const shape& c, const std::string& kernel, double ms) {
  const double tflops = flops(c) / (ms * 1e-3) / 1e12;
  std::fprintf(json,
               "{\"dtype\":\"%s\",\"b\":%d,\"h\":%d,\"s\":%d,\"d\":%d,\"mask\":\"%s\",\"kernel\":\"%s\",\"ms\":%.5f,"
               "\"tflops\":%.2f}\n",
               dtype, c.b, c.h, c.s, c.d, c.causal ? "causal" : "dense", kernel.c_str(), ms, tflops);
  std::fflush(json);
  std::printf("%-5s (%d,%2d,%5d,%3d) %-6s %-22s %9.3f ms %7.1f TFLOP/s\n", dtype, c.b, c.h, c.s, c.d,
              c.causal ? "causal" : "dense", kernel.c_str(), ms, tflops);
}

#if FUSEDATTN_BENCH_TILE_SWEEP
/// Σ (a − b)² and Σ b² over n values, accumulated in sums[0], sums[1].
template <class E>
__global__ void squared_difference(const E* a, const E* b, fa::index_t n, double* sums) {
  double d2 = 0, b2 = 0;
  for (fa::index_t i = blockIdx.x * fa::index_t(blockDim.x) + threadIdx.x; i < n; i += fa::index_t(gridDim.x) * blockDim.x) {
    const double x = cb::widen(a[i]), y = cb::widen(b[i]);
    d2 += (x - y) * (x - y);
    b2 += y * y;
  }
  atomicAdd(&sums[0], d2);
  atomicAdd(&sums[1], b2);
}

/// ‖a − b‖ / ‖b‖ of two device arrays.
template <class E>
double relative_difference(const E* a, const E* b, fa::index_t n) {
  double* sums = nullptr;
  BENCH_CHECK(cudaMalloc(&sums, 2 * sizeof(double)));
  BENCH_CHECK(cudaMemset(sums, 0, 2 * sizeof(double)));
  squared_difference<<<512, 256>>>(a, b, n, sums);
  double h[2] = {0, 0};
  BENCH_CHECK(cudaMemcpy(h, sums, sizeof(h), cudaMemcpyDeviceToHost));
  cudaFree(sums);
  return std::sqrt(h[0] / h[1]);
}

/// Times one flash tile on a shape (launch_flash directly: the alternatives the heuristic chose between).
/// One call of the default flash on the last input set (output in x.o).
template <class T>
void time_default_once(const shape& c, operands<T>& x) {
  const int i = x.sets - 1;
  const fa::status st = c.causal ? fa::attend(fa::policy::cuda{nullptr, fa::policy::cuda_kernel::flash}, x.p, x.view(x.q[i]),
                                              x.view(x.k[i]), x.view(x.v[i]), x.out(), fa::causal{}, x.lse)
                                 : fa::attend(fa::policy::cuda{nullptr, fa::policy::cuda_kernel::flash}, x.p, x.view(x.q[i]),
                                              x.view(x.k[i]), x.view(x.v[i]), x.out(), fa::dense{}, x.lse);
  if (!st) std::exit(1);
  BENCH_CHECK(cudaDeviceSynchronize());
}

/// `Hopper`: Tile is a hopper_tile, launched with launch_flash_hopper (sm_90a builds on a Hopper only).
template <class T, class Tile, bool Hopper = false>
void time_tile(const shape& c, operands<T>& x, const char* label) {
  using E = cb::device_t<T>;
  const fa::band_mask m = c.causal ? fa::bind(fa::causal{}, x.p) : fa::bind(fa::dense{}, x.p);
  const fa::strides4 st = x.out().stride;
  const float scale_log2 = float(x.p.softmax_scale() * 1.4426950408889634);
  const auto run = [&](int i) {
    // Input set i's parameters (head_dim 0: the tile's).
    cb::flash_params fp = fab::fill_flash_params(x.q[i], x.k[i], x.v[i], x.o, x.lse, st, c.b, c.h, c.s, scale_log2, m);
    const fa::status st = [&] {
      if constexpr (Hopper)
        return cb::launch_flash_hopper<E, Tile>(fp, nullptr);
      else
        return cb::launch_flash<E, Tile>(fp, nullptr);
    }();
    if (!st) std::exit(1);
  };
  const double ms = median_ms(run, x.sets);
  run(x.sets - 1);
  report(fa::scalar_name<T>(), c, std::string("flash ") + label, ms);
  // The tile computes the same function as the default one: compare O of the last input set.
  const fa::index_t n = fa::index_t(c.b) * c.h * c.s * c.d;
  E* o_tile = nullptr;
  BENCH_CHECK(cudaMalloc(&o_tile, n * sizeof(E)));
  BENCH_CHECK(cudaMemcpy(o_tile, x.o, n * sizeof(E), cudaMemcpyDeviceToDevice));
  time_default_once(c, x);
  const double rel = relative_difference(o_tile, x.o, n);
  cudaFree(o_tile);
  std::printf("      %s vs default tile: relative difference %.2e%s\n", label, rel, rel < 1e-2 ? "" : "  <-- MISMATCH");
}
#endif

/// One line saying which kernel a call runs (fa::plan): its name, its device scratch and, when it has one, why.
void print_plan(const fa::kernel_plan& pl) {
  if (!pl) {
    std::printf("      plan: refused: %s\n", pl.st.what());
    return;
  }
  std::printf("      plan: %s, %zu bytes of scratch%s%s\n", pl.kernel.c_str(), pl.scratch_bytes, pl.why.empty() ? "" : "; ",
              pl.why.c_str());
}

template <class T>
void time_attend(const shape& c, operands<T>& x, fa::policy::cuda_kernel kernel, const char* label) {
  print_plan(c.causal ? fa::plan(fa::policy::cuda{nullptr, kernel}, x.p, x.view(x.q[0]), x.view(x.k[0]), x.view(x.v[0]),
                                 x.out(), fa::causal{}, x.lse)
                      : fa::plan(fa::policy::cuda{nullptr, kernel}, x.p, x.view(x.q[0]), x.view(x.k[0]), x.view(x.v[0]),
                                 x.out(), fa::dense{}, x.lse));
  const double ms = median_ms(
      [&](int i) {
        const fa::status st = c.causal ? fa::attend(fa::policy::cuda{nullptr, kernel}, x.p, x.view(x.q[i]), x.view(x.k[i]),
                                                    x.view(x.v[i]), x.out(), fa::causal{}, x.lse)
                                       : fa::attend(fa::policy::cuda{nullptr, kernel}, x.p, x.view(x.q[i]), x.view(x.k[i]),
                                                    x.view(x.v[i]), x.out(), fa::dense{}, x.lse);
        if (!st) {
          std::fprintf(stderr, "attend: %s\n", st.what());
          std::exit(1);
        }
      },
      x.sets);
  report(fa::scalar_name<T>(), c, label, ms);
}

/// Input sets so that one pass over all of them (~ 3·n·sizeof each) exceeds the L2 several times.
int sets_for(const shape& c, int elem) {
  const double bytes = 3.0 * c.b * c.h * c.s * c.d * elem;
  const double l2_x4 = 4 * 60e6;
  return std::max(1, std::min(4, int(std::ceil(l2_x4 / bytes))));
}

template <class T>
void flash_suite(const shape& c) {
  operands<T> x(c, sets_for(c, 2));
  time_attend<T>(c, x, fa::policy::cuda_kernel::flash, "flash (default tile)");
  time_attend<T>(c, x, fa::policy::cuda_kernel::flash_mma_sync, "flash mma.sync");
#if FUSEDATTN_BENCH_TILE_SWEEP
  // The default tile against the alternatives: on a Hopper (sm_90a build) the other Hopper tiles (the mma.sync
  // kernel's default is timed above), elsewhere the mma.sync kernel's other K/V buffer count and key tiles.
  if (cb::hopper_flash_ready(nullptr)) {
    if (c.d == 128) {
      time_tile<T, cb::hopper_tile<128, 64, 1>, true>(c, x, "wg2 n64 b1 (hopper)");
      time_tile<T, cb::hopper_tile<128, 64, 2>, true>(c, x, "wg2 n64 b2 (hopper)");
      time_tile<T, cb::hopper_tile<128, 64, 1, 3>, true>(c, x, "wg3 n64 b1 (hopper)");
    } else if (c.d == 64) {
      time_tile<T, cb::hopper_tile<64, 128, 1>, true>(c, x, "wg2 n128 b1 (hopper)");
      time_tile<T, cb::hopper_tile<64, 64, 1>, true>(c, x, "wg2 n64 b1 (hopper)");
      time_tile<T, cb::hopper_tile<64, 128, 1, 3>, true>(c, x, "wg3 n128 b1 (hopper)");
      time_tile<T, cb::hopper_tile<64, 64, 1, 3>, true>(c, x, "wg3 n64 b1 (hopper)");
    } else if (c.d == 256) {  // 128-key tiles do not fit in shared memory; one warpgroup (64 rows) is the other choice
      time_tile<T, cb::hopper_tile<256, 64, 1, 1>, true>(c, x, "wg1 n64 b1 (hopper)");
    }
  } else if (c.d == 128) {
    time_tile<T, cb::flash_tile<128, 4, 64, 32, 1>>(c, x, "w4 n64 r32 s1");
    time_tile<T, cb::flash_tile<128, 4, 32, 32, 2>>(c, x, "w4 n32 r32 s2");
    time_tile<T, cb::flash_tile<128, 8, 64, 32, 2>>(c, x, "w8 n64 r32 s2");
  } else {
    time_tile<T, cb::flash_tile<64, 4, 128, 32, 2>>(c, x, "w4 n128 r32 s2");
    time_tile<T, cb::flash_tile<64, 4, 64, 32, 2>>(c, x, "w4 n64 r32 s2");
  }
#endif
}

/// The CUDA-core kernel (cuda.flash_generic) beside the tensor-core one: bf16 aligned (automatic: the tensor-core
/// kernel), bf16 one element off alignment (automatic: the tensor-core kernel on aligned copies; and flash_generic
/// asked for) and f32 (automatic: flash_generic, fa::plan says why).
void generic_suite(const shape& c) {
  {
    operands<Eigen::bfloat16> x(c, sets_for(c, 2));
    time_attend<Eigen::bfloat16>(c, x, fa::policy::cuda_kernel::automatic, "automatic (aligned)");
  }
  {
    operands<Eigen::bfloat16> x(c, sets_for(c, 2), 1);
    time_attend<Eigen::bfloat16>(c, x, fa::policy::cuda_kernel::automatic, "automatic (base + 1)");
    time_attend<Eigen::bfloat16>(c, x, fa::policy::cuda_kernel::flash_generic, "flash_generic (base + 1)");
  }
  {
    operands<float> x(c, sets_for(c, 4));
    time_attend<float>(c, x, fa::policy::cuda_kernel::automatic, "automatic (f32)");
  }
}

template <class T>
void fusion_suite(const shape& c) {
  operands<T> x(c, sets_for(c, 2));
  time_attend<T>(c, x, fa::policy::cuda_kernel::flash, "flash");
  time_attend<T>(c, x, fa::policy::cuda_kernel::naive, "naive 3-pass");
}

/// Decode: s_q = 1 against a long key cache (split-KV path), flash beside naive (unless `naive` is false);
/// memory-bound, so GB/s of K and V.
template <class T>
void decode_suite(int b, int h, int s_kv, int d, bool naive = true) {
  using E = cb::device_t<T>;
  const fa::problem p{b, h, h, 1, s_kv, d};
  const fa::index_t n_q = fa::index_t(b) * h * d, n_kv = fa::index_t(b) * h * s_kv * d;
  E *q, *k, *v, *o;
  BENCH_CHECK(cudaMalloc(&q, n_q * sizeof(E)));
  BENCH_CHECK(cudaMalloc(&k, n_kv * sizeof(E)));
  BENCH_CHECK(cudaMalloc(&v, n_kv * sizeof(E)));
  BENCH_CHECK(cudaMalloc(&o, n_q * sizeof(E)));
  fill_random<<<1024, 256>>>(q, n_q, 7u);
  fill_random<<<1024, 256>>>(k, n_kv, 8u);
  fill_random<<<1024, 256>>>(v, n_kv, 9u);
  const auto qv = fa::bhsd(reinterpret_cast<const T*>(q), p.q_dims());
  const auto kv = fa::bhsd(reinterpret_cast<const T*>(k), p.kv_dims());
  const auto vv = fa::bhsd(reinterpret_cast<const T*>(v), p.kv_dims());
  const auto ov = fa::bhsd(reinterpret_cast<T*>(o), p.o_dims());
  for (auto kernel : {fa::policy::cuda_kernel::flash, fa::policy::cuda_kernel::flash_mma_sync, fa::policy::cuda_kernel::naive}) {
    if (kernel == fa::policy::cuda_kernel::naive && !naive) continue;
    const char* name = kernel == fa::policy::cuda_kernel::flash            ? "flash"
                       : kernel == fa::policy::cuda_kernel::flash_mma_sync ? "flash mma.sync"
                                                                           : "naive";
    const double ms = median_ms(
        [&](int) {
          if (!fa::attend(fa::policy::cuda{nullptr, kernel}, p, qv, kv, vv, ov, fa::causal{fa::align::bottom_right}))
            std::exit(1);
        },
        1);
    const double gbps = 2.0 * n_kv * sizeof(E) / (ms * 1e-3) / 1e9;
    std::fprintf(json, "{\"dtype\":\"%s\",\"b\":%d,\"h\":%d,\"s_q\":1,\"s\":%d,\"d\":%d,\"mask\":\"causal_br\",\"kernel\":\"decode %s\",\"ms\":%.5f,\"gbps\":%.1f}\n",
                 fa::scalar_name<T>(), b, h, s_kv, d, name, ms, gbps);
    std::printf("%-5s decode b=%d h=%d s_kv=%d d=%d %-6s %9.4f ms %8.1f GB/s of K+V\n", fa::scalar_name<T>(), b, h, s_kv, d,
                name, ms, gbps);
  }
  cudaFree(q);
  cudaFree(k);
  cudaFree(v);
  cudaFree(o);
}

/// Block-sparse flash against dense flash on the same inputs (f16, B = 1, D = 128, blocks 128 × 512, one random
/// pattern per head at `sparsity`): the layout copied to the device inside every call (block_sparse{layout}), and
/// uploaded once (cuda::device_block_sparse). The ideal speed-up is 1 / active fraction.
void block_sparse_suite(int h, int s, double sparsity) {
  using T = Eigen::half;
  const shape c{1, h, s, 128, false};
  operands<T> x(c, sets_for(c, 2));
  const fa::block_layout layout = fa::random_layout(fa::block_geometry{s, s, 128, 512, 1, h}, sparsity, 42);
  fa::cuda::device_block_layout device_layout;
  if (const fa::status st = fa::cuda::upload(layout, device_layout); !st) {
    std::fprintf(stderr, "upload: %s\n", st.what());
    std::exit(1);
  }
  const fa::policy::cuda pol{nullptr, fa::policy::cuda_kernel::flash};
  const auto check = [](const fa::status& st) {
    if (!st) {
      std::fprintf(stderr, "attend: %s\n", st.what());
      std::exit(1);
    }
  };
  const auto dense_call = [&](int i) {
    check(fa::attend(pol, x.p, x.view(x.q[i]), x.view(x.k[i]), x.view(x.v[i]), x.out(), fa::dense{}, x.lse));
  };
  const auto device_call = [&](int i) {
    check(fa::attend(pol, x.p, x.view(x.q[i]), x.view(x.k[i]), x.view(x.v[i]), x.out(),
                     fa::cuda::device_block_sparse{device_layout}, x.lse));
  };
  const double dense_ms = median_ms(dense_call, x.sets);
  const auto copied_call = [&](int i) {
    check(fa::attend(pol, x.p, x.view(x.q[i]), x.view(x.k[i]), x.view(x.v[i]), x.out(), fa::block_sparse{layout}, x.lse));
  };
  const double copied_ms = median_ms(copied_call, x.sets);
  const double device_ms = median_ms(device_call, x.sets);
  // The portable kernel on the same device layout (on a Hopper the default is the wgmma kernel).
  const fa::policy::cuda portable{nullptr, fa::policy::cuda_kernel::flash_mma_sync};
  const double mma_sync_ms = median_ms(
      [&](int i) {
        check(fa::attend(portable, x.p, x.view(x.q[i]), x.view(x.k[i]), x.view(x.v[i]), x.out(),
                         fa::cuda::device_block_sparse{device_layout}, x.lse));
      },
      x.sets);
  constexpr int queued = 10;
  const double dense_queued_ms = median_ms_queued(dense_call, x.sets, queued);
  const double device_queued_ms = median_ms_queued(device_call, x.sets, queued);
  const double copied_queued_ms = median_ms_queued(copied_call, x.sets, queued);
  const double active = layout.density();
  std::fprintf(json,
               "{\"dtype\":\"f16\",\"b\":1,\"h\":%d,\"s\":%d,\"d\":128,\"mask\":\"block_sparse %.2f\","
               "\"kernel\":\"block-sparse vs dense flash\",\"dense_ms\":%.5f,\"sparse_ms\":%.5f,\"speedup\":%.2f,"
               "\"device_layout_ms\":%.5f,\"device_layout_speedup\":%.2f,\"dense_queued_ms\":%.5f,"
               "\"device_layout_queued_ms\":%.5f,\"device_layout_queued_speedup\":%.2f,\"active_fraction\":%.4f,"
               "\"ideal_speedup\":%.2f,\"mma_sync_device_layout_ms\":%.5f,\"copied_queued_ms\":%.5f,"
               "\"copied_queued_speedup\":%.2f}\n",
               h, s, sparsity, dense_ms, copied_ms, dense_ms / copied_ms, device_ms, dense_ms / device_ms,
               dense_queued_ms, device_queued_ms, dense_queued_ms / device_queued_ms, active, 1.0 / active, mma_sync_ms,
               copied_queued_ms, dense_queued_ms / copied_queued_ms);
#if FUSEDATTN_BENCH_TILE_SWEEP
  // The other Hopper tiles on the same device layout (launch_flash_hopper directly).
  if (cb::hopper_flash_ready(nullptr)) {
    const fa::block_sparse_mask m = fa::cuda::bind(fa::cuda::device_block_sparse{device_layout}, x.p).mask;
    const fa::strides4 st = x.out().stride;
    const float scale_log2 = float(x.p.softmax_scale() * 1.4426950408889634);
    // Input set i's parameters (head_dim 0: the tile's 128).
    const auto params = [&](int i) {
      return fab::fill_flash_params(x.q[i], x.k[i], x.v[i], x.o, x.lse, st, 1, h, s, scale_log2, m);
    };
    const auto sparse_tile = [&](auto tile, const char* label) {
      using Tile = decltype(tile);
      const double ms = median_ms([&](int i) { check(cb::launch_flash_hopper<__half, Tile>(params(i), nullptr)); },
                                  x.sets);
      std::printf("      sparse, device layout, hopper tile %s: %.3f ms (%.2fx)\n", label, ms, dense_ms / ms);
      std::fprintf(json, "{\"kernel\":\"block-sparse tile %s\",\"s\":%d,\"sparse_ms\":%.5f,\"speedup\":%.2f}\n", label, s,
                   ms, dense_ms / ms);
    };
    sparse_tile(cb::hopper_tile<128, 64, 2>{}, "wg2 n64 b2");
    sparse_tile(cb::hopper_tile<128, 64, 1>{}, "wg2 n64 b1");
  }
#endif
  std::printf("f16   block-sparse (1,%d,%d,128) sparsity %.2f (active %.3f, 128x512 blocks, ideal %.2fx): dense flash "
              "%.3f ms; sparse, layout copied per call %.3f ms (%.2fx); sparse, device layout %.3f ms (%.2fx)\n",
              h, s, sparsity, active, 1.0 / active, dense_ms, copied_ms, dense_ms / copied_ms, device_ms,
              dense_ms / device_ms);
  std::printf("      queued %d calls back to back: dense flash %.3f ms, sparse (device layout) %.3f ms per call (%.2fx), "
              "sparse (layout copied) %.3f ms (%.2fx); sparse on the mma.sync kernel %.3f ms\n",
              queued, dense_queued_ms, device_queued_ms, dense_queued_ms / device_queued_ms, copied_queued_ms,
              dense_queued_ms / copied_queued_ms, mma_sync_ms);
}

/// Writes a layout as text for bench/peers/torch_peer.py --block-sparse: "seq_q seq_kv block_q block_kv batch
/// heads", then row_offsets on one line, cols on one line. CSR row r = (b · heads + h) · n_q_blocks + q_block (batch 1
/// and one pattern per head here: r = h · n_q_blocks + q_block); kv-block kb holds keys [kb · block_kv, (kb + 1) ·
/// block_kv) clipped to seq_kv.
bool write_layout(const fa::block_layout& layout, const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) {
    std::fprintf(stderr, "cannot write %s\n", path.c_str());
    return false;
  }
  const fa::block_geometry& g = layout.geometry();
  std::fprintf(f, "%lld %lld %lld %lld %lld %lld\n", (long long)g.seq_q, (long long)g.seq_kv, (long long)g.block_q,
               (long long)g.block_kv, (long long)g.batch, (long long)g.heads);
  for (std::size_t i = 0; i < layout.row_offsets().size(); ++i)
    std::fprintf(f, i ? " %lld" : "%lld", (long long)layout.row_offsets()[i]);
  std::fprintf(f, "\n");
  for (std::size_t i = 0; i < layout.cols().size(); ++i) std::fprintf(f, i ? " %d" : "%d", int(layout.cols()[i]));
  std::fprintf(f, "\n");
  return std::fclose(f) == 0;
}

/// One call each of f16 flash (2,16,8192,128) dense, (4,32,4096,64) dense and causal, and block-sparse flash
/// (1,16,10000,128) on a device layout, for a profiler (bench_gpu OUT.jsonl profile).
void profile_calls() {
  using T = Eigen::half;
  const fa::policy::cuda pol{nullptr, fa::policy::cuda_kernel::flash};
  for (const shape& c : {shape{2, 16, 8192, 128, false}, shape{4, 32, 4096, 64, false}, shape{4, 32, 4096, 64, true}}) {
    operands<T> x(c, 1);
    const bool ok = c.causal ? bool(fa::attend(pol, x.p, x.view(x.q[0]), x.view(x.k[0]), x.view(x.v[0]), x.out(),
                                               fa::causal{}, x.lse))
                             : bool(fa::attend(pol, x.p, x.view(x.q[0]), x.view(x.k[0]), x.view(x.v[0]), x.out(),
                                               fa::dense{}, x.lse));
    if (!ok) std::exit(1);
  }
  const shape cs{1, 16, 10000, 128, false};
  operands<T> xs(cs, 1);
  const fa::block_layout layout = fa::random_layout(fa::block_geometry{10000, 10000, 128, 512, 1, 16}, 0.9, 42);
  fa::cuda::device_block_layout device_layout;
  if (!fa::cuda::upload(layout, device_layout)) std::exit(1);
  if (!fa::attend(pol, xs.p, xs.view(xs.q[0]), xs.view(xs.k[0]), xs.view(xs.v[0]), xs.out(),
                  fa::cuda::device_block_sparse{device_layout}, xs.lse))
    std::exit(1);
  BENCH_CHECK(cudaDeviceSynchronize());
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1) json = std::fopen(argv[1], "w");
  if (json == nullptr) return 1;
  if (argc > 2 && std::string(argv[2]) == "profile") {
    profile_calls();
    return 0;
  }
#if FUSEDATTN_BENCH_TILE_SWEEP
  if (argc > 2 && std::string(argv[2]) == "d64") {  // unmasked head_dim 64: two, three and four warpgroups, by seq
    for (const shape& c : {shape{8, 32, 512, 64, false}, shape{8, 32, 1024, 64, false}, shape{4, 32, 2048, 64, false},
                           shape{4, 32, 4096, 64, false}, shape{2, 32, 8192, 64, false}})
      for (int dtype = 0; dtype < 2; ++dtype) {
        const auto rounds = [&](auto t) {
          using T = decltype(t);
          operands<T> x(c, sets_for(c, 2));
          for (int round = 0; round < 2; ++round) {  // alternated, so neither is always timed first
            time_tile<T, cb::hopper_tile<64, 128, 1>, true>(c, x, "wg2 n128 b1 (hopper)");
            time_tile<T, cb::hopper_tile<64, 128, 1, 3>, true>(c, x, "wg3 n128 b1 (hopper)");
            time_tile<T, cb::hopper_tile<64, 64, 1, 4>, true>(c, x, "wg4 n64 b1 (hopper)");
          }
        };
        if (dtype == 0) rounds(Eigen::half{});
        else rounds(Eigen::bfloat16{});
      }
    return 0;
  }
#endif
  if (argc > 2 && std::string(argv[2]) == "decode") {  // split-KV calls only: decode shapes and one head of 4096 rows
    decode_suite<Eigen::half>(1, 32, 32768, 128, false);
    decode_suite<Eigen::half>(8, 32, 8192, 128, false);
    decode_suite<Eigen::bfloat16>(4, 16, 16384, 64, false);
    decode_suite<Eigen::half>(1, 8, 65536, 128, false);
    decode_suite<Eigen::half>(2, 32, 16384, 128, false);
    decode_suite<Eigen::half>(4, 32, 4096, 128, false);
    decode_suite<Eigen::bfloat16>(1, 32, 8192, 64, false);
    flash_suite<Eigen::half>({1, 1, 4096, 64, false});
    flash_suite<Eigen::bfloat16>({1, 1, 4096, 64, false});
    return 0;
  }
  if (argc > 2 && std::string(argv[2]) == "peer") {  // block-sparse and short dense items, for torch_peer.py
    if (argc < 4) {
      std::fprintf(stderr, "usage: %s OUT.jsonl peer DIR\n", argv[0]);
      return 1;
    }
    const std::string dir = argv[3];
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    cudaDeviceProp prop{};
    BENCH_CHECK(cudaGetDeviceProperties(&prop, 0));
    std::printf("device: %s, %d SMs, L2 %d MB\n", prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20);
    for (int s : {4096, 10000}) {
      // The layout block_sparse_suite builds (same geometry, sparsity and seed).
      const fa::block_layout layout = fa::random_layout(fa::block_geometry{s, s, 128, 512, 1, 16}, 0.9, 42);
      if (!write_layout(layout, dir + "/layout_" + std::to_string(s) + ".txt")) return 1;
      block_sparse_suite(16, s, 0.9);
    }
    const shape short_items{10, 16, 1024, 128, false};
    {
      operands<Eigen::half> x(short_items, sets_for(short_items, 2));
      time_attend<Eigen::half>(short_items, x, fa::policy::cuda_kernel::flash, "flash (default tile)");
    }
    {
      operands<Eigen::bfloat16> x(short_items, sets_for(short_items, 2));
      time_attend<Eigen::bfloat16>(short_items, x, fa::policy::cuda_kernel::flash, "flash (default tile)");
    }
    return 0;
  }
  if (argc > 2 && std::string(argv[2]) == "generic") {  // cuda.flash_generic against the tensor-core kernel
    for (const shape& c : {shape{2, 16, 4096, 128, false}, shape{2, 16, 4096, 128, true}, shape{1, 32, 8192, 64, false},
                           shape{1, 32, 8192, 64, true}})
      generic_suite(c);
    return 0;
  }
  if (argc > 2 && std::string(argv[2]) == "sparse") {  // the block-sparse suite only
    block_sparse_suite(16, 4096, 0.9);
    block_sparse_suite(16, 10000, 0.9);
    return 0;
  }
  cudaDeviceProp prop{};
  BENCH_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs, L2 %d MB\n", prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20);
  const shape main_shapes[] = {{1, 32, 2048, 128, false}, {1, 32, 2048, 128, true},  {2, 16, 8192, 128, false},
                               {2, 16, 8192, 128, true},  {1, 16, 16384, 128, false}, {1, 16, 16384, 128, true},
                               {4, 32, 4096, 64, false},  {4, 32, 4096, 64, true},    {1, 32, 1024, 128, false},
                               // the rest of the seed leaderboard's shapes
                               {1, 1, 4096, 64, false},   {1, 32, 512, 64, false},
                               // head_dim 256 (the Hopper kernel's widest head)
                               {4, 16, 4096, 256, false}, {4, 16, 4096, 256, true},
                               // head_dim 96 (on a Hopper the 128 tile, its columns 96–127 read as zeros)
                               {4, 16, 4096, 96, false},  {4, 16, 4096, 96, true}};
  for (const shape& c : main_shapes) {
    flash_suite<Eigen::half>(c);
    flash_suite<Eigen::bfloat16>(c);
  }
  if (argc > 2 && std::string(argv[2]) == "flash") return 0;  // the flash shapes only (A/B of a kernel change)
  for (int s : {128, 512, 1024, 4096}) {
    fusion_suite<Eigen::half>({1, 32, s, 128, false});
    fusion_suite<Eigen::half>({1, 32, s, 128, true});
  }
  block_sparse_suite(16, 4096, 0.9);
  block_sparse_suite(16, 10000, 0.9);
  decode_suite<Eigen::half>(1, 32, 32768, 128);
  decode_suite<Eigen::half>(8, 32, 8192, 128);
  decode_suite<Eigen::bfloat16>(4, 16, 16384, 64);
  return 0;
}
