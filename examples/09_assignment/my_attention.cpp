// YOUR IMPLEMENTATION GOES HERE.
//
// my_attention() (declared in my_attention.hpp) computes O = softmax(Q·Kᵀ / sqrt(dim) + mask) · V for every
// (batch, head); tensors are contiguous float32 [batch][heads][seq][dim]; seq_q and seq_kv may differ; with
// p.causal, query i sees keys 0..i only. The harness (harness.cpp) checks it against a float64 reference on
// stress inputs and at every size it times (max |error| < 1e-3, on 1 thread and on all), then times it beside
// fusedattn's naive and flash kernels at S = 128, 512 and 1024.
// As shipped this stub writes nothing, so every check fails: that is by design.
//
// Suggested path (docs/teaching.md of the fusedattn tree explains each step):
//   1. the plain three-pass version per query row (scores, row max, exp and sum, weighted sum of V rows): get it
//      correct, including causal and seq_q != seq_kv; subtract the row max before exp, or large logits overflow;
//   2. tile it: blocks of K/V rows with the online softmax (running max m and sum l, rescale the accumulator);
//   3. vectorise the inner loops (the build uses -O3 -march=native) and split (batch, head, query block) over
//      p.threads threads (OpenMP is available: #pragma omp parallel for num_threads(p.threads)).
#include "my_attention.hpp"

#include <cstdio>

void my_attention(const float* /*q*/, const float* /*k*/, const float* /*v*/, float* /*o*/,
                  const attention_problem& /*p*/) {
  static bool told = false;
  if (!told) std::fprintf(stderr, "my_attention(): not implemented yet -- fill in my_attention.cpp\n");
  told = true;
}
