// attend(policy::cuda) instantiated by nvcc for the GPU tests (see gpu_entry.hpp): the helpers, and the bridge for
// float and double (the 16-bit types: gpu_entry_f16.cu, gpu_entry_bf16.cu).
#include "gpu_entry_impl.cuh"

namespace fusedattn::testing::gpu {

bool device_available(std::string& why) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    why = std::string("no usable CUDA device: ") + cudaGetErrorString(e);
    cudaGetLastError();
    return false;
  }
  if (n == 0) {
    why = "no CUDA device";
    return false;
  }
  return true;
}

status attend_cpu_naive(const problem& p, tensor_ref<const float> q, tensor_ref<const float> k,
                        tensor_ref<const float> v, tensor_ref<float> o, float* lse) {
  return attend(policy::cpu_naive{1}, p, q, k, v, o, dense{}, lse);
}

status upload_status(const block_layout_view& layout) {
  cuda::device_block_layout dev;
  return cuda::upload(layout, dev);
}

namespace {
__global__ void spin_kernel(long long cycles) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
}
}  // namespace

status spin(int microseconds) {
  spin_kernel<<<1, 1>>>(2000LL * microseconds);
  return cuda_backend::from_cuda(cudaGetLastError(), "spin_kernel");
}

status synchronize() {
  if (status st = cuda_backend::from_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize"); !st) return st;
  return cuda_backend::from_cuda(cudaGetLastError(), "a kernel");
}

status scratch_reserved(std::size_t& bytes) { return cuda::scratch_reserved(bytes); }
status trim_scratch(std::size_t keep_bytes) { return cuda::trim_scratch(keep_bytes); }

FUSEDATTN_GPU_ENTRY(float)
FUSEDATTN_GPU_ENTRY(double)
#undef FUSEDATTN_GPU_ENTRY

}  // namespace fusedattn::testing::gpu
