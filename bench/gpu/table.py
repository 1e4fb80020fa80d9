"""Joins the JSON lines of bench_attention and torch_peer.py into one table: per (dtype, shape, mask), TFLOP/s of
fusedattn's default flash, its best tile, and each PyTorch peer. Usage: table.py A.jsonl [B.jsonl ...]"""
import collections
import json
import sys

rows = collections.OrderedDict()
for path in sys.argv[1:]:
    try:
        lines = open(path).read().splitlines()
    except OSError:
        continue
    for line in lines:
        if not line.strip():
            continue
        r = json.loads(line)
        if "tflops" not in r:  # decode rows report GB/s; bench.log prints them
            continue
        key = (r["dtype"], r["b"], r["h"], r["s"], r["d"], r["mask"])
        rows.setdefault(key, {})[r["kernel"]] = r["tflops"]

cols = ["flash (default tile)", "flash mma.sync", "best tile", "flash", "naive 3-pass", "torch sdpa flash", "torch sdpa cudnn", "torch flex"]
print("TFLOP/s " + " | ".join(f"{c:>20}" for c in cols))
for key, k in rows.items():
    tiles = {n: v for n, v in k.items() if n.startswith("flash w")}
    best = max(tiles.items(), key=lambda kv: kv[1]) if tiles else None
    vals = []
    for c in cols:
        if c == "best tile":
            vals.append(f"{best[1]:7.1f} ({best[0][6:]})" if best else "")
        else:
            vals.append(f"{k[c]:.1f}" if c in k else "")
    print("%-4s %s %-6s " % (key[0], "(%d,%d,%d,%d)" % key[1:5], key[5]) + " | ".join(f"{v:>20}" for v in vals))
