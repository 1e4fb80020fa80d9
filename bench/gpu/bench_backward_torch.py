"""PyTorch SDPA's backward (flash and cuDNN backends) on bench_backward.cu's shapes: bf16, B·H = 16·16, S 1024-8192,
head_dim 64 and 128, dense and causal. One JSON line per shape and backend; TFLOP/s by 10·B·H·S²·D (halved for
causal). Usage: python3 bench_backward_torch.py [reps]"""
import json
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

reps = int(sys.argv[1]) if len(sys.argv) > 1 else 10
B, H = 16, 16
backends = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}
for d in (64, 128):
    for s in (1024, 2048, 4096, 8192):
        for causal in (False, True):
            q, k, v = (torch.randn(B, H, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
            grad = torch.randn(B, H, s, d, device="cuda", dtype=torch.bfloat16)
            for name, backend in backends.items():
                row = {"impl": name, "dtype": "bf16", "batch": B, "heads": H, "seq": s, "head_dim": d, "causal": causal}
                try:
                    with sdpa_kernel([backend]):
                        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                        for _ in range(2):
                            torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)
                        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        e0.record()
                        for _ in range(reps):
                            torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)
                        e1.record()
                        torch.cuda.synchronize()
                    ms = e0.elapsed_time(e1) / reps
                    flops = 10.0 * B * H * s * s * d * (0.5 if causal else 1.0)
                    row.update(ms=round(ms, 4), tflops=round(flops / (ms * 1e-3) / 1e12, 1))
                except Exception as exc:  # a backend that does not take the shape
                    row["error"] = str(exc).splitlines()[0][:200]
                print(json.dumps(row), flush=True)
            del q, k, v, grad
