// attend(policy::cuda) instantiated by nvcc for the GPU tests (see gpu_entry.hpp).
#include "gpu_entry.hpp"

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

template <class T>
status attend_cuda(policy::cuda_kernel kernel, const problem& p, tensor_ref<const T> q, tensor_ref<const T> k,
                   tensor_ref<const T> v, tensor_ref<T> o, const any_mask& mask, float* lse) {
  return attend(policy::cuda{nullptr, kernel}, p, q, k, v, o, mask, lse);
}

template <class T>
status attend_cuda_uploaded(policy::cuda_kernel kernel, const problem& p, tensor_ref<const T> q, tensor_ref<const T> k,
                            tensor_ref<const T> v, tensor_ref<T> o, const block_sparse& mask, float* lse,
                            bool skip_upload) {
  cuda::device_block_layout layout;
  if (!skip_upload)
    if (status st = cuda::upload(mask.layout, layout); !st) return st;
  const status st = attend(policy::cuda{nullptr, kernel}, p, q, k, v, o, cuda::device_block_sparse{layout, mask.within}, lse);
  const status sync = synchronize();  // the layout is freed below: the kernel must be done with it
  return st ? sync : st;
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

#define FUSEDATTN_GPU_ENTRY(T)                                                                                 \
  template status attend_cuda<T>(policy::cuda_kernel, const problem&, tensor_ref<const T>, tensor_ref<const T>, \
                                 tensor_ref<const T>, tensor_ref<T>, const any_mask&, float*);              \
  template status attend_cuda_uploaded<T>(policy::cuda_kernel, const problem&, tensor_ref<const T>,              \
                                          tensor_ref<const T>, tensor_ref<const T>, tensor_ref<T>,               \
                                          const block_sparse&, float*, bool);
FUSEDATTN_GPU_ENTRY(Eigen::half)
FUSEDATTN_GPU_ENTRY(Eigen::bfloat16)
FUSEDATTN_GPU_ENTRY(float)
FUSEDATTN_GPU_ENTRY(double)
#undef FUSEDATTN_GPU_ENTRY

}  // namespace fusedattn::testing::gpu
