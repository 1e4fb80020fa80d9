// A/B timing of policy::cuda's flash kernels on a fixed list of shapes (f16; dense, causal, bottom-right decode):
// the same source built against two include trees (a commit's and the working tree's) times a kernel change in one
// run on one card. Median of 22 loops of 5 calls between CUDA events, two input sets alternated.
//   nvcc -O3 -std=c++17 -arch=sm_90a --expt-relaxed-constexpr -DFUSEDATTN_WITH_CUDA=1 -I<tree>/include
//        -isystem <eigen3> -Xcompiler -fopenmp -lgomp -lcublas bench/gpu/ab_flash.cu -o ab_flash   (one line)
//   ab_flash TAG [mma] [softcap|alibi|sinks|all] [dims] [tiles]
//     mma: policy::cuda_kernel::flash_mma_sync instead of flash; softcap (cap 30), alibi (slopes 2^-(8(h+1)/H),
//     the mask's alignment), sinks (logit 1), all: those score modifiers on every call; dims: the head_dims between
//     the tile widths (40, 80, and 136–192 dense and causal) instead of the list below; tiles (with dims): each
//     head_dim above 128 also on the Hopper tiles that could take it, launched directly (launch_flash_hopper,
//     sm_90a builds on a Hopper: the 192 tile with 80, 96 and 112 keys, the 256 tile padded), each checked against
//     the default call's O. A call the tree refuses prints "refused" and the run goes on.
#include <fusedattn/fusedattn.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

namespace fa = fusedattn;
namespace cb = fusedattn::cuda_backend;
using f16 = Eigen::half;

struct shape {
  int b, h, hkv, sq, skv, d;
  int mask;  // 0 dense, 1 causal, 2 causal bottom-right
};

int main(int argc, char** argv) {
  const char* tag = argc > 1 ? argv[1] : "?";
  bool mma = false, dims = false, tiles = false, use_cap = false, use_alibi = false, use_sinks = false;
  for (int a = 2; a < argc; ++a) {
    const std::string arg = argv[a];
    mma = mma || arg == "mma";
    dims = dims || arg == "dims";
    tiles = tiles || arg == "tiles";
    use_cap = use_cap || arg == "softcap" || arg == "all";
    use_alibi = use_alibi || arg == "alibi" || arg == "all";
    use_sinks = use_sinks || arg == "sinks" || arg == "all";
  }
  const std::vector<shape> shapes =
      dims ? std::vector<shape>{{4, 16, 16, 4096, 4096, 40, 0},  {4, 16, 16, 4096, 4096, 80, 0},
                                {4, 16, 16, 4096, 4096, 80, 1},  {4, 16, 16, 4096, 4096, 136, 0},
                                {4, 16, 16, 4096, 4096, 136, 1}, {4, 16, 16, 4096, 4096, 144, 0},
                                {4, 16, 16, 4096, 4096, 144, 1}, {4, 16, 16, 4096, 4096, 160, 0},
                                {4, 16, 16, 4096, 4096, 160, 1}, {4, 16, 16, 4096, 4096, 176, 0},
                                {4, 16, 16, 4096, 4096, 176, 1}, {4, 16, 16, 4096, 4096, 192, 0},
                                {4, 16, 16, 4096, 4096, 192, 1}}
           : std::vector<shape>{{4, 32, 32, 4096, 4096, 64, 0},  {4, 32, 32, 4096, 4096, 64, 1},
                                {2, 16, 16, 8192, 8192, 128, 0}, {2, 16, 16, 8192, 8192, 128, 1},
                                {4, 16, 16, 4096, 4096, 256, 1}, {4, 16, 16, 4096, 4096, 96, 1},
                                {1, 32, 32, 2048, 2048, 128, 1}, {8, 32, 8, 1, 8192, 128, 2},
                                {1, 32, 32, 1024, 1024, 64, 1}};
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (const shape& s : shapes) {
    fa::problem p{s.b, s.h, s.hkv, s.sq, s.skv, s.d};
    const size_t nq = size_t(s.b) * s.h * s.sq * s.d, nkv = size_t(s.b) * s.hkv * s.skv * s.d;
    std::vector<f16> hq(nq), hk(nkv);
    for (auto& x : hq) x = f16(nd(rng));
    for (auto& x : hk) x = f16(nd(rng));
    f16 *q[2], *k[2], *v[2], *o;
    for (int i = 0; i < 2; ++i) {
      cudaMalloc(&q[i], nq * 2);
      cudaMalloc(&k[i], nkv * 2);
      cudaMalloc(&v[i], nkv * 2);
      cudaMemcpy(q[i], hq.data(), nq * 2, cudaMemcpyHostToDevice);
      cudaMemcpy(k[i], hk.data(), nkv * 2, cudaMemcpyHostToDevice);
      cudaMemcpy(v[i], hk.data(), nkv * 2, cudaMemcpyHostToDevice);
    }
    cudaMalloc(&o, nq * 2);
    // The modifiers' per-head slopes and sink logits, in device memory.
    std::vector<float> h_slopes(size_t(s.h)), h_sinks(size_t(s.h), 1.f);
    for (int h = 0; h < s.h; ++h) h_slopes[size_t(h)] = std::exp2(-8.f * float(h + 1) / float(s.h));
    float *slopes = nullptr, *sink_logits = nullptr;
    cudaMalloc(&slopes, sizeof(float) * size_t(s.h));
    cudaMalloc(&sink_logits, sizeof(float) * size_t(s.h));
    cudaMemcpy(slopes, h_slopes.data(), sizeof(float) * size_t(s.h), cudaMemcpyHostToDevice);
    cudaMemcpy(sink_logits, h_sinks.data(), sizeof(float) * size_t(s.h), cudaMemcpyHostToDevice);
    const fa::align alignment = s.mask == 2 ? fa::align::bottom_right : fa::align::top_left;
    fa::modified<fa::any_mask> mask{s.mask == 0 ? fa::any_mask{fa::dense{}} : fa::any_mask{fa::causal{alignment}}, {}};
    if (use_cap) mask = mask | fa::softcap{30.f};
    if (use_alibi) mask = mask | fa::alibi{slopes, alignment};
    if (use_sinks) mask = mask | fa::sinks{sink_logits};
    auto call = [&](int i) {
      const auto qv = fa::bhsd<const f16>(q[i], p.q_dims());
      const auto kv = fa::bhsd<const f16>(k[i], p.kv_dims());
      const auto vv = fa::bhsd<const f16>(v[i], p.kv_dims());
      const auto ov = fa::bhsd<f16>(o, p.o_dims());
      const fa::policy::cuda pol{nullptr, mma ? fa::policy::cuda_kernel::flash_mma_sync : fa::policy::cuda_kernel::flash};
      return fa::attend(pol, p, qv, kv, vv, ov, mask);
    };
    const auto release = [&] {
      for (int i = 0; i < 2; ++i) cudaFree(q[i]), cudaFree(k[i]), cudaFree(v[i]);
      cudaFree(o);
      cudaFree(slopes);
      cudaFree(sink_logits);
    };
    if (const fa::status st = call(0); !st) {
      std::printf("%s (%d,%d/%d,%d,%d,%d): refused: %s\n", tag, s.b, s.h, s.hkv, s.sq, s.skv, s.d, st.what());
      release();
      continue;
    }
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    // Median ms of 22 loops of 5 calls of `run(i)`, input sets alternated.
    const auto median_ms = [&](auto&& run) {
      std::vector<float> ms;
      for (int r = 0; r < 25; ++r) {
        const int reps = 5;
        cudaEventRecord(a);
        for (int i = 0; i < reps; ++i) run(i % 2);
        cudaEventRecord(b);
        cudaEventSynchronize(b);
        float t = 0;
        cudaEventElapsedTime(&t, a, b);
        if (r >= 3) ms.push_back(t / reps);
      }
      std::sort(ms.begin(), ms.end());
      return double(ms[ms.size() / 2]);
    };
    const double frac = s.mask == 0 ? 1.0 : s.sq == 1 ? 1.0 : 0.5;
    const double flops = 4.0 * s.b * s.h * double(s.sq) * s.skv * s.d * frac;
    const double bytes = 2.0 * nkv * 2;
    const char* mask_name = s.mask == 0 ? "dense " : s.mask == 1 ? "causal" : "br";
    const double med = median_ms([&](int i) { (void)call(i); });
    std::printf("%s (%d,%d/%d,%d,%d,%d) %s: %.4f ms  %.1f TFLOP/s  %.0f GB/s K+V\n", tag, s.b, s.h, s.hkv, s.sq, s.skv,
                s.d, mask_name, med, flops / med / 1e9, bytes / med / 1e6);
    if (tiles && dims && s.d > 128 && !use_cap && !use_alibi && !use_sinks) {
      // The default call's O of input set 0, then each tile's O of the same inputs against it.
      std::vector<f16> o_default(nq), o_tile(nq);
      (void)call(0);
      cudaMemcpy(o_default.data(), o, nq * 2, cudaMemcpyDeviceToHost);
      const fa::band_mask m = s.mask == 0 ? fa::bind(fa::dense{}, p) : fa::bind(fa::causal{alignment}, p);
      const auto qs = fa::bhsd<const f16>(q[0], p.q_dims()).stride, ks = fa::bhsd<const f16>(k[0], p.kv_dims()).stride;
      const float scale_log2 = float(p.softmax_scale() * 1.4426950408889634);
      const auto time_tile = [&](auto tile, const char* label) {
        using Tile = decltype(tile);
        if (s.d > Tile::head_dim) return;
        const auto run = [&](int i) {
          // Input set i's parameters, by name; the rest as flash_params_t initialises them (no lse).
          cb::flash_params fp{};
          fp.q = q[i];
          fp.k = k[i];
          fp.v = v[i];
          fp.o = o;
          fp.q_stride = fp.o_stride = qs;
          fp.k_stride = fp.v_stride = ks;
          fp.batch = s.b;
          fp.heads = s.h;
          fp.group = s.h / s.hkv;
          fp.seq_q = s.sq;
          fp.seq_kv = s.skv;
          fp.head_dim = s.d;
          fp.scale_log2 = scale_log2;
          fp.mask = m;
          fp.splits = 1;
          if (!cb::launch_flash_hopper<__half, Tile>(fp, nullptr)) std::printf("  %s: refused\n", label);
        };
        const double t = median_ms(run);
        run(0);
        cudaMemcpy(o_tile.data(), o, nq * 2, cudaMemcpyDeviceToHost);
        double diff = 0;
        for (size_t i = 0; i < nq; ++i)
          diff = std::max(diff, double(std::abs(float(o_tile[i]) - float(o_default[i]))));
        std::printf("%s (%d,%d/%d,%d,%d,%d) %s %-13s: %.4f ms  %.1f TFLOP/s  max |O - O_default| %.2e%s\n", tag, s.b,
                    s.h, s.hkv, s.sq, s.skv, s.d, mask_name, label, t, flops / t / 1e9, diff,
                    diff < 1e-2 ? "" : "  <-- MISMATCH");
      };
      time_tile(cb::hopper_tile<192, 80, 1>{}, "tile 192x80");
      time_tile(cb::hopper_tile<192, 96, 1>{}, "tile 192x96");
      time_tile(cb::hopper_tile<192, 112, 1>{}, "tile 192x112");
      time_tile(cb::hopper_tile<256, 80, 1>{}, "tile 256x80");
    }
    release();
    if (cudaGetLastError() != cudaSuccess) return 1;
  }
  return 0;
}
