/// @file attend_cuda.cuh
/// The CUDA side of `attend`: checks that every pointer is device memory, picks flash or the naive pipeline for
/// policy::cuda's `kernel`, and runs it on the policy's stream; block-sparse layouts come copied per call or already
/// on the device (cuda::device_block_sparse). Included by dispatch/attend.hpp when
/// FUSEDATTN_WITH_CUDA is 1; a translation unit that sees it must be compiled by nvcc (a .cu file).
#pragma once

#if !defined(__CUDACC__)
#error "fusedattn's CUDA backend must be compiled by nvcc: include fusedattn with FUSEDATTN_WITH_CUDA=1 only in .cu files (the fusedattn::cuda CMake target sets it for CUDA sources only)"
#endif

#include <string>
#include <type_traits>

#include <cuda_runtime.h>

#include "../../core/problem.hpp"
#include "../../core/status.hpp"
#include "../../core/tensor.hpp"
#include "../../dispatch/policy.hpp"
#include "../../kernels/block_sparse.hpp"
#include "../../kernels/mask.hpp"
#include "device_layout.cuh"
#include "device_types.cuh"
#include "error.cuh"
#include "flash.cuh"
#include "flash_hopper.cuh"
#include "naive.cuh"

namespace fusedattn {
namespace cuda_backend {

/// Compute capability major of the current device (0 when it cannot be read).
inline int device_major() {
  int device = 0, major = 0;
  if (cudaGetDevice(&device) != cudaSuccess || cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return major;
}

/// ok when the flash kernel applies to this call, else errc::unsupported saying why.
template <class T>
status flash_applies(const problem& p, const tensor_ref<const T>& q, const tensor_ref<const T>& k,
                     const tensor_ref<const T>& v, const tensor_ref<T>& o) {
  using E = device_t<T>;
  constexpr int min_major = 8;  // mma.sync m16n8k16 with bf16, ldmatrix, cp.async: sm_80
  if (!std::is_same_v<E, __half> && !std::is_same_v<E, __nv_bfloat16>)
    return {errc::unsupported, std::string("CUDA flash takes f16 and bf16; this call is ") + scalar_name<T>() +
                                   " (policy::cuda{.kernel = automatic} runs it on the naive pipeline)"};
  if (!with_default_tile(p.head_dim, false, [](auto) { return true; }))
    return {errc::unsupported,
            "problem.head_dim is " + std::to_string(p.head_dim) + "; CUDA flash takes " + flash_head_dims_text};
  if (!flash_aligned(q) || !flash_aligned(k) || !flash_aligned(v) || !flash_aligned(o))
    return {errc::unsupported,
            "CUDA flash needs 16-byte aligned data and row/head/batch strides that are multiples of 8 elements"};
  if (device_major() < min_major) return {errc::unsupported, "CUDA flash needs compute capability 8.0 or newer"};
  return flash_grid_fits(p);
}

/// True when the Hopper kernel's q-tile of `rows` rows fits the mask (see flash_fits_mask).
inline bool hopper_fits_mask(const band_mask&, int) { return true; }
inline bool hopper_fits_mask(const block_sparse_mask& m, int rows) { return m.block_q % rows == 0; }

/// ok when flash's q-tile fits the mask: a block-sparse q-tile must lie in one q-block row (block_q a multiple of
/// the tile's rows).
inline status flash_fits_mask(const band_mask&, index_t) { return {}; }
static_assert(hopper_default_tile<64>::type::block_m == flash_default_tile<64>::type::block_m &&
                  hopper_default_tile<128>::type::block_m == flash_default_tile<128>::type::block_m,
              "both flash kernels must cut q into the same tiles: flash_fits_mask checks one size (head_dim 256 "
              "differs: run_flash asks hopper_fits_mask)");
inline status flash_fits_mask(const block_sparse_mask& m, index_t head_dim) {
  const index_t rows =
      with_default_tile(head_dim, index_t(1), [](auto tile) { return index_t(decltype(tile)::block_m); });
  if (m.block_q % rows == 0) return {};
  return {errc::unsupported, "CUDA flash needs block_sparse's block_q to be a multiple of " + std::to_string(rows) +
                                 " (its q-tile); block_q is " + std::to_string(m.block_q)};
}

/// A copy of a block-sparse mask whose CSR arrays live in device memory: one allocation (freed with `arena`, in
/// stream order) and one copy of the packed arrays. Refused (errc::unsupported) while `stream` is being captured
/// into a CUDA graph: the graph would read the copy's source, a buffer of this call, when it runs.
inline status layout_to_device(const block_sparse_mask& host, scratch_arena& arena, cudaStream_t stream,
                               block_sparse_mask& dev) {
  bool capturing = false;
  if (status st = stream_capturing(stream, capturing); !st) return st;
  if (capturing)
    return {errc::unsupported,
            "block_sparse{layout} on policy::cuda copies the layout from host memory inside the call, which a CUDA "
            "graph cannot capture (the graph would read the copy's source when it runs, after the call has freed "
            "it); upload the layout once (cuda::upload) and pass cuda::device_block_sparse"};
  const index_t rows = host.pattern_batch * host.pattern_heads * host.n_q_blocks;
  const packed_layout pk = pack_layout(rows, host.row_offsets, host.cols, host.run_offsets, host.runs);
  unsigned char* d = nullptr;
  if (status st = arena.allocate(d, index_t(pk.bytes.size()), "block-sparse layout"); !st) return st;
  if (status st = from_cuda(cudaMemcpyAsync(d, pk.bytes.data(), pk.bytes.size(), cudaMemcpyHostToDevice, stream),
                            "cudaMemcpyAsync(block-sparse layout)");
      !st)
    return st;
  dev = rebase(host, pk, d);
  return {};
}

/// Runs the flash kernel (flash_applies must have said ok): the Hopper kernel where hopper_flash_ready says yes
/// (unless `portable`), else the mma.sync kernel.
template <class T, class Mask>
status run_flash(const problem& p, const tensor_ref<const T>& q, const tensor_ref<const T>& k,
                 const tensor_ref<const T>& v, const tensor_ref<T>& o, const Mask& mask, float* lse,
                 cudaStream_t stream, bool portable = false) {
  using E = device_t<T>;
  if constexpr (std::is_same_v<E, __half> || std::is_same_v<E, __nv_bfloat16>) {
    constexpr double log2e = 1.4426950408889634;
    flash_params_t<Mask> fp{q.data, k.data, v.data, o.data, lse, q.stride, k.stride, v.stride, o.stride,
                            int(p.batch), int(p.heads), int(p.group_size()), int(p.seq_q), int(p.seq_kv),
                            static_cast<float>(p.softmax_scale() * log2e), mask, 1, nullptr, nullptr};
    fp.head_dim = int(p.head_dim);
    const bool hopper_head_dim = p.head_dim == 64 || p.head_dim == 96 || p.head_dim == 128 || p.head_dim == 256;
    if (!portable && hopper_head_dim && hopper_flash_ready(stream)) {
      if (p.head_dim == 64) {
        int multiprocessors = 0;
        if (status st = device_multiprocessors(multiprocessors); !st) return st;
        if (hopper_takes_turns_tile(mask, p.batch, p.heads, p.seq_q, multiprocessors))
          return launch_flash_hopper<E, typename hopper_turns_tile<64>::type>(fp, stream);
      }
      if (p.head_dim == 64 && hopper_takes_whole_rows(mask, p.seq_q))
        return launch_flash_hopper<E, typename hopper_whole_row_tile<64>::type>(fp, stream);
      if (p.head_dim == 64) return launch_flash_hopper<E, typename hopper_default_tile<64>::type>(fp, stream);
      using tile128 = typename hopper_default_tile<128>::type;
      if (p.head_dim == 128) return launch_flash_hopper<E, tile128>(fp, stream);
      // head_dim 96 on the 128 tile: its tensor maps read columns 96–127 as zeros (launch_flash_hopper), so the
      // tensor cores do 4/3 of the work, and still run it faster than the portable kernel does.
      if (p.head_dim == 96 && hopper_fits_mask(mask, tile128::block_m))
        return launch_flash_hopper<E, tile128>(fp, stream);
      // head_dim 256: the Hopper tile takes 128 query rows, the portable one 64 (flash_fits_mask checks 64); a
      // block-sparse layout whose block_q is an odd multiple of 64 stays on the portable kernel.
      using tile256 = typename hopper_default_tile<256>::type;
      if (p.head_dim == 256 && hopper_fits_mask(mask, tile256::block_m))
        return launch_flash_hopper<E, tile256>(fp, stream);
    }
    return with_default_tile(p.head_dim, status{errc::unsupported, "problem.head_dim: CUDA flash has no tile for it"},
                             [&](auto tile) { return launch_flash<E, decltype(tile)>(fp, stream); });
  } else {
    return flash_applies(p, q, k, v, o);  // says why not
  }
}

/// policy::cuda's attend after validation: device-pointer checks, kernel choice, launch. Asynchronous: an error of
/// the kernels themselves shows at the next synchronisation of the stream. `mask` is a band, or a block-sparse mask
/// whose arrays are already in device memory.
template <class T, class Mask>
status attend(const policy::cuda& pol, const problem& p, const tensor_ref<const T>& q, const tensor_ref<const T>& k,
              const tensor_ref<const T>& v, const tensor_ref<T>& o, const Mask& mask, float* lse) {
  const void* ptrs[5] = {q.data, k.data, v.data, o.data, lse};
  const char* names[5] = {"q", "k", "v", "o", "lse"};
  for (int i = 0; i < 5; ++i)
    if (ptrs[i] != nullptr)
      if (status st = check_device_pointer(ptrs[i], names[i]); !st) return st;
  const auto stream = static_cast<cudaStream_t>(pol.stream);
  switch (pol.kernel) {
    case policy::cuda_kernel::naive: return naive_attention(p, q, k, v, o, mask, lse, stream);
    case policy::cuda_kernel::flash:
    case policy::cuda_kernel::flash_mma_sync:
      if (status st = flash_applies(p, q, k, v, o); !st) return st;
      if (status st = flash_fits_mask(mask, p.head_dim); !st) return st;
      return run_flash(p, q, k, v, o, mask, lse, stream, pol.kernel == policy::cuda_kernel::flash_mma_sync);
    case policy::cuda_kernel::automatic:
      if (flash_applies(p, q, k, v, o) && flash_fits_mask(mask, p.head_dim))
        return run_flash(p, q, k, v, o, mask, lse, stream);
      return naive_attention(p, q, k, v, o, mask, lse, stream);
  }
  return status::invalid("policy.kernel is not a valid fusedattn::policy::cuda_kernel value");
}

}  // namespace cuda_backend

namespace detail {
/// policy::cuda with a block-sparse mask: the layout (host arrays, as on the CPU) is copied to the device first.
template <class T>
status run(const policy::cuda& pol, const problem& p, const tensor_ref<const T>& q, const tensor_ref<const T>& k,
           const tensor_ref<const T>& v, const tensor_ref<T>& o, const block_sparse_mask& mask, float* lse) {
  const auto stream = static_cast<cudaStream_t>(pol.stream);
  cuda_backend::scratch_arena arena(stream);
  block_sparse_mask on_device;
  if (status st = cuda_backend::layout_to_device(mask, arena, stream, on_device); !st) return st;
  return cuda_backend::attend(pol, p, q, k, v, o, on_device, lse);
}
/// policy::cuda with a layout already in device memory (cuda::device_block_sparse): no copy; the layout's geometry
/// is checked against the problem first.
template <class T>
status run(const policy::cuda& pol, const problem& p, const tensor_ref<const T>& q, const tensor_ref<const T>& k,
           const tensor_ref<const T>& v, const tensor_ref<T>& o, const cuda::device_block_sparse_mask& mask,
           float* lse) {
  if (status st = cuda::check_geometry(mask.geometry, p); !st) return st;
  return cuda_backend::attend(pol, p, q, k, v, o, mask.mask, lse);
}
/// Device memory on a CPU policy is a compile-time misuse.
template <class T>
struct device_mask_on_cpu : std::false_type {};
template <class T>
status run(const policy::cpu_naive&, const problem&, const tensor_ref<const T>&, const tensor_ref<const T>&,
           const tensor_ref<const T>&, const tensor_ref<T>&, const cuda::device_block_sparse_mask&, float*) {
  static_assert(device_mask_on_cpu<T>::value,
                "cuda::device_block_sparse holds device memory: use it with policy::cuda (CPU policies take block_sparse)");
  return {};
}
template <class Arch, class T>
status run(const policy::cpu<Arch>&, const problem&, const tensor_ref<const T>&, const tensor_ref<const T>&,
           const tensor_ref<const T>&, const tensor_ref<T>&, const cuda::device_block_sparse_mask&, float*) {
  static_assert(device_mask_on_cpu<T>::value,
                "cuda::device_block_sparse holds device memory: use it with policy::cuda (CPU policies take block_sparse)");
  return {};
}
/// policy::cuda: see cuda_backend::attend.
template <class T>
status run(const policy::cuda& pol, const problem& p, const tensor_ref<const T>& q, const tensor_ref<const T>& k,
           const tensor_ref<const T>& v, const tensor_ref<T>& o, const band_mask& mask, float* lse) {
  return cuda_backend::attend(pol, p, q, k, v, o, mask, lse);
}
}  // namespace detail
}  // namespace fusedattn
