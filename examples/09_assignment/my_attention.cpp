// YOUR IMPLEMENTATION GOES HERE.
//
// The harness (harness.cpp) checks my_attention() against fusedattn on three configurations (max error < 1e-3)
// and times it against fusedattn's naive and flash kernels at seq = 128, 512 and 1024.
// As shipped this stub computes nothing, so the check fails loudly: that is by design.
//
// Suggested path: (1) the naive three-pass version (scores, scale, softmax, P·V) — get it correct;
// (2) tile it (blocks of K/V, online softmax: running max m and sum l, rescale the accumulator);
// (3) vectorise the inner loops and use threads across (batch, head).
#include "my_attention.hpp"

#include <cstdio>

void my_attention(const float* /*q*/, const float* /*k*/, const float* /*v*/, float* /*o*/, int /*batch*/,
                  int /*heads*/, int /*seq*/, int /*dim*/) {
  std::fprintf(stderr, "my_attention(): not implemented yet -- fill in my_attention.cpp\n");
}
