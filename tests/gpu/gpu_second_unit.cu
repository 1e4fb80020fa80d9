// A second nvcc translation unit that includes the whole library, linked into test_gpu with gpu_entry.cu: a program
// of several .cu files must link (no non-template kernel or non-inline function defined in a header). It also tells
// which flash kernel `policy::cuda_kernel::flash` runs on this device, for the test log.
#include "gpu_entry.hpp"

namespace fusedattn::testing::gpu {

const char* flash_kernel_name() {
  return cuda_backend::hopper_flash_ready(nullptr) ? "the Hopper (wgmma) kernel" : "the mma.sync kernel";
}

}  // namespace fusedattn::testing::gpu
