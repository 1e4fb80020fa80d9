#!/usr/bin/env python3
"""Draws the bench pictures from fusedattn-bench JSON (Python 3 + matplotlib).

    python3 bench/plot.py RESULTS.json [MORE.json ...] [--out DIR] [--filter REGEX] [--into-source-tree]

It refuses to write into the fusedattn source tree (docs/img holds the project's own pictures) unless
--into-source-tree says so; folders the tree ignores (build*/, ...) are fine.

roofline.png: the two roofs (memory: AI x bandwidth, compute: the FMA peak) for each thread count measured at the
start of the run, and one labelled dot per row at (modelled arithmetic intensity, achieved GFLOP/s). --filter keeps
the rows whose name matches; --time cpu rates them on CPU time (1-thread rows on a busy machine).
sparsity.png (only when rows named block_sparse/... with a `sparsity` counter are present): speedup against
sparsity (achieved: 1 - the row's `density` when present, else the requested `sparsity`), one curve per
(S, block shape); the speedup of a row is its `dense_us` counter (dense flash timed in the
same sweep, as bench/block_sparse_sweep.cpp writes) over its own time, else the time of the sparsity-0 row of its
curve (or of the dense flash row of the same shape) over its own time.
The roofs come from the first file whose context carries them (fusedattn_peak_flops_threads_N, ...).
"""

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_json  # noqa: E402

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

GIGA = 1e9
KERNEL_COLOURS = ["tab:red", "tab:blue", "tab:green", "tab:purple", "tab:orange", "tab:brown", "tab:pink",
                  "tab:olive", "tab:cyan", "tab:gray"]


def short_label(row):
    """'s512 h8' (plus d when it is not 64)."""
    s = "s%d" % row["s_q"] if row["s_q"] == row["s_kv"] else "s%dx%d" % (row["s_q"], row["s_kv"])
    text = "%s h%d" % (s, row["h"])
    if int(row["d"]) != 64:
        text += " d%d" % row["d"]
    if row["mask"] != "dense":
        text += " " + row["mask"]
    return text


def plot_roofline(rows, roofs, path, title, bf16_roofs=None):
    points = [r for r in rows if r.get("flop", 0) > 0 and r.get("bytes", 0) > 0 and r["seconds"] > 0]
    if not points:
        print("plot: no row with flop and bytes counters; roofline.png not drawn", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(11, 7.5))
    ai = [r["flop"] / r["bytes"] for r in points]
    used = {int(r.get("threads", 1)) for r in points}
    roofs = {t: roof for t, roof in roofs.items() if t in used}
    x_lo = min(ai + [peak / bw for peak, bw in roofs.values()]) / 3
    x_hi = max(ai + [peak / bw for peak, bw in roofs.values()]) * 3
    styles = ["-", "--", ":", "-."]
    for i, (threads, (peak, bw)) in enumerate(sorted(roofs.items())):
        ridge = peak / bw
        ls = styles[i % len(styles)]
        ax.plot([x_lo, ridge], [x_lo * bw / GIGA, peak / GIGA], color="black", ls=ls, lw=1.2)
        ax.plot([ridge, x_hi], [peak / GIGA, peak / GIGA], color="black", ls=ls, lw=1.2,
                label="%d thread%s: peak %.0f GFLOP/s, %.1f GB/s" % (threads, "" if threads == 1 else "s",
                                                                     peak / GIGA, bw / GIGA))
    for i, (threads, peak) in enumerate(sorted((bf16_roofs or {}).items())):
        if threads not in roofs:
            continue
        bw = roofs[threads][1]
        ax.plot([peak / bw, x_hi], [peak / GIGA, peak / GIGA], color="grey", ls=styles[i % len(styles)], lw=1.2,
                label="%d thread%s: bf16 dot-product peak %.0f GFLOP/s" % (threads, "" if threads == 1 else "s",
                                                                          peak / GIGA))
    kernels = sorted({r["kernel"] for r in points})
    colour = {k: KERNEL_COLOURS[i % len(KERNEL_COLOURS)] for i, k in enumerate(kernels)}
    seen = set()
    for r, x in zip(points, ai):
        y = r["flop"] / r["seconds"] / GIGA
        threads = int(r.get("threads", 1))
        marker = "o" if threads == 1 else "s"
        hollow = r["dtype"] != "f32"
        key = (r["kernel"], r["dtype"], threads)
        ax.plot([x], [y], marker=marker, ms=6, ls="none", color=colour[r["kernel"]],
                markerfacecolor="none" if hollow else colour[r["kernel"]],
                label=None if key in seen else "%s %s, %d thread%s" % (key[0], key[1], threads,
                                                                     "" if threads == 1 else "s"))
        seen.add(key)
        ax.annotate(short_label(r), (x, y), textcoords="offset points", xytext=(4, 2), fontsize=5.5,
                    color=colour[r["kernel"]])
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(x_lo, x_hi)
    ax.set_xlabel("arithmetic intensity (FLOP per byte of the kernel's modelled traffic)")
    ax.set_ylabel("achieved GFLOP/s")
    ax.set_title(title)
    ax.grid(True, which="both", lw=0.3, alpha=0.5)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    print("plot: wrote %s (%d rows)" % (path, len(points)))


def block_shape(row):
    """(block_q, block_kv) from the counters, else from an 'AxB' or 'bqA_bkvB' token of the name."""
    if "block_q" in row and "block_kv" in row:
        return int(row["block_q"]), int(row["block_kv"])
    m = re.search(r"(?:^|[/_])(\d+)x(\d+)(?:$|[/_])", row["name"]) or re.search(r"bq(\d+)_bkv(\d+)", row["name"])
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def plot_sparsity(rows, path, title):
    sparse = [r for r in rows if r["kernel"] == "block_sparse" and "sparsity" in r]
    if not sparse:
        return
    flash = {bench_json.shape_key(r): r["seconds"] for r in rows if r["kernel"] == "flash"}

    def curve_key(r):
        bq, bkv = block_shape(r)
        frame = r.get("frame", 0)
        return (int(r["s_q"]), int(r["s_kv"]), bq, bkv, int(r["h"]), int(r["d"]), r["dtype"], int(r.get("threads", 1)),
                frame)

    curves = {}
    for r in sparse:
        curves.setdefault(curve_key(r), []).append(r)
    fig, ax = plt.subplots(figsize=(9, 6))
    drawn = 0
    for key, members in sorted(curves.items()):
        members.sort(key=lambda r: (1.0 - r["density"]) if "density" in r else r["sparsity"])
        if all("dense_us" in r for r in members):
            # The sweep timed dense flash interleaved with each row: the speedup over that.
            speedups = [r["dense_us"] * 1e-6 / r["seconds"] for r in members]
        else:
            zero = [r for r in members if r["sparsity"] == 0]
            base = zero[0]["seconds"] if zero else flash.get(bench_json.shape_key(members[0]))
            if not base:
                print("plot: no dense_us, sparsity-0 or flash row for %s; curve skipped" % (key,), file=sys.stderr)
                continue
            speedups = [base / r["seconds"] for r in members]
        s_q, s_kv, bq, bkv, h, d, dtype, threads, frame = key
        s = "S=%d" % s_q if s_q == s_kv else "S=%dx%d" % (s_q, s_kv)
        label = "%s, %dx%d blocks, h%d d%d %s t%d%s" % (s, bq, bkv, h, d, dtype, threads, ", frame" if frame else "")
        # The achieved sparsity, 1 - density, where the sweep recorded it: with few kv blocks per row the
        # requested sparsity rounds to whole blocks (2 blocks per row can only drop 0, 1 or 2 of them).
        xs = [1.0 - r["density"] if "density" in r else r["sparsity"] for r in members]
        ax.plot(xs, speedups, marker="o", ms=4, label=label)
        drawn += 1
    if not drawn:
        plt.close(fig)
        return
    xs = [i / 100 for i in range(0, 91)]
    ax.plot(xs, [1 / (1 - x) for x in xs], color="black", ls=":", lw=1, label="ideal 1/(1 - sparsity)")
    ax.set_xlabel("sparsity achieved (1 - fraction of score blocks visited)")
    ax.set_ylabel("speedup over dense flash (or over sparsity 0)")
    ax.set_title(title)
    ax.grid(True, lw=0.3, alpha=0.5)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    print("plot: wrote %s (%d curves)" % (path, drawn))


SOURCE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def inside_source_tree(folder):
    """True when `folder` lies in the fusedattn tree this script belongs to, outside its ignored folders."""
    path = os.path.realpath(folder)
    root = os.path.realpath(SOURCE_ROOT)
    if os.path.commonpath([path, root]) != root:
        return False
    first = os.path.relpath(path, root).split(os.sep)[0]
    # The tree's .gitignore keeps /build*/ and dot folders out of the repository.
    return not (first.startswith("build") or (first.startswith(".") and first != "."))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", nargs="+", help="fusedattn-bench JSON files (--benchmark_out=FILE)")
    ap.add_argument("--out", default=".", help="directory for roofline.png and sparsity.png (default: .)")
    ap.add_argument("--time", choices=["real", "cpu"], default="real",
                    help="roofline: rate on wall time (default) or on the timing thread's CPU time, which is the "
                         "kernel's own work for 1-thread rows on a machine shared with other jobs")
    ap.add_argument("--filter", default="", help="roofline: keep only the rows whose name matches (re.search)")
    ap.add_argument("--into-source-tree", action="store_true",
                    help="allow --out inside the fusedattn source tree (e.g. docs/img, to replace the project's "
                         "pictures on purpose)")
    args = ap.parse_args()
    if inside_source_tree(args.out) and not args.into_source_tree:
        sys.exit("plot: --out %s lies in the fusedattn source tree (%s), where it would overwrite the project's "
                 "own pictures; write under build/ or outside the tree, or pass --into-source-tree"
                 % (args.out, SOURCE_ROOT))
    rows, roofs, context = [], {}, {}
    for path in args.json:
        ctx, r = bench_json.load(path)
        rows += r
        if not roofs:
            roofs, context = bench_json.ceilings(ctx), ctx
    os.makedirs(args.out, exist_ok=True)
    where = "%s, %s CPUs, %s" % (context.get("host_name", "?"), context.get("num_cpus", "?"),
                                 context.get("date", "?")[:10])
    picked = [r for r in rows if re.search(args.filter, r["name"])]
    if args.time == "cpu":
        for r in picked:
            r["seconds"] = r["cpu_seconds"]
        where += ", rates on CPU time"
    plot_roofline(picked, roofs, os.path.join(args.out, "roofline.png"), "fusedattn roofline (%s)" % where,
                  bench_json.bf16_peaks(context))
    plot_sparsity(rows, os.path.join(args.out, "sparsity.png"), "block-sparse speedup vs sparsity (%s)" % where)


if __name__ == "__main__":
    main()
