#!/usr/bin/env python3
"""Example 12: fusedattn inside PyTorch, the course's own workflow.

Two extensions are compiled at run time by torch.utils.cpp_extension.load_inline from the C++ / CUDA sources below,
both calling fa::attend on torch tensors (views built from each tensor's own strides, no copy):
  - a CPU extension (policy::cpu<>, the flash kernel, OpenMP threads = torch.get_num_threads()), f32;
  - a CUDA extension (policy::cuda on the current CUDA stream), f16: the fused tensor-core kernel.
Each is checked against F.scaled_dot_product_attention (max |difference| < 1e-3; also shown: both against a float64
reference) on the timed sizes, causal (PyTorch's is_causal: top-left), S_q != S_kv and a B·S·H·D tensor viewed with
.transpose(1, 2) (strides, no copy), then timed beside SDPA at S = 128, 512, 1024 with (B, H, D) = (1, 8, 64): the
assignment's table with its slowdown factor (fusedattn time / SDPA time; below 1: fusedattn is faster).

    python3 examples/12_torch_extension/torch_extension.py [--device cpu|cuda|all] [--seqs 128,512,1024]
            [--heads 8] [--dim 64] [--include DIR ...] [--json FILE]

Needs torch >= 2.0 (F.scaled_dot_product_attention), a C++ compiler and ninja (load_inline), nvcc for the CUDA
extension, and the headers of fusedattn (this tree's include/, found from this file), Eigen 3.4 and xsimd (searched
in <tree>/.deps/usr/include, /usr/include, /usr/local/include; --include adds folders). Where torch >= 2.0 is
missing it prints why and exits 0 (skipped); without a GPU or nvcc the CUDA part is skipped the same way.
Exit code: 1 when a check fails or an extension does not build.
"""

import argparse
import json
import math
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TREE = os.path.dirname(os.path.dirname(HERE))
TOLERANCE = 1e-3

# ---- the extensions' sources ---------------------------------------------------------------------------------

# Shared by both: a fusedattn view of a 4-D torch tensor (B, H, S, D) with the tensor's own strides, in elements.
VIEW_SOURCE = r"""
template <class T, class Scalar>
fa::tensor_ref<const T> view_of(const torch::Tensor& t) {
  return fa::strided<const T>(reinterpret_cast<const T*>(t.data_ptr<Scalar>()),
                              {t.size(0), t.size(1), t.size(2), t.size(3)},
                              {t.stride(0), t.stride(1), t.stride(2), t.stride(3)});
}

// The kernels read each row's head_dim elements contiguously; any other stride is accepted as is.
torch::Tensor rows_contiguous(const torch::Tensor& t) { return t.stride(3) == 1 ? t : t.contiguous(); }

void check_inputs(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "q, k, v must be 4-D (batch, heads, seq, head_dim)");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(), "q, k, v: one dtype");
  TORCH_CHECK(k.sizes() == v.sizes(), "k and v must have the same sizes");
}

fa::problem problem_of(const torch::Tensor& q, const torch::Tensor& k) {
  return fa::problem{q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), q.size(3)};
}
"""

CPU_SOURCE = r"""
#include <fusedattn/fusedattn.hpp>

namespace fa = fusedattn;
""" + VIEW_SOURCE + r"""
/// softmax(q·kᵀ/sqrt(d) (+ top-left causal mask))·v on the CPU, f32 or f64, with `threads` OpenMP threads.
torch::Tensor fa_attend_cpu(torch::Tensor q, torch::Tensor k, torch::Tensor v, bool causal, int64_t threads) {
  check_inputs(q, k, v);
  TORCH_CHECK(q.device().is_cpu(), "fa_attend_cpu: tensors must be on the CPU");
  q = rows_contiguous(q);
  k = rows_contiguous(k);
  v = rows_contiguous(v);
  torch::Tensor o = torch::empty(q.sizes(), q.options());  // contiguous B·H·S·D
  const fa::problem p = problem_of(q, k);
  fa::policy::cpu<> pol;
  pol.threads = static_cast<int>(threads);
  auto run = [&](auto tag, auto scalar) {
    using T = decltype(tag);
    using S = decltype(scalar);
    const auto qv = view_of<T, S>(q), kv = view_of<T, S>(k), vv = view_of<T, S>(v);
    const auto ov = fa::bhsd(reinterpret_cast<T*>(o.data_ptr<S>()), p.o_dims());
    return causal ? fa::attend(pol, p, qv, kv, vv, ov, fa::causal{fa::align::top_left})
                  : fa::attend(pol, p, qv, kv, vv, ov);
  };
  const auto type = q.scalar_type();
  TORCH_CHECK(type == torch::kFloat32 || type == torch::kFloat64, "fa_attend_cpu: float32 or float64 tensors");
  const fa::status st = type == torch::kFloat32 ? run(float{}, float{}) : run(double{}, double{});
  TORCH_CHECK(static_cast<bool>(st), "fusedattn: ", st.what());
  return o;
}
"""

CUDA_DECLARATION = r"""
torch::Tensor fa_attend_cuda(torch::Tensor q, torch::Tensor k, torch::Tensor v, bool causal);
"""

# load_inline puts torch/types.h, cuda.h and cuda_runtime.h before this; FUSEDATTN_WITH_CUDA=1 comes from the flags.
CUDA_SOURCE = r"""
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <fusedattn/fusedattn.hpp>

namespace fa = fusedattn;
""" + VIEW_SOURCE + r"""
/// softmax(q·kᵀ/sqrt(d) (+ top-left causal mask))·v on the tensors' GPU, on PyTorch's current stream there;
/// f16 and bf16 run the fused flash kernel, f32 the naive cuBLAS pipeline.
torch::Tensor fa_attend_cuda(torch::Tensor q, torch::Tensor k, torch::Tensor v, bool causal) {
  check_inputs(q, k, v);
  TORCH_CHECK(q.is_cuda() && k.device() == q.device() && v.device() == q.device(),
              "fa_attend_cuda: q, k, v on one CUDA device");
  const c10::cuda::CUDAGuard guard(q.device());
  q = rows_contiguous(q);
  k = rows_contiguous(k);
  v = rows_contiguous(v);
  torch::Tensor o = torch::empty(q.sizes(), q.options());
  const fa::problem p = problem_of(q, k);
  const fa::policy::cuda pol{at::cuda::getCurrentCUDAStream().stream()};
  auto run = [&](auto tag, auto scalar) {
    using T = decltype(tag);
    using S = decltype(scalar);
    const auto qv = view_of<T, S>(q), kv = view_of<T, S>(k), vv = view_of<T, S>(v);
    const auto ov = fa::bhsd(reinterpret_cast<T*>(o.data_ptr<S>()), p.o_dims());
    return causal ? fa::attend(pol, p, qv, kv, vv, ov, fa::causal{fa::align::top_left})
                  : fa::attend(pol, p, qv, kv, vv, ov);
  };
  // at::Half / at::BFloat16 and Eigen::half / Eigen::bfloat16 are the same 16 bits.
  const auto type = q.scalar_type();
  TORCH_CHECK(type == torch::kFloat16 || type == torch::kBFloat16 || type == torch::kFloat32,
              "fa_attend_cuda: float16, bfloat16 or float32 tensors");
  const fa::status st = type == torch::kFloat16    ? run(Eigen::half{}, at::Half{})
                        : type == torch::kBFloat16 ? run(Eigen::bfloat16{}, at::BFloat16{})
                                                   : run(float{}, float{});
  TORCH_CHECK(static_cast<bool>(st), "fusedattn: ", st.what());
  return o;
}
"""

# torch compiles CUDA sources with these defined (for its own Half type); fusedattn's kernels use CUDA's half
# operators and conversions, so they are undefined again (extra flags come after torch's own).
UNDEF_NO_HALF = ["-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__", "-U__CUDA_NO_HALF2_OPERATORS__",
                 "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "-U__CUDA_NO_BFLOAT16_OPERATORS__"]
# The flags fusedattn's CMake gives every CUDA translation unit of fusedattn::cuda.
FUSEDATTN_CUDA_FLAGS = ["-DFUSEDATTN_WITH_CUDA=1", "--expt-relaxed-constexpr", "-diag-suppress=20012,554,1675"]


# ---- helpers ----------------------------------------------------------------------------------------------------

def skip(message):
    print("example 12: skipped: " + message)
    sys.exit(0)


def include_dirs(extra):
    """fusedattn's include/, Eigen's and xsimd's folders (first found), plus --include."""
    dirs = [os.path.join(TREE, "include")] + list(extra)
    prefixes = [os.path.join(TREE, ".deps", "usr", "include"), "/usr/include", "/usr/local/include"]
    for probe, sub in (("Eigen/Core", "eigen3"), ("xsimd/xsimd.hpp", ""), ("xtl/xtl_config.hpp", "")):
        if any(os.path.exists(os.path.join(d, probe)) for d in dirs):
            continue
        for p in prefixes:
            d = os.path.join(p, sub) if sub else p
            if os.path.exists(os.path.join(d, probe)):
                dirs.append(d)
                break
        else:
            if probe != "xtl/xtl_config.hpp":  # xtl only where xsimd 8 needs it
                sys.exit("example 12: %s not found; pass --include DIR" % probe)
    return dirs


def reference(q, k, v, causal):
    """float64 softmax(q·kᵀ/sqrt(d) + top-left causal mask)·v on the CPU."""
    import torch
    q, k, v = (x.detach().to("cpu", torch.float64) for x in (q, k, v))
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        s_q, s_kv = s.shape[-2], s.shape[-1]
        s = s.masked_fill(torch.ones(s_q, s_kv, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def max_diff(a, b):
    import torch
    return float((a.to("cpu", torch.float64) - b.to("cpu", torch.float64)).abs().max())


def time_pair(ours, theirs, sync, rounds, min_time):
    """Median seconds per call of two callables: the same call count for both, timed in alternating order per round
    (so drift and launch overhead treat them alike)."""
    for f in (ours, theirs):
        f()
    sync()
    calls = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(calls):
            theirs()
        sync()
        if time.perf_counter() - t0 >= min_time or calls >= 1 << 16:
            break
        calls *= 2
    times = {0: [], 1: []}
    for r in range(rounds):
        order = (0, 1) if r % 2 == 0 else (1, 0)
        for which in order:
            f = ours if which == 0 else theirs
            t0 = time.perf_counter()
            for _ in range(calls):
                f()
            sync()
            times[which].append((time.perf_counter() - t0) / calls)
    return statistics.median(times[0]), statistics.median(times[1])


def run_device(device, attend, dtype, args, json_rows):
    """Checks, then the timing table, for one extension. Returns False when a check fails."""
    import torch
    import torch.nn.functional as F
    gen = torch.Generator(device="cpu").manual_seed(12)

    def rand(*shape):
        return (torch.rand(*shape, generator=gen) * 2 - 1).to(device=device, dtype=dtype)

    h, d = args.heads, args.dim
    cases = [("timed size", (1, h, s, s, d), False, False) for s in args.seqs]
    cases += [("causal", (1, 4, 300, 300, d), True, False),
              ("S_q < S_kv", (1, 4, 100, 333, d), False, False),
              ("S_q > S_kv, causal", (1, 4, 333, 100, d), True, False),
              ("B·S·H·D via transpose", (2, 4, 257, 257, d), False, True)]
    print("\n== %s, %s: fa::attend against F.scaled_dot_product_attention (max |difference| < %g)" % (
        device, str(dtype).replace("torch.", ""), TOLERANCE))
    print("  %-24s %-22s %6s %12s %12s %12s" % ("case", "(B,H,S_q,S_kv,D)", "causal", "vs SDPA", "ours-f64",
                                                 "SDPA-f64"))
    ok = True
    for what, (b, hh, s_q, s_kv, dd), causal, transposed in cases:
        if transposed:  # B·S·H·D storage seen as B·H·S·D: strides (S·H·D, D, H·D, 1)
            q = rand(b, s_q, hh, dd).transpose(1, 2)
            k = rand(b, s_kv, hh, dd).transpose(1, 2)
            v = rand(b, s_kv, hh, dd).transpose(1, 2)
        else:
            q, k, v = rand(b, hh, s_q, dd), rand(b, hh, s_kv, dd), rand(b, hh, s_kv, dd)
        ours = attend(q, k, v, causal)
        theirs = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        ref = reference(q, k, v, causal)
        diff, e_ours, e_theirs = max_diff(ours, theirs), max_diff(ours, ref), max_diff(theirs, ref)
        good = diff < TOLERANCE
        ok &= good
        print("  %-24s %-22s %6s %12.3g %12.3g %12.3g  %s" % (what, "(%d,%d,%d,%d,%d)" % (b, hh, s_q, s_kv, dd),
                                                               "yes" if causal else "no", diff, e_ours, e_theirs,
                                                               "PASS" if good else "FAIL"))
    if not ok:
        print("FAILED: fa::attend does not match SDPA on %s; nothing timed" % device)
        return False

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    threads = torch.get_num_threads() if device == "cpu" else 1
    print("\n  timing (B, H, S, D) = (1, %d, S, %d), dense, %s%s; median of %d alternating rounds" % (
        h, d, str(dtype).replace("torch.", ""), ", %d threads" % threads if device == "cpu" else "", args.rounds))
    print("  %6s %12s %12s %14s %14s %10s" % ("S", "SDPA ms", "fusedattn ms", "SDPA GFLOP/s", "ours GFLOP/s",
                                              "slowdown"))
    for s in args.seqs:
        q, k, v = rand(1, h, s, d), rand(1, h, s, d), rand(1, h, s, d)
        t_ours, t_sdpa = time_pair(lambda: attend(q, k, v, False),
                                   lambda: F.scaled_dot_product_attention(q, k, v), sync, args.rounds,
                                   args.min_time)
        flop = 4.0 * h * s * s * d
        print("  %6d %12.4f %12.4f %14.1f %14.1f %9.2fx" % (s, t_sdpa * 1e3, t_ours * 1e3, flop / t_sdpa / 1e9,
                                                            flop / t_ours / 1e9, t_ours / t_sdpa))
        for kernel, t in (("torch_ext_fusedattn_" + device, t_ours), ("peer_torch_sdpa_" + device, t_sdpa)):
            name = "%s/%s/dense/b1_h%d_s%d_d%d%s" % (kernel, "f32" if dtype == torch.float32 else "f16", h, s, d,
                                                     "/threads:%d" % threads if device == "cpu" else "")
            elem = torch.tensor([], dtype=dtype).element_size()
            json_rows.append({"name": name, "run_name": name, "run_type": "iteration", "iterations": 1,
                              "real_time": t * 1e6, "cpu_time": t * 1e6, "time_unit": "us", "b": 1, "h": h,
                              "h_kv": h, "s_q": s, "s_kv": s, "d": d, "threads": threads, "density": 1.0,
                              "flop": flop, "bytes": 4.0 * h * s * d * elem, "bytes_min": 4.0 * h * s * d * elem,
                              "FLOP/s": flop / t, "label": "%s dense" % ("f32" if dtype == torch.float32 else "f16")})
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda", "all"], default="all")
    ap.add_argument("--seqs", default="128,512,1024", help="timed sequence lengths (default 128,512,1024)")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7, help="timing rounds (median kept; default 7)")
    ap.add_argument("--min-time", type=float, default=0.05, help="seconds per timed loop (default 0.05)")
    ap.add_argument("--include", action="append", default=[], help="an extra include folder (Eigen, xsimd)")
    ap.add_argument("--build-dir", default=None, help="where load_inline builds (default: torch's cache folder)")
    ap.add_argument("--json", default=None, help="write the timed rows in fusedattn-bench's schema")
    ap.add_argument("--verbose", action="store_true", help="show the compiler commands")
    args = ap.parse_args()
    args.seqs = [int(s) for s in args.seqs.split(",") if s]

    try:
        import torch
    except ImportError:
        skip("PyTorch is not installed; it needs torch >= 2.0 (F.scaled_dot_product_attention): "
             "pip install torch (Debian 12's python3-torch is 1.13)")
    major = int(torch.__version__.split(".")[0])
    if major < 2:
        skip("torch %s is older than 2.0, which brought F.scaled_dot_product_attention: pip install 'torch>=2.0'"
             % torch.__version__)
    from torch.utils.cpp_extension import CUDA_HOME, load_inline

    includes = include_dirs(args.include)
    build = {}
    if args.build_dir:
        os.makedirs(args.build_dir, exist_ok=True)
    ok, rows = True, []
    print("example 12: torch %s; fusedattn headers from %s" % (torch.__version__, includes[0]))

    if args.device in ("cpu", "all"):
        if args.build_dir:
            build["build_directory"] = os.path.join(args.build_dir, "cpu")
            os.makedirs(build["build_directory"], exist_ok=True)
        t0 = time.time()
        cpu_ext = load_inline(name="fusedattn_torch_cpu", cpp_sources=[CPU_SOURCE], functions=["fa_attend_cpu"],
                              extra_include_paths=includes, extra_cflags=["-O3", "-march=native", "-fopenmp"],
                              extra_ldflags=["-fopenmp"], verbose=args.verbose, **build)
        print("CPU extension built in %.0f s" % (time.time() - t0))
        threads = torch.get_num_threads()
        ok &= run_device("cpu", lambda q, k, v, c: cpu_ext.fa_attend_cpu(q, k, v, c, threads), torch.float32, args,
                         rows)

    if args.device in ("cuda", "all"):
        if not torch.cuda.is_available():
            print("example 12: CUDA part skipped: torch.cuda.is_available() is False")
        elif CUDA_HOME is None:
            print("example 12: CUDA part skipped: no CUDA toolkit (nvcc) for load_inline")
        else:
            major_cc, minor_cc = torch.cuda.get_device_capability()
            # sm_90a carries fusedattn's Hopper (wgmma) kernel; any other card gets its own arch (mma.sync kernel).
            arch = "90a" if (major_cc, minor_cc) == (9, 0) else "%d%d" % (major_cc, minor_cc)
            if args.build_dir:
                build["build_directory"] = os.path.join(args.build_dir, "cuda")
                os.makedirs(build["build_directory"], exist_ok=True)
            t0 = time.time()
            cuda_ext = load_inline(
                name="fusedattn_torch_cuda", cpp_sources=[CUDA_DECLARATION], cuda_sources=[CUDA_SOURCE],
                functions=["fa_attend_cuda"], extra_include_paths=includes, extra_cflags=["-O3"],
                extra_cuda_cflags=["-O3", "-gencode=arch=compute_%s,code=sm_%s" % (arch, arch)] + UNDEF_NO_HALF +
                FUSEDATTN_CUDA_FLAGS,
                extra_ldflags=["-lcublas"], with_cuda=True, verbose=args.verbose, **build)
            print("CUDA extension built in %.0f s for sm_%s (%s)" % (time.time() - t0, arch,
                                                                   torch.cuda.get_device_name(0)))
            with torch.inference_mode():
                ok &= run_device("cuda", cuda_ext.fa_attend_cuda, torch.float16, args, rows)

    if args.json:
        context = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "executable": __file__,
                   "num_cpus": os.cpu_count(), "library_build_type": "release",
                   "fusedattn_peers": "torch %s%s" % (torch.__version__, (", " + torch.cuda.get_device_name(0))
                                                     if torch.cuda.is_available() else "")}
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"context": context, "benchmarks": rows}, f, indent=2)
        print("wrote %s" % args.json)
    print("PASSED" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
