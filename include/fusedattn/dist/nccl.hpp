/// @file nccl.hpp
/// The NCCL engine of the communicator concept (dist/comm.hpp): a grouped ncclSend/ncclRecv per exchange on a
/// communication stream of its own, ordered after the compute stream's work by an event and waited for by the
/// compute stream through another, so the transfer of the next K/V shard runs while the current one is computed.
/// It wraps an ncclComm_t the program owns (made with ncclCommInitRank or ncclCommInitAll); it never destroys it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include <cuda_runtime.h>
#include <nccl.h>

#include "../core/status.hpp"

namespace fusedattn {
namespace dist {

/// A communicator over an NCCL communicator, for device buffers; one per rank and device. Not copyable.
class nccl_comm {
 public:
  /// One exchange in flight: the event its transfers complete.
  struct request {
    cudaEvent_t done = nullptr;
  };

  /// Wraps `comm`; the current CUDA device must be the communicator's. Check ok() before use.
  explicit nccl_comm(ncclComm_t comm) : comm_(comm), init_(set_up()) {}
  nccl_comm(const nccl_comm&) = delete;
  nccl_comm& operator=(const nccl_comm&) = delete;
  ~nccl_comm() {
    if (reduce_buf_) cudaFree(reduce_buf_);
    if (host_buf_) cudaFreeHost(host_buf_);
    for (cudaEvent_t e : {ready_, done_[0], done_[1]})
      if (e) cudaEventDestroy(e);
    if (comm_stream_) cudaStreamDestroy(comm_stream_);
  }

  /// Whether construction succeeded, and why not.
  const status& ok() const { return init_; }
  int rank() const { return rank_; }
  int size() const { return size_; }
  /// The stream the transfers run on.
  cudaStream_t comm_stream() const { return comm_stream_; }

  /// After the work enqueued on `stream` so far: send `bytes` from `send` to `to` and receive into `recv` from
  /// `from`, as one NCCL group on the communication stream.
  status start_exchange(const void* send, int to, void* recv, int from, std::size_t bytes, request& r, void* stream) {
    if (!init_) return init_;
    if (status st = cuda("cudaEventRecord", cudaEventRecord(ready_, static_cast<cudaStream_t>(stream))); !st) return st;
    if (status st = cuda("cudaStreamWaitEvent", cudaStreamWaitEvent(comm_stream_, ready_, 0)); !st) return st;
    if (status st = nccl("ncclGroupStart", ncclGroupStart()); !st) return st;
    const status s1 = nccl("ncclSend", ncclSend(send, bytes, ncclUint8, to, comm_, comm_stream_));
    const status s2 = nccl("ncclRecv", ncclRecv(recv, bytes, ncclUint8, from, comm_, comm_stream_));
    if (status st = nccl("ncclGroupEnd", ncclGroupEnd()); !st) return st;
    if (!s1) return s1;
    if (!s2) return s2;
    r.done = done_[next_];
    next_ = 1 - next_;
    return cuda("cudaEventRecord", cudaEventRecord(r.done, comm_stream_));
  }

  /// The work enqueued on `stream` from now on runs after the exchange (the host does not block).
  status wait(request& r, void* stream) {
    if (r.done == nullptr) return {};
    return cuda("cudaStreamWaitEvent", cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), r.done, 0));
  }

  /// ncclAllReduce(min) through a small device buffer, staged in pinned host memory (both copies asynchronous);
  /// blocks until the result is on the host. On the communication stream: it runs after the transfers started
  /// so far and beside the compute stream's work.
  status all_reduce_min(std::int64_t* values, int count) {
    if (!init_) return init_;
    if (count > max_reduce) return status::invalid("all_reduce_min: count is " + std::to_string(count) + "; at most 8");
    const std::size_t bytes = static_cast<std::size_t>(count) * sizeof(std::int64_t);
    for (int i = 0; i < count; ++i) host_buf_[i] = values[i];
    if (status st = cuda("cudaMemcpyAsync", cudaMemcpyAsync(reduce_buf_, host_buf_, bytes, cudaMemcpyHostToDevice, comm_stream_)); !st)
      return st;
    if (status st = nccl("ncclAllReduce", ncclAllReduce(reduce_buf_, reduce_buf_, static_cast<std::size_t>(count),
                                                        ncclInt64, ncclMin, comm_, comm_stream_));
        !st)
      return st;
    if (status st = cuda("cudaMemcpyAsync", cudaMemcpyAsync(host_buf_, reduce_buf_, bytes, cudaMemcpyDeviceToHost, comm_stream_)); !st)
      return st;
    if (status st = cuda("cudaStreamSynchronize", cudaStreamSynchronize(comm_stream_)); !st) return st;
    for (int i = 0; i < count; ++i) values[i] = host_buf_[i];
    return {};
  }

 private:
  static constexpr int max_reduce = 8;

  /// Reads rank and size, creates the communication stream, its events and the all-reduce buffer.
  status set_up() {
    if (status st = nccl("ncclCommUserRank", ncclCommUserRank(comm_, &rank_)); !st) return st;
    if (status st = nccl("ncclCommCount", ncclCommCount(comm_, &size_)); !st) return st;
    // The transfers' stream has the device's highest priority: the flash kernel fills every SM, and the block
    // scheduler then gives NCCL's blocks the first SM that frees up instead of queueing them behind the grid.
    int lowest = 0, highest = 0;
    if (status st = cuda("cudaDeviceGetStreamPriorityRange", cudaDeviceGetStreamPriorityRange(&lowest, &highest)); !st)
      return st;
    if (status st = cuda("cudaStreamCreateWithPriority",
                         cudaStreamCreateWithPriority(&comm_stream_, cudaStreamNonBlocking, highest));
        !st)
      return st;
    for (cudaEvent_t* e : {&ready_, &done_[0], &done_[1]})
      if (status st = cuda("cudaEventCreateWithFlags", cudaEventCreateWithFlags(e, cudaEventDisableTiming)); !st)
        return st;
    void* buf = nullptr;
    if (status st = cuda("cudaMalloc", cudaMalloc(&buf, max_reduce * sizeof(std::int64_t))); !st) return st;
    reduce_buf_ = static_cast<std::int64_t*>(buf);
    if (status st = cuda("cudaMallocHost", cudaMallocHost(&buf, max_reduce * sizeof(std::int64_t))); !st) return st;
    host_buf_ = static_cast<std::int64_t*>(buf);
    return {};
  }

  static status nccl(const char* what, ncclResult_t r) {
    if (r == ncclSuccess) return {};
    return {errc::backend_error, std::string(what) + " failed: " + ncclGetErrorString(r)};
  }
  static status cuda(const char* what, cudaError_t e) {
    if (e == cudaSuccess) return {};
    return {errc::backend_error, std::string(what) + " failed: " + cudaGetErrorString(e)};
  }

  ncclComm_t comm_;
  int rank_ = 0;
  int size_ = 1;
  cudaStream_t comm_stream_ = nullptr;
  cudaEvent_t ready_ = nullptr;
  cudaEvent_t done_[2] = {nullptr, nullptr};
  int next_ = 0;
  std::int64_t* reduce_buf_ = nullptr;
  std::int64_t* host_buf_ = nullptr;  // pinned staging of all_reduce_min's values
  status init_;  // last: its initialiser, set_up(), writes the members above
};

}  // namespace dist
}  // namespace fusedattn
