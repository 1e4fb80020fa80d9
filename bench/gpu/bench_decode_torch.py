#!/usr/bin/env python3
"""PyTorch's SDPA (cuDNN and flash backends) on bench_decode.cu's shapes: GQA decode, 32 query heads / 8 kv heads,
head_dim 128, bf16, one query row per sequence, batch 1, 8, 64 x S_kv 4096, 32768, 131072, K and V contiguous
(B, 8, S, 128) passed with enable_gqa=True. Each call reads another copy of K/V (copies spanning at least 1 GiB), as
bench_decode does. Prints `decode/bf16/torch_<backend>/b{B}_h32_hkv8_skv{S}_d128  <us> us  <GB/s> GB/s` (bytes =
K+V read), or why a backend refused the shape.

usage: python3 bench/gpu/bench_decode_torch.py [--iters N]
"""
import argparse

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
import torch.nn.functional as F


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    heads, heads_kv, d = 32, 8, 128
    print("# device", torch.cuda.get_device_name(0), "torch", torch.__version__, "cuDNN", torch.backends.cudnn.version())
    for batch in (1, 8, 64):
        for s_kv in (4096, 32768, 131072):
            per = batch * heads_kv * s_kv * d * 2  # bytes of K (and of V)
            copies = max(1, min(8, -(-(1 << 30) // (2 * per))))
            q = torch.randn(batch, heads, 1, d, device="cuda", dtype=torch.bfloat16)
            kv = [(torch.randn(batch, heads_kv, s_kv, d, device="cuda", dtype=torch.bfloat16),
                   torch.randn(batch, heads_kv, s_kv, d, device="cuda", dtype=torch.bfloat16)) for _ in range(copies)]
            for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
                label = "decode/bf16/torch_%s/b%d_h%d_hkv%d_skv%d_d%d" % (name, batch, heads, heads_kv, s_kv, d)
                try:
                    with sdpa_kernel([backend]):
                        def call(c):
                            k, v = kv[c % copies]
                            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
                        for c in range(min(3 * copies, 24)):
                            call(c)
                        torch.cuda.synchronize()
                        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        a.record()
                        for c in range(args.iters):
                            call(c)
                        b.record()
                        b.synchronize()
                        us = a.elapsed_time(b) * 1000.0 / args.iters
                    print("%-52s %10.1f us %8.1f GB/s" % (label, us, 2 * per / us * 1e-3), flush=True)
                except Exception as e:  # a backend that refuses the shape says why
                    print("%-52s refused: %s" % (label, str(e).splitlines()[0][:150]), flush=True)
            del kv
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
