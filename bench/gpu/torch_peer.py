"""PyTorch's attention on the same shapes as bench_attention.cu, for the same run on the same card: SDPA with the
flash backend, SDPA with the cuDNN backend, and FlexAttention (torch.compile). CUDA events, warm-up, median.
Usage: torch_peer.py OUT.jsonl [flex_budget_seconds] [d64|d96]; with "d64", the unmasked head_dim 64 shapes of
bench_gpu's d64 mode instead; with "d96", only the head_dim 96 shapes."""
import json
import math
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPES = [(1, 32, 2048, 128, False), (1, 32, 2048, 128, True), (2, 16, 8192, 128, False), (2, 16, 8192, 128, True),
          (1, 16, 16384, 128, False), (1, 16, 16384, 128, True), (4, 32, 4096, 64, False), (4, 32, 4096, 64, True),
          (1, 32, 1024, 128, False), (1, 1, 4096, 64, False), (1, 32, 512, 64, False), (4, 16, 4096, 256, False),
          (4, 16, 4096, 256, True), (4, 16, 4096, 96, False), (4, 16, 4096, 96, True)]
D64_SHAPES = [(8, 32, 512, 64, False), (8, 32, 1024, 64, False), (4, 32, 2048, 64, False), (4, 32, 4096, 64, False),
              (2, 32, 8192, 64, False)]


def median_ms(fn, sets):
    for i in range(3):
        fn(i % sets)
    torch.cuda.synchronize()
    times, total = [], 0.0
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    i = 0
    while i < 100 and (i < 10 or total < 300.0):
        start.record()
        fn(i % sets)
        stop.record()
        stop.synchronize()
        t = start.elapsed_time(stop)
        times.append(t)
        total += t
        i += 1
    times.sort()
    return times[len(times) // 2]


def flops(b, h, s, d, causal):
    return 4.0 * b * h * (s * (s + 1) / 2 if causal else s * s) * d


def inputs(b, h, s, d, dtype):
    """Input sets [Q, K, V] in [-1, 1), enough (at most 4) that one pass over them exceeds the L2 several times, and
    how many."""
    sets = max(1, min(4, math.ceil(4 * 60e6 / (3 * b * h * s * d * 2))))
    gen = torch.Generator(device="cuda").manual_seed(1)
    return [[torch.rand(b, h, s, d, device="cuda", dtype=dtype, generator=gen) * 2 - 1 for _ in range(3)]
            for _ in range(sets)], sets


def time_sdpa(qkv, sets, causal=False):
    """[(label, ms)] of SDPA's flash and cuDNN backends; a backend that fails is reported and left out."""
    runs = []
    for backend, label in ((SDPBackend.FLASH_ATTENTION, "torch sdpa flash"),
                           (SDPBackend.CUDNN_ATTENTION, "torch sdpa cudnn")):
        def call(i, backend=backend):
            with sdpa_kernel(backend):
                F.scaled_dot_product_attention(*qkv[i], is_causal=causal)
        try:
            runs.append((label, median_ms(call, sets)))
        except Exception as e:  # noqa: BLE001 - report and go on
            print(label, "failed:", e)
    return runs


def main():
    out = open(sys.argv[1], "w")
    flex_budget = float(sys.argv[2]) if len(sys.argv) > 2 else 240.0
    which = sys.argv[3] if len(sys.argv) > 3 else ""
    shapes = D64_SHAPES if which == "d64" else [c for c in SHAPES if c[3] == 96] if which == "d96" else SHAPES
    flex = None
    # One compiled FlexAttention per shape and mask: let dynamo keep them all instead of falling back to eager.
    torch._dynamo.config.recompile_limit = 256
    torch._dynamo.config.cache_size_limit = 256
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        flex = torch.compile(flex_attention)
    except Exception as e:  # noqa: BLE001 - report and go on without FlexAttention
        print("FlexAttention unavailable:", e)
    print("device:", torch.cuda.get_device_name(0), "torch", torch.__version__)
    t_flex = 0.0
    for dtype, name in ((torch.float16, "f16"), (torch.bfloat16, "bf16")):
        for (b, h, s, d, causal) in shapes:
            qkv, sets = inputs(b, h, s, d, dtype)
            runs = time_sdpa(qkv, sets, causal)
            if flex is not None and t_flex < flex_budget:
                t0 = time.time()
                try:
                    mask = None
                    if causal:
                        mask = create_block_mask(lambda b_, h_, q, k: q >= k, None, None, s, s)
                    runs.append(("torch flex", median_ms(lambda i: flex(*qkv[i], block_mask=mask), sets)))
                except Exception as e:  # noqa: BLE001
                    print("flex failed:", e)
                t_flex += time.time() - t0
            for label, ms in runs:
                tf = flops(b, h, s, d, causal) / (ms * 1e-3) / 1e12
                rec = dict(dtype=name, b=b, h=h, s=s, d=d, mask="causal" if causal else "dense", kernel=label, ms=ms,
                           tflops=round(tf, 2))
                out.write(json.dumps(rec) + "\n")
                out.flush()
                print(f"{name:5} ({b},{h:2},{s:5},{d:3}) {rec['mask']:6} {label:22} {ms:9.3f} ms {tf:7.1f} TFLOP/s")
            del qkv
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
