/// @file flash.hpp
/// Entry points of the CPU flash kernel: `flash_attention<Arch>` (the tile loop of tile_loop.hpp with any bound
/// mask, or the decode kernel of decode.hpp for decode-shaped calls), `flash_attention_kv` (the same over any KV
/// source) and `flash_scratch_bytes` (what the tile loop allocates). Validation is the caller's (attend) job.
#pragma once

#include <string>
#include <type_traits>

#include "../core/problem.hpp"
#include "../core/status.hpp"
#include "../core/tensor.hpp"
#include "../core/types.hpp"
#include "../cpu/simd.hpp"
#include "../cpu/tiles.hpp"
#include "decode.hpp"
#include "kv_source.hpp"
#include "tile_loop.hpp"

namespace fusedattn {
namespace kernels {

/// Bytes of scratch a CPU flash call allocates for `p`, `mask` (its q_granule shapes the q-tiles), `tiles`
/// and `threads` (clamped to the number of work items as the call does): per thread the Q tile (bq × d), the
/// S/P tile (bq × bkv), the accumulator (bq × dp), three row vectors, and a packed Kᵀ/V cache of one kv head
/// (2 × seq_kv × d, converted to the accumulation type, padded) — or, when there are fewer kv heads than threads,
/// one shared packed copy of every kv head instead of the per-thread caches; plus, for the decode split,
/// b·h·q-tiles·chunks·bq·(dp + 2) partial results. Nothing grows with seq_q × seq_kv. (This is the tile loop's
/// scratch; a decode-shaped call, see flash_attention, takes the decode kernel's much smaller per-thread rows and
/// its b·h·chunks·(d + 2) partial results instead.)
template <class T, class Arch = xsimd::default_arch, class Mask = band_mask>
index_t flash_scratch_bytes(const problem& p, const Mask& mask, tile_sizes tiles = {}, int threads = 1) {
  if constexpr (std::is_same<Arch, cpu::best>::value)
    return cpu::with_best_arch([&](auto a) { return flash_scratch_bytes<T, decltype(a)>(p, mask, tiles, threads); });
  using Acc = accum_t<T>;
  const flash_plan f = make_plan<Acc, Arch>(p, mask, tiles);
  const index_t items = p.batch * p.heads * f.q_tiles() * f.chunks;
  const index_t n_threads = std::max<index_t>(1, std::min<index_t>(threads, items));
  return scratch_bytes<Acc, Arch>(p, f, n_threads);
}

/// flash_attention (below) with K and V from a KV source (kv_source.hpp) that holds p.seq_kv keys for every
/// sequence: a strided tensor, or one sequence of a paged cache (attend_paged's tile-loop path).
template <class T, class Arch, class Mask, class KV>
status flash_attention_kv(const problem& p, const tensor_ref<const T>& q, const KV& kv, const tensor_ref<T>& o,
                          const Mask& mask, float* lse, int threads, tile_sizes tiles = {}) {
  if (threads <= 0)
    return status::invalid("policy.threads is " + std::to_string(threads) + "; it must be >= 1");
  const index_t t[3] = {tiles.q, tiles.kv, tiles.kv_split};
  const char* name[3] = {"q", "kv", "kv_split"};
  for (int i = 0; i < 3; ++i)
    if (t[i] < 0)
      return status::invalid(std::string("policy.tiles.") + name[i] + " is " + std::to_string(t[i]) +
                             "; it must be >= 0 (0 chooses by heuristic)");
  if constexpr (std::is_same<Arch, cpu::best>::value)
    return cpu::with_best_arch(
        [&](auto a) { return flash_attention_kv<T, decltype(a)>(p, q, kv, o, mask, lse, threads, tiles); });
  if (status st = cpu::arch_status<Arch>(); !st) return st;
  // fusedattn's own arch tags (cpu/arch_x86.hpp): the decode kernel runs on the compiled xsimd arch, the tile loop
  // on the kernel set the tag and the storage types select (cpu::tile_arch).
  using kv_value = std::remove_cv_t<std::remove_pointer_t<decltype(kv.k_row(0, 0, 0))>>;
  if constexpr (std::is_same<Mask, band_mask>::value)
    if (use_decode_kernel<Mask>(p, tiles))
      return decode_attention<T, cpu::xsimd_arch_t<Arch>>(p, q, kv, o, [&](index_t) { return mask; }, lse, threads);
  return flash_tile_loop<T, cpu::tile_arch_t<T, kv_value, Arch>, Mask>(p, q, kv, o, mask, lse, threads, tiles);
}

/// Flash attention on the CPU with the SIMD arch `Arch` (an xsimd arch, or scalar_arch): one online-softmax tile
/// loop over the kv tiles the bound `mask` lists, `threads` threads over (batch, head, q-tile[, key chunk]).
/// Results are bitwise identical for any thread count. Every worker thread runs with flush-to-zero and
/// denormals-are-zero (cpu/fp_env.hpp), restored on exit.
/// Preconditions: the call was validated (validate.hpp). Returns errc::invalid_argument for threads < 1 or a
/// negative tile size, errc::unsupported when this CPU cannot run `Arch`, errc::out_of_memory when the scratch
/// (flash_scratch_bytes) cannot be allocated; nothing is written on failure.
/// Decode-shaped calls (a band mask, default tiles, at most cpu::decode_max_rows query rows per kv head) run the
/// decode kernel instead (decode.hpp: K and V read in place, split across threads by key chunks).
template <class T, class Arch, class Mask>
status flash_attention(const problem& p, const tensor_ref<const T>& q, const tensor_ref<const T>& k,
                       const tensor_ref<const T>& v, const tensor_ref<T>& o, const Mask& mask, float* lse,
                       int threads, tile_sizes tiles = {}) {
  return flash_attention_kv<T, Arch>(p, q, strided_kv<T>{k, v}, o, mask, lse, threads, tiles);
}

}  // namespace kernels
}  // namespace fusedattn
