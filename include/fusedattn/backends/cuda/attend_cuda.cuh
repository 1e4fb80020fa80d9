/// @file attend_cuda.cuh
/// The CUDA side of `attend`: checks that every pointer is device memory, picks the tensor-core flash kernel, the
/// CUDA-core one (flash_generic) or the naive pipeline for policy::cuda's `kernel`, and runs it on the policy's stream; block-sparse layouts come copied per call or already
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
#include "decode.cuh"
#include "device_layout.cuh"
#include "device_types.cuh"
#include "error.cuh"
#include "flash.cuh"
#include "flash_generic.cuh"
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
                                   " (policy::cuda{.kernel = automatic} runs it on cuda.flash_generic)"};
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

/// True for a call with nothing to compute (a zero batch, heads, seq_q or seq_kv: attend_empty).
inline bool empty_call(const problem& p) {
  return p.batch == 0 || p.heads == 0 || p.seq_q == 0 || p.seq_kv == 0;
}

/// Why block_sparse{layout} (host arrays) is refused on a stream being captured into a CUDA graph.
inline status layout_copy_in_capture() {
  return {errc::unsupported,
          "block_sparse{layout} on policy::cuda copies the layout from host memory inside the call, which a CUDA "
          "graph cannot capture (the graph would read the copy's source when it runs, after the call has freed "
          "it); upload the layout once (cuda::upload) and pass cuda::device_block_sparse"};
}

/// A copy of a block-sparse mask whose CSR arrays live in device memory: one allocation (freed with `arena`, in
/// stream order) and one copy of the packed arrays. Refused (errc::unsupported) while `stream` is being captured
/// into a CUDA graph: the graph would read the copy's source, a buffer of this call, when it runs.
inline status layout_to_device(const block_sparse_mask& host, scratch_arena& arena, cudaStream_t stream,
                               block_sparse_mask& dev) {
  bool capturing = false;
  if (status st = stream_capturing(stream, capturing); !st) return st;
  if (capturing) return layout_copy_in_capture();
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

/// The flash instantiation a call runs: the mma.sync kernel (its default tile for head_dim), or one of the Hopper
/// kernel's tiles. choose_flash_route picks it; run_flash launches it and plan_run (plan.cuh) describes it.
enum class flash_route {
  mma_sync,
  hopper_turns_64,
  hopper_whole_row_64,
  hopper_64,
  hopper_128,
  hopper_padded_128,  ///< head_dim 72–120 on the 128 tile (columns past head_dim read as zeros)
  hopper_192,
  hopper_padded_192,  ///< head_dim 136–184 on the 192 tile
  hopper_256,
  hopper_padded_256   ///< head_dim 200–248 on the 256 tile
};

/// The flash route of a call flash_applies accepted: a Hopper tile where hopper_flash_ready says yes (unless
/// `portable`) and the tile fits the mask, else mma_sync (head_dim 32 and below, and any call whose mask the Hopper
/// tile does not fit, on its padded tile). head_dim 64, 128, 192 and 256 take their own tiles; every other multiple
/// of 8 above 32 takes the next tile up (40–56 the warp-specialised 64 tiles, hopper_padded_128, hopper_padded_192,
/// hopper_padded_256), whose tensor maps read the columns past head_dim as zeros (launch_flash_hopper): the tensor
/// cores then do up to 64/40, 128/72, 192/136 or 256/200 of the work and still run it faster than the portable
/// kernel. A call with score modifiers at head_dim 64 takes the default Hopper tile, and below 64 the portable
/// kernel (the turns and whole-row tiles have no instantiation with modifiers). Errors only when the device cannot
/// be asked.
template <class Mask>
status choose_flash_route(const problem& p, const Mask& mask, cudaStream_t stream, bool portable, flash_route& route) {
  route = flash_route::mma_sync;
  const bool hopper_head_dim = p.head_dim > 32 && p.head_dim <= 256 && p.head_dim % 8 == 0;
  if (portable || !hopper_head_dim || !hopper_flash_ready(stream)) return {};
  if (p.head_dim == 64 && mods_of(mask).any()) {
    route = flash_route::hopper_64;
    return {};
  }
  if (p.head_dim < 64) {  // only the warp-specialised 64 tiles read Q by tensor map, which pads the columns
    if (mods_of(mask).any() || !hopper_fits_mask(mask, hopper_whole_row_tile<64>::type::block_m)) return {};
    int multiprocessors = 0;
    if (status st = device_multiprocessors(multiprocessors); !st) return st;
    route = hopper_takes_turns_tile(mask, p.batch, p.heads, p.seq_q, multiprocessors) ? flash_route::hopper_turns_64
                                                                                     : flash_route::hopper_whole_row_64;
    return {};
  }
  if (p.head_dim == 64) {
    int multiprocessors = 0;
    if (status st = device_multiprocessors(multiprocessors); !st) return st;
    route = hopper_takes_turns_tile(mask, p.batch, p.heads, p.seq_q, multiprocessors) ? flash_route::hopper_turns_64
            : hopper_takes_whole_rows(mask, p.seq_q)                                ? flash_route::hopper_whole_row_64
                                                                                     : flash_route::hopper_64;
    return {};
  }
  using tile128 = typename hopper_default_tile<128>::type;
  using tile192 = typename hopper_default_tile<192>::type;
  using tile256 = typename hopper_default_tile<256>::type;
  static_assert(tile192::block_m == tile256::block_m, "head_dims above 128 share one q-tile height (flash_fits_mask)");
  // head_dim 128 keeps the Hopper tile whatever the mask (flash_fits_mask already asked for its 128-row q-tile).
  if (p.head_dim == 128) route = flash_route::hopper_128;
  else if (p.head_dim < 128 && hopper_fits_mask(mask, tile128::block_m)) route = flash_route::hopper_padded_128;
  // Above 128 the Hopper tile takes 128 query rows, the portable one 64 (flash_fits_mask checks 64): a
  // block-sparse layout whose block_q is an odd multiple of 64 stays on the portable kernel.
  else if (p.head_dim > 128 && p.head_dim <= 192 && hopper_fits_mask(mask, tile192::block_m))
    route = p.head_dim == 192 ? flash_route::hopper_192 : flash_route::hopper_padded_192;
  else if (p.head_dim > 192 && hopper_fits_mask(mask, tile256::block_m))
    route = p.head_dim == 256 ? flash_route::hopper_256 : flash_route::hopper_padded_256;
  return {};
}

/// `f(Tile{}, hopper)` for a route's tile: `hopper` is std::true_type for a Hopper tile, std::false_type for the
/// mma.sync tile of head_dim; `otherwise` when mma.sync has no tile for head_dim.
template <class R, class F>
R with_route_tile(flash_route route, index_t head_dim, R otherwise, F&& f) {
  switch (route) {
    case flash_route::hopper_turns_64: return f(typename hopper_turns_tile<64>::type{}, std::true_type{});
    case flash_route::hopper_whole_row_64: return f(typename hopper_whole_row_tile<64>::type{}, std::true_type{});
    case flash_route::hopper_64: return f(typename hopper_default_tile<64>::type{}, std::true_type{});
    case flash_route::hopper_128:
    case flash_route::hopper_padded_128: return f(typename hopper_default_tile<128>::type{}, std::true_type{});
    case flash_route::hopper_192:
    case flash_route::hopper_padded_192: return f(typename hopper_default_tile<192>::type{}, std::true_type{});
    case flash_route::hopper_256:
    case flash_route::hopper_padded_256: return f(typename hopper_default_tile<256>::type{}, std::true_type{});
    case flash_route::mma_sync: break;
  }
  return with_default_tile(head_dim, std::move(otherwise), [&](auto tile) { return f(tile, std::false_type{}); });
}

/// Whether a mask leaves masked keys inside the key tiles flash visits: every mask but a band without limits (no
/// mask, whose only partial tiles end at seq_kv, past which the kernels read zeros).
template <class Mask>
bool has_masked_keys(const Mask& m) {
  if constexpr (mask_traits<Mask>::one_segment)
    return m.element_band().lo != -band_mask::unbounded || m.element_band().hi != band_mask::unbounded;
  else
    return true;
}

/// Runs the flash kernel (flash_applies must have said ok) on choose_flash_route's route; `Mods` picks the kernels'
/// instantiation for calls with score modifiers.
template <bool Mods, class E, class Mask>
status run_flash_route(const problem& p, flash_params_t<Mask>& fp, const Mask& mask, cudaStream_t stream,
                       bool portable) {
  flash_route route = flash_route::mma_sync;
  if (status st = choose_flash_route(p, mask, stream, portable, route); !st) return st;
  const status no_tile{errc::unsupported, "problem.head_dim: CUDA flash has no tile for it"};
  // The contract guard: where a mask leaves masked keys inside visited tiles (anything but no mask), the flash
  // kernel raises a flag (a 4-byte scratch buffer) when a block's O holds an inf or NaN, and the repair pass (flash_repair_kernel) then reads
  // O back and recomputes those q-blocks with plain_pv on tiles whose V has one: the tensor-core product cannot keep
  // a masked key's P = 0 from an inf or NaN in its V row. With the flag down it returns at once.
  const bool guarded = has_masked_keys(mask);
  struct flag_owner {  // frees the flag in stream order, after every kernel of the call
    void* ptr = nullptr;
    cudaStream_t stream;
    ~flag_owner() {
      if (ptr != nullptr) cudaFreeAsync(ptr, stream);
    }
  } flag{nullptr, stream};
  if (guarded) {
    if (status st = scratch_allocate(flag.ptr, sizeof(int), stream, "cudaMallocFromPoolAsync(repair pass flag)"); !st)
      return st;
    fp.nonfinite = static_cast<int*>(flag.ptr);
    if (status st = from_cuda(cudaMemsetAsync(fp.nonfinite, 0, sizeof(int), stream), "cudaMemsetAsync(repair flag)");
        !st)
      return st;
  }
  const status launched = with_route_tile(route, p.head_dim, no_tile, [&](auto tile, auto hopper) {
    using Tile = decltype(tile);
    if constexpr (decltype(hopper)::value) {
      constexpr bool default_tile = !(std::is_same_v<Tile, typename hopper_turns_tile<64>::type> ||
                                      std::is_same_v<Tile, typename hopper_whole_row_tile<64>::type>);
      if constexpr (Mods && !default_tile) return no_tile;
      else return launch_flash_hopper<E, Tile, Mask, Mods>(fp, stream);
    } else {
      return launch_flash<E, Tile, Mask, Mods>(fp, stream);
    }
  });
  if (!launched || !guarded) return launched;
  return with_default_tile(p.head_dim, no_tile, [&](auto portable_tile) {
    return launch_flash_repair<E, decltype(portable_tile), Mask, Mods>(fp, stream);
  });
}

/// Runs the flash kernel (flash_applies must have said ok) on choose_flash_route's route.
template <class T, class Mask>
status run_flash(const problem& p, const tensor_ref<const T>& q, const tensor_ref<const T>& k,
                 const tensor_ref<const T>& v, const tensor_ref<T>& o, const Mask& mask, float* lse,
                 cudaStream_t stream, bool portable = false, bool concurrent = false) {
  using E = device_t<T>;
  if constexpr (std::is_same_v<E, __half> || std::is_same_v<E, __nv_bfloat16>) {
    flash_params_t<Mask> fp = flash_params_of(p, q, k, v, o, mask, lse);
    fp.per_item = concurrent ? 1 : 0;
    if (mods_of(mask).any()) return run_flash_route<true, E>(p, fp, mask, stream, portable);
    return run_flash_route<false, E>(p, fp, mask, stream, portable);
  } else {
    return flash_applies(p, q, k, v, o);  // says why not
  }
}

/// ok when every non-null pointer of the call is device memory (the score modifiers' slopes and sink logits too),
/// else the status naming the first one that is not.
template <class T>
status check_device_pointers(const tensor_ref<const T>& q, const tensor_ref<const T>& k, const tensor_ref<const T>& v,
                             const tensor_ref<T>& o, const float* lse, const bound_mods& mods = {}) {
  const void* ptrs[7] = {q.data, k.data, v.data, o.data, lse, mods.alibi_slopes, mods.sink_logits};
  const char* names[7] = {"q", "k", "v", "o", "lse", "alibi.slopes", "sinks.logits"};
  for (int i = 0; i < 7; ++i)
    if (ptrs[i] != nullptr)
      if (status st = check_device_pointer(ptrs[i], names[i]); !st) return st;
  return {};
}

/// Contiguous bhsd views of a problem's Q, K, V and O at the given addresses (null: geometry only).
template <class T>
struct packed_views {
  tensor_ref<const T> q, k, v;
  tensor_ref<T> o;
  packed_views(const problem& p, T* qc, T* kc, T* vc, T* oc)
      : q(bhsd<const T>(qc, p.q_dims())), k(bhsd<const T>(kc, p.kv_dims())), v(bhsd<const T>(vc, p.kv_dims())),
        o(bhsd<T>(oc, p.o_dims())) {}
};

/// True when the tensor-core flash kernels refuse a call only for its views' alignment (a base address or a stride
/// that is not a multiple of 16 bytes) and take the same call on contiguous copies: run_flash_packed.
template <class T, class Mask>
bool flash_takes_packed(const problem& p, const tensor_ref<const T>& q, const tensor_ref<const T>& k,
                        const tensor_ref<const T>& v, const tensor_ref<T>& o, const Mask& mask) {
  if (flash_aligned(q) && flash_aligned(k) && flash_aligned(v) && flash_aligned(o)) return false;
  const packed_views<T> c(p, nullptr, nullptr, nullptr, nullptr);
  return flash_applies(p, c.q, c.k, c.v, c.o).ok() && flash_fits_mask(mask, p.head_dim).ok();
}

/// Device scratch bytes of run_flash_packed: the contiguous copies of Q, K, V and O (O(S), the inputs' size).
template <class T>
std::size_t packed_scratch_bytes(const problem& p) {
  return std::size_t(2 * p.batch * p.heads * p.seq_q + 2 * p.batch * p.heads_kv * p.seq_kv) *
         std::size_t(p.head_dim) * sizeof(T);
}

/// The tensor-core flash kernels on views they refuse for alignment only (flash_takes_packed): Q, K and V copied
/// into contiguous buffers from the scratch pool (one element-wise pass each), flash into a contiguous O, and O
/// copied out to its strides. Memory stays O(S); the copies cost one pass over the inputs and O.
template <class T, class Mask>
status run_flash_packed(const problem& p, const tensor_ref<const T>& q, const tensor_ref<const T>& k,
                        const tensor_ref<const T>& v, const tensor_ref<T>& o, const Mask& mask, float* lse,
                        cudaStream_t stream) {
  using E = device_t<T>;
  const index_t n_q = p.batch * p.heads * p.seq_q * p.head_dim, n_kv = p.batch * p.heads_kv * p.seq_kv * p.head_dim;
  scratch_arena arena(stream);
  E *qc = nullptr, *kc = nullptr, *vc = nullptr, *oc = nullptr;
  if (status st = arena.allocate(qc, n_q, "aligned copy of Q"); !st) return st;
  if (status st = arena.allocate(kc, n_kv, "aligned copy of K"); !st) return st;
  if (status st = arena.allocate(vc, n_kv, "aligned copy of V"); !st) return st;
  if (status st = arena.allocate(oc, n_q, "aligned O"); !st) return st;
  const auto device_view = [](const auto& t) {
    using X = std::remove_pointer_t<decltype(t.data)>;
    using D = std::conditional_t<std::is_const_v<X>, const E, E>;
    return tensor_ref<D>{reinterpret_cast<D*>(t.data), t.dims, t.stride};
  };
  pack_kernel<<<elementwise_grid(n_q), 256, 0, stream>>>(device_view(q), qc, n_q);
  pack_kernel<<<elementwise_grid(n_kv), 256, 0, stream>>>(device_view(k), kc, n_kv);
  pack_kernel<<<elementwise_grid(n_kv), 256, 0, stream>>>(device_view(v), vc, n_kv);
  if (status st = last_launch("pack_kernel"); !st) return st;
  const packed_views<T> c(p, reinterpret_cast<T*>(qc), reinterpret_cast<T*>(kc), reinterpret_cast<T*>(vc),
                          reinterpret_cast<T*>(oc));
  if (status st = run_flash(p, c.q, c.k, c.v, c.o, mask, lse, stream); !st) return st;
  unpack_kernel<<<elementwise_grid(n_q), 256, 0, stream>>>(static_cast<const E*>(oc), device_view(o), n_q);
  return last_launch("unpack_kernel");
}

/// The kernel family of a call: the tensor-core flash kernels (with cuda.decode for GQA decode shapes), the same on
/// aligned copies of views they refuse for alignment only (run_flash_packed), the CUDA-core flash kernel
/// (flash_generic.cuh), or the naive pipeline.
enum class cuda_path { flash, packed, generic, naive };

/// What policy::cuda's `kernel` picks for a call (the one choice attend and plan_run share), with `why` saying why
/// when it is not the tensor-core kernel (automatic's reason for flash_generic, or the kernel asked for). Not ok when
/// the call is refused (flash or flash_mma_sync where flash does not apply; flash_generic, or automatic, beyond the
/// generic kernel's extents; an invalid kernel value).
template <class T, class Mask>
status choose_kernel(const policy::cuda& pol, const problem& p, const tensor_ref<const T>& q,
                     const tensor_ref<const T>& k, const tensor_ref<const T>& v, const tensor_ref<T>& o,
                     const Mask& mask, cuda_path& path, std::string& why) {
  path = cuda_path::naive;
  why.clear();
  switch (pol.kernel) {
    case policy::cuda_kernel::naive:
      why = "policy::cuda{.kernel = naive} asks for the naive pipeline";
      return {};
    case policy::cuda_kernel::flash:
    case policy::cuda_kernel::flash_mma_sync:
      if (status st = flash_applies(p, q, k, v, o); !st) return st;
      if (status st = flash_fits_mask(mask, p.head_dim); !st) return st;
      path = cuda_path::flash;
      return {};
    case policy::cuda_kernel::flash_generic:
      if (status st = generic_applies(p); !st) return st;
      path = cuda_path::generic;
      why = "policy::cuda{.kernel = flash_generic} asks for the CUDA-core flash kernel";
      return {};
    case policy::cuda_kernel::automatic: {
      const status applies = flash_applies(p, q, k, v, o);
      const status st = applies ? flash_fits_mask(mask, p.head_dim) : applies;
      if (st) {
        path = cuda_path::flash;
        return {};
      }
      if (flash_takes_packed(p, q, k, v, o, mask)) {
        path = cuda_path::packed;
        why = std::string("policy::cuda{.kernel = automatic} runs the tensor-core flash kernels on aligned copies of "
                          "Q, K, V and O (scratch of their size): ") +
              st.what();
        return {};
      }
      if (status generic = generic_applies(p); !generic) return generic;
      path = cuda_path::generic;
      why = std::string("the tensor-core flash kernels do not take this call, so policy::cuda{.kernel = automatic} "
                        "runs the CUDA-core flash kernel: ") +
            st.what();
      return {};
    }
  }
  return status::invalid("policy.kernel is not a valid fusedattn::policy::cuda_kernel value");
}

/// O = 0 and lse = −inf on every row (a call with seq_kv = 0: no row sees a key), or lse = the head's sink logit with
/// sinks; one thread per element of O.
template <class E>
__global__ void no_key_kernel(const tensor_ref<E> o, float* lse, index_t n, const bound_mods mods) {
  const dims4 d = o.dims;
  for (index_t e = blockIdx.x * index_t(blockDim.x) + threadIdx.x; e < n; e += index_t(gridDim.x) * blockDim.x) {
    const index_t c = e % d.d, s = (e / d.d) % d.s, bh = e / (d.d * d.s);
    o.row(bh / d.h, bh % d.h, s)[c] = narrow<E>(0.f);
    if (lse != nullptr && c == 0) lse[e / d.d] = mods.sink<float>(bh % d.h);
  }
}

/// Calls with a zero extent: nothing to compute. batch, heads or seq_q = 0: no output (`done`, nothing launched);
/// seq_kv = 0: every row sees no key, O = 0 and lse = −inf, or the sink logit (one fill kernel).
template <class T>
status attend_empty(const problem& p, const tensor_ref<T>& o, float* lse, const bound_mods& mods, cudaStream_t stream,
                    bool& done) {
  done = empty_call(p);
  if (!done || p.batch == 0 || p.heads == 0 || p.seq_q == 0) return {};
  using E = device_t<T>;
  const index_t n = p.batch * p.heads * p.seq_q * p.head_dim;
  const tensor_ref<E> oe{reinterpret_cast<E*>(o.data), o.dims, o.stride};
  no_key_kernel<E><<<elementwise_grid(n), 256, 0, stream>>>(oe, lse, n, mods);
  return last_launch("no_key_kernel");
}

/// policy::cuda's attend after validation: device-pointer checks, kernel choice (choose_kernel; decode shapes on the
/// automatic kernel go to cuda.decode, decode_takes; calls the tensor-core kernels do not take to flash_generic),
/// launch.
/// Asynchronous: an error of the kernels themselves shows at the next synchronisation of the stream. `mask` is a
/// band, or a block-sparse mask whose arrays are already in device memory.
template <class T, class Mask>
status attend(const policy::cuda& pol, const problem& p, const tensor_ref<const T>& q, const tensor_ref<const T>& k,
              const tensor_ref<const T>& v, const tensor_ref<T>& o, const Mask& mask, float* lse) {
  if (status st = check_device_pointers(q, k, v, o, lse, mods_of(mask)); !st) return st;
  const auto stream = static_cast<cudaStream_t>(pol.stream);
  bool empty = false;
  cuda_path path = cuda_path::naive;
  std::string why;
  if (status st = choose_kernel(pol, p, q, k, v, o, mask, path, why); !st) return st;
  if (status st = attend_empty(p, o, lse, mods_of(mask), stream, empty); !st || empty) return st;
  if constexpr (mask_traits<Mask>::one_segment)
    if (decode_takes(pol, p, q, k, v, o, mask)) return run_decode(pol, p, q, k, v, o, mask.element_band(), lse);
  if (path == cuda_path::flash)
    return run_flash(p, q, k, v, o, mask, lse, stream, pol.kernel == policy::cuda_kernel::flash_mma_sync,
                     pol.concurrent);
  if (path == cuda_path::packed) return run_flash_packed(p, q, k, v, o, mask, lse, stream);
  if (path == cuda_path::generic) return run_flash_generic(p, q, k, v, o, mask, lse, stream);
  return naive_attention(p, q, k, v, o, mask, lse, stream);
}

}  // namespace cuda_backend

namespace detail {
/// policy::cuda with a block-sparse mask: the layout (host arrays, as on the CPU) is copied to the device first.
template <class T>
status run(const policy::cuda& pol, const problem& p, const tensor_ref<const T>& q, const tensor_ref<const T>& k,
           const tensor_ref<const T>& v, const tensor_ref<T>& o, const block_sparse_mask& mask, float* lse) {
  if (cuda_backend::empty_call(p)) return cuda_backend::attend(pol, p, q, k, v, o, mask, lse);  // reads no layout
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

#include "plan.cuh"  // fa::plan for policy::cuda, from the choices above
