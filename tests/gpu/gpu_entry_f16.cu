// The GPU tests' bridge (gpu_entry.hpp) for Eigen::half: a translation unit of its own (gpu_entry_impl.cuh).
#include "gpu_entry_impl.cuh"

namespace fusedattn::testing::gpu {
FUSEDATTN_GPU_ENTRY(Eigen::half)
}  // namespace fusedattn::testing::gpu
