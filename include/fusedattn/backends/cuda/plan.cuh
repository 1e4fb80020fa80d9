/// @file plan.cuh
/// `fa::plan` for policy::cuda: which kernel attend() would run, its device scratch bytes, and why when it is not the
/// fused kernel, from the very choices attend_cuda.cuh makes (choose_kernel, choose_flash_route, flash_split_count).
/// Launches no attention kernel. Included by attend_cuda.cuh.
#pragma once

#include <cstddef>
#include <string>
#include <type_traits>
#include <utility>

#include "../../core/plan.hpp"
#include "attend_cuda.cuh"

namespace fusedattn {
namespace cuda_backend {

/// A plan that carries only the status attend() would return.
inline kernel_plan refused_plan(status st) { return kernel_plan{std::move(st), {}, 0, false, {}}; }

/// The plan of a call whose mask is a band or a block-sparse mask with device arrays; `layout_bytes` is the device
/// copy of a host layout the call makes first (0 for the others).
template <class T, class Mask>
kernel_plan plan_cuda(const policy::cuda& pol, const problem& p, const tensor_ref<const T>& q,
                      const tensor_ref<const T>& k, const tensor_ref<const T>& v, const tensor_ref<T>& o,
                      const Mask& mask, const float* lse, std::size_t layout_bytes) {
  kernel_plan plan;
  cuda_path path = cuda_path::naive;
  std::string why;
  if (status st = check_device_pointers(q, k, v, o, lse, mods_of(mask)); !st) return refused_plan(st);
  if (status st = choose_kernel(pol, p, q, k, v, o, mask, path, why); !st) return refused_plan(st);
  if (p.batch == 0 || p.heads == 0 || p.seq_q == 0) {
    plan.kernel = "cuda.none";
    plan.why = "nothing to compute: batch x heads x seq_q is 0, so nothing is launched";
    return plan;
  }
  if (p.seq_kv == 0) {
    plan.kernel = "cuda.no_keys";
    plan.why = "seq_kv is 0: every row sees no key, so one fill kernel sets O to 0 and lse to -inf";
    return plan;
  }
  if (decode_takes(pol, p, q, k, v, o, mask)) {
    int splits = 1;
    if (status st = decode_plan_splits<T>(p, p.seq_kv, splits); !st) return refused_plan(st);
    plan.kernel = "cuda.decode";
    plan.scratch_bytes = decode_scratch_bytes(splits, p);
    plan.fused = true;
    return plan;
  }
  if (path == cuda_path::generic) {
    std::size_t parts = 0;
    if (status st = generic_scratch_bytes<T>(p, mask, parts); !st) return refused_plan(st);
    plan.kernel = "cuda.flash_generic";
    plan.scratch_bytes = layout_bytes + parts;
    plan.fused = true;
    plan.why = why;
    return plan;
  }
  if (path == cuda_path::naive) {
    const std::size_t naive = naive_scratch_bytes<T>(p);
    plan.kernel = "cuda.naive";
    plan.scratch_bytes = naive == SIZE_MAX ? SIZE_MAX : naive + layout_bytes;
    plan.why = why;
    return plan;
  }
  const auto stream = static_cast<cudaStream_t>(pol.stream);
  flash_route route = flash_route::mma_sync;
  int multiprocessors = 0;
  if (status st = choose_flash_route(p, mask, stream, pol.kernel == policy::cuda_kernel::flash_mma_sync, route); !st)
    return refused_plan(st);
  if (status st = device_multiprocessors(multiprocessors); !st) return refused_plan(st);
  const index_t rows = p.batch * p.heads * p.seq_q;
  const status described = with_route_tile(
      route, p.head_dim, status{errc::unsupported, "problem.head_dim: CUDA flash has no tile for it"},
      [&](auto tile, auto hopper) {
        using Tile = decltype(tile);
        const int splits = flash_split_count<Mask>(p.batch, p.heads, p.seq_q, p.seq_kv, Tile::block_m, Tile::block_n,
                                                   multiprocessors);
        plan.kernel = splits > 1 ? "cuda.flash_split_kv" : decltype(hopper)::value ? "cuda.flash_hopper" : "cuda.flash_mma_sync";
        plan.scratch_bytes = layout_bytes + flash_split_scratch_bytes(splits, rows, Tile::head_dim) +
                             (has_masked_keys(mask) ? sizeof(int) : 0);  // the repair pass's flag
        return status{};
      });
  if (!described) return refused_plan(described);
  plan.fused = true;
  if (path == cuda_path::packed) {  // the same kernels on aligned copies of Q, K, V and O
    plan.scratch_bytes += packed_scratch_bytes<T>(p);
    plan.why = why;
  }
  return plan;
}

}  // namespace cuda_backend

namespace detail {

/// fa::plan for policy::cuda (dispatch/plan.hpp calls it after validating the call as attend does): the kernel
/// attend() would run — "cuda.decode" (decode_takes: GQA decode shapes), "cuda.flash_hopper", "cuda.flash_mma_sync", "cuda.flash_split_kv" (either flash kernel with
/// the keys split over blocks and the parts merged), "cuda.flash_generic" (the CUDA-core kernel: fused, with `why`
/// the tensor-core kernels do not take the call, or that it was asked for; its split-KV parts as scratch),
/// "cuda.naive"; "cuda.none" (a zero batch, heads or seq_q: nothing
/// runs) or "cuda.no_keys" (seq_kv = 0: O = 0, lse = −inf) — its device scratch bytes (split-KV parts; the naive
/// pipeline's packed copies, S and P; a host block-sparse layout's device copy; the aligned copies of views the
/// tensor-core kernels refuse for alignment only), and `why` for the naive pipeline, flash_generic and the aligned
/// copies.
/// `mask` is the bound mask attend's dispatch passes on: band_mask, block_sparse_mask (host arrays) or
/// cuda::device_block_sparse_mask. Either flash kernel with a mask includes its repair pass (flash_repair_kernel:
/// returns at once unless the flash kernel raised its flag, 4 bytes of scratch). Not modelled: the Hopper kernel's fallback to mma.sync when the driver refuses a
/// tensor map (flash_applies' strides make that a driver fault). The first call on a device asks it once whether
/// the Hopper kernel's code is present (hopper_flash_ready's one-thread probe), as attend does.
template <class T, class Bound>
kernel_plan plan_run(const policy::cuda& pol, const problem& p, const tensor_ref<const T>& q,
                     const tensor_ref<const T>& k, const tensor_ref<const T>& v, const tensor_ref<T>& o,
                     const Bound& mask, const float* lse) {
  if constexpr (std::is_same_v<Bound, cuda::device_block_sparse_mask>) {
    if (status st = cuda::check_geometry(mask.geometry, p); !st) return cuda_backend::refused_plan(st);
    return cuda_backend::plan_cuda(pol, p, q, k, v, o, mask.mask, lse, 0);
  } else if constexpr (std::is_same_v<Bound, block_sparse_mask>) {
    // detail::run copies the layout to the device first, which a stream capture refuses (layout_to_device).
    const auto stream = static_cast<cudaStream_t>(pol.stream);
    bool capturing = false;
    if (status st = cuda_backend::stream_capturing(stream, capturing); !st) return cuda_backend::refused_plan(st);
    if (capturing) return cuda_backend::refused_plan(cuda_backend::layout_copy_in_capture());
    std::size_t layout_bytes = 0;
    if (!cuda_backend::empty_call(p)) {
      const index_t rows = mask.pattern_batch * mask.pattern_heads * mask.n_q_blocks;
      layout_bytes = cuda_backend::pack_layout(rows, mask.row_offsets, mask.cols, mask.run_offsets, mask.runs).bytes.size();
    }
    return cuda_backend::plan_cuda(pol, p, q, k, v, o, mask, lse, layout_bytes);
  } else {
    return cuda_backend::plan_cuda(pol, p, q, k, v, o, mask, lse, 0);
  }
}

}  // namespace detail
}  // namespace fusedattn
