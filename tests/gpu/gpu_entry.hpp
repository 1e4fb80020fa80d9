/// @file gpu_entry.hpp
/// The bridge of the GPU tests: `attend_cuda` is attend(policy::cuda{...}) compiled by nvcc in gpu_entry*.cu, callable
/// from the Catch2 files that g++ compiles; plus a device buffer and the device check. Not part of the library.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include <fusedattn/fusedattn.hpp>

namespace fusedattn::testing::gpu {

/// True when a CUDA device can run the tests; otherwise `why` says what is missing.
bool device_available(std::string& why);

/// attend(policy::cuda{nullptr, kernel}, ...) on device pointers; returns the launch status.
template <class T>
status attend_cuda(policy::cuda_kernel kernel, const problem& p, tensor_ref<const T> q, tensor_ref<const T> k,
                   tensor_ref<const T> v, tensor_ref<T> o, const any_mask& mask, float* lse);

/// The same call with block_sparse's layout uploaded first (cuda::upload) and passed as cuda::device_block_sparse
/// (no copy per call); synchronizes before the device layout is freed. With `skip_upload` the device layout stays
/// empty (attend must refuse it). Returns the first failing status (upload, launch or synchronisation).
template <class T>
status attend_cuda_uploaded(policy::cuda_kernel kernel, const problem& p, tensor_ref<const T> q, tensor_ref<const T> k,
                            tensor_ref<const T> v, tensor_ref<T> o, const block_sparse& mask, float* lse,
                            bool skip_upload = false);

/// The same call captured on a stream of its own into a CUDA graph (cudaStreamCaptureModeGlobal), then the graph
/// launched `replays` times and the stream synchronised; before each launch after the first, O (when its view has no
/// gaps) and lse are set to NaN, so that each launch must write them alone. With `uploaded` the mask must be a
/// block_sparse, whose layout is uploaded before the capture and passed as cuda::device_block_sparse. Returns
/// attend's status at capture (the capture is ended either way), else the first failing CUDA call's.
template <class T>
status attend_cuda_graph(policy::cuda_kernel kernel, const problem& p, tensor_ref<const T> q, tensor_ref<const T> k,
                         tensor_ref<const T> v, tensor_ref<T> o, const any_mask& mask, float* lse, int replays,
                         bool uploaded = false);

/// attend(policy::cuda{stream, kernel}, ...) on a non-blocking stream of its own, created, synchronised and destroyed
/// here: for calls from several host threads at once. Returns the first failing status.
template <class T>
status attend_cuda_own_stream(policy::cuda_kernel kernel, const problem& p, tensor_ref<const T> q,
                              tensor_ref<const T> k, tensor_ref<const T> v, tensor_ref<T> o, const any_mask& mask,
                              float* lse);

/// attend(policy::cuda{nullptr, kernel}, ...) with score modifiers: `mask` holds device pointers
/// for the ALiBi slopes and sink logits.
template <class T>
status attend_cuda_mods(policy::cuda_kernel kernel, const problem& p, tensor_ref<const T> q, tensor_ref<const T> k,
                        tensor_ref<const T> v, tensor_ref<T> o, const modified<any_mask>& mask, float* lse);

/// fa::plan of that call.
template <class T>
kernel_plan plan_cuda_mods(policy::cuda_kernel kernel, const problem& p, tensor_ref<const T> q, tensor_ref<const T> k,
                           tensor_ref<const T> v, tensor_ref<T> o, const modified<any_mask>& mask, float* lse);

/// fa::plan(policy::cuda{nullptr, kernel}, ...) on device pointers: the kernel attend would run, its scratch, why.
template <class T>
kernel_plan plan_cuda(policy::cuda_kernel kernel, const problem& p, tensor_ref<const T> q, tensor_ref<const T> k,
                      tensor_ref<const T> v, tensor_ref<T> o, const any_mask& mask, float* lse);

/// attend(policy::cpu_naive{1}, ..., dense{}) compiled by nvcc, i.e. with the backend, which can tell that
/// device pointers were handed to a CPU policy.
status attend_cpu_naive(const problem& p, tensor_ref<const float> q, tensor_ref<const float> k,
                        tensor_ref<const float> v, tensor_ref<float> o, float* lse);

/// The status of cuda::upload for a layout view (the device copy is dropped).
status upload_status(const block_layout_view& layout);

/// Which kernel policy::cuda_kernel::flash runs on the current device (gpu_second_unit.cu).
const char* flash_kernel_name();

/// Queues a kernel on the default stream that spins one thread for about `microseconds` (at most 2 GHz), so that
/// the calls queued after it wait on the device while the host goes on.
status spin(int microseconds);

/// cudaDeviceSynchronize (and the last error) as a status: where an asynchronous kernel fault shows.
status synchronize();

/// cuda::scratch_reserved and cuda::trim_scratch (fusedattn's scratch pool on the current device).
status scratch_reserved(std::size_t& bytes);
status trim_scratch(std::size_t keep_bytes);

/// Device memory holding a copy of a host vector; copied back on request.
template <class T>
class device_buffer {
 public:
  explicit device_buffer(const std::vector<T>& host) : n_(host.size()) {
    if (cudaMalloc(reinterpret_cast<void**>(&ptr_), bytes()) != cudaSuccess) ptr_ = nullptr;
    if (ptr_ != nullptr) cudaMemcpy(ptr_, host.data(), bytes(), cudaMemcpyHostToDevice);
  }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  ~device_buffer() { cudaFree(ptr_); }
  T* data() const { return ptr_; }
  bool ok() const { return ptr_ != nullptr; }
  void copy_to(std::vector<T>& host) const { cudaMemcpy(host.data(), ptr_, bytes(), cudaMemcpyDeviceToHost); }

 private:
  std::size_t bytes() const { return n_ * sizeof(T); }
  T* ptr_ = nullptr;
  std::size_t n_;
};

/// The same view over a device copy of its buffer.
template <class T, class U>
tensor_ref<T> on_device(const tensor_ref<U>& host_view, const void* host_base, T* device_base) {
  const auto offset = (reinterpret_cast<const char*>(host_view.data) - static_cast<const char*>(host_base)) /
                      static_cast<std::ptrdiff_t>(sizeof(T));
  return {device_base + offset, host_view.dims, host_view.stride};
}

}  // namespace fusedattn::testing::gpu
