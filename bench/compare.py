#!/usr/bin/env python3
"""Joins two fusedattn-bench JSON files (or one file with itself) and prints time ratios per shape.

    python3 bench/compare.py A.json B.json [--a REGEX] [--b REGEX]

Rows are joined on the problem (b, h, h_kv, s_q, s_kv, d), the storage type and mask of the label, and the
`threads` counter; every pair of kernels found for one problem is printed with both times and the speedup of A
over B (time_B / time_A: above 1 means A is faster). --a and --b keep only the rows of A and B whose name matches
(re.search), e.g. compare flash against the OpenBLAS peer of the same run:

    python3 bench/compare.py run.json run.json --a '^flash/' --b '^peer_openblas_naive/'
    python3 bench/compare.py run.json torch_cpu.json --b '^peer_torch_sdpa_cpu/'

The last line gives the geometric mean of the speedups.
"""

import argparse
import math
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_json  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a", help="JSON file A")
    ap.add_argument("b", help="JSON file B")
    ap.add_argument("--a", dest="a_re", default="", help="keep the rows of A whose name matches this regex")
    ap.add_argument("--b", dest="b_re", default="", help="keep the rows of B whose name matches this regex")
    args = ap.parse_args()
    _, rows_a = bench_json.load(args.a)
    _, rows_b = bench_json.load(args.b)
    rows_a = [r for r in rows_a if re.search(args.a_re, r["name"])]
    rows_b = [r for r in rows_b if re.search(args.b_re, r["name"])]
    by_key = {}
    for r in rows_b:
        by_key.setdefault(bench_json.shape_key(r), []).append(r)
    lines, speedups = [], []
    for ra in rows_a:
        key = bench_json.shape_key(ra)
        for rb in by_key.get(key, []):
            if rb is ra or (rb["name"] == ra["name"] and args.a == args.b):
                continue
            speedup = rb["seconds"] / ra["seconds"]
            speedups.append(speedup)
            lines.append((bench_json.shape_text(key), ra["kernel"], ra["seconds"] * 1e6, rb["kernel"],
                          rb["seconds"] * 1e6, speedup))
    if not lines:
        print("compare: no problem appears in both A and B (after --a / --b)")
        return 1
    w = max(len(line[0]) for line in lines)
    wk = max(max(len(line[1]), len(line[3])) for line in lines)
    print("%-*s  %-*s %12s  %-*s %12s  %8s" % (w, "problem", wk, "A", "A us", wk, "B", "B us", "B/A"))
    for shape, ka, ta, kb, tb, s in lines:
        print("%-*s  %-*s %12.1f  %-*s %12.1f  %7.2fx" % (w, shape, wk, ka, ta, wk, kb, tb, s))
    geo = math.exp(sum(math.log(s) for s in speedups) / len(speedups))
    print("geometric mean of B/A over %d pairs: %.2fx" % (len(speedups), geo))
    return 0


if __name__ == "__main__":
    sys.exit(main())
