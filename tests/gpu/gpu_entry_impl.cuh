/// @file gpu_entry_impl.cuh
/// The GPU tests' bridge functions (gpu_entry.hpp) as templates, and the macro that instantiates them for one storage
/// type: each type in a translation unit of its own (gpu_entry.cu, gpu_entry_f16.cu, gpu_entry_bf16.cu), so that
/// the kernels of the 16-bit types compile in parallel. Not part of the library.
#pragma once

#include "gpu_entry.hpp"

namespace fusedattn::testing::gpu {

template <class T>
status attend_cuda(policy::cuda_kernel kernel, const problem& p, tensor_ref<const T> q, tensor_ref<const T> k,
                   tensor_ref<const T> v, tensor_ref<T> o, const any_mask& mask, float* lse) {
  return attend(policy::cuda{nullptr, kernel}, p, q, k, v, o, mask, lse);
}

template <class T>
kernel_plan plan_cuda(policy::cuda_kernel kernel, const problem& p, tensor_ref<const T> q, tensor_ref<const T> k,
                      tensor_ref<const T> v, tensor_ref<T> o, const any_mask& mask, float* lse) {
  return plan(policy::cuda{nullptr, kernel}, p, q, k, v, o, mask, lse);
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

template <class T>
status attend_cuda_graph(policy::cuda_kernel kernel, const problem& p, tensor_ref<const T> q, tensor_ref<const T> k,
                         tensor_ref<const T> v, tensor_ref<T> o, const any_mask& mask, float* lse, int replays,
                         bool uploaded) {
  using cuda_backend::from_cuda;
  cuda::device_block_layout layout;  // outlives the graph's runs
  if (uploaded) {
    const block_sparse* sparse = std::get_if<block_sparse>(&mask);
    if (sparse == nullptr) return status::invalid("attend_cuda_graph: uploaded needs a block_sparse mask");
    if (status st = cuda::upload(sparse->layout, layout); !st) return st;
  }
  cudaStream_t stream = nullptr;
  if (status st = from_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate"); !st)
    return st;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  const auto capture = [&]() -> status {
    if (status st = from_cuda(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), "cudaStreamBeginCapture");
        !st)
      return st;
    const policy::cuda pol{stream, kernel};
    const status called =
        uploaded ? attend(pol, p, q, k, v, o, cuda::device_block_sparse{layout, std::get<block_sparse>(mask).within}, lse)
                 : attend(pol, p, q, k, v, o, mask, lse);
    const status ended = from_cuda(cudaStreamEndCapture(stream, &graph), "cudaStreamEndCapture");
    return !called ? called : ended;
  };
  // Before each launch after the first, O (when it has no gaps) and lse are set to NaN, so that the last launch
  // alone must have written them (a graph whose launches depend on state left by the one before fails).
  const index_t o_elems = o.dims.b * o.dims.h * o.dims.s * o.dims.d;
  const bool o_dense = (o.dims.b - 1) * o.stride.b + (o.dims.h - 1) * o.stride.h + (o.dims.s - 1) * o.stride.s +
                           o.dims.d == o_elems;
  const auto run = [&]() -> status {
    if (status st = from_cuda(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate"); !st) return st;
    for (int r = 0; r < replays; ++r) {
      if (r > 0 && o_dense)
        if (status st = from_cuda(cudaMemsetAsync(o.data, 0xff, std::size_t(o_elems) * sizeof(T), stream),
                                  "cudaMemsetAsync(O)");
            !st)
          return st;
      if (r > 0 && lse != nullptr)
        if (status st = from_cuda(cudaMemsetAsync(lse, 0xff, std::size_t(p.lse_size()) * sizeof(float), stream),
                                  "cudaMemsetAsync(lse)");
            !st)
          return st;
      if (status st = from_cuda(cudaGraphLaunch(exec, stream), "cudaGraphLaunch"); !st) return st;
    }
    return from_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  };
  const status captured = capture();
  const status result = captured ? run() : captured;
  if (exec != nullptr) cudaGraphExecDestroy(exec);
  if (graph != nullptr) cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
  cudaGetLastError();
  return result;
}

template <class T>
status attend_cuda_own_stream(policy::cuda_kernel kernel, const problem& p, tensor_ref<const T> q,
                              tensor_ref<const T> k, tensor_ref<const T> v, tensor_ref<T> o, const any_mask& mask,
                              float* lse) {
  using cuda_backend::from_cuda;
  cudaStream_t stream = nullptr;
  if (status st = from_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate"); !st)
    return st;
  const status called = attend(policy::cuda{stream, kernel}, p, q, k, v, o, mask, lse);
  const status synced = from_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  cudaStreamDestroy(stream);
  return !called ? called : synced;
}

template <class T>
status attend_cuda_mods(policy::cuda_kernel kernel, const problem& p, tensor_ref<const T> q, tensor_ref<const T> k,
                        tensor_ref<const T> v, tensor_ref<T> o, const modified<any_mask>& mask, float* lse) {
  return attend(policy::cuda{nullptr, kernel}, p, q, k, v, o, mask, lse);
}

template <class T>
kernel_plan plan_cuda_mods(policy::cuda_kernel kernel, const problem& p, tensor_ref<const T> q, tensor_ref<const T> k,
                           tensor_ref<const T> v, tensor_ref<T> o, const modified<any_mask>& mask, float* lse) {
  return plan(policy::cuda{nullptr, kernel}, p, q, k, v, o, mask, lse);
}

#define FUSEDATTN_GPU_ENTRY(T)                                                                                 \
  template status attend_cuda<T>(policy::cuda_kernel, const problem&, tensor_ref<const T>, tensor_ref<const T>, \
                                 tensor_ref<const T>, tensor_ref<T>, const any_mask&, float*);              \
  template kernel_plan plan_cuda<T>(policy::cuda_kernel, const problem&, tensor_ref<const T>, tensor_ref<const T>, \
                                     tensor_ref<const T>, tensor_ref<T>, const any_mask&, float*);              \
  template status attend_cuda_uploaded<T>(policy::cuda_kernel, const problem&, tensor_ref<const T>,              \
                                          tensor_ref<const T>, tensor_ref<const T>, tensor_ref<T>,               \
                                          const block_sparse&, float*, bool);                                  \
  template status attend_cuda_graph<T>(policy::cuda_kernel, const problem&, tensor_ref<const T>,                 \
                                       tensor_ref<const T>, tensor_ref<const T>, tensor_ref<T>, const any_mask&,  \
                                       float*, int, bool);                                                  \
  template status attend_cuda_own_stream<T>(policy::cuda_kernel, const problem&, tensor_ref<const T>,            \
                                            tensor_ref<const T>, tensor_ref<const T>, tensor_ref<T>,             \
                                            const any_mask&, float*);                                           \
  template status attend_cuda_mods<T>(policy::cuda_kernel, const problem&, tensor_ref<const T>, tensor_ref<const T>, \
                                      tensor_ref<const T>, tensor_ref<T>, const modified<any_mask>&, float*);       \
  template kernel_plan plan_cuda_mods<T>(policy::cuda_kernel, const problem&, tensor_ref<const T>,                   \
                                         tensor_ref<const T>, tensor_ref<const T>, tensor_ref<T>,                    \
                                         const modified<any_mask>&, float*);

}  // namespace fusedattn::testing::gpu
