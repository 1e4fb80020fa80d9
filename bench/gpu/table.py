"""Joins bench_gpu's JSON lines and bench/peers/torch_peer.py's JSON (fusedattn-bench's schema) into one table: per
(dtype, shape, mask), TFLOP/s of fusedattn's default flash, its portable kernel, its best tile, and each PyTorch peer.
Usage: table.py FILE [FILE ...] (each either JSON lines of bench_gpu or one JSON document of torch_peer.py)."""
import collections
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import bench_json  # noqa: E402

PEER_COLUMNS = {"peer_torch_flash": "torch sdpa flash", "peer_torch_cudnn": "torch sdpa cudnn",
                "peer_torch_efficient": "torch sdpa efficient", "peer_torch_flex": "torch flex"}
COLUMNS = ["flash (default tile)", "flash mma.sync", "best tile", "flash", "naive 3-pass", "torch sdpa flash",
           "torch sdpa cudnn", "torch flex"]


def records(path):
    """(dtype, b, h, s, d, mask, kernel column, TFLOP/s) of one file's rows that carry a FLOP rate."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return
    try:
        doc = json.loads(text)
    except ValueError:
        doc = None
    if isinstance(doc, dict) and "benchmarks" in doc:
        _, rows = bench_json.load(path)
        for r in rows:
            if r["kernel"] in PEER_COLUMNS and r.get("s_q") == r.get("s_kv") and "FLOP/s" in r:
                yield (r["dtype"], int(r["b"]), int(r["h"]), int(r["s_q"]), int(r["d"]), r["mask"],
                       PEER_COLUMNS[r["kernel"]], r["FLOP/s"] / 1e12)
        return
    for line in text.splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        if "tflops" in r:  # decode rows report GB/s; bench.log prints them
            yield r["dtype"], r["b"], r["h"], r["s"], r["d"], r["mask"], r["kernel"], r["tflops"]


def main():
    rows = collections.OrderedDict()
    for path in sys.argv[1:]:
        for dtype, b, h, s, d, mask, kernel, tflops in records(path):
            rows.setdefault((dtype, b, h, s, d, mask), {})[kernel] = tflops
    print("TFLOP/s " + " | ".join(f"{c:>20}" for c in COLUMNS))
    for key, k in rows.items():
        tiles = {n: v for n, v in k.items() if n.startswith("flash w")}
        best = max(tiles.items(), key=lambda kv: kv[1]) if tiles else None
        vals = []
        for c in COLUMNS:
            if c == "best tile":
                vals.append(f"{best[1]:7.1f} ({best[0][6:]})" if best else "")
            else:
                vals.append(f"{k[c]:.1f}" if c in k else "")
        print("%-4s %s %-6s " % (key[0], "(%d,%d,%d,%d)" % key[1:5], key[5]) + " | ".join(f"{v:>20}" for v in vals))


if __name__ == "__main__":
    main()
