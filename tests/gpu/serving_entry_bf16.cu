// The GPU serving tests' bridge for Eigen::bfloat16 (serving_entry_impl.cuh).
#include "serving_entry_impl.cuh"

namespace fusedattn::testing::gpu {
FUSEDATTN_SERVING_ENTRY(Eigen::bfloat16)
}  // namespace fusedattn::testing::gpu
