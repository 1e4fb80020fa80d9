#!/usr/bin/env python3
"""Writes the assignment report's skeleton (Markdown) from one run of the harness on this machine.

    python3 report.py --harness build/assignment [--out build/report] [--quick]
    python3 report.py --json build/assignment.json [--out build/report]      (a JSON the harness wrote before)
    cmake --build build --target report                                     (the same, from the build)

It runs the harness with --json (or reads the JSON given), then writes OUT/report.md: the correctness table, the
timings at S = 128, 512 and 1024 (yours, fusedattn naive and flash, 1 and all threads), FLOPs, bytes and arithmetic
intensity per S, each timed row's position on this machine's roofline and its bound, the memory table (naive S x S
scores against the flash working set), and the sections you write yourself marked TODO. OUT/roofline.png is drawn
when matplotlib is installed (otherwise a message says how to get it). Python 3 standard library otherwise.
Exit code: the harness's (1 when a check failed; the report is written all the same).
"""

import argparse
import json
import os
import subprocess
import sys

GIGA = 1e9
MIB = 1024.0 * 1024.0
KERNEL_TEXT = {"student": "yours", "naive": "fusedattn naive", "flash": "fusedattn flash"}


def size_text(b):
    if b < MIB:
        return "%.4g KiB" % (b / 1024.0)
    if b < 1024 * MIB:
        return "%.4g MiB" % (b / MIB)
    return "%.4g GiB" % (b / MIB / 1024.0)


def roofs_of(context):
    """{threads: (peak FLOP/s, bandwidth B/s)} from the context keys fusedattn-bench also writes."""
    out = {}
    for key, value in context.items():
        if key.startswith("fusedattn_peak_flops_threads_"):
            t = int(key.rsplit("_", 1)[1])
            bw = context.get("fusedattn_bandwidth_threads_%d" % t)
            if bw is not None:
                out[t] = (float(value), float(bw))
    return out


def correctness_section(doc):
    a = doc["assignment"]
    lines = ["## 1. Correctness", "",
             "Each case against a float64 reference computed by the harness (max |error| must stay below %g), your "
             "kernel run on 1 thread and on %d. `max |logit|` shows how large the scaled scores get: the `logits x30` "
             "cases overflow `exp` unless the row maximum is subtracted first. The last column is fusedattn's flash "
             "kernel on the same inputs (the harness's own sanity check)." % (a["tolerance"], a["all_threads"]), "",
             "| case | (b, h, S_q, S_kv, d) | causal | max \\|logit\\| | error, 1 thread | error, all threads "
             "| fusedattn flash | result |",
             "|---|---|---|---|---|---|---|---|"]

    def err(x):
        return "NaN/inf/unwritten" if x is None else "%.2g" % x
    for c in a["checks"]:
        lines.append("| %s | (%d, %d, %d, %d, %d) | %s | %.0f | %s | %s | %s | %s |" % (
            c["what"], c["b"], c["h"], c["s_q"], c["s_kv"], c["d"], "yes" if c["causal"] else "no",
            c["max_abs_logit"], err(c["err_1_thread"]), err(c["err_all_threads"]), err(c["err_fusedattn_flash"]),
            "PASS" if c["pass"] else "**FAIL**"))
    return lines


def rows_by(doc):
    out = {}
    for r in doc["benchmarks"]:
        out[(r["name"].split("/")[0], int(r["s_q"]), int(r["threads"]))] = r
    return out


def timing_section(doc, rows):
    lines = ["## 2. Timings", ""]
    if not rows:
        return lines + ["Nothing timed: a check failed (the harness times only a kernel that passes every check), or "
                        "the harness ran with --check-only.", ""]
    threads = sorted({t for (_, _, t) in rows})
    seqs = sorted({s for (_, s, _) in rows})
    lines += ["(1, 8, S, 64), f32, dense; median wall time per call (the harness's `--quick` runs time fewer calls). "
              "GFLOP/s on 4·b·h·S²·d FLOPs. `used` = process CPU time / wall time: the CPUs a call really kept "
              "busy (a 1-thread row above 1.5 is not a 1-thread figure). Slowdown = your time / flash's time on as "
              "many threads.", "",
              "| S | threads | yours ms | yours GFLOP/s | used | naive ms | flash ms | flash GFLOP/s "
              "| slowdown vs flash | slowdown vs PyTorch |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for s in seqs:
        for t in threads:
            me, nv, fl = rows.get(("student", s, t)), rows.get(("naive", s, t)), rows.get(("flash", s, t))
            if not (me and nv and fl):
                continue
            ms = lambda r: r["real_time"] * 1e-3  # noqa: E731  (us -> ms)
            lines.append("| %d | %d | %.3f | %.2f | %.2f | %.3f | %.3f | %.2f | %.2fx | TODO |" % (
                s, t, ms(me), me["FLOP/s"] / GIGA, me.get("threads_used", 0), ms(nv), ms(fl), fl["FLOP/s"] / GIGA,
                me["real_time"] / fl["real_time"]))
    lines += ["", "TODO: the PyTorch column: `F.scaled_dot_product_attention` on the same shapes (fusedattn's "
              "examples/12_torch_extension prints this table with its slowdown factor; bench/peers/torch_peer.py and "
              "bench/compare.py put PyTorch's rows beside this run's JSON). Which optimisations does PyTorch apply "
              "that you do not?", ""]
    return lines


def intensity_section(doc):
    a = doc["assignment"]
    lines = ["## 3. Arithmetic intensity", "",
             "FLOPs = 4·b·h·S²·d (two multiply-adds per score element and head-dim element: Q·Kᵀ and P·V). "
             "Bytes, f32 (4 B per element):", "",
             "- compulsory: read Q, K, V and write O once: 4 · 4·b·h·S·d (no schedule moves less);",
             "- naive three-pass, modelled without caches: compulsory + 6 trips of the S×S scores of every head "
             "(write S; scale: read and write; softmax: read and write; P·V: read): + 6 · 4·b·h·S²;",
             "- flash, modelled: Q read and O written once; K and V re-read once per q-block of Bq rows: "
             "4 · (2·b·h·S·d + 2·b·h·S·d·ceil(S/Bq)).", "",
             "| S | GFLOP | compulsory MB | AI compulsory | naive MB (model) | AI naive | flash MB (model, Bq) "
             "| AI flash |",
             "|---|---|---|---|---|---|---|---|"]
    for m in a["model"]:
        lines.append("| %d | %.4f | %.2f | %.1f | %.1f | %.2f | %.2f (%d) | %.1f |" % (
            m["s"], m["flop"] / GIGA, m["bytes_min"] / 1e6, m["flop"] / m["bytes_min"], m["bytes_naive"] / 1e6,
            m["flop"] / m["bytes_naive"], m["bytes_flash"] / 1e6, m["flash_q_tile"], m["flop"] / m["bytes_flash"]))
    lines += ["", "TODO: your kernel's bytes (count every read and write of your schedule), its AI at two sequence "
              "lengths, and how it moves with S. (Without caches the naive AI rises towards d/6 FLOP/B; measured "
              "DRAM traffic falls with S once the S×S scores outgrow the cache: fusedattn's docs/teaching.md.)", ""]
    return lines


def roofline_section(doc, rows, roofs, picture):
    lines = ["## 4. Roofline position and bound", ""]
    if not rows or not roofs:
        return lines + ["Nothing timed, or no roofs measured: run the harness without --check-only.", ""]
    lines += ["Roofs measured by the harness on this machine (f32 FMA loop; triad a = b + s·c over arrays far larger "
              "than the last-level cache):", ""]
    for t, (peak, bw) in sorted(roofs.items()):
        lines.append("- %d thread%s: peak %.1f GFLOP/s, bandwidth %.1f GB/s, ridge point %.1f FLOP/B" % (
            t, "" if t == 1 else "s", peak / GIGA, bw / GIGA, peak / bw))
    lines += ["", "Attainable = min(peak, AI × bandwidth) with the AI of section 3 (**modelled** traffic; yours: the "
              "compulsory bytes until you model your own). A row is memory-bound when its AI lies left of the ridge "
              "point. Profiler counters give the **measured** traffic: section 6.", "",
              "| kernel | S | threads | AI (FLOP/B) | achieved GFLOP/s | attainable GFLOP/s | % of roof | bound |",
              "|---|---|---|---|---|---|---|---|"]
    for (kernel, s, t), r in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
        if t not in roofs:
            continue
        peak, bw = roofs[t]
        ai = r["flop"] / r["bytes"]
        att = min(peak, ai * bw)
        lines.append("| %s | %d | %d | %.1f%s | %.2f | %.1f | %.1f %% | %s |" % (
            KERNEL_TEXT.get(kernel, kernel), s, t, ai, " (compulsory)" if kernel == "student" else "",
            r["FLOP/s"] / GIGA, att / GIGA, 100.0 * r["FLOP/s"] / att, "memory" if ai * bw < peak else "compute"))
    lines.append("")
    lines.append("![roofline](roofline.png)" if picture else
                 "(roofline.png not drawn: matplotlib is not installed; `sudo apt install python3-matplotlib` or "
                 "`pip install matplotlib`, then run the report again.)")
    return lines + [""]


def memory_section(doc):
    lines = ["## 5. Memory savings", "",
             "The naive pipeline materialises the S×S scores of every head (f32); the flash schedule keeps a few "
             "tiles per thread (Q, O accumulator, K, V, scores, row max and sum) whatever S. `flash scratch` is what "
             "fusedattn's CPU kernel really allocates for one thread (its tiles plus a packed copy of one head's K "
             "and V, which grows as S, never as S²).", "",
             "| S | heads | naive S×S per head | naive, all heads | flash tiles (Bq×Bkv) | flash scratch | "
             "naive all / flash scratch |",
             "|---|---|---|---|---|---|---|"]
    for m in doc["assignment"]["memory"]:
        lines.append("| %d | %d | %s | %s | %s (%dx%d) | %s | %.0fx |" % (
            m["s"], m["h"], size_text(m["naive_per_head"]), size_text(m["naive_total"]), size_text(m["flash_tiles"]),
            m["tile_q"], m["tile_kv"], size_text(m["flash_scratch"]), m["naive_total"] / m["flash_scratch"]))
    return lines + [""]


def todo_sections():
    return ["## 6. Profiler evidence", "",
            "TODO: before and after each optimisation. CPU: `perf stat -e cycles,instructions,"
            "LLC-load-misses,...` where counters exist (not in most VMs), `valgrind --tool=cachegrind` on a build "
            "with `-DASSIGNMENT_NATIVE=OFF -DCMAKE_CXX_FLAGS=-march=x86-64-v3`, Intel Advisor's roofline or VTune's "
            "memory access analysis, likwid-perfctr -g MEM_DP/FLOPS_SP. GPU: `ncu --set full` (Speed of Light, "
            "Roofline). fusedattn's docs/teaching.md shows the commands and what to read in them.", "",
            "## 7. The effect of fusion", "",
            "TODO: the naive pipeline against your fused kernel: DRAM traffic (modelled in section 3, measured in "
            "section 6), the position on the roofline (section 4), the time (section 2) and the memory (section 5).",
            ""]


def draw_roofline(rows, roofs, path, title):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("report: matplotlib is not installed; roofline.png skipped (sudo apt install python3-matplotlib, "
              "or pip install matplotlib)", file=sys.stderr)
        return False
    points = [(k, r) for k, r in rows.items() if k[2] in roofs]
    if not points:
        return False
    fig, ax = plt.subplots(figsize=(9, 6))
    ais = [r["flop"] / r["bytes"] for _, r in points]
    ridges = [peak / bw for peak, bw in roofs.values()]
    x_lo, x_hi = min(ais + ridges) / 3, max(ais + ridges) * 3
    for i, (t, (peak, bw)) in enumerate(sorted(roofs.items())):
        ls = ["-", "--", ":"][i % 3]
        ax.plot([x_lo, peak / bw, x_hi], [x_lo * bw / GIGA, peak / GIGA, peak / GIGA], color="black", ls=ls, lw=1.2,
                label="%d thread%s: %.0f GFLOP/s, %.1f GB/s" % (t, "" if t == 1 else "s", peak / GIGA, bw / GIGA))
    colours = {"student": "tab:red", "naive": "tab:blue", "flash": "tab:green"}
    seen = set()
    for (kernel, s, t), r in points:
        x, y = r["flop"] / r["bytes"], r["FLOP/s"] / GIGA
        key = (kernel, t)
        ax.plot([x], [y], marker="o" if t == 1 else "s", ls="none", color=colours.get(kernel, "tab:gray"),
                label=None if key in seen else "%s, %d thread%s" % (KERNEL_TEXT.get(kernel, kernel), t,
                                                                   "" if t == 1 else "s"))
        seen.add(key)
        ax.annotate("S=%d" % s, (x, y), textcoords="offset points", xytext=(4, 2), fontsize=7)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(x_lo, x_hi)
    ax.set_xlabel("arithmetic intensity, FLOP per modelled byte (yours: per compulsory byte)")
    ax.set_ylabel("achieved GFLOP/s")
    ax.set_title(title)
    ax.grid(True, which="both", lw=0.3, alpha=0.5)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    print("report: wrote %s" % path)
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--harness", help="the harness executable to run (build/assignment)")
    src.add_argument("--json", help="a JSON file the harness wrote with --json")
    ap.add_argument("--out", default="report", help="folder for report.md, roofline.png and the JSON (default: report)")
    ap.add_argument("--quick", action="store_true", help="pass --quick to the harness (fewer timing runs)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rc = 0
    json_path = args.json
    if args.harness:
        json_path = os.path.join(args.out, "assignment.json")
        cmd = [os.path.abspath(args.harness), "--json", json_path] + (["--quick"] if args.quick else [])
        print("report: running %s" % " ".join(cmd), flush=True)
        done = subprocess.run(cmd, stdout=subprocess.PIPE, universal_newlines=True)
        sys.stdout.write(done.stdout)
        with open(os.path.join(args.out, "harness.txt"), "w", encoding="utf-8") as f:
            f.write(done.stdout)
        rc = done.returncode
        if not os.path.exists(json_path):
            print("report: the harness wrote no JSON (exit code %d)" % rc, file=sys.stderr)
            return rc or 1
    with open(json_path, encoding="utf-8") as f:
        doc = json.load(f)
    ctx = doc.get("context", {})
    rows = rows_by(doc)
    roofs = roofs_of(ctx)
    where = "%s, %s CPUs, %s" % (ctx.get("host_name", "?"), ctx.get("num_cpus", "?"), ctx.get("date", "?"))
    picture = bool(rows) and draw_roofline(rows, roofs, os.path.join(args.out, "roofline.png"),
                                           "attention on the roofline (%s)" % where)
    passed = all(c["pass"] for c in doc["assignment"]["checks"])
    lines = ["# An optimized attention kernel: report", "",
             "Machine: %s. Generated by report.py from `%s`%s. Sections marked TODO are yours to write." % (
                 where, os.path.basename(json_path),
                 " (quick timing: fewer runs per row)" if ctx.get("fusedattn_assignment_quick") == "1" else ""),
             "", "All checks: **%s**." % ("PASS" if passed else "FAIL"), ""]
    lines += correctness_section(doc) + [""]
    lines += timing_section(doc, rows)
    lines += intensity_section(doc)
    lines += roofline_section(doc, rows, roofs, picture)
    lines += memory_section(doc)
    lines += todo_sections()
    out = os.path.join(args.out, "report.md")
    with open(out, "w", encoding="utf-8") as f:
        f.write("\n".join(lines))
    print("report: wrote %s" % out)
    return rc if rc else (0 if passed else 1)


if __name__ == "__main__":
    sys.exit(main())
