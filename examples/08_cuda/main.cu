// Example 08: attention on an NVIDIA GPU with policy::cuda. The same problem, views, masks and status as on the CPU;
// the pointers are device memory. f16 inputs with head_dim 32, 64, 96, 128 or 256 run the fused flash kernel on
// tensor cores (mma.sync), accumulating in f32. The output is copied back and checked on sampled rows against a
// float64 loop.
// Exit codes: 0 match, 1 mismatch or error, 77 no GPU here (ctest reports the example as skipped).
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include <fusedattn/fusedattn.hpp>

namespace fa = fusedattn;
using f16 = Eigen::half;  // cuda_fp16.h already names a type `half`

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("no CUDA device here: skipped\n");
    return 77;
  }
  // (B, H, S, D) = (1, 32, 2048, 128), f16, causal: one of the leaderboard shapes.
  const fa::problem p{1, 32, 32, 2048, 2048, 128};
  const std::size_t n = static_cast<std::size_t>(p.batch * p.heads * p.seq_q * p.head_dim);
  std::mt19937 rng(8);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  std::vector<f16> q(n), k(n), v(n), o(n);
  for (auto* buf : {&q, &k, &v})
    for (f16& x : *buf) x = f16(u(rng));

  f16 *dq = nullptr, *dk = nullptr, *dv = nullptr, *dout = nullptr;
  for (f16** ptr : {&dq, &dk, &dv, &dout}) cudaMalloc(ptr, n * sizeof(f16));
  cudaMemcpy(dq, q.data(), n * sizeof(f16), cudaMemcpyHostToDevice);
  cudaMemcpy(dk, k.data(), n * sizeof(f16), cudaMemcpyHostToDevice);
  cudaMemcpy(dv, v.data(), n * sizeof(f16), cudaMemcpyHostToDevice);
  cudaStream_t stream;
  cudaStreamCreate(&stream);

  const auto call = [&] {
    return fa::attend(fa::policy::cuda{stream}, p, fa::bhsd<const f16>(dq, p.q_dims()),
                      fa::bhsd<const f16>(dk, p.kv_dims()), fa::bhsd<const f16>(dv, p.kv_dims()),
                      fa::bhsd(dout, p.o_dims()), fa::causal{});
  };
  // Which kernel attend() runs for this call, its device scratch and, were it not the fused kernel, why.
  const fa::kernel_plan plan = fa::plan(fa::policy::cuda{stream}, p, fa::bhsd<const f16>(dq, p.q_dims()),
                                        fa::bhsd<const f16>(dk, p.kv_dims()), fa::bhsd<const f16>(dv, p.kv_dims()),
                                        fa::bhsd(dout, p.o_dims()), fa::causal{});
  if (!plan) {
    std::fprintf(stderr, "fusedattn: %s\n", plan.st.what());
    return 1;
  }
  std::printf("plan: %s, %zu bytes of device scratch%s%s\n", plan.kernel.c_str(), plan.scratch_bytes,
              plan.fused ? " (fused)" : "; not fused: ", plan.why.c_str());
  if (const fa::status st = call(); !st) {
    std::fprintf(stderr, "fusedattn: %s\n", st.what());
    return 1;
  }
  // Time 20 calls with CUDA events.
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  cudaEventRecord(start, stream);
  for (int r = 0; r < 20; ++r) (void)call();
  cudaEventRecord(stop, stream);
  cudaEventSynchronize(stop);
  float ms = 0;
  cudaEventElapsedTime(&ms, start, stop);
  ms /= 20;
  cudaMemcpy(o.data(), dout, n * sizeof(f16), cudaMemcpyDeviceToHost);

  // Float64 check of a few causal rows of heads 0 and 31.
  double err = 0;
  const fa::index_t s = p.seq_kv, d = p.head_dim;
  for (fa::index_t h : {0, 31})
    for (fa::index_t i : {fa::index_t(0), fa::index_t(777), s - 1}) {
      const std::size_t base = static_cast<std::size_t>(h * s * d);
      std::vector<double> w(static_cast<std::size_t>(i + 1));
      double m = -INFINITY, l = 0;
      for (fa::index_t j = 0; j <= i; ++j) {  // causal: keys 0..i
        double dot = 0;
        for (fa::index_t c = 0; c < d; ++c)
          dot += double(float(q[base + static_cast<std::size_t>(i * d + c)])) * double(float(k[base + static_cast<std::size_t>(j * d + c)]));
        w[static_cast<std::size_t>(j)] = dot * p.softmax_scale();
        m = std::max(m, w[static_cast<std::size_t>(j)]);
      }
      for (double& x : w) l += (x = std::exp(x - m));
      for (fa::index_t c = 0; c < d; ++c) {
        double ref = 0;
        for (fa::index_t j = 0; j <= i; ++j) ref += w[static_cast<std::size_t>(j)] / l * double(float(v[base + static_cast<std::size_t>(j * d + c)]));
        err = std::max(err, std::abs(ref - double(float(o[base + static_cast<std::size_t>(i * d + c)]))));
      }
    }
  const double flop = 4.0 * p.batch * p.heads * d * (double(s) * (s + 1) / 2);  // causal: half the scores
  std::printf("CUDA flash, (1,32,2048,128) f16 causal: %.1f us, %.1f TFLOP/s; max error vs float64 %.2g\n",
              ms * 1e3, flop / (ms * 1e-3) * 1e-12, err);
  for (f16* ptr : {dq, dk, dv, dout}) cudaFree(ptr);
  cudaStreamDestroy(stream);
  const bool ok = err < 2e-3;  // f16 output: a few units of its rounding (2^-11 relative)
  std::printf("%s\n", ok ? "OK" : "MISMATCH");
  return ok ? 0 : 1;
}
