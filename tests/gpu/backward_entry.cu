// attend_backward(policy::cuda) instantiated by nvcc for the GPU tests (see backward_entry.hpp).
#include "backward_entry.hpp"

namespace fusedattn::testing::gpu {

template <class T>
status attend_backward_cuda(const problem& p, tensor_ref<const T> q, tensor_ref<const T> k, tensor_ref<const T> v,
                            tensor_ref<const T> o, tensor_ref<const T> d_o, const float* lse, tensor_ref<T> dq,
                            tensor_ref<T> dk, tensor_ref<T> dv, const any_mask& mask, bool deterministic) {
  policy::cuda pol;
  pol.deterministic = deterministic;
  return attend_backward(pol, p, q, k, v, o, d_o, lse, dq, dk, dv, mask);
}

template <class T>
status attend_backward_cuda_mods(const problem& p, tensor_ref<const T> q, tensor_ref<const T> k, tensor_ref<const T> v,
                                 tensor_ref<const T> o, tensor_ref<const T> d_o, const float* lse, tensor_ref<T> dq,
                                 tensor_ref<T> dk, tensor_ref<T> dv, const modified<any_mask>& mask,
                                 bool deterministic) {
  policy::cuda pol;
  pol.deterministic = deterministic;
  return attend_backward(pol, p, q, k, v, o, d_o, lse, dq, dk, dv, mask);
}

template <class T>
status attend_backward_cuda_uploaded(const problem& p, tensor_ref<const T> q, tensor_ref<const T> k,
                                     tensor_ref<const T> v, tensor_ref<const T> o, tensor_ref<const T> d_o,
                                     const float* lse, tensor_ref<T> dq, tensor_ref<T> dk, tensor_ref<T> dv,
                                     const block_sparse& mask, bool deterministic) {
  cuda::device_block_layout layout;
  if (status st = cuda::upload(mask.layout, layout); !st) return st;
  policy::cuda pol;
  pol.deterministic = deterministic;
  const status st = attend_backward(pol, p, q, k, v, o, d_o, lse, dq, dk, dv,
                                    cuda::device_block_sparse{layout, mask.within});
  const status sync = cuda_backend::from_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  return st ? sync : st;
}

#define FUSEDATTN_BACKWARD_ENTRY(T)                                                                                \
  template status attend_backward_cuda<T>(const problem&, tensor_ref<const T>, tensor_ref<const T>,                \
                                          tensor_ref<const T>, tensor_ref<const T>, tensor_ref<const T>,           \
                                          const float*, tensor_ref<T>, tensor_ref<T>, tensor_ref<T>,               \
                                          const any_mask&, bool);                                                  \
  template status attend_backward_cuda_mods<T>(const problem&, tensor_ref<const T>, tensor_ref<const T>,           \
                                               tensor_ref<const T>, tensor_ref<const T>, tensor_ref<const T>,      \
                                               const float*, tensor_ref<T>, tensor_ref<T>, tensor_ref<T>,          \
                                               const modified<any_mask>&, bool);                                   \
  template status attend_backward_cuda_uploaded<T>(const problem&, tensor_ref<const T>, tensor_ref<const T>,       \
                                                   tensor_ref<const T>, tensor_ref<const T>, tensor_ref<const T>,  \
                                                   const float*, tensor_ref<T>, tensor_ref<T>, tensor_ref<T>,      \
                                                   const block_sparse&, bool);
FUSEDATTN_BACKWARD_ENTRY(Eigen::half)
FUSEDATTN_BACKWARD_ENTRY(Eigen::bfloat16)
FUSEDATTN_BACKWARD_ENTRY(float)
#undef FUSEDATTN_BACKWARD_ENTRY

}  // namespace fusedattn::testing::gpu
