// The GPU serving tests' bridge for Eigen::half (serving_entry_impl.cuh).
#include "serving_entry_impl.cuh"

namespace fusedattn::testing::gpu {
FUSEDATTN_SERVING_ENTRY(Eigen::half)
}  // namespace fusedattn::testing::gpu
