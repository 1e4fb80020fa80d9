/// @file plan.hpp
/// `plan`: which kernel `attend` would run for a call, the scratch bytes it would allocate and, when that is not
/// the backend's fused kernel, why. It validates exactly as attend() does and launches nothing.
#pragma once

#include <algorithm>
#include <new>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>

#include "../core/plan.hpp"
#include "../core/problem.hpp"
#include "../core/status.hpp"
#include "../core/tensor.hpp"
#include "../core/validate.hpp"
#include "../cpu/simd.hpp"
#include "../kernels/block_sparse.hpp"
#include "../kernels/flash.hpp"
#include "../kernels/mask.hpp"
#include "../kernels/modifiers.hpp"
#include "../kernels/naive.hpp"
#include "policy.hpp"

#if FUSEDATTN_WITH_CUDA
#include "../backends/cuda/attend_cuda.cuh"
#endif
#if FUSEDATTN_WITH_ASCEND
#include "../backends/ascend/attend_ascend.hpp"
#endif

namespace fusedattn {

namespace detail {

/// CPU policies given device memory: detectable only where the CUDA backend is compiled in (an nvcc translation
/// unit), where cudaPointerGetAttributes tells device memory from host memory; elsewhere there is nothing to ask.
template <class T>
status check_host_memory(const tensor_ref<const T>& q, const tensor_ref<const T>& k, const tensor_ref<const T>& v,
                         const tensor_ref<T>& o, const float* lse) {
#if FUSEDATTN_WITH_CUDA
  const std::pair<const void*, const char*> operands[] = {{q.data, "q"}, {k.data, "k"}, {v.data, "v"},
                                                          {o.data, "o"}, {lse, "lse"}};
  for (const auto& [ptr, name] : operands)
    if (status st = cuda_backend::check_host_pointer(ptr, name); !st) return st;
#else
  (void)q, (void)k, (void)v, (void)o, (void)lse;
#endif
  return {};
}

/// A plan that only carries a failed status.
inline kernel_plan failed_plan(status st) {
  kernel_plan r;
  (void)(r.st = std::move(st));  // status is [[nodiscard]], its assignment too (nvcc warns)
  return r;
}

/// No query row at all (batch, heads or seq_q is 0): attend() returns ok and writes nothing.
inline bool nothing_to_compute(const problem& p) { return p.batch == 0 || p.heads == 0 || p.seq_q == 0; }

/// The plan of the CPU policies for the sizes where no attention kernel runs: nothing to compute, or seq_kv = 0
/// (O = 0, lse = −inf written directly). Returns false when a kernel runs.
inline bool plan_trivial_cpu(const problem& p, kernel_plan& r) {
  if (nothing_to_compute(p)) {
    r.kernel = "cpu.none";
    r.why = "nothing to compute: batch x heads x seq_q is 0, so nothing is written";
    return true;
  }
  if (p.seq_kv == 0) {
    r.kernel = "cpu.no_keys";
    r.why = "seq_kv is 0: every row sees no key, so O is set to 0 and lse to -inf without an attention kernel";
    return true;
  }
  return false;
}

/// The checks of policy::cpu<Arch> beyond validate(): tile sizes >= 0 and a CPU that runs `Arch`.
template <class Arch>
status check_cpu_flash_policy(const policy::cpu<Arch>& pol) {
  const index_t t[3] = {pol.tiles.q, pol.tiles.kv, pol.tiles.kv_split};
  const char* name[3] = {"q", "kv", "kv_split"};
  for (int i = 0; i < 3; ++i)
    if (t[i] < 0)
      return status::invalid(std::string("policy.tiles.") + name[i] + " is " + std::to_string(t[i]) +
                             "; it must be >= 0 (0 chooses by heuristic)");
  if (status st = cpu::arch_status<Arch>(); !st) return st;
  return {};
}

/// Plan of the CPU flash kernel. The scratch is flash_scratch_bytes (what the tile loop allocates); before it is
/// computed in int64, an upper bound of every product it forms is computed in long double, and a call whose
/// scratch would pass 2^62 bytes is refused as invalid_argument (no machine has that memory; the int64 sums would
/// overflow).
template <class Arch, class T, class Bound>
kernel_plan plan_run(const policy::cpu<Arch>& pol, const problem& p, const tensor_ref<const T>& q,
                     const tensor_ref<const T>& k, const tensor_ref<const T>& v, const tensor_ref<T>& o,
                     const Bound& mask, const float* lse) {
  if constexpr (std::is_same<Arch, cpu::best>::value)  // the arch cpu::best picks on this CPU, by its name
    return cpu::with_best_arch([&](auto a) {
      return plan_run(policy::cpu<decltype(a)>{pol.threads, pol.tiles}, p, q, k, v, o, mask, lse);
    });
  using Acc = accum_t<T>;
  if (status st = check_host_memory(q, k, v, o, lse); !st) return failed_plan(st);
  if (status st = check_cpu_flash_policy(pol); !st) return failed_plan(st);
  kernel_plan r;
  if (plan_trivial_cpu(p, r)) return r;
  r.kernel = std::string("cpu.flash<") + Arch::name() + ">";
  r.fused = true;
  try {
    const kernels::flash_plan f = kernels::make_plan<Acc, Arch>(p, mask, pol.tiles);
    using ld = long double;
    const ld items = ld(p.batch) * ld(p.heads) * ld(f.q_tiles()) * ld(f.chunks);
    const ld threads = std::max<ld>(1, std::min<ld>(pol.threads, items));
    const ld kv_head = ld(f.panels) * ld(f.d) * ld(f.cols) + ld(f.v_chunks) * ld(p.seq_kv) * ld(f.vw);
    const ld per_thread = ld(f.bq_pad) * ld(f.d + f.lds + f.dp + 3) + kv_head + 2 * ld(f.panels);
    const ld bound = ld(sizeof(Acc)) * (threads * per_thread + items * ld(f.bq_pad) * ld(f.dp + 2) +
                                        ld(p.batch) * ld(p.heads_kv) * kv_head) +
                     threads * 2 * ld(f.panels);
    if (bound >= ld(index_t(1) << 62))
      return failed_plan(status::invalid(
          "problem: seq_q " + str(p.seq_q) + ", seq_kv " + str(p.seq_kv) + " and head_dim " + str(p.head_dim) +
          " over batch x heads " + str(p.batch) + " x " + str(p.heads) + " on " + std::to_string(pol.threads) +
          " threads need more than 2^62 bytes of flash scratch"));
    r.scratch_bytes = static_cast<std::size_t>(kernels::flash_scratch_bytes<T, Arch>(p, mask, pol.tiles, pol.threads));
  } catch (const std::bad_alloc&) {
    return failed_plan({errc::out_of_memory, "flash: cannot allocate the q-tile list of " + str(p.seq_q) + " rows"});
  }
  return r;
}

/// Plan of the naive pipeline: per thread (min(threads, batch x heads) of them) the seq_q x seq_kv scores and the
/// Q, K, V, O copies of one head (kernels::naive_workspace_bytes), in checked arithmetic.
template <class T, class Bound>
kernel_plan plan_run(const policy::cpu_naive& pol, const problem& p, const tensor_ref<const T>& q,
                     const tensor_ref<const T>& k, const tensor_ref<const T>& v, const tensor_ref<T>& o,
                     const Bound& mask, const float* lse) {
  if (status st = check_host_memory(q, k, v, o, lse); !st) return failed_plan(st);
  (void)mask;  // the pipeline takes every mask and modifier: nothing in the plan depends on them
  kernel_plan r;
  if (plan_trivial_cpu(p, r)) return r;
  r.kernel = "cpu.naive";
  r.why = "policy::cpu_naive runs the three-pass pipeline, which materialises the seq_q x seq_kv scores of each "
          "(batch, head); policy::cpu<Arch> runs the fused kernel";
  const index_t threads = std::max<index_t>(1, std::min<index_t>(pol.threads, p.batch * p.heads));
  index_t bytes = kernels::naive_workspace_bytes<T>(p);
  if (bytes == INT64_MAX || !mul_ok(bytes, threads, bytes) || bytes == INT64_MAX)
    return failed_plan(status::invalid("problem: seq_q x seq_kv = " + str(p.seq_q) + " x " + str(p.seq_kv) +
                                       " scores on " + str(threads) +
                                       " threads of the naive pipeline need more than 2^63 bytes"));
  r.scratch_bytes = static_cast<std::size_t>(bytes);
  return r;
}

#if !FUSEDATTN_WITH_CUDA
// Its own inline namespace, as detail::run's: a program may mix translation units with and without the backend.
inline namespace cuda_off {
template <class T, class Bound>
kernel_plan plan_run(const policy::cuda&, const problem&, const tensor_ref<const T>&, const tensor_ref<const T>&,
                     const tensor_ref<const T>&, const tensor_ref<T>&, const Bound&, const float*) {
  return failed_plan({errc::unsupported, "fusedattn was built without CUDA support (FUSEDATTN_WITH_CUDA is off)"});
}
}  // namespace cuda_off
#endif

#if !FUSEDATTN_WITH_ASCEND
template <class T, class Bound>
kernel_plan plan_run(const policy::ascend&, const problem&, const tensor_ref<const T>&, const tensor_ref<const T>&,
                     const tensor_ref<const T>&, const tensor_ref<T>&, const Bound&, const float*) {
  return failed_plan({errc::unsupported, "fusedattn was built without Ascend support (FUSEDATTN_WITH_ASCEND is off)"});
}
#endif

}  // namespace detail

/// What `attend(pol, p, q, k, v, o, mask, lse)` would do, without doing it: the status it would return for bad
/// input (validation is the same), and otherwise the kernel it would run (`kernel_plan::kernel`, e.g.
/// "cpu.flash<avx512f>", "cpu.naive", "cuda.flash_hopper"), the scratch bytes that kernel allocates, whether it is
/// the backend's fused O(S)-memory kernel and, when not, why. Reads no tensor data, writes nothing, launches nothing.
/// @code
///   const fa::kernel_plan pl = fa::plan(fa::policy::cpu<>{}, p, q, k, v, o, fa::causal{});
///   if (pl) std::printf("%s, %zu bytes of scratch%s%s\n", pl.kernel.c_str(), pl.scratch_bytes,
///                       pl.fused ? "" : ": ", pl.why.c_str());
/// @endcode
template <class Policy, class T, class Mask = dense>
kernel_plan plan(const Policy& pol, const problem& p, tensor_ref<const detail::identity_t<T>> q,
                 tensor_ref<const detail::identity_t<T>> k, tensor_ref<const detail::identity_t<T>> v, tensor_ref<T> o,
                 const Mask& mask = {}, const float* lse = nullptr) {
  if constexpr (detail::is_runtime_mask_v<Mask>) {
    return detail::visit_mask(mask, [&](const auto& m) { return plan(pol, p, q, k, v, o, m, lse); });
  } else {
    if (status st = validate_policy(pol); !st) return detail::failed_plan(st);
    if (status st = validate(p, q, k, v, o, mask, lse); !st) return detail::failed_plan(st);
    return detail::plan_run(pol, p, q, k, v, o, bind(mask, p), lse);
  }
}

}  // namespace fusedattn
