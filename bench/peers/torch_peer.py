#!/usr/bin/env python3
"""PyTorch's attention on fusedattn's benchmark shapes, written in fusedattn-bench's JSON schema (Google Benchmark's
format with the same counters), so bench/compare.py, bench/plot.py and bench/gpu/table.py read the rows beside ours.

    python3 bench/peers/torch_peer.py [--device cpu|cuda|all] [--suite bench|gpu|gpu-d64|gpu-d96|gpu-dims] [--full]
        [--backends flash,efficient,cudnn,flex] [--flex-budget SECONDS] [--min-time SECONDS] [--repetitions N]
        [--threads N] [--cpu-types f32,f16,bf16] [--backward [--iters N]] [--filter REGEX] [--out FILE]
    python3 bench/peers/torch_peer.py --device cuda --decode [--iters N] [--filter REGEX] [--out FILE]
    python3 bench/peers/torch_peer.py --device cuda --ragged [--filter REGEX] [--out FILE]
    python3 bench/peers/torch_peer.py (--decode | --backward) --list [--device cpu|cuda|all] [--filter REGEX]
    python3 bench/peers/torch_peer.py --block-sparse DIR [--ours FUSEDATTN.jsonl] [--out FILE]
    python3 bench/peers/torch_peer.py --interleave PATH/fusedattn-tile-sweep [--rounds N] [--shapes "B,H,S,D;..."]
        [--thread-counts 1,16] [--min-time SECONDS] [--repetitions N] [--out FILE]

Modes:
  default        SDPA and FlexAttention on a suite of shapes. `--suite bench` (default): fusedattn-bench's shapes (the
                 leaderboard's (B, H, S, D) and the assignment's S = 128, 512, 1024 with 8 heads, D = 64) on the CPU
                 (f32 with 1 and all threads, f16 with all threads; --full: every combination) and on CUDA (f16;
                 --full adds f32 and the math backend). `--suite gpu`: the shapes of bench/gpu/bench_attention.cu
                 (f16 and bf16, dense and causal); `gpu-d64` its unmasked head_dim 64 sweep, `gpu-d96` its head_dim 96
                 rows, `gpu-dims` bench/gpu/ab_flash.cu's `dims` shapes (head_dims between the tile widths).
                 --flex-budget caps the seconds spent on FlexAttention (it compiles per shape and mask).
                 --cpu-types: the CPU rows' storage types (default f32,f16; the first gets 1 and all threads, the
                 others all threads; bf16 rows sit beside fusedattn-bench's flash/bf16 and flash_amx/bf16 rows).
                 --backward adds SDPA's backward, the time of torch.autograd.grad(O, (Q, K, V), dO) on a graph
                 kept from one forward (the forward not timed), FLOPs 10·b·h·s²·d × the counted fraction. CPU: f32,
                 dense and causal, 1 and all threads, on the shapes of fusedattn-bench's flash_bwd rows
                 (`peer_torch_sdpa_cpu_bwd/...`, causal counting the allowed entries as flash_bwd does). CUDA: the
                 shapes of bench/gpu/bench_backward.cu (bf16, B·H = 16·16, S 1024-8192, head_dim 64 and 128, dense
                 and causal), `peer_torch_flash_bwd/...` and `peer_torch_cudnn_bwd/...` (the backend forced for the
                 forward whose graph is timed), counted and timed as bench_backward does (causal halves the count;
                 the mean of --iters calls between two events), with its JSON keys too (impl sdpa_flash /
                 sdpa_cudnn, batch, heads, seq, head_dim, causal, ms, tflops). --filter _bwd/ keeps only the
                 backward rows.
  --decode       CUDA SDPA (cuDNN and flash backends, enable_gqa) and FlexAttention's paged attention on
                 bench/gpu/bench_decode.cu's GQA decode shapes: bf16, 32 query / 8 kv heads, head_dim 128, one query
                 row, batch 1, 8, 64 x S_kv 4096, 32768, 131072. Rows
                 `decode/bf16/torch_<cudnn|flash>/b{B}_h32_hkv8_skv{S}_d128` beside bench_decode's `contig` lines,
                 `decode/bf16/torch_flex_paged<P>/...` (P = 16, 64) beside its `paged<P>` lines: the PagedAttention
                 of torch.nn.attention.experimental._paged_attention with pages of P tokens handed out in a shuffled
                 order (reserve, assign into a physical cache (1, 8, pages·P, 128), convert_logical_block_mask), then
                 torch.compile(flex_attention) with enable_gqa (one query row, or 16 with the real one kept where one
                 is refused: counter q_rows); a shape it cannot take (missing, out of memory, compile error) is a
                 note. bytes = the K and V one call reads, GB/s their rate. Each call reads another copy of K/V (the
                 copies spanning at least 1 GiB); the time is the mean of --iters calls (default 20) queued between
                 two events, as bench_decode times.
  --ragged       CUDA varlen flash attention, torch.ops.aten._flash_attention_forward(q, k, v, cu_seqlens_q,
                 cu_seqlens_k, max_q, max_k, 0.0, is_causal, False, scale=1/sqrt(d)) on packed (tokens, heads, d)
                 bf16 tensors, on bench/gpu/bench_ragged.cu's ragged batches (uniform 16 x 1024; mixed and short:
                 the lengths listed above RAGGED_HEADS below, drawn with the LCG both files share), 32 query heads,
                 GQA 32/8 at head_dim 128 and MHA 32/32 at head_dim 64, causal (q = kv lengths: top-left and
                 bottom-right agree) and no mask. Rows `ragged/bf16/<uniform|mixed|short>/<causal|dense>/
                 torch_flash_varlen/h32_hkv8_d128` beside bench_ragged's `ragged/bf16/<set>/<mask>/h32_hkv8_d128`;
                 FLOPs 4·d·heads·(allowed pairs) per sequence, as bench_ragged counts; timed as it times (the
                 median over 7 rounds of ~20 ms of queued calls, two input sets alternating). K/V go in with their
                 8 heads (the op takes GQA); where a torch refuses that, with their heads repeated (counter gqa =
                 "repeated", and a note). Without torch, a GPU or the op: a note, nothing timed, exit code 0.
  --list         with --decode or --backward: the rows' names and counts (decode: K/V bytes and copies), nothing run.
  --block-sparse FlexAttention's block-sparse speed-up on the layouts `bench_gpu OUT.jsonl peer DIR` writes
                 (layout_4096.txt, layout_10000.txt: B 1, H 16, D 128, f16, 128 x 512 blocks, sparsity 0.9), beside
                 dense SDPA (flash, cuDNN) and dense FlexAttention, then the dense kernels on (10,16,1024,128): 1280
                 items of 128 query rows x 1024 keys, as long as the block-sparse items at S 10000. FlexAttention rows
                 also carry the time per call with 10 calls queued back to back. With --ours (bench_gpu's JSON lines
                 of the same run) a summary puts fusedattn's figures beside these.
  --interleave   PyTorch's CPU SDPA and fusedattn's CPU flash (timed by fusedattn-tile-sweep: f32, dense,
                 policy::cpu<> with the heuristic tiles) on the same shapes, interleaved: per round, shape and thread
                 count one timing of each back to back, the order alternating per round, so a machine whose speed
                 drifts slows both sides of a pair alike. Rows `peer_torch_sdpa_cpu/...` and `flash/...` hold each
                 side's median over the rounds; the torch row also the per-round ratios torch / ours
                 (ratio_median, ratio_min, ratio_max: above 1 means fusedattn is faster).

Rows: name `KERNEL/DTYPE/MASK/bB_hH_sS_dD[/threads:T]` (decode: bench_decode's names), label "DTYPE MASK",
counters b h h_kv s_q s_kv d threads density flop bytes bytes_min FLOP/s B/s max_err (decode rows also GB/s).
Kernels: peer_torch_sdpa_cpu (CPU SDPA under torch.set_num_threads(T)), peer_torch_flash / peer_torch_efficient /
peer_torch_cudnn / peer_torch_math (CUDA SDPA restricted to one backend by sdpa_kernel), peer_torch_flex
(torch.compile(flex_attention); causal and block-sparse through a BlockMask); a `_bwd` suffix for the backward.
Causal is PyTorch's is_causal (top-left), like the bench's `causal`; FLOPs count the allowed score entries
(density). `bytes` is the compulsory traffic (Q, K, V, O once; decode: K and V): a foreign kernel's modelled
traffic is not known.

Every row is checked before it is timed: up to 256 query rows of batch 0, head 0 against a float64
softmax(scale·QKᵀ + mask)·V on the CPU (backward rows: dQ, dK, dV of batch 0, head 0 against float64 autograd, the
error relative to each gradient's largest entry; decode rows: every head's query row of batch 0, relative to the
output's largest entry); a row whose error exceeds its type's tolerance is written as an error row (error_occurred
and the message), never timed. A backend that refuses a shape (flash with f32, an old GPU) is skipped with a note
on stderr. CPU times are wall clock per call, the median of --repetitions runs of a call count calibrated to
--min-time; CUDA times are CUDA events around one call, the median of 10 to 100 calls (until 300 ms), cycling
through enough input sets that a pass over them exceeds the L2 several times (--decode and the CUDA backward rows:
the mean of --iters queued calls).

Needs torch >= 2.3 (torch.nn.attention.sdpa_kernel); FlexAttention and --decode (enable_gqa) need torch >= 2.5;
FlexAttention is skipped without it. --list runs on any torch.
"""

import argparse
import contextlib
import datetime
import inspect
import itertools
import json
import math
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time

try:
    import torch
    import torch.nn.functional as F
except ImportError as e:  # --ragged says so and exits 0; the other modes exit with the message
    torch = F = None
    TORCH_MISSING = "torch is not importable (%s)" % e
else:
    TORCH_MISSING = None

LEADERBOARD = [(1, 1, 128, 64), (1, 1, 512, 64), (1, 1, 1024, 64), (1, 1, 2048, 64), (1, 1, 4096, 64),
               (1, 8, 512, 64), (1, 12, 512, 64), (1, 32, 512, 64), (1, 32, 1024, 128), (1, 32, 2048, 128)]
ASSIGNMENT = [(1, 8, 128, 64), (1, 8, 512, 64), (1, 8, 1024, 64)]
# bench/gpu/bench_attention.cu's flash suite: (B, H, S, D, causal).
GPU_SHAPES = [(1, 32, 2048, 128, False), (1, 32, 2048, 128, True), (2, 16, 8192, 128, False),
              (2, 16, 8192, 128, True), (1, 16, 16384, 128, False), (1, 16, 16384, 128, True),
              (4, 32, 4096, 64, False), (4, 32, 4096, 64, True), (1, 32, 1024, 128, False), (1, 1, 4096, 64, False),
              (1, 32, 512, 64, False), (4, 16, 4096, 256, False), (4, 16, 4096, 256, True),
              (4, 16, 4096, 96, False), (4, 16, 4096, 96, True)]
# bench/gpu/ab_flash.cu's `dims` shapes: head_dims between the flash kernels' tile widths.
GPU_DIMS_SHAPES = [(4, 16, 4096, 40, False), (4, 16, 4096, 80, False), (4, 16, 4096, 80, True),
                   (4, 16, 4096, 136, True), (4, 16, 4096, 160, True), (4, 16, 4096, 192, True)]
GPU_D64_SHAPES = [(8, 32, 512, 64, False), (8, 32, 1024, 64, False), (4, 32, 2048, 64, False),
                  (4, 32, 4096, 64, False), (2, 32, 8192, 64, False)]
# fusedattn-bench's flash_bwd shapes (bench/rows_backward.cpp).
BACKWARD = [(1, 8, 1024, 64), (1, 4, 2048, 64), (1, 2, 4096, 64), (1, 8, 1024, 128), (1, 4, 2048, 128),
            (1, 2, 4096, 128)]
# bench/gpu/bench_backward.cu's shapes: (B, H), head_dims, sequence lengths (bf16, dense and causal).
CUDA_BACKWARD_BH, CUDA_BACKWARD_DIMS, CUDA_BACKWARD_SEQS = (16, 16), (64, 128), (1024, 2048, 4096, 8192)
# bench/gpu/bench_decode.cu's shapes: GQA decode, bf16, one query row, batch x S_kv, 32 query / 8 kv heads, D 128.
DECODE_BATCHES, DECODE_SEQS = (1, 8, 64), (4096, 32768, 131072)
DECODE_HEADS, DECODE_HEADS_KV, DECODE_D = 32, 8, 128
DECODE_PAGES = (16, 64)  # tokens a page of bench_decode's paged16 / paged64 caches (FlexAttention's paged rows)
DECODE_SPAN = 1 << 30  # bytes the K/V copies span at least: each call reads another copy, so L2 holds none of it
DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16} if torch else {}
# Largest |error| against the float64 reference accepted per storage type (inputs uniform in [-1, 1)).
TOLERANCE = {"f32": 1e-3, "f16": 1e-2, "bf16": 5e-2}
CHECK_ROWS = 256
SDPA_BACKENDS = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION",
                 "math": "MATH"}
# Block-sparse mode: bench_gpu's block-sparse suite (B 1, f16, 128 x 512 blocks, sparsity 0.9).
SPARSE_H, SPARSE_D, SPARSE_SPARSITY, SPARSE_SEQS = 16, 128, 0.9, (4096, 10000)
SHORT_ITEMS = (10, 16, 1024, 128)
QUEUED_CALLS = 10
# bench/gpu/bench_ragged.cu's ragged batches (q = kv lengths, packed end to end), drawn with the LCG both files
# share: state <- state * 1664525 + 1013904223 (mod 2^32), a draw in [lo, hi] = lo + (state >> 8) % (hi - lo + 1).
#   uniform: 16 x 1024 (16384 tokens)
#   mixed:   seed 2, lengths in [128, 4096] drawn until the total reaches 16384 (8 sequences, 17623 tokens):
#            726 1482 2926 354 3487 2252 3817 2579
#   short:   seed 3, 64 lengths in [64, 512] (17939 tokens):
#            197 287 466 409 454 119 461 236 322 113 127 397 235 469 501 189 236 461 447 206 83 194 382 137
#            486 172 449 158 72 74 219 286 101 366 229 113 333 119 311 68 390 92 493 425 80 225 197 397 95 221
#            487 221 494 424 144 200 237 312 387 275 275 466 376 342
# Shapes (h_kv, d) with 32 query heads: GQA 32/8 at head_dim 128, MHA 32/32 at head_dim 64; masks causal and none.
RAGGED_HEADS, RAGGED_SHAPES = 32, ((8, 128), (32, 64))
RAGGED_ROUNDS, RAGGED_ROUND_MS = 7, 20.0
PAD_BLOCKS = 8  # inactive blocks past the layout, for indices past the sequence a mask_mod may be asked about


def note(*parts):
    print("torch_peer:", *parts, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------------- the schema

def shape_name(b, h, s, d):
    return "b%d_h%d_s%d_d%d" % (b, h, s, d)


def causal_fraction(s_q, s_kv):
    """Fraction of score entries a top-left causal mask allows."""
    return sum(min(i + 1, s_kv) for i in range(s_q)) / float(s_q * s_kv)


def dims(shape):
    """(b, h, h_kv, s_q, s_kv, d) of a square shape (b, h, s, d) or of a full one (b, h, h_kv, s_q, s_kv, d)."""
    if len(shape) == 4:
        b, h, s, d = shape
        return b, h, h, s, s, d
    return tuple(shape)


def bench_row(name, shape, dtype, mask, threads, density, seconds, iterations, max_err, flop=None, traffic=None,
              **extra):
    """One row of fusedattn-bench's schema: time per call in microseconds, the bench's counters. `flop` replaces the
    forward count 4·b·h·s_q·s_kv·d·density (the backward rows count 10·...); `traffic` replaces `bytes` and
    `bytes_min` (the decode rows count the K and V read, as fusedattn-bench's decode rows do) and adds GB/s."""
    b, h, h_kv, s_q, s_kv, d = dims(shape)
    if flop is None:
        flop = 4.0 * b * h * s_q * s_kv * d * density
    bytes_min = traffic if traffic is not None else \
        torch.tensor([], dtype=DTYPES[dtype]).element_size() * 2.0 * (b * h * s_q * d + b * h_kv * s_kv * d)
    row = {"name": name, "run_name": name, "run_type": "iteration", "repetitions": 1, "repetition_index": 0,
           "threads": threads, "iterations": iterations, "real_time": seconds * 1e6, "cpu_time": seconds * 1e6,
           "time_unit": "us", "b": b, "h": h, "h_kv": h_kv, "s_q": s_q, "s_kv": s_kv, "d": d, "density": density,
           "flop": flop, "bytes": bytes_min, "bytes_min": bytes_min, "FLOP/s": flop / seconds,
           "B/s": bytes_min / seconds, "label": "%s %s" % (dtype, mask)}
    if traffic is not None:
        row["GB/s"] = round(traffic / seconds * 1e-9, 1)
    if max_err is not None:
        row["max_err"] = max_err
    row.update(extra)
    return row


def error_row(name, shape, dtype, mask, threads, message):
    b, h, h_kv, s_q, s_kv, d = dims(shape)
    return {"name": name, "run_name": name, "run_type": "iteration", "repetitions": 1, "repetition_index": 0,
            "threads": threads, "iterations": 0, "real_time": 0, "cpu_time": 0, "time_unit": "us",
            "error_occurred": True, "error_message": message, "b": b, "h": h, "h_kv": h_kv, "s_q": s_q,
            "s_kv": s_kv, "d": d, "label": "%s %s" % (dtype, mask)}


def rate(row):
    """The row's figure of merit for the progress lines: GB/s for memory-bound rows, else GFLOP/s or TFLOP/s."""
    if "GB/s" in row:
        return "%8.1f GB/s" % row["GB/s"]
    if row["FLOP/s"] >= 1e12:
        return "%8.1f TFLOP/s" % (row["FLOP/s"] * 1e-12)
    return "%8.1f GFLOP/s" % (row["FLOP/s"] * 1e-9)


class Output:
    """The JSON document; rewritten after every row, so an interrupted run keeps what it measured."""

    def __init__(self, path, mode):
        self.path, self.rows = path, []
        self.context = {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "host_name": socket.gethostname(), "executable": "bench/peers/torch_peer.py " + mode,
            "num_cpus": os.cpu_count(), "library_build_type": "release",
            "fusedattn_peers": "torch %s, %s%s" % (
                torch.__version__, platform.processor() or platform.machine(),
                (", " + torch.cuda.get_device_name(0)) if torch.cuda.is_available() else "")}

    def add(self, row):
        if row is None:
            return
        row["family_index"] = len(self.rows)
        row["per_family_instance_index"] = 0
        self.rows.append(row)
        self.write()

    def write(self):
        with open(self.path, "w", encoding="utf-8") as f:
            json.dump({"context": self.context, "benchmarks": self.rows}, f, indent=2)


# ---------------------------------------------------------------------------------------------- inputs and timing

def cpu_inputs(shape, dtype, seed=1):
    """Q, K, V uniform in [-1, 1) on the CPU."""
    b, h, s, d = shape
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [(torch.rand(b, h, s, d, generator=g) * 2 - 1).to(DTYPES[dtype]) for _ in range(3)]


def cuda_inputs(shape, dtype, seed=1):
    """Input sets [Q, K, V] in [-1, 1) on the GPU, enough (at most 4) that one pass over them exceeds the L2 several
    times."""
    b, h, s, d = shape
    sets = max(1, min(4, math.ceil(4 * 60e6 / (3 * b * h * s * d * 2))))
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [[torch.rand(b, h, s, d, device="cuda", dtype=DTYPES[dtype], generator=gen) * 2 - 1 for _ in range(3)]
            for _ in range(sets)]


def time_cpu(fn, min_time, repetitions):
    """(median seconds per call over `repetitions` runs of a call count lasting about min_time, the call count)."""
    fn()
    calls = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        elapsed = time.perf_counter() - t0
        if elapsed >= min_time or calls >= 1 << 20:
            break
        calls = max(calls * 2, int(calls * min_time / max(elapsed, 1e-9) * 1.2))
    per_call = [elapsed / calls]
    for _ in range(repetitions - 1):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        per_call.append((time.perf_counter() - t0) / calls)
    return statistics.median(per_call), calls


def time_cuda(fn, sets):
    """(median seconds of one call fn(i) between two CUDA events, the call count): 3 warm-up calls, then 10 to 100
    calls until 300 ms, cycling through the input sets."""
    for i in range(3):
        fn(i % sets)
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times, total = [], 0.0
    while len(times) < 100 and (len(times) < 10 or total < 300.0):
        start.record()
        fn(len(times) % sets)
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
        total += times[-1]
    return statistics.median(times) * 1e-3, len(times)


def time_cuda_queued(fn, sets, rounds, warmup, calls=None, round_ms=None):
    """(median seconds of one call, calls in the rounds): `warmup` calls (call i on input set i % sets), then `rounds`
    rounds of `calls` calls queued between two CUDA events (the host's work overlaps the previous call's kernels), call
    i of round r on input set (r·calls + i) % sets; the median over the rounds of the mean per call. With `calls`, the
    device is synchronized after the warm-up; without it, one calibration call fn(0) timed between the two events
    follows the warm-up and sets it: as many calls as make a round last about `round_ms` ms, 3 to 500 (bench_ragged's
    timing)."""
    for i in range(warmup):
        fn(i % sets)
    if calls is not None:
        torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if calls is None:
        start.record()
        fn(0)
        stop.record()
        stop.synchronize()
        calls = max(3, min(500, math.ceil(round_ms / max(start.elapsed_time(stop), 1e-3))))
    per_call = []
    for r in range(rounds):
        start.record()
        for i in range(calls):
            fn((r * calls + i) % sets)
        stop.record()
        stop.synchronize()
        per_call.append(start.elapsed_time(stop) / calls)
    return statistics.median(per_call) * 1e-3, calls * rounds


def time_cuda_mean(fn, sets, iters, warmup):
    """(mean seconds of one call, iters): `warmup` calls, then `iters` calls queued between two CUDA events, call i
    on input set i % sets (bench/gpu/bench_decode.cu's and bench_backward.cu's timing)."""
    for i in range(warmup):
        fn(i % sets)
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(iters):
        fn(i % sets)
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) * 1e-3 / iters, iters


# ------------------------------------------------------------------------------------------------------ checking

def max_error(out, q, k, v, allowed=None, causal=False, relative=False, heads=1):
    """Largest |out − reference| over up to CHECK_ROWS query rows of batch 0, query heads [0, heads) (each against
    its kv head, h / h_kv query heads a kv head); the reference is softmax(QKᵀ/√d + mask)·V in float64 on the CPU.
    `allowed(rows, s_kv)` gives a boolean [rows, s_kv] mask. relative: divided by the reference's largest |entry| (a
    row over thousands of keys averages V to near 0)."""
    n = min(CHECK_ROWS, q.shape[-2])
    group = q.shape[1] // k.shape[1]
    err, top = 0.0, 0.0
    for head in range(heads):
        if head % group == 0:
            k0, v0 = (x[0, head // group].detach().to("cpu", torch.float64) for x in (k, v))
        q0 = q[0, head, :n].detach().to("cpu", torch.float64)
        s = q0 @ k0.T / math.sqrt(q0.shape[-1])
        if causal:
            s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
        if allowed is not None:
            s = s.masked_fill(~allowed(n, k0.shape[0]), float("-inf"))
        ref = torch.softmax(s, dim=-1) @ v0
        err = max(err, float((out[0, head, :n].to("cpu", torch.float64) - ref).abs().max()))
        top = max(top, float(ref.abs().max()))
    return err / top if relative else err


def checked_row(name, attend, qkv_sets, shape, dtype, mask, threads, density, device, args, allowed=None,
                queued=False, timer=None, relative=False, heads=1, **extra):
    """Checks one call against float64 (max_error), then times it; returns a row, an error row, or None (backend
    refused). `timer(fn, sets)` replaces the CUDA timing (fn(i) calls on input set i)."""
    causal = mask == "causal"
    q, k, v = qkv_sets[0]
    try:
        out = attend(q, k, v)
    except Exception as e:  # noqa: BLE001 - the backend does not take this dtype / shape / GPU, or cannot compile
        note("%s skipped: %s" % (name, (str(e).splitlines() or [type(e).__name__])[0]))
        return None
    err = max_error(out, q, k, v, allowed, causal, relative, heads)
    del out
    if not err <= TOLERANCE[dtype]:
        return error_row(name, shape, dtype, mask, threads, "max error %.3g%s against float64 exceeds %.3g" % (
            err, " (relative to the largest entry)" if relative else "", TOLERANCE[dtype]))
    sets = len(qkv_sets)
    if device == "cuda":
        seconds, iterations = (timer or time_cuda)(lambda i: attend(*qkv_sets[i]), sets)
        if queued:
            extra["queued_real_time"] = time_cuda_queued(lambda i: attend(*qkv_sets[i]), sets, rounds=30,
                                                           warmup=3 * QUEUED_CALLS, calls=QUEUED_CALLS)[0] * 1e6
    else:
        seconds, iterations = time_cpu(lambda: attend(q, k, v), args.min_time, args.repetitions)
    row = bench_row(name, shape, dtype, mask, threads, density, seconds, iterations, err, **extra)
    note("%-64s %12.1f us %s  max_err %.2g" % (name, seconds * 1e6, rate(row), err))
    return row


# ----------------------------------------------------------------------------------------------------- the calls

def sdpa_with(backend, causal, gqa=False):
    """attend(q, k, v) restricted to one SDPA backend; gqa: K and V hold fewer heads than Q (enable_gqa)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    chosen = getattr(SDPBackend, SDPA_BACKENDS[backend])
    kwargs = {"enable_gqa": True} if gqa else {}

    def attend(q, k, v):
        with sdpa_kernel([chosen]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, **kwargs)
    return attend


class Flex:
    """torch.compile(flex_attention) with one BlockMask per (mask, S); None where FlexAttention is missing."""

    def __init__(self):
        # One compiled kernel per shape and mask: let dynamo keep them all instead of falling back to eager.
        for key in ("recompile_limit", "cache_size_limit"):
            try:
                setattr(torch._dynamo.config, key, 256)
            except Exception:  # noqa: BLE001 - a name this version lacks
                pass
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        self.create_block_mask = create_block_mask
        self.compiled = torch.compile(flex_attention, dynamic=False)
        self.masks = {}

    def causal(self, s):
        if s not in self.masks:
            self.masks[s] = self.create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, s, s,
                                                   device="cuda")
        return self.masks[s]

    def attend(self, causal, block_mask=None):
        def call(q, k, v):
            bm = self.causal(q.shape[-2]) if causal else block_mask
            return self.compiled(q, k, v, block_mask=bm)
        return call


def make_flex():
    try:
        return Flex()
    except Exception as e:  # noqa: BLE001 - report and go on without FlexAttention
        note("FlexAttention unavailable (%s)" % e)
        return None


# ------------------------------------------------------------------------------------------------ the suite mode

def bench_rows(full, max_threads, types):
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


def gpu_rows(args):
    """(shape, dtype, mask) of the CUDA rows of a suite."""
    if args.suite == "bench":
        types = ["f16", "f32"] if args.full else ["f16"]
        return [(sh, t, m) for sh, t, m, _ in bench_rows(args.full, 1, types)]
    shapes = {"gpu": GPU_SHAPES, "gpu-d64": GPU_D64_SHAPES, "gpu-dims": GPU_DIMS_SHAPES,
              "gpu-d96": [c for c in GPU_SHAPES if c[3] == 96]}[args.suite]
    return [((b, h, s, d), t, "causal" if c else "dense") for t in ("f16", "bf16") for (b, h, s, d, c) in shapes]


def run_suite(args, out):
    keep = re.compile(args.filter)
    want_cpu = args.device in ("cpu", "all") and args.suite == "bench"
    want_cuda = args.device == "cuda" or (args.device == "all" and torch.cuda.is_available())
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("torch_peer: --device cuda but torch.cuda.is_available() is False")

    if want_cpu:
        with torch.inference_mode():
            for shape, dtype, mask, threads in bench_rows(args.full, args.threads, args.cpu_types.split(",")):
                name = "peer_torch_sdpa_cpu/%s/%s/%s/threads:%d" % (dtype, mask, shape_name(*shape), threads)
                if not keep.search(name):
                    continue
                torch.set_num_threads(threads)
                causal = mask == "causal"
                attend = lambda q, k, v, c=causal: F.scaled_dot_product_attention(q, k, v, is_causal=c)  # noqa: E731
                density = causal_fraction(shape[2], shape[2]) if causal else 1.0
                out.add(checked_row(name, attend, [cpu_inputs(shape, dtype)], shape, dtype, mask, threads, density,
                                    "cpu", args))

    if want_cpu and args.backward:
        run_backward(args, out, keep, "cpu")

    if want_cuda:
        backends = [b for b in args.backends.split(",") if b]
        if args.full and args.suite == "bench" and "math" not in backends:
            backends.append("math")
        flex = make_flex() if "flex" in backends and any(
            keep.search("peer_torch_flex/%s/%s/%s" % (t, m, shape_name(*sh))) for sh, t, m in gpu_rows(args)) else None
        flex_seconds = 0.0
        with torch.inference_mode():
            for shape, dtype, mask in gpu_rows(args):
                causal = mask == "causal"
                qkv = None
                for backend in backends:
                    kernel = "peer_torch_" + backend
                    name = "%s/%s/%s/%s" % (kernel, dtype, mask, shape_name(*shape))
                    if not keep.search(name):
                        continue
                    if backend == "flex":
                        if flex is None or flex_seconds >= args.flex_budget:
                            continue
                        attend = flex.attend(causal)
                    elif backend in SDPA_BACKENDS:
                        attend = sdpa_with(backend, causal)
                    else:
                        sys.exit("torch_peer: unknown backend %r (flash, efficient, cudnn, math, flex)" % backend)
                    qkv = qkv or cuda_inputs(shape, dtype)
                    # The math backend computes every score; the fused ones skip fully masked tiles.
                    density = causal_fraction(shape[2], shape[2]) if causal and backend != "math" else 1.0
                    t0 = time.time()
                    out.add(checked_row(name, attend, qkv, shape, dtype, mask, 1, density, "cuda", args))
                    if backend == "flex":
                        flex_seconds += time.time() - t0
                del qkv
                torch.cuda.empty_cache()
        if args.backward:
            run_backward(args, out, keep, "cuda")


# ------------------------------------------------------------------------------------------- the backward rows

def backward_rows(args, device):
    """(name, shape, dtype, mask, threads, backend) of the backward rows on `device`. CPU: fusedattn-bench's flash_bwd
    shapes, f32, dense and causal, 1 and all threads, SDPA's CPU kernel. CUDA: bench/gpu/bench_backward.cu's shapes,
    bf16, dense and causal, SDPA forced to its flash and to its cuDNN backend."""
    rows = []
    if device == "cpu":
        for shape in BACKWARD:
            for mask in ("dense", "causal"):
                for threads in sorted({1, args.threads}):
                    rows.append(("peer_torch_sdpa_cpu_bwd/f32/%s/%s/threads:%d" % (mask, shape_name(*shape), threads),
                                 shape, "f32", mask, threads, None))
        return rows
    b, h = CUDA_BACKWARD_BH
    for d in CUDA_BACKWARD_DIMS:
        for s in CUDA_BACKWARD_SEQS:
            for mask in ("dense", "causal"):
                for backend in ("flash", "cudnn"):
                    rows.append(("peer_torch_%s_bwd/bf16/%s/%s" % (backend, mask, shape_name(b, h, s, d)),
                                 (b, h, s, d), "bf16", mask, 1, backend))
    return rows


def backward_density(device, mask, s):
    """The counted fraction of score entries: fusedattn-bench's flash_bwd rows count the entries a top-left causal
    mask allows, bench_backward.cu halves the dense count."""
    if mask != "causal":
        return 1.0
    return causal_fraction(s, s) if device == "cpu" else 0.5


def uniform(shape, dtype, device, gen):
    return torch.empty(*shape, dtype=DTYPES[dtype], device=device).uniform_(-1, 1, generator=gen)


def grad_error(q, k, v, d_o, grads, causal):
    """Largest |gradient − reference| / max |reference| over dQ, dK and dV of batch 0, head 0 (relative to each
    gradient's largest entry: with inputs in [-1, 1) a dense row's gradients stay near 1/√S, below any absolute
    tolerance); the reference is float64 autograd through softmax(QKᵀ/√d + top-left causal mask)·V of the same
    inputs, on their device."""
    q0, k0, v0 = (x[0, 0].detach().double().requires_grad_(True) for x in (q, k, v))
    s = q0 @ k0.T / math.sqrt(q0.shape[-1])
    if causal:
        rows = torch.arange(s.shape[0], device=s.device)
        cols = torch.arange(s.shape[1], device=s.device)
        s = s.masked_fill(cols[None, :] > rows[:, None], float("-inf"))
    ref = torch.autograd.grad(torch.softmax(s, dim=-1) @ v0, (q0, k0, v0), d_o[0, 0].double())
    return max(float((g[0, 0].double() - r).abs().max() / r.abs().max()) for g, r in zip(grads, ref))


def run_backward(args, out, keep, device):
    """SDPA's backward rows. Per row one forward (under the forced backend on CUDA), its gradients checked against
    float64 (grad_error), then torch.autograd.grad(O, (Q, K, V), dO) timed on the graph kept from that forward (the
    forward not timed). CPU: time_cpu; CUDA: bench_backward.cu's timing, 2 warm-up calls, then the mean of --iters
    calls (default 10) between two events. The CUDA rows also carry bench_backward's JSON keys (impl, batch, heads,
    seq, head_dim, causal, ms, tflops)."""
    iters = args.iters or 10
    for name, shape, dtype, mask, threads, backend in backward_rows(args, device):
        if not keep.search(name):
            continue
        b, h, s, d = shape
        causal = mask == "causal"
        density = backward_density(device, mask, s)
        if device == "cpu":
            torch.set_num_threads(threads)
            gen = torch.Generator(device="cpu").manual_seed(1)
            forced = contextlib.nullcontext
        else:
            from torch.nn.attention import SDPBackend, sdpa_kernel
            gen = torch.Generator(device="cuda").manual_seed(1)
            forced = lambda chosen=getattr(SDPBackend, SDPA_BACKENDS[backend]): sdpa_kernel([chosen])  # noqa: E731
        q, k, v = (uniform(shape, dtype, device, gen).requires_grad_(True) for _ in range(3))
        d_o = uniform(shape, dtype, device, gen)
        try:
            with forced():
                o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                grads = torch.autograd.grad(o, (q, k, v), d_o, retain_graph=True)
        except Exception as e:  # noqa: BLE001 - the backend does not take this shape / GPU
            note("%s skipped: %s" % (name, (str(e).splitlines() or [type(e).__name__])[0]))
            continue
        err = grad_error(q, k, v, d_o, grads, causal)
        del grads
        if not err <= TOLERANCE[dtype]:
            out.add(error_row(name, shape, dtype, mask, threads,
                              "max gradient error %.3g (relative to the largest entry) against float64 exceeds "
                              "%.3g" % (err, TOLERANCE[dtype])))
            continue
        def step(*_, o=o, inputs=(q, k, v), d_o=d_o):
            return torch.autograd.grad(o, inputs, d_o, retain_graph=True)
        with forced():
            if device == "cpu":
                seconds, iterations = time_cpu(step, args.min_time, args.repetitions)
            else:
                seconds, iterations = time_cuda_mean(step, 1, iters, 2)
        flop = 10.0 * b * h * s * s * d * density
        extra = {} if device == "cpu" else dict(
            impl="sdpa_" + backend, batch=b, heads=h, seq=s, head_dim=d, causal=causal, ms=round(seconds * 1e3, 4),
            tflops=round(flop / seconds * 1e-12, 1))
        row = bench_row(name, shape, dtype, mask, threads, density, seconds, iterations, err, flop=flop, **extra)
        note("%-64s %12.1f us %s  max_err %.2g" % (name, seconds * 1e6, rate(row), err))
        out.add(row)
        del step, o, q, k, v, d_o
        if device == "cuda":
            torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------- the decode mode

def decode_rows():
    """(name, shape, backend, copies, kv_bytes) in bench/gpu/bench_decode.cu's order: per batch and S_kv, SDPA's cuDNN
    backend, its flash backend, then FlexAttention's paged attention with pages of 16 and 64 tokens (backend
    flex_paged16, flex_paged64). shape is (b, h, h_kv, s_q, s_kv, d); copies: the K/V copies the calls rotate through
    (together at least DECODE_SPAN bytes, at most 8); kv_bytes: the K and V one call reads."""
    rows = []
    for b in DECODE_BATCHES:
        for s_kv in DECODE_SEQS:
            per = b * DECODE_HEADS_KV * s_kv * DECODE_D * 2  # bytes of K (and of V), bf16
            copies = max(1, min(8, -(-DECODE_SPAN // (2 * per))))
            shape = (b, DECODE_HEADS, DECODE_HEADS_KV, 1, s_kv, DECODE_D)
            for backend in ("cudnn", "flash") + tuple("flex_paged%d" % p for p in DECODE_PAGES):
                name = "decode/bf16/torch_%s/b%d_h%d_hkv%d_skv%d_d%d" % (backend, b, DECODE_HEADS, DECODE_HEADS_KV,
                                                                         s_kv, DECODE_D)
                rows.append((name, shape, backend, copies, 2.0 * per))
    return rows


def flex_paged(name, flex, sets, page):
    """(attend, extra counters) for FlexAttention's paged attention (torch.nn.attention.experimental._paged_attention)
    over pages of `page` tokens, or None after a note (FlexAttention or PagedAttention missing, out of memory, a
    compile error). PagedAttention hands out its pages in a shuffled order (a permutation from torch.randperm, as
    bench_decode shuffles its block table); every K/V copy of `sets` is scattered through its page table into a
    physical cache (1, h_kv, pages·page, d) of its own, and the logical block mask (all blocks full, BLOCK_SIZE = page)
    is converted to physical pages. flex_attention (enable_gqa) runs on one query row; where it refuses that, on the
    row padded to 16 (counter q_rows), only the real row returned. All sets share sets[0]'s query (run_decode's)."""
    if flex is None:
        note("%s skipped: FlexAttention unavailable" % name)
        return None
    try:
        from torch.nn.attention.experimental._paged_attention import PagedAttention
        from torch.nn.attention.flex_attention import create_block_mask, noop_mask
        q, k, _ = sets[0]
        b, h_kv, s_kv, d = k.shape
        n_pages = b * s_kv // page
        paged = PagedAttention(n_pages, page, b, device="cuda")
        paged.empty_pages = torch.randperm(n_pages, generator=torch.Generator().manual_seed(page)).tolist()
        for i in range(b):
            paged.reserve(torch.tensor(i), torch.tensor(s_kv, device="cuda"))
        idx, pos = torch.arange(b, device="cuda"), torch.arange(s_kv, device="cuda").view(1, s_kv)
        caches = {}
        for _, k, v in sets:
            caches[id(k)] = kc, vc = [torch.empty(1, h_kv, n_pages * page, d, dtype=k.dtype, device="cuda")
                                      for _ in range(2)]
            for i in range(b):  # a batch at a time: assign's transposed copy of K and V stays small
                paged.assign(idx[i:i + 1], pos, k[i:i + 1], v[i:i + 1], kc, vc)
        convert = paged.convert_logical_block_mask  # newer versions take the lengths (kv_len)
        lengths = {"kv_len": torch.full((b,), s_kv, dtype=torch.int64, device="cuda")} \
            if "kv_len" in inspect.signature(convert).parameters else {}
        failure = None
        for rows in (1, 16):
            mask = convert(create_block_mask(noop_mask, b, None, rows, s_kv, device="cuda", BLOCK_SIZE=page),
                           **lengths)
            q_in = q if rows == 1 else F.pad(q, (0, 0, 0, rows - 1))

            def attend(q, k, v, q_in=q_in, mask=mask, rows=rows):
                kc, vc = caches[id(k)]
                o = flex.compiled(q_in, kc, vc, block_mask=mask, enable_gqa=True)
                return o if rows == 1 else o[:, :, :1]
            try:
                attend(*sets[0])
                return attend, {"page_size": page, "q_rows": rows}
            except Exception as e:  # noqa: BLE001 - one query row refused: padded once more, then given up
                failure = failure or e
        raise failure
    except Exception as e:  # noqa: BLE001 - missing, out of memory, cannot compile: a note, the other rows go on
        note("%s skipped: %s" % (name, (str(e).splitlines() or [type(e).__name__])[0]))
        return None


def run_decode(args, out):
    """GQA decode under SDPA (enable_gqa) with the cuDNN and the flash backend forced, and under FlexAttention's paged
    attention (flex_paged). Each row is checked against float64 (the query row of every head of batch 0, relative to
    the largest entry), then timed as bench_decode times: min(3·copies, 24) warm-up calls, then the mean of --iters
    calls (default 20) queued between two events, call i reading K/V copy i % copies."""
    if not torch.cuda.is_available():
        sys.exit("torch_peer: --decode needs a GPU, and torch.cuda.is_available() is False")
    keep = re.compile(args.filter)
    iters = args.iters or 20
    note("device:", torch.cuda.get_device_name(0), "torch", torch.__version__, "cuDNN", torch.backends.cudnn.version())
    rows = [r for r in decode_rows() if keep.search(r[0])]
    flex = make_flex() if any(r[2].startswith("flex") for r in rows) else None
    with torch.inference_mode():
        for (shape, copies), group in itertools.groupby(rows, key=lambda r: (r[1], r[3])):
            b, h, h_kv, s_q, s_kv, d = shape
            gen = torch.Generator(device="cuda").manual_seed(1)
            q = uniform((b, h, s_q, d), "bf16", "cuda", gen)
            sets = [(q, uniform((b, h_kv, s_kv, d), "bf16", "cuda", gen), uniform((b, h_kv, s_kv, d), "bf16", "cuda",
                                                                                  gen)) for _ in range(copies)]
            timer = lambda fn, n, c=copies: time_cuda_mean(fn, n, iters, min(3 * c, 24))  # noqa: E731
            for name, _, backend, _, kv_bytes in group:
                made = flex_paged(name, flex, sets, int(backend[len("flex_paged"):])) \
                    if backend.startswith("flex_paged") else (sdpa_with(backend, False, gqa=True), {})
                if made is not None:
                    out.add(checked_row(name, made[0], sets, shape, "bf16", "decode", 1, 1.0, "cuda", args,
                                        timer=timer, relative=True, heads=h, traffic=kv_bytes, **made[1]))
                del made  # a paged row's caches go before the next row's
                torch.cuda.empty_cache()
            del q, sets
            torch.cuda.empty_cache()


def list_rows(args):
    """Prints the rows --decode or --backward would time, with their counts, and runs nothing."""
    keep = re.compile(args.filter)
    if args.decode:
        for name, shape, _, copies, kv_bytes in decode_rows():
            if keep.search(name):
                b, h, _, s_q, s_kv, d = shape
                print("%-52s flop %.4g  K+V %.4f GiB  copies %d (%.2f GiB)" % (
                    name, 4.0 * b * h * s_q * s_kv * d, kv_bytes / 2**30, copies, copies * kv_bytes / 2**30))
        return
    if not args.backward:
        sys.exit("torch_peer: --list lists the rows of --decode or of --backward")
    for device in (("cpu", "cuda") if args.device == "all" else (args.device,)):
        for name, shape, dtype, mask, _, _ in backward_rows(args, device):
            if keep.search(name):
                b, h, s, d = shape
                flop = 10.0 * b * h * s * s * d * backward_density(device, mask, s)
                print("%-60s flop %.4g  density %.4f" % (name, flop, backward_density(device, mask, s)))


# --------------------------------------------------------------------------------------------- the ragged mode

def ragged_lengths(seed, lo, hi, count=None, total=None):
    """Lengths in [lo, hi] from the LCG shared with bench/gpu/bench_ragged.cu: `count` of them, or as many as it takes
    for their sum to reach `total`."""
    state, out = seed, []
    while (count is not None and len(out) < count) or (total is not None and sum(out) < total):
        state = (state * 1664525 + 1013904223) & 0xFFFFFFFF
        out.append(lo + (state >> 8) % (hi - lo + 1))
    return out


def ragged_sets():
    """(name, lengths) of bench_ragged's batches, in its order."""
    return [("uniform", [1024] * 16), ("mixed", ragged_lengths(2, 128, 4096, total=16384)),
            ("short", ragged_lengths(3, 64, 512, count=64))]


def varlen_flash(op, causal, scale):
    """attend(q, k, v, cu, max_len): torch.ops.aten._flash_attention_forward on packed (tokens, heads, d) tensors,
    the same offsets for queries and keys; the output."""
    def attend(q, k, v, cu, max_len):
        try:
            res = op(q, k, v, cu, cu, max_len, max_len, 0.0, causal, False, scale=scale)
        except TypeError:  # a torch whose op takes no scale: its default is the same 1/sqrt(d)
            res = op(q, k, v, cu, cu, max_len, max_len, 0.0, causal, False)
        return res[0]
    return attend


def ragged_error(out, q, k, v, lengths, causal):
    """Largest |out - reference| over the last CHECK_ROWS query rows of the first and the longest sequence, query heads
    0 and H - 1; the reference is softmax(QK^T/sqrt(d) + causal mask)·V in float64 on the CPU, per sequence."""
    h, h_kv = q.shape[1], k.shape[1]
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    err = 0.0
    for b in sorted({0, max(range(len(lengths)), key=lambda i: lengths[i])}):
        t0, n = offsets[b], lengths[b]
        rows = min(CHECK_ROWS, n)
        for head in (0, h - 1):
            kv = head // (h // h_kv)
            q0 = q[t0 + n - rows:t0 + n, head].to("cpu", torch.float64)
            k0, v0 = (x[t0:t0 + n, kv].to("cpu", torch.float64) for x in (k, v))
            s = q0 @ k0.T / math.sqrt(q0.shape[-1])
            if causal:  # row i of the last `rows` sees keys 0 .. n - rows + i
                s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(n - rows + 1), float("-inf"))
            ref = torch.softmax(s, dim=-1) @ v0
            err = max(err, float((out[t0 + n - rows:t0 + n, head].to("cpu", torch.float64) - ref).abs().max()))
    return err


def run_ragged(args, out):
    """PyTorch's varlen flash attention (torch.ops.aten._flash_attention_forward with cu_seqlens) on
    bench/gpu/bench_ragged.cu's ragged batches, shapes and masks, timed as it times them (time_cuda_queued: 3 warm-up
    calls, a calibration call, RAGGED_ROUNDS rounds of about RAGGED_ROUND_MS ms; two input sets alternating). Each row
    is checked against float64 first (ragged_error). GQA K/V go to the op as they are; where it refuses them, K/V with
    their heads repeated (row counter gqa = "repeated", and a note). A missing GPU or op is a note, nothing timed."""
    if not torch.cuda.is_available():
        note("--ragged: torch.cuda.is_available() is False: nothing timed")
        return
    try:
        op = torch.ops.aten._flash_attention_forward
    except (AttributeError, RuntimeError) as e:
        note("--ragged: torch %s has no aten::_flash_attention_forward (%s): nothing timed" % (torch.__version__, e))
        return
    keep = re.compile(args.filter)
    note("device:", torch.cuda.get_device_name(0), "torch", torch.__version__)
    gen = torch.Generator(device="cuda").manual_seed(1)
    with torch.inference_mode():
        for h_kv, d in RAGGED_SHAPES:
            h = RAGGED_HEADS
            for set_name, lengths in ragged_sets():
                tokens = sum(lengths)
                cu = torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32, device="cuda")
                max_len = max(lengths)
                qkv = [(uniform((tokens, h, d), "bf16", "cuda", gen), uniform((tokens, h_kv, d), "bf16", "cuda", gen),
                        uniform((tokens, h_kv, d), "bf16", "cuda", gen)) for _ in range(2)]
                for mask in ("causal", "dense"):
                    causal = mask == "causal"
                    name = "ragged/bf16/%s/%s/torch_flash_varlen/h%d_hkv%d_d%d" % (set_name, mask, h, h_kv, d)
                    if not keep.search(name):
                        continue
                    attend = varlen_flash(op, causal, 1.0 / math.sqrt(d))
                    sets, gqa = qkv, "native" if h_kv < h else "none"
                    try:
                        o = attend(*sets[0], cu, max_len)
                    except Exception as e:  # noqa: BLE001 - refuses GQA, this GPU, or the dtype
                        if h_kv == h:
                            note("%s skipped: %s" % (name, (str(e).splitlines() or [type(e).__name__])[0]))
                            continue
                        note("%s: the op refuses GQA (%s); K/V heads repeated %dx" % (
                            name, (str(e).splitlines() or [type(e).__name__])[0], h // h_kv))
                        sets = [(q, k.repeat_interleave(h // h_kv, dim=1), v.repeat_interleave(h // h_kv, dim=1))
                                for q, k, v in qkv]
                        gqa = "repeated"
                        try:
                            o = attend(*sets[0], cu, max_len)
                        except Exception as e2:  # noqa: BLE001
                            note("%s skipped: %s" % (name, (str(e2).splitlines() or [type(e2).__name__])[0]))
                            continue
                    shape = (1, h, h_kv, tokens, tokens, d)
                    pair_count = sum(n * (n + 1) // 2 if causal else n * n for n in lengths)
                    flop = 4.0 * d * h * pair_count
                    err = ragged_error(o, *sets[0], lengths, causal)
                    del o
                    if not err <= TOLERANCE["bf16"]:
                        out.add(error_row(name, shape, "bf16", mask, 1, "max error %.3g against float64 exceeds %.3g"
                                          % (err, TOLERANCE["bf16"])))
                        note("%s: max error %.3g against float64" % (name, err))
                        continue
                    seconds, calls = time_cuda_queued(lambda i, s=sets, a=attend: a(*s[i], cu, max_len), len(sets),
                                                      rounds=RAGGED_ROUNDS, warmup=3, round_ms=RAGGED_ROUND_MS)
                    row = bench_row(name, shape, "bf16", mask, 1, pair_count / float(tokens * tokens), seconds, calls,
                                    err, flop=flop, set=set_name, sequences=len(lengths), tokens=tokens, gqa=gqa,
                                    us=round(seconds * 1e6, 3), tflops=round(flop / seconds * 1e-12, 2))
                    note("%-64s %12.1f us %s  max_err %.2g" % (name, seconds * 1e6, rate(row), err))
                    out.add(row)
                    if gqa == "repeated":
                        del sets
                del qkv, cu
                torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------- the block-sparse mode

def read_layout(path):
    """bench_gpu's layout file: "seq_q seq_kv block_q block_kv batch heads", then row_offsets, then cols (CSR).
    Row r = (b * heads + h) * n_q + q_block lists the active kv-blocks of q-block row q_block of pattern
    b * heads + h; kv-block kb holds keys [kb * block_kv, (kb + 1) * block_kv), both clipped to the sequence."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    seq_q, seq_kv, block_q, block_kv, batch, heads = (int(x) for x in lines[0].split())
    offsets = [int(x) for x in lines[1].split()]
    cols = [int(x) for x in lines[2].split()] if len(lines) > 2 else []
    n_q, n_kv = -(-seq_q // block_q), -(-seq_kv // block_kv)
    if len(offsets) != batch * heads * n_q + 1 or offsets[0] != 0 or offsets[-1] != len(cols):
        raise ValueError("%s: row_offsets do not describe %d rows of %d cols" % (path, batch * heads * n_q, len(cols)))
    if any(c < 0 or c >= n_kv for c in cols):
        raise ValueError("%s: a kv-block index outside [0, %d)" % (path, n_kv))
    return dict(seq_q=seq_q, seq_kv=seq_kv, block_q=block_q, block_kv=block_kv, batch=batch, heads=heads, n_q=n_q,
                n_kv=n_kv, offsets=offsets, cols=cols)


def active_blocks(lay):
    """(pattern, q_block, kv_block) of every active block."""
    out = []
    for r in range(len(lay["offsets"]) - 1):
        pattern, qb = divmod(r, lay["n_q"])
        out.extend((pattern, qb, lay["cols"][t]) for t in range(lay["offsets"][r], lay["offsets"][r + 1]))
    return out


def fractions(lay):
    """Active blocks over all blocks (bench_gpu's active_fraction) and allowed (query, key) pairs over all."""
    patterns = lay["batch"] * lay["heads"]
    blocks = len(lay["cols"]) / float(patterns * lay["n_q"] * lay["n_kv"])
    pairs = sum(min(lay["block_q"], lay["seq_q"] - qb * lay["block_q"]) *
                min(lay["block_kv"], lay["seq_kv"] - kb * lay["block_kv"]) for _, qb, kb in active_blocks(lay))
    return blocks, pairs / float(patterns * lay["seq_q"] * lay["seq_kv"])


def block_table(lay):
    """Boolean [patterns, n_q + PAD_BLOCKS, n_kv + PAD_BLOCKS], True where a block is active (CPU)."""
    t = torch.zeros(lay["batch"] * lay["heads"], lay["n_q"] + PAD_BLOCKS, lay["n_kv"] + PAD_BLOCKS, dtype=torch.bool)
    idx = torch.tensor(active_blocks(lay), dtype=torch.long)
    t[idx[:, 0], idx[:, 1], idx[:, 2]] = True
    return t


def read_ours(path):
    """bench_gpu's JSON lines of the same run: block-sparse rows by S, short-item flash rows by dtype."""
    ours = {}
    if not path:
        return ours
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    continue
                rec = json.loads(line)
                if rec.get("kernel") == "block-sparse vs dense flash":
                    ours[rec["s"]] = rec
                elif rec.get("kernel") == "flash (default tile)" and (
                        rec.get("b"), rec.get("h"), rec.get("s"), rec.get("d")) == SHORT_ITEMS:
                    ours[rec["dtype"]] = rec
    except (OSError, ValueError, KeyError) as e:
        note("cannot read", path, ":", e)
    return ours


def run_block_sparse(args, out):
    if not torch.cuda.is_available():
        sys.exit("torch_peer: --block-sparse needs a GPU")
    flex = make_flex()
    note("device:", torch.cuda.get_device_name(0), "torch", torch.__version__, "cuDNN", torch.backends.cudnn.version())
    summary = {}
    with torch.inference_mode():
        for s in SPARSE_SEQS:
            try:
                lay = read_layout(os.path.join(args.block_sparse, "layout_%d.txt" % s))
            except (OSError, ValueError) as e:
                note("S %d: no layout:" % s, e)
                continue
            if (lay["seq_q"], lay["seq_kv"], lay["batch"], lay["heads"]) != (s, s, 1, SPARSE_H):
                note("S %d: the layout is for another shape" % s)
                continue
            block_frac, pair_frac = fractions(lay)
            shape = (1, SPARSE_H, s, SPARSE_D)
            qkv = cuda_inputs(shape, "f16")
            times = {}
            for backend in ("flash", "cudnn"):
                row = checked_row("peer_torch_%s/f16/dense/%s" % (backend, shape_name(*shape)),
                                  sdpa_with(backend, False), qkv, shape, "f16", "dense", 1, 1.0, "cuda", args)
                out.add(row)
                if row and not row.get("error_occurred"):
                    times[backend] = row["real_time"]
            if flex is not None:
                row = checked_row("peer_torch_flex/f16/dense/%s" % shape_name(*shape), flex.attend(False), qkv,
                                  shape, "f16", "dense", 1, 1.0, "cuda", args, queued=True)
                out.add(row)
                if row and not row.get("error_occurred"):
                    times["flex"], times["flex queued"] = row["real_time"], row["queued_real_time"]
                table = block_table(lay)
                table_gpu = table.cuda()
                bq, bkv = lay["block_q"], lay["block_kv"]
                t0 = time.time()
                try:  # Flex's BLOCK_SIZE 128: a 512-key block is four of its blocks
                    bm = flex.create_block_mask(lambda b, h, qi, ki: table_gpu[h, qi // bq, ki // bkv], 1, SPARSE_H,
                                                s, s, device="cuda")
                except Exception as e:  # noqa: BLE001 - e.g. out of memory for the element mask: build it compiled
                    note("create_block_mask failed, compiling it:", e)
                    torch.cuda.empty_cache()
                    bm = torch.compile(flex.create_block_mask)(
                        lambda b, h, qi, ki: table_gpu[h, qi // bq, ki // bkv], 1, SPARSE_H, s, s, device="cuda")
                note("S %d: create_block_mask %.1f s" % (s, time.time() - t0))

                def allowed(rows, s_kv, t=table):  # head 0's pattern, for the float64 check
                    qi = torch.arange(rows) // bq
                    ki = torch.arange(s_kv) // bkv
                    return t[0][qi[:, None], ki[None, :]]
                extra = dict(sparsity=SPARSE_SPARSITY, active_fraction=round(block_frac, 4),
                             ideal_speedup=round(1 / block_frac, 2))
                row = checked_row("peer_torch_flex/f16/block_sparse/%s" % shape_name(*shape),
                                  flex.attend(False, bm), qkv, shape, "f16", "block_sparse", 1, pair_frac, "cuda",
                                  args, allowed=allowed, queued=True, **extra)
                if row and not row.get("error_occurred"):
                    times["flex block-sparse"] = row["real_time"]
                    times["flex block-sparse queued"] = row["queued_real_time"]
                    if "flex" in times:
                        row["speedup"] = times["flex"] / row["real_time"]
                        row["queued_speedup"] = times["flex queued"] / row["queued_real_time"]
                    for key, counter in (("cudnn", "speedup_vs_cudnn"), ("flash", "speedup_vs_sdpa_flash")):
                        if key in times:
                            row[counter] = times[key] / row["real_time"]
                out.add(row)
            summary[s] = (times, block_frac)
            del qkv
            torch.cuda.empty_cache()

        short = {}
        for dtype in ("f16", "bf16"):
            qkv = cuda_inputs(SHORT_ITEMS, dtype)
            short[dtype] = {}
            for backend in ("flash", "cudnn", "flex"):
                if backend == "flex" and flex is None:
                    continue
                attend = flex.attend(False) if backend == "flex" else sdpa_with(backend, False)
                row = checked_row("peer_torch_%s/%s/dense/%s" % (backend, dtype, shape_name(*SHORT_ITEMS)), attend,
                                  qkv, SHORT_ITEMS, dtype, "dense", 1, 1.0, "cuda", args, queued=backend == "flex")
                out.add(row)
                if row and not row.get("error_occurred"):
                    short[dtype][backend] = row["real_time"]
            del qkv
            torch.cuda.empty_cache()

    ours = read_ours(args.ours)
    print("== summary (us; speed-up = dense / block-sparse)")
    for s, (t, block_frac) in summary.items():
        g = lambda key: t.get(key, float("nan"))  # noqa: E731
        sp = g("flex block-sparse")
        print("S %5d (1,%d,%d,%d) f16, block-sparse %.2f, active %.4f (ideal %.2fx): flex dense %.1f, flex "
              "block-sparse %.1f -> %.2fx (queued %.2fx); cuDNN dense %.1f -> %.2fx; sdpa flash dense %.1f" % (
                  s, SPARSE_H, s, SPARSE_D, SPARSE_SPARSITY, block_frac, 1 / block_frac, g("flex"), sp,
                  g("flex") / sp, g("flex queued") / g("flex block-sparse queued"), g("cudnn"), g("cudnn") / sp,
                  g("flash")))
        if s in ours:
            o = ours[s]
            print("        fusedattn: dense flash %.1f, block-sparse (device layout) %.1f -> %.2fx (queued %.2fx); "
                  "flex block-sparse / fusedattn block-sparse %.2f" % (
                      o["dense_ms"] * 1e3, o["device_layout_ms"] * 1e3, o["device_layout_speedup"],
                      o["device_layout_queued_speedup"], sp / (o["device_layout_ms"] * 1e3)))
    b, h, s, d = SHORT_ITEMS
    flop = 4.0 * b * h * s * s * d
    for dtype, t in short.items():
        line = ", ".join("%s %.1f us (%.0f TFLOP/s)" % (k, us, flop / (us * 1e-6) / 1e12) for k, us in t.items())
        if dtype in ours:
            line += ", fusedattn flash %.1f us (%.0f TFLOP/s)" % (ours[dtype]["ms"] * 1e3, ours[dtype]["tflops"])
        print("short items %s %s: %s" % (dtype, SHORT_ITEMS, line))


# ------------------------------------------------------------------------------------------ the interleaved mode

def time_ours(binary, shape, threads, min_time, repetitions):
    """Median seconds per call of fusedattn's CPU flash on `shape` with `threads` threads (fusedattn-tile-sweep)."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    try:
        subprocess.run([binary, "--shapes=%d,%d,%d,%d" % shape, "--threads=%d" % threads,
                        "--min-time=%g" % min_time, "--reps=%d" % repetitions, "--json=" + path],
                       check=True, stdout=subprocess.DEVNULL)
        with open(path, encoding="utf-8") as f:
            return json.load(f)[0]["us"] * 1e-6
    finally:
        os.unlink(path)


def time_torch_cpu(shape, threads, min_time, repetitions):
    """Median seconds per call of torch's CPU SDPA on `shape` with `threads` threads."""
    torch.set_num_threads(threads)
    q, k, v = cpu_inputs(shape, "f32")
    with torch.inference_mode():
        return time_cpu(lambda: F.scaled_dot_product_attention(q, k, v), min_time, repetitions)[0]


def run_interleaved(args, out):
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes.split(";") if s]
    threads = [int(t) for t in args.thread_counts.split(",")]
    with torch.inference_mode():  # one checked call per shape before any timing
        for sh in shapes:
            q, k, v = cpu_inputs(sh, "f32")
            err = max_error(F.scaled_dot_product_attention(q, k, v), q, k, v)
            if not err <= TOLERANCE["f32"]:
                sys.exit("torch_peer: torch's SDPA on %s is off by %.3g against float64" % (sh, err))
    times = {(sh, t): {"torch": [], "ours": []} for sh in shapes for t in threads}
    for r in range(args.rounds):
        for sh in shapes:
            for t in threads:
                for side in (("torch", "ours") if r % 2 == 0 else ("ours", "torch")):
                    if side == "torch":
                        sec = time_torch_cpu(sh, t, args.min_time, args.repetitions)
                    else:
                        sec = time_ours(args.interleave, sh, t, args.min_time, args.repetitions)
                    times[(sh, t)][side].append(sec)
                note("round %d %-16s t%-3d torch %10.1f us  ours %10.1f us" % (
                    r, "(%d,%d,%d,%d)" % sh, t, times[(sh, t)]["torch"][-1] * 1e6, times[(sh, t)]["ours"][-1] * 1e6))
    print("%-18s %7s %12s %12s %14s %18s" % ("problem", "threads", "torch us", "ours us", "torch/ours",
                                           "per-round range"))
    for (sh, t), v in times.items():
        ratios = [a / b for a, b in zip(v["torch"], v["ours"])]
        suffix = "f32/dense/%s/threads:%d" % (shape_name(*sh), t)
        out.add(bench_row("peer_torch_sdpa_cpu/" + suffix, sh, "f32", "dense", t, 1.0, statistics.median(v["torch"]),
                          args.rounds, None, rounds=args.rounds, ratio_median=statistics.median(ratios),
                          ratio_min=min(ratios), ratio_max=max(ratios)))
        out.add(bench_row("flash/" + suffix, sh, "f32", "dense", t, 1.0, statistics.median(v["ours"]), args.rounds,
                          None, rounds=args.rounds))
        print("%-18s %7d %12.1f %12.1f %13.2fx %8.2fx .. %.2fx" % (
            "(%d,%d,%d,%d)" % sh, t, statistics.median(v["torch"]) * 1e6, statistics.median(v["ours"]) * 1e6,
            statistics.median(ratios), min(ratios), max(ratios)))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda", "all"], default="all",
                    help="suite mode: cpu, cuda, or all (default: the CPU, and CUDA when a GPU is present)")
    ap.add_argument("--suite", choices=["bench", "gpu", "gpu-d64", "gpu-d96", "gpu-dims"], default="bench",
                    help="suite mode: fusedattn-bench's shapes (default) or bench_gpu's (CUDA only)")
    ap.add_argument("--full", action="store_true", help="bench suite: every combination, like fusedattn-bench --full")
    ap.add_argument("--backends", default="flash,efficient,cudnn,flex",
                    help="CUDA kernels, comma-separated from flash, efficient, cudnn, math, flex "
                         "(default flash,efficient,cudnn,flex)")
    ap.add_argument("--flex-budget", type=float, default=240.0,
                    help="seconds FlexAttention may take in the suite mode, compiling included (default 240)")
    ap.add_argument("--block-sparse", metavar="DIR", help="block-sparse mode on the layouts bench_gpu's peer mode "
                                                         "wrote to DIR")
    ap.add_argument("--ours", metavar="JSONL", help="block-sparse mode: bench_gpu's JSON lines of the same run")
    ap.add_argument("--interleave", metavar="TILE_SWEEP", help="interleaved mode: path of fusedattn-tile-sweep")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved mode: rounds (default 5)")
    ap.add_argument("--shapes", default="1,8,512,64;1,1,4096,64;1,32,1024,128;1,32,512,64",
                    help="interleaved mode: B,H,S,D;... (default: four leaderboard shapes)")
    ap.add_argument("--thread-counts", default="1,%d" % (os.cpu_count() or 1),
                    help="interleaved mode: thread counts (default 1 and all)")
    ap.add_argument("--min-time", type=float, default=0.2, help="CPU: seconds per timed run (default 0.2)")
    ap.add_argument("--repetitions", type=int, default=3, help="CPU: timed runs per row, the median kept (default 3)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="suite mode: 'all threads' on the CPU")
    ap.add_argument("--cpu-types", default="f32,f16",
                    help="suite mode: the CPU rows' storage types, comma-separated (f32, f16, bf16; default f32,f16)")
    ap.add_argument("--backward", action="store_true",
                    help="suite mode: adds SDPA's backward, on the CPU fusedattn-bench's flash_bwd shapes (f32), on "
                         "CUDA bench/gpu/bench_backward.cu's (bf16, flash and cuDNN)")
    ap.add_argument("--decode", action="store_true",
                    help="decode mode (CUDA): SDPA's cuDNN and flash backends and FlexAttention's paged attention "
                         "on bench/gpu/bench_decode.cu's shapes")
    ap.add_argument("--ragged", action="store_true",
                    help="ragged mode (CUDA): varlen flash attention on bench/gpu/bench_ragged.cu's ragged batches")
    ap.add_argument("--iters", type=int, default=None,
                    help="CUDA --decode and --backward rows: timed calls, their mean kept (default 20 for --decode, "
                         "10 for --backward)")
    ap.add_argument("--list", action="store_true",
                    help="print the rows --decode or --backward would time (name, FLOPs, bytes) and run nothing")
    ap.add_argument("--filter", default="", help="suite mode: only rows whose name this regex matches (re.search)")
    ap.add_argument("--out", default="torch_peer.json", help="output JSON file (default torch_peer.json)")
    args = ap.parse_args()
    if sum(map(bool, (args.block_sparse, args.interleave, args.decode, args.ragged))) > 1:
        sys.exit("torch_peer: --block-sparse, --interleave, --decode and --ragged are separate modes")
    if TORCH_MISSING:
        if args.ragged:
            note("--ragged: %s: nothing timed" % TORCH_MISSING)
            return
        sys.exit("torch_peer: " + TORCH_MISSING)
    if args.ragged and args.device == "cpu":
        sys.exit("torch_peer: --ragged times CUDA varlen flash attention: use --device cuda")
    if args.decode and args.device == "cpu":
        sys.exit("torch_peer: --decode times CUDA SDPA: use --device cuda")
    if args.iters is not None and args.iters < 1:
        sys.exit("torch_peer: --iters must be at least 1, not %d" % args.iters)
    if args.list:
        list_rows(args)
        return
    if (args.decode or args.device == "cuda") and not torch.cuda.is_available():
        sys.exit("torch_peer: %s needs a GPU, and torch.cuda.is_available() is False" % (
            "--decode" if args.decode else "--device cuda"))
    if not hasattr(F, "scaled_dot_product_attention"):
        sys.exit("torch_peer: torch %s has no scaled_dot_product_attention (needs torch >= 2.3)" % torch.__version__)

    mode = ("--block-sparse" if args.block_sparse else "--interleave" if args.interleave else
            "--decode" if args.decode else "--ragged" if args.ragged else
            "--suite " + args.suite + (" --backward" if args.backward else ""))
    out = Output(args.out, mode)
    if args.block_sparse:
        run_block_sparse(args, out)
    elif args.interleave:
        run_interleaved(args, out)
    elif args.decode:
        run_decode(args, out)
    elif args.ragged:
        run_ragged(args, out)
    else:
        run_suite(args, out)
    out.write()
    note("wrote %d rows to %s" % (len(out.rows), args.out))


if __name__ == "__main__":
    main()
