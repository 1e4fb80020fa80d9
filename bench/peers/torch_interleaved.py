#!/usr/bin/env python3
"""Times PyTorch's CPU SDPA and fusedattn's CPU flash on the same shapes, interleaved: for each round, shape and
thread count, one timing of each back to back (the order alternates per round), so a machine whose speed drifts
(a shared VM host) slows both sides of a pair alike. Reports per row the median time of each over the rounds and
the median of the per-round ratios (torch time / ours: above 1 means fusedattn is faster).

    python3 bench/peers/torch_interleaved.py --ours build/bench/fusedattn-tile-sweep [--rounds 5]
        [--shapes "B,H,S,D;..."] [--threads 1,16] [--min-time SECONDS] [--repetitions N] [--out FILE]

Ours is timed by fusedattn-tile-sweep (f32, dense, policy::cpu<> with the heuristic tiles: the same call as
fusedattn-bench's flash rows), torch by torch.nn.functional.scaled_dot_product_attention under
torch.set_num_threads(T) on uniform [-1, 1) f32 inputs; both report the median of --repetitions timed runs of a
call count calibrated to --min-time. Correctness is checked elsewhere (torch_sdpa.py, the test suite).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_sdpa  # noqa: E402


def time_ours(binary, shape, threads, min_time, repetitions):
    """Median seconds per call of fusedattn's flash on `shape` with `threads` threads (fusedattn-tile-sweep)."""
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


def time_torch(shape, threads, min_time, repetitions):
    """Median seconds per call of torch's CPU SDPA on `shape` with `threads` threads."""
    torch.set_num_threads(threads)
    q, k, v = torch_sdpa.inputs(shape, "f32", "cpu", seed=1)
    with torch.inference_mode():
        seconds, _ = torch_sdpa.time_call(lambda: F.scaled_dot_product_attention(q, k, v), lambda: None,
                                          min_time, repetitions)
    return seconds


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ours", required=True, help="path of fusedattn-tile-sweep")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--shapes", default="1,8,512,64;1,1,4096,64;1,32,1024,128;1,32,512,64")
    ap.add_argument("--threads", default="1,%d" % (os.cpu_count() or 1))
    ap.add_argument("--min-time", type=float, default=0.3, help="seconds per timed run of each side")
    ap.add_argument("--repetitions", type=int, default=3)
    ap.add_argument("--out", default="torch_interleaved.json")
    args = ap.parse_args()

    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes.split(";") if s]
    threads = [int(t) for t in args.threads.split(",")]
    rows = {(sh, t): {"torch": [], "ours": []} for sh in shapes for t in threads}
    for r in range(args.rounds):
        for sh in shapes:
            for t in threads:
                sides = ["torch", "ours"] if r % 2 == 0 else ["ours", "torch"]
                for side in sides:
                    if side == "torch":
                        sec = time_torch(sh, t, args.min_time, args.repetitions)
                    else:
                        sec = time_ours(args.ours, sh, t, args.min_time, args.repetitions)
                    rows[(sh, t)][side].append(sec)
                print("round %d %-16s t%-3d torch %10.1f us  ours %10.1f us" % (
                    r, "(%d,%d,%d,%d)" % sh, t, rows[(sh, t)]["torch"][-1] * 1e6, rows[(sh, t)]["ours"][-1] * 1e6),
                    file=sys.stderr)

    out = []
    print("%-18s %7s %12s %12s %14s %18s" % ("problem", "threads", "torch us", "ours us", "torch/ours", "per-round range"))
    for (sh, t), v in rows.items():
        ratios = [a / b for a, b in zip(v["torch"], v["ours"])]
        row = {"b": sh[0], "h": sh[1], "s": sh[2], "d": sh[3], "threads": t,
               "torch_us": [x * 1e6 for x in v["torch"]], "ours_us": [x * 1e6 for x in v["ours"]], "ratios": ratios,
               "median_ratio": statistics.median(ratios)}
        out.append(row)
        print("%-18s %7d %12.1f %12.1f %13.2fx %8.2fx .. %.2fx" % (
            "(%d,%d,%d,%d)" % sh, t, statistics.median(v["torch"]) * 1e6, statistics.median(v["ours"]) * 1e6,
            row["median_ratio"], min(ratios), max(ratios)))
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({"torch": torch.__version__, "rounds": args.rounds, "min_time": args.min_time,
                   "repetitions": args.repetitions, "rows": out}, f, indent=2)


if __name__ == "__main__":
    main()
