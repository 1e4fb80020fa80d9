// The GPU tests' bridge (gpu_entry.hpp) for Eigen::bfloat16: a translation unit of its own (gpu_entry_impl.cuh).
#include "gpu_entry_impl.cuh"

namespace fusedattn::testing::gpu {
FUSEDATTN_GPU_ENTRY(Eigen::bfloat16)
}  // namespace fusedattn::testing::gpu
