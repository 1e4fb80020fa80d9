// A/B timing of policy::cuda's flash kernels on a fixed list of shapes (f16; dense, causal, bottom-right decode):
// the same source built against two include trees (a commit's and the working tree's) times a kernel change in one
// run on one card. Median of 22 loops of 5 calls between CUDA events, two input sets alternated.
//   nvcc -O3 -std=c++17 -arch=sm_90a --expt-relaxed-constexpr -DFUSEDATTN_WITH_CUDA=1 -I<tree>/include
//        -isystem <eigen3> -Xcompiler -fopenmp -lgomp -lcublas bench/gpu/ab_flash.cu -o ab_flash   (one line)
//   ab_flash TAG [mma] [softcap|alibi|sinks|all] [dims]
//     mma: policy::cuda_kernel::flash_mma_sync instead of flash; softcap (cap 30), alibi (slopes 2^-(8(h+1)/H),
//     the mask's alignment), sinks (logit 1), all: those score modifiers on every call; dims: the head_dims that
//     run on padded tiles (40, 80, 136, 160, 192) instead of the list below. A call the tree refuses prints
//     "refused" and the run goes on.
#include <fusedattn/fusedattn.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

namespace fa = fusedattn;
using f16 = Eigen::half;

struct shape {
  int b, h, hkv, sq, skv, d;
  int mask;  // 0 dense, 1 causal, 2 causal bottom-right
};

int main(int argc, char** argv) {
  const char* tag = argc > 1 ? argv[1] : "?";
  bool mma = false, dims = false, use_cap = false, use_alibi = false, use_sinks = false;
  for (int a = 2; a < argc; ++a) {
    const std::string arg = argv[a];
    mma = mma || arg == "mma";
    dims = dims || arg == "dims";
    use_cap = use_cap || arg == "softcap" || arg == "all";
    use_alibi = use_alibi || arg == "alibi" || arg == "all";
    use_sinks = use_sinks || arg == "sinks" || arg == "all";
  }
  const std::vector<shape> shapes =
      dims ? std::vector<shape>{{4, 16, 16, 4096, 4096, 40, 0},  {4, 16, 16, 4096, 4096, 80, 0},
                                {4, 16, 16, 4096, 4096, 80, 1},  {4, 16, 16, 4096, 4096, 136, 1},
                                {4, 16, 16, 4096, 4096, 160, 1}, {4, 16, 16, 4096, 4096, 192, 1}}
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
    std::vector<float> ms;
    for (int r = 0; r < 25; ++r) {
      const int reps = 5;
      cudaEventRecord(a);
      for (int i = 0; i < reps; ++i) (void)call(i % 2);
      cudaEventRecord(b);
      cudaEventSynchronize(b);
      float t = 0;
      cudaEventElapsedTime(&t, a, b);
      if (r >= 3) ms.push_back(t / reps);
    }
    std::sort(ms.begin(), ms.end());
    const double med = ms[ms.size() / 2];
    const double frac = s.mask == 0 ? 1.0 : s.sq == 1 ? 1.0 : 0.5;
    const double flops = 4.0 * s.b * s.h * double(s.sq) * s.skv * s.d * frac;
    const double bytes = 2.0 * nkv * 2;
    std::printf("%s (%d,%d/%d,%d,%d,%d) %s: %.4f ms  %.1f TFLOP/s  %.0f GB/s K+V\n", tag, s.b, s.h, s.hkv, s.sq, s.skv,
                s.d, s.mask == 0 ? "dense " : s.mask == 1 ? "causal" : "br", med, flops / med / 1e9, bytes / med / 1e6);
    release();
    if (cudaGetLastError() != cudaSuccess) return 1;
  }
  return 0;
}
