"""FlexAttention's block-sparse speed-up on the layouts of bench_gpu's block-sparse suite (written by
`bench_gpu OUT.jsonl peer DIR`), beside dense SDPA (cuDNN, flash) and dense FlexAttention, for the same run on the same
card; then the dense kernels on (10,16,1024,128) ("short items": 1280 items of 128 query rows x 1024 keys, as long as
the block-sparse items at S 10000). CUDA events, warm-up, median, as torch_peer.py; the FlexAttention rows also per call
with 10 calls queued back to back (as bench_gpu's queued figures). The first FlexAttention call of each shape and mask
compiles (torch.compile). Usage: sparse_peer.py OUT.jsonl DIR [FUSEDATTN.jsonl]; with bench_gpu's JSON lines of the
same run, the summary puts its block-sparse and short-item figures beside these."""
import json
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# The same timing, inputs and SDPA calls as torch_peer.py (this directory is on sys.path when run).
from torch_peer import inputs, median_ms, time_sdpa

H, D, SPARSITY = 16, 128, 0.9  # bench_gpu's block-sparse suite: B 1, f16, 128 x 512 blocks, seed 42
SEQS = (4096, 10000)
SHORT = (10, 16, 1024, 128)  # (B, H, S, D)
QUEUED = 10
PAD_BLOCKS = 8  # False blocks past the layout, for indices past the sequence a mask_mod may be asked about


def median_ms_queued(fn, sets, calls=QUEUED):
    """Median ms of one call with `calls` calls queued between two events (the host's work overlaps the previous
    call's kernels): 3 warm-up rounds, 30 rounds."""
    for i in range(3 * calls):
        fn(i % sets)
    torch.cuda.synchronize()
    times = []
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for r in range(30):
        start.record()
        for i in range(calls):
            fn((r * calls + i) % sets)
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / calls)
    times.sort()
    return times[len(times) // 2]


def read_layout(path):
    """bench_gpu's layout file: "seq_q seq_kv block_q block_kv batch heads", then row_offsets, then cols (CSR).
    Row r = (b * heads + h) * n_q + q_block lists the active kv-blocks of q-block row q_block of pattern b * heads + h
    (queries [q_block * block_q, (q_block + 1) * block_q)); kv-block kb holds keys [kb * block_kv, (kb + 1) * block_kv),
    both clipped to the sequence."""
    with open(path) as f:
        lines = f.read().splitlines()
    seq_q, seq_kv, block_q, block_kv, batch, heads = (int(x) for x in lines[0].split())
    offsets = [int(x) for x in lines[1].split()]
    cols = [int(x) for x in lines[2].split()] if len(lines) > 2 else []
    n_q, n_kv = -(-seq_q // block_q), -(-seq_kv // block_kv)
    if len(offsets) != batch * heads * n_q + 1 or offsets[0] != 0 or offsets[-1] != len(cols):
        raise ValueError(f"{path}: row_offsets do not describe {batch * heads * n_q} rows of {len(cols)} cols")
    if any(c < 0 or c >= n_kv for c in cols):
        raise ValueError(f"{path}: a kv-block index outside [0, {n_kv})")
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
    blocks = len(lay["cols"]) / (patterns * lay["n_q"] * lay["n_kv"])
    pairs = sum(min(lay["block_q"], lay["seq_q"] - qb * lay["block_q"]) *
                min(lay["block_kv"], lay["seq_kv"] - kb * lay["block_kv"]) for _, qb, kb in active_blocks(lay))
    return blocks, pairs / (patterns * lay["seq_q"] * lay["seq_kv"])


def block_table(lay):
    """Boolean [patterns, n_q + PAD_BLOCKS, n_kv + PAD_BLOCKS] on the device, True where a block is active."""
    t = torch.zeros(lay["batch"] * lay["heads"], lay["n_q"] + PAD_BLOCKS, lay["n_kv"] + PAD_BLOCKS, dtype=torch.bool)
    idx = torch.tensor(active_blocks(lay), dtype=torch.long)
    t[idx[:, 0], idx[:, 1], idx[:, 2]] = True
    return t.cuda()


def layout_mask_mod(table, block_q, block_kv):
    """FlexAttention mask_mod of a block_table (batch 1, one pattern per head)."""
    def mask_mod(b, h, q_idx, kv_idx):
        return table[h, q_idx // block_q, kv_idx // block_kv]
    return mask_mod


def element_mask(lay, table):
    """The layout as an SDPA attn_mask: boolean [1, patterns, seq_q, seq_kv] (batch 1, one pattern per head)."""
    qi = torch.arange(lay["seq_q"], device="cuda") // lay["block_q"]
    ki = torch.arange(lay["seq_kv"], device="cuda") // lay["block_kv"]
    return table[:, qi[:, None], ki[None, :]].unsqueeze(0)


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    out = open(sys.argv[1], "w")
    layout_dir = sys.argv[2]
    # One compiled FlexAttention per shape and mask (dynamic=False): let dynamo keep them all.
    for key in ("recompile_limit", "cache_size_limit"):
        try:
            setattr(torch._dynamo.config, key, 256)
        except Exception:  # noqa: BLE001 - a name this version lacks
            pass
    flex = create_block_mask = None
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        flex = torch.compile(flex_attention, dynamic=False)
    except Exception as e:  # noqa: BLE001 - report and go on without FlexAttention
        print("FlexAttention unavailable:", e)
    print("device:", torch.cuda.get_device_name(0), "torch", torch.__version__, "cuDNN",
          torch.backends.cudnn.version())

    def emit(rec, flop):
        rec["tflops"] = round(flop / (rec["ms"] * 1e-3) / 1e12, 2)
        out.write(json.dumps(rec) + "\n")
        out.flush()
        print(f"{rec['dtype']:5} ({rec['b']},{rec['h']:2},{rec['s']:5},{rec['d']:3}) {rec['mask']:17} "
              f"{rec['kernel']:24} {rec['ms']:9.4f} ms {rec['tflops']:7.1f} TFLOP/s"
              + (f"  queued {rec['queued_ms']:.4f} ms" if "queued_ms" in rec else ""))

    def flex_timed(label, fn, sets):
        """(single-call ms, queued ms) of a FlexAttention call, or None; prints the first (compiling) calls' time."""
        t0 = time.time()
        try:
            fn(0)
            torch.cuda.synchronize()
            t1 = time.time()
            ms = median_ms(fn, sets)
            queued = median_ms_queued(fn, sets)
            print(f"      {label}: first call {t1 - t0:.1f} s (compiles, unless an earlier call did)")
            return ms, queued
        except Exception as e:  # noqa: BLE001
            print(label, "failed:", e)
            return None

    summary = {}
    for s in SEQS:
        try:
            lay = read_layout(f"{layout_dir}/layout_{s}.txt")
        except Exception as e:  # noqa: BLE001
            print(f"S {s}: no layout:", e)
            continue
        if (lay["seq_q"], lay["seq_kv"], lay["batch"], lay["heads"]) != (s, s, 1, H):
            print(f"S {s}: the layout is for another shape:", lay["seq_q"], lay["seq_kv"], lay["batch"], lay["heads"])
            continue
        block_frac, pair_frac = fractions(lay)
        per_row = [lay["offsets"][r + 1] - lay["offsets"][r] for r in range(len(lay["offsets"]) - 1)]
        print(f"S {s}: {len(per_row)} rows of {lay['block_q']}x{lay['block_kv']} blocks, "
              f"{min(per_row)}..{max(per_row)} per row, active fraction {block_frac:.4f} (pairs {pair_frac:.4f})")
        dense_flop = 4.0 * H * s * s * D
        base = dict(dtype="f16", b=1, h=H, s=s, d=D)
        qkv, sets = inputs(1, H, s, D, torch.float16)
        dense = dict(time_sdpa(qkv, sets))
        for label, ms in dense.items():
            emit(dict(base, mask="dense", kernel=label, ms=ms), dense_flop)
        res = dict(dense)
        if flex is not None:
            r = flex_timed("torch flex dense", lambda i: flex(*qkv[i]), sets)
            if r:
                res["torch flex"], res["torch flex queued"] = r
                emit(dict(base, mask="dense", kernel="torch flex", ms=r[0], queued_ms=r[1]), dense_flop)
            try:
                table = block_table(lay)
                mask_mod = layout_mask_mod(table, lay["block_q"], lay["block_kv"])
                t0 = time.time()
                try:  # BLOCK_SIZE 128: a 512-key block is four of Flex's blocks
                    bm = create_block_mask(mask_mod, 1, H, s, s, device="cuda")
                except Exception as e:  # noqa: BLE001 - e.g. out of memory for the element mask: build it compiled
                    print("      create_block_mask failed, compiling it:", e)
                    torch.cuda.empty_cache()
                    bm = torch.compile(create_block_mask)(mask_mod, 1, H, s, s, device="cuda")
                try:
                    flex_sparsity = float(bm.sparsity())
                except Exception:  # noqa: BLE001
                    flex_sparsity = None
                print(f"      create_block_mask {time.time() - t0:.1f} s, BlockMask sparsity {flex_sparsity}%")
                if s == SEQS[0]:  # light check: Flex block-sparse against SDPA with the layout as a boolean attn_mask
                    q, k, v = qkv[0]
                    o_flex = flex(q, k, v, block_mask=bm).float()
                    m = element_mask(lay, table)
                    for backend, name, dt in ((SDPBackend.EFFICIENT_ATTENTION, "sdpa efficient f16", torch.float16),
                                              (SDPBackend.MATH, "sdpa math f32", torch.float32)):
                        try:
                            with sdpa_kernel(backend):
                                o_ref = F.scaled_dot_product_attention(q.to(dt), k.to(dt), v.to(dt), attn_mask=m)
                            diff = (o_flex - o_ref.float()).abs().max().item()
                            print(f"      check S {s}: flex block-sparse vs {name} with the layout as attn_mask: "
                                  f"max abs difference {diff:.2e}" + ("" if diff < 1e-2 else "  <-- MISMATCH"))
                            out.write(json.dumps(dict(base, kernel="check flex block-sparse", reference=name,
                                                      max_abs_diff=diff)) + "\n")
                            del o_ref
                        except Exception as e:  # noqa: BLE001
                            print(f"      check vs {name} failed:", e)
                    del m, o_flex
                    torch.cuda.empty_cache()
                r = flex_timed("torch flex block-sparse", lambda i: flex(*qkv[i], block_mask=bm), sets)
                if r:
                    res["torch flex block-sparse"], res["torch flex block-sparse queued"] = r
                    rec = dict(base, mask=f"block_sparse {SPARSITY:.2f}", kernel="torch flex block-sparse", ms=r[0],
                               queued_ms=r[1], active_fraction=round(block_frac, 4), pair_fraction=round(pair_frac, 4),
                               ideal_speedup=round(1 / block_frac, 2), flex_block_mask_sparsity=flex_sparsity)
                    if "torch flex" in res:
                        rec["speedup"] = round(res["torch flex"] / r[0], 2)
                        rec["queued_speedup"] = round(res["torch flex queued"] / r[1], 2)
                    for label, key in (("torch sdpa cudnn", "speedup_vs_cudnn"), ("torch sdpa flash",
                                                                                  "speedup_vs_sdpa_flash")):
                        if label in res:
                            rec[key] = round(res[label] / r[0], 2)
                    emit(rec, dense_flop * block_frac)
            except Exception as e:  # noqa: BLE001
                print("flex block-sparse failed:", e)
        summary[s] = (res, block_frac)
        del qkv
        torch.cuda.empty_cache()

    b, h, s, d = SHORT
    short_flop = 4.0 * b * h * s * s * d
    short = {}
    for dtype, name in ((torch.float16, "f16"), (torch.bfloat16, "bf16")):
        qkv, sets = inputs(b, h, s, d, dtype)
        res = dict(time_sdpa(qkv, sets))
        for label, ms in res.items():
            emit(dict(dtype=name, b=b, h=h, s=s, d=d, mask="dense", kernel=label, ms=ms), short_flop)
        if flex is not None:
            r = flex_timed("torch flex dense", lambda i: flex(*qkv[i]), sets)
            if r:
                res["torch flex"] = r[0]
                emit(dict(dtype=name, b=b, h=h, s=s, d=d, mask="dense", kernel="torch flex", ms=r[0], queued_ms=r[1]),
                     short_flop)
        short[name] = res
        del qkv
        torch.cuda.empty_cache()

    ours = {}  # bench_gpu's rows of the same run, when given
    if len(sys.argv) > 3:
        try:
            for line in open(sys.argv[3]):
                if line.strip():
                    rec = json.loads(line)
                    if rec.get("kernel") == "block-sparse vs dense flash":
                        ours[rec["s"]] = rec
                    elif rec.get("kernel") == "flash (default tile)" and (
                            rec["b"], rec["h"], rec["s"], rec["d"]) == SHORT:
                        ours[rec["dtype"]] = rec
        except Exception as e:  # noqa: BLE001
            print("cannot read", sys.argv[3], ":", e)

    print("\n== summary (ms; speed-up = dense / block-sparse)")
    for s, (res, block_frac) in summary.items():
        g = lambda k: res.get(k, float("nan"))  # noqa: E731
        sp, sp_queued = g("torch flex block-sparse"), g("torch flex block-sparse queued")
        print(f"S {s:5} (1,{H},{s},{D}) f16, block-sparse {SPARSITY:.2f}, active {block_frac:.4f} (ideal "
              f"{1 / block_frac:.2f}x): flex dense {g('torch flex'):.4f}, flex block-sparse {sp:.4f} -> "
              f"{g('torch flex') / sp:.2f}x (queued {g('torch flex queued') / sp_queued:.2f}x); "
              f"cuDNN dense {g('torch sdpa cudnn'):.4f} -> {g('torch sdpa cudnn') / sp:.2f}x; "
              f"sdpa flash dense {g('torch sdpa flash'):.4f}")
        if s in ours:
            o = ours[s]
            print(f"        fusedattn: dense flash {o['dense_ms']:.4f}, block-sparse (device layout) "
                  f"{o['device_layout_ms']:.4f} -> {o['device_layout_speedup']:.2f}x (queued "
                  f"{o['device_layout_queued_speedup']:.2f}x); flex block-sparse / fusedattn block-sparse "
                  f"{sp / o['device_layout_ms']:.2f}")
    for name, res in short.items():
        line = ", ".join(f"{k} {ms:.4f} ({short_flop / (ms * 1e-3) / 1e12:.0f} TFLOP/s)" for k, ms in res.items())
        if name in ours:
            line += f", fusedattn flash {ours[name]['ms']:.4f} ({ours[name]['tflops']:.0f} TFLOP/s)"
        print(f"short items {name} {SHORT}: {line}")


if __name__ == "__main__":
    main()
