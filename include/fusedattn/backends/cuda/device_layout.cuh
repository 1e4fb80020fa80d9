/// @file device_layout.cuh
/// Block-sparse layouts resident in device memory: `cuda::device_block_layout` (owns one device allocation, freed
/// by its destructor), `cuda::upload` (validate + copy once), and the mask `cuda::device_block_sparse` that
/// attend(policy::cuda{...}, ...) takes in place of block_sparse{layout} to skip the per-call copy. Not the kernel.
#pragma once

#include <cstddef>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include <cuda_runtime.h>

#include "../../core/problem.hpp"
#include "../../core/status.hpp"
#include "../../kernels/block_layout.hpp"
#include "../../kernels/block_sparse.hpp"
#include "error.cuh"

namespace fusedattn {
namespace cuda_backend {

/// A layout's CSR arrays packed into one byte buffer (index_t arrays first, so every array stays aligned), and
/// where each array starts in it; `run_offsets` and `runs` are absent when the layout has no run arrays.
struct packed_layout {
  std::vector<unsigned char> bytes;
  std::size_t row_offsets = 0, run_offsets = 0, cols = 0, runs = 0;
  bool has_runs = false;
};

/// Packs `rows + 1` row offsets, their `cols`, and (when `run_offsets` is not null) the runs.
inline packed_layout pack_layout(index_t rows, const index_t* row_offsets, const block_index* cols,
                                 const index_t* run_offsets, const block_index* runs) {
  packed_layout pk;
  const std::size_t n_offsets = std::size_t(rows + 1), n_cols = std::size_t(row_offsets[rows]);
  pk.has_runs = run_offsets != nullptr;
  const std::size_t n_runs = pk.has_runs ? 2 * std::size_t(run_offsets[rows]) : 0;
  pk.row_offsets = 0;
  pk.run_offsets = n_offsets * sizeof(index_t);
  pk.cols = pk.run_offsets + (pk.has_runs ? n_offsets * sizeof(index_t) : 0);
  pk.runs = pk.cols + n_cols * sizeof(block_index);
  pk.bytes.resize(pk.runs + n_runs * sizeof(block_index) + 1);  // + 1: never a zero-byte allocation
  std::memcpy(pk.bytes.data() + pk.row_offsets, row_offsets, n_offsets * sizeof(index_t));
  if (n_cols > 0) std::memcpy(pk.bytes.data() + pk.cols, cols, n_cols * sizeof(block_index));
  if (pk.has_runs) {
    std::memcpy(pk.bytes.data() + pk.run_offsets, run_offsets, n_offsets * sizeof(index_t));
    if (n_runs > 0) std::memcpy(pk.bytes.data() + pk.runs, runs, n_runs * sizeof(block_index));
  }
  return pk;
}

/// The bound mask `host` with its arrays pointing into `base`, a device copy of `pk.bytes`.
inline block_sparse_mask rebase(const block_sparse_mask& host, const packed_layout& pk, void* base) {
  unsigned char* d = static_cast<unsigned char*>(base);
  block_sparse_mask dev = host;
  dev.row_offsets = reinterpret_cast<const index_t*>(d + pk.row_offsets);
  dev.cols = reinterpret_cast<const block_index*>(d + pk.cols);
  dev.run_offsets = pk.has_runs ? reinterpret_cast<const index_t*>(d + pk.run_offsets) : nullptr;
  dev.runs = pk.has_runs ? reinterpret_cast<const block_index*>(d + pk.runs) : nullptr;
  return dev;
}

}  // namespace cuda_backend

namespace cuda {

class device_block_layout;
inline status upload(const block_layout_view& host, device_block_layout& out, cudaStream_t stream = nullptr);

/// A block-sparse layout copied once into device memory (one allocation), for attend calls that reuse it:
/// `upload(layout, dev)` validates and copies; `device_block_sparse{dev, within}` is the mask. Move-only; the
/// destructor frees the memory, so keep it alive (and unmoved-from) until the calls that use it have finished.
class device_block_layout {
 public:
  device_block_layout() = default;
  device_block_layout(const device_block_layout&) = delete;
  device_block_layout& operator=(const device_block_layout&) = delete;
  device_block_layout(device_block_layout&& other) noexcept { swap(other); }
  device_block_layout& operator=(device_block_layout&& other) noexcept {
    if (this != &other) {
      reset();
      swap(other);
    }
    return *this;
  }
  ~device_block_layout() { reset(); }

  /// True until a successful upload.
  bool empty() const { return storage_ == nullptr; }
  /// The shape the layout was built for.
  const block_geometry& geometry() const { return geometry_; }
  /// The layout bound like block_sparse's (every pattern), arrays in device memory: for kernels, not host code.
  const block_sparse_mask& device_mask() const { return mask_; }
  /// Frees the device memory (the caller makes sure no call still uses it).
  void reset() {
    if (storage_ != nullptr) cudaFree(storage_);
    storage_ = nullptr;
    geometry_ = {};
    mask_ = {};
  }

 private:
  friend status upload(const block_layout_view& host, device_block_layout& out, cudaStream_t stream);
  void swap(device_block_layout& other) noexcept {
    std::swap(storage_, other.storage_);
    std::swap(geometry_, other.geometry_);
    std::swap(mask_, other.mask_);
  }
  void* storage_ = nullptr;
  block_geometry geometry_{};
  block_sparse_mask mask_{};
};

/// Validates `host` (as attend validates a block_sparse layout) and copies it into device memory owned by `out`,
/// on `stream`, waiting for the copy; `host` may be freed afterwards. On failure `out` is left as it was.
/// @return ok; errc::invalid_argument naming the bad layout field; errc::out_of_memory when the driver reports
///         cudaErrorMemoryAllocation, errc::backend_error for any other CUDA failure; both carry the driver's text.
inline status upload(const block_layout_view& host, device_block_layout& out, cudaStream_t stream) {
  if (status st = detail::check_layout(host); !st) return st;
  const block_geometry& g = host.geometry;
  const cuda_backend::packed_layout pk =
      cuda_backend::pack_layout(g.rows(), host.row_offsets, host.cols, host.run_offsets, host.runs);
  device_block_layout fresh;
  const cudaError_t e = cudaMalloc(&fresh.storage_, pk.bytes.size());
  if (e != cudaSuccess) {
    cudaGetLastError();
    fresh.storage_ = nullptr;
    // out_of_memory only when the driver says so (cudaErrorMemoryAllocation); any other failure is its own error.
    const status st = cuda_backend::from_cuda(e, "cudaMalloc");
    return {st.code(), "cuda::upload: cannot allocate " + std::to_string(pk.bytes.size()) +
                           " bytes for the block-sparse layout: " + st.what()};
  }
  if (status st = cuda_backend::from_cuda(
          cudaMemcpyAsync(fresh.storage_, pk.bytes.data(), pk.bytes.size(), cudaMemcpyHostToDevice, stream),
          "cudaMemcpyAsync(block-sparse layout)");
      !st)
    return st;
  if (status st = cuda_backend::from_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize(upload)"); !st)
    return st;
  fresh.geometry_ = g;
  // Bound like bind(block_sparse) does for the shape; `band` (the element rule) is set per call.
  fresh.mask_ = cuda_backend::rebase(detail::bind_geometry(g), pk, fresh.storage_);
  out = std::move(fresh);
  return {};
}
/// upload() of an owning layout.
inline status upload(const block_layout& host, device_block_layout& out, cudaStream_t stream = nullptr) {
  return upload(host.view(), out, stream);
}

/// Block-sparse attention on a layout already in device memory: the same rule as block_sparse{layout, within}
/// (query i sees key j iff block (i / block_q, j / block_kv) is listed and `within` allows (i, j)), with no copy
/// per call. policy::cuda only. A view: `layout` must outlive every call that uses this mask.
struct device_block_sparse {
  const device_block_layout* layout = nullptr;
  block_sparse::element_rule within = dense{};

  device_block_sparse() = default;
  device_block_sparse(const device_block_layout& l, block_sparse::element_rule w = dense{}) : layout(&l), within(w) {}
  /// A temporary layout would be freed before the call runs: keep it in a variable.
  device_block_sparse(const device_block_layout&&, block_sparse::element_rule = dense{}) = delete;
};

/// device_block_sparse bound to a problem: the device-resident mask and the geometry to check against the problem.
struct device_block_sparse_mask {
  block_sparse_mask mask;
  block_geometry geometry;
};
/// Its score modifiers (kernels/modifiers.hpp binds them here).
inline bound_mods& mods_ref(device_block_sparse_mask& m) { return m.mask.band.mods; }
inline const bound_mods& mods_of(const device_block_sparse_mask& m) { return m.mask.band.mods; }

/// The problem-independent checks of a device_block_sparse (attend's validation finds this by argument lookup):
/// an uploaded layout and a valid element rule. The geometry is checked against the problem before the launch.
inline status check_mask(const device_block_sparse& m) {
  if (m.layout == nullptr || m.layout->empty())
    return status::invalid("device_block_sparse.layout is empty; cuda::upload a block_layout into it first");
  return detail::check_element_rule(m.within, "device_block_sparse.");
}

/// Binds a device_block_sparse to a problem (attend finds this by argument lookup). Preconditions: check_mask ok.
inline device_block_sparse_mask bind(const device_block_sparse& m, const problem& p) {
  device_block_sparse_mask r{m.layout->device_mask(), m.layout->geometry()};
  r.mask.seq_q = p.seq_q;
  r.mask.seq_kv = p.seq_kv;
  r.mask.band = std::visit([&](const auto& w) { return fusedattn::bind(w, p); }, m.within);
  return r;
}

inline const char* mask_name(const device_block_sparse&) { return "cuda::device_block_sparse"; }

/// The layout was built for this problem (as attend checks a block_sparse layout): errc::invalid_argument naming
/// the field otherwise.
inline status check_geometry(const block_geometry& g, const problem& p) {
  return detail::check_geometry(g, p, "device_block_sparse.");
}

}  // namespace cuda
}  // namespace fusedattn
