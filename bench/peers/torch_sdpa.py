#!/usr/bin/env python3
"""Times PyTorch's scaled_dot_product_attention on fusedattn-bench's shapes and writes the rows in the bench's JSON
schema (Google Benchmark's format with the same counters), so bench/compare.py and bench/plot.py read them.

    python3 bench/peers/torch_sdpa.py [--device cpu|cuda|all] [--full] [--min-time SECONDS] [--filter REGEX] [--out FILE]

Rows (names start with the kernel, the label is "dtype mask", counters b h h_kv s_q s_kv d threads density flop
bytes bytes_min FLOP/s B/s, plus max_err):
  peer_torch_sdpa_cpu/f32/dense/b1_h8_s512_d64/threads:T   CPU SDPA with torch.set_num_threads(T)
  peer_torch_flash/f16/...    CUDA, SDPBackend.FLASH_ATTENTION        peer_torch_cudnn/...  SDPBackend.CUDNN_ATTENTION
  peer_torch_efficient/...    CUDA, SDPBackend.EFFICIENT_ATTENTION    peer_torch_math/...   SDPBackend.MATH (--full)
  peer_torch_flex/...         CUDA, torch.compile(flex_attention), causal through a block mask
The shapes are those of fusedattn-bench: the leaderboard (B, H, S, D) and the assignment's S = 128, 512, 1024 with
8 heads and D = 64, and the rows mirror the bench's quick set (CPU: f32 with 1 and all threads, f16 with all
threads, the assignment shapes f32 dense and causal with 1 thread; CUDA: f16) or, with --full, every combination
(CUDA adds f32). Causal is PyTorch's is_causal (top-left), like the bench's `causal`.

Every row is checked before it is timed: its output for batch 0, head 0 against a float64 softmax(QKᵀ·scale)·V on
the CPU; a row whose error exceeds the tolerance of its type is written as an error row (error_occurred, the
message), never timed. A backend that refuses a shape (e.g. flash with f32) is skipped with a note on stderr.
Times are wall-clock per call (after torch.cuda.synchronize on the GPU), the median of --repetitions runs of a
call count calibrated to --min-time. `bytes` is the compulsory traffic (Q, K, V, O once): the modelled traffic of a
kernel outside this repository is not known.
"""

import argparse
import datetime
import json
import math
import os
import platform
import re
import socket
import statistics
import sys
import time

import torch
import torch.nn.functional as F

LEADERBOARD = [(1, 1, 128, 64), (1, 1, 512, 64), (1, 1, 1024, 64), (1, 1, 2048, 64), (1, 1, 4096, 64),
               (1, 8, 512, 64), (1, 12, 512, 64), (1, 32, 512, 64), (1, 32, 1024, 128), (1, 32, 2048, 128)]
ASSIGNMENT = [(1, 8, 128, 64), (1, 8, 512, 64), (1, 8, 1024, 64)]
DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
# Largest |error| against the float64 reference accepted per storage type (inputs uniform in [-1, 1)).
TOLERANCE = {"f32": 1e-3, "f16": 1e-2, "bf16": 5e-2}
FLOPS_PER_SCORE_ELEMENT = 4.0


def row_set(full, max_threads, types):
    """(shape, dtype, mask, threads) in fusedattn-bench's order. Quick: the leaderboard dense, in types[0] with 1 and
    all threads and in the other types with all threads, then the assignment shapes in types[0], dense and causal,
    1 thread. Full: every shape x type x {dense, causal} x {1, all threads}."""
    both = sorted({1, max_threads})
    rows = []
    for sh in LEADERBOARD:
        if full:
            rows += [(sh, t, m, th) for t in types for m in ("dense", "causal") for th in both]
        else:
            rows += [(sh, types[0], "dense", th) for th in both]
            rows += [(sh, t, "dense", max_threads) for t in types[1:]]
    for sh in ASSIGNMENT:
        for t in (types if full else types[:1]):
            rows += [(sh, t, m, th) for m in ("dense", "causal") for th in (both if full else [1])]
    unique = []  # (1, 8, 512, 64) is both a leaderboard and an assignment shape
    for r in rows:
        if r not in unique:
            unique.append(r)
    return unique


def shape_name(b, h, s, d):
    return "b%d_h%d_s%d_d%d" % (b, h, s, d)


def allowed_fraction(mask, s_q, s_kv):
    """Fraction of score entries a top-left causal (or dense) mask allows."""
    if mask == "dense":
        return 1.0
    allowed = sum(min(i + 1, s_kv) for i in range(s_q))
    return allowed / float(s_q * s_kv)


def reference_head(q, k, v, causal):
    """float64 softmax(q·kᵀ/√d + mask)·v of batch 0, head 0, on the CPU."""
    q0, k0, v0 = (x[0, 0].detach().to("cpu", torch.float64) for x in (q, k, v))
    s = q0 @ k0.T / math.sqrt(q0.shape[-1])
    if causal:
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, dim=-1) @ v0


def time_call(fn, sync, min_time, repetitions):
    """Median seconds per call over `repetitions` runs of a call count that lasts about min_time."""
    fn()
    sync()
    calls = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        elapsed = time.perf_counter() - t0
        if elapsed >= min_time or calls >= 1 << 20:
            break
        calls = max(calls * 2, int(calls * min_time / max(elapsed, 1e-9) * 1.2))
    per_call = [elapsed / calls]
    for _ in range(repetitions - 1):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        per_call.append((time.perf_counter() - t0) / calls)
    return statistics.median(per_call), calls


def make_row(name, index, shape, dtype, mask, threads, density, seconds, calls, max_err, elem_bytes):
    b, h, s, d = shape
    flop = FLOPS_PER_SCORE_ELEMENT * b * h * s * s * d * density
    bytes_min = elem_bytes * (4.0 * b * h * s * d)
    row = {"name": name, "family_index": index, "per_family_instance_index": 0, "run_name": name,
           "run_type": "iteration", "repetitions": 1, "repetition_index": 0, "threads": threads,
           "iterations": calls, "real_time": seconds * 1e6, "cpu_time": seconds * 1e6, "time_unit": "us",
           "b": b, "h": h, "h_kv": h, "s_q": s, "s_kv": s, "d": d, "density": density, "flop": flop,
           "bytes": bytes_min, "bytes_min": bytes_min, "FLOP/s": flop / seconds, "B/s": bytes_min / seconds,
           "max_err": max_err, "label": "%s %s" % (dtype, mask)}
    return row


def error_row(name, index, shape, dtype, mask, threads, message):
    b, h, s, d = shape
    return {"name": name, "family_index": index, "per_family_instance_index": 0, "run_name": name,
            "run_type": "iteration", "repetitions": 1, "repetition_index": 0, "threads": threads,
            "iterations": 0, "real_time": 0, "cpu_time": 0, "time_unit": "us", "error_occurred": True,
            "error_message": message, "b": b, "h": h, "h_kv": h, "s_q": s, "s_kv": s, "d": d,
            "label": "%s %s" % (dtype, mask)}


def inputs(shape, dtype, device, seed):
    b, h, s, d = shape
    g = torch.Generator(device="cpu").manual_seed(seed)
    make = lambda: (torch.rand(b, h, s, d, generator=g) * 2 - 1).to(device=device, dtype=DTYPES[dtype])  # noqa: E731
    return make(), make(), make()


def run_one(kernel, attend, shape, dtype, mask, threads, device, args, index, density):
    """Checks and times one row; returns its JSON dict (or an error row), or None when the backend refuses."""
    b, h, s, d = shape
    name = "%s/%s/%s/%s" % (kernel, dtype, mask, shape_name(b, h, s, d))
    if device == "cpu":
        name += "/threads:%d" % threads
    q, k, v = inputs(shape, dtype, device, seed=1)
    causal = mask == "causal"
    try:
        out = attend(q, k, v, causal)
    except Exception as e:  # noqa: BLE001  the backend does not take this dtype / shape / GPU, or cannot compile
        print("torch_sdpa: %s skipped: %s" % (name, str(e).splitlines()[0]), file=sys.stderr)
        return None
    err = float((out[0, 0].to("cpu", torch.float64) - reference_head(q, k, v, causal)).abs().max())
    if not err <= TOLERANCE[dtype]:
        return error_row(name, index, shape, dtype, mask, threads,
                         "max error %.3g against float64 exceeds %.3g" % (err, TOLERANCE[dtype]))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    seconds, calls = time_call(lambda: attend(q, k, v, causal), sync, args.min_time, args.repetitions)
    print("torch_sdpa: %-60s %12.1f us  max_err %.2g" % (name, seconds * 1e6, err), file=sys.stderr)
    return make_row(name, index, shape, dtype, mask, threads, density, seconds, calls, err,
                    torch.tensor([], dtype=DTYPES[dtype]).element_size())


def sdpa_with(backend):
    """attend(q, k, v, causal) restricted to one SDPA backend (torch >= 2.3: torch.nn.attention.sdpa_kernel)."""
    from torch.nn.attention import sdpa_kernel

    def attend(q, k, v, causal):
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return attend


def flex_attend():
    """attend(q, k, v, causal) through torch.compile(flex_attention) (torch >= 2.5); causal as a block mask."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    compiled = torch.compile(flex_attention)
    masks = {}

    def attend(q, k, v, causal):
        block_mask = None
        if causal:
            key = (q.shape[-2], k.shape[-2])
            if key not in masks:
                masks[key] = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, B=None, H=None,
                                               Q_LEN=key[0], KV_LEN=key[1], device=q.device)
            block_mask = masks[key]
        return compiled(q, k, v, block_mask=block_mask)
    return attend


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda", "all"], default="all",
                    help="cpu, cuda, or all (default: the CPU, and CUDA when a GPU is present)")
    ap.add_argument("--full", action="store_true", help="every combination, like fusedattn-bench --full")
    ap.add_argument("--min-time", type=float, default=0.2, help="seconds per timed run (default 0.2)")
    ap.add_argument("--repetitions", type=int, default=3, help="timed runs per row; the median is kept (default 3)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="'all threads' on the CPU")
    ap.add_argument("--out", default="torch_sdpa.json", help="output JSON file (default torch_sdpa.json)")
    ap.add_argument("--filter", default="", help="regular expression: only rows whose name it matches (re.search)")
    args = ap.parse_args()

    benchmarks, index = [], 0
    context = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "host_name": socket.gethostname(), "executable": "bench/peers/torch_sdpa.py",
               "num_cpus": os.cpu_count(), "library_build_type": "release",
               "fusedattn_peers": "torch %s, %s%s" % (
                   torch.__version__, platform.processor() or platform.machine(),
                   (", " + torch.cuda.get_device_name(0)) if torch.cuda.is_available() else "")}

    keep = re.compile(args.filter)

    def add(row):
        """Keeps a row and rewrites the file, so an interrupted run keeps what it measured."""
        nonlocal index
        if row is None:
            return
        benchmarks.append(row)
        index += 1
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"context": context, "benchmarks": benchmarks}, f, indent=2)

    want_cpu = args.device in ("cpu", "all")
    want_cuda = args.device == "cuda" or (args.device == "all" and torch.cuda.is_available())
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("torch_sdpa: --device cuda but torch.cuda.is_available() is False")

    if want_cpu:
        attend = lambda q, k, v, causal: F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
        with torch.inference_mode():
            for shape, dtype, mask, threads in row_set(args.full, args.threads, ["f32", "f16"]):
                name = "peer_torch_sdpa_cpu/%s/%s/%s/threads:%d" % (dtype, mask, shape_name(*shape), threads)
                if not keep.search(name):
                    continue
                torch.set_num_threads(threads)
                density = allowed_fraction(mask, shape[2], shape[2])
                add(run_one("peer_torch_sdpa_cpu", attend, shape, dtype, mask, threads, "cpu", args, index, density))

    if want_cuda:
        from torch.nn.attention import SDPBackend
        backends = [("peer_torch_flash", "FLASH_ATTENTION"), ("peer_torch_efficient", "EFFICIENT_ATTENTION"),
                    ("peer_torch_cudnn", "CUDNN_ATTENTION")]
        if args.full:
            backends.append(("peer_torch_math", "MATH"))
        kernels = [(k, sdpa_with(getattr(SDPBackend, b))) for k, b in backends if hasattr(SDPBackend, b)]
        try:
            kernels.append(("peer_torch_flex", flex_attend()))
        except ImportError as e:
            print("torch_sdpa: FlexAttention unavailable (%s)" % e, file=sys.stderr)
        types = ["f16", "f32"] if args.full else ["f16"]
        gpu_rows = [(sh, t, m) for sh, t, m, _ in row_set(args.full, 1, types)]
        with torch.inference_mode():
            for kernel, attend in kernels:
                for shape, dtype, mask in gpu_rows:
                    if not keep.search("%s/%s/%s/%s" % (kernel, dtype, mask, shape_name(*shape))):
                        continue
                    # The math backend materialises every score; the fused ones skip fully masked tiles.
                    density = 1.0 if kernel == "peer_torch_math" else allowed_fraction(mask, shape[2], shape[2])
                    add(run_one(kernel, attend, shape, dtype, mask, 1, "cuda", args, index, density))

    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({"context": context, "benchmarks": benchmarks}, f, indent=2)
    print("torch_sdpa: wrote %d rows to %s" % (len(benchmarks), args.out), file=sys.stderr)


if __name__ == "__main__":
    main()
