"""Reading fusedattn-bench JSON (Google Benchmark's format, and the same schema written by bench/peers/*.py).

Shared by bench/plot.py and bench/compare.py. A row is one benchmark: when repetitions were aggregated, its median;
otherwise its median iteration run. Each row is a dict with the counters, plus `name` (without "/real_time"),
`kernel` (the name's first component), `dtype` and `mask` (from the label "f16 causal"), `seconds` (wall time per
call) and `cpu_seconds` (the timing thread's CPU time per call).
"""

import json
import statistics

TIME_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}
REAL_TIME_SUFFIX = "/real_time"


def load(path):
    """Returns (context dict, list of rows) of one JSON file."""
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    iterations, medians, order, seen = {}, {}, [], set()
    for b in doc.get("benchmarks", []):
        if b.get("error_occurred"):
            continue
        name = b.get("run_name", b["name"])
        if name.endswith(REAL_TIME_SUFFIX):
            name = name[: -len(REAL_TIME_SUFFIX)]
        if name not in seen:
            seen.add(name)
            order.append(name)
        if b.get("run_type") == "aggregate":
            if b.get("aggregate_name") == "median":
                medians[name] = b
        else:
            iterations.setdefault(name, []).append(b)
    rows = []
    for name in order:
        if name in medians:
            b = medians[name]
        elif name in iterations:
            runs = sorted(iterations[name], key=lambda r: r["real_time"])
            b = runs[len(runs) // 2]
        else:
            continue
        row = dict(b)
        row["name"] = name
        row["kernel"] = name.split("/")[0]
        label = (b.get("label") or "").split()
        row["dtype"] = label[0] if label else "?"
        row["mask"] = label[1] if len(label) > 1 else "dense"
        row["seconds"] = b["real_time"] * TIME_UNIT_SECONDS[b.get("time_unit", "ns")]
        row["cpu_seconds"] = b.get("cpu_time", b["real_time"]) * TIME_UNIT_SECONDS[b.get("time_unit", "ns")]
        rows.append(row)
    return doc.get("context", {}), rows


def ceilings(context):
    """{threads: (peak FLOP/s, bandwidth B/s)} from the context fusedattn-bench records."""
    out = {}
    for key, value in context.items():
        if key.startswith("fusedattn_peak_flops_threads_"):
            t = int(key.rsplit("_", 1)[1])
            bw = context.get("fusedattn_bandwidth_threads_%d" % t)
            if bw is not None:
                out[t] = (float(value), float(bw))
    return out


def bf16_peaks(context):
    """{threads: bf16 dot-product peak FLOP/s} from the context (absent where the CPU has no AVX512-BF16)."""
    return {int(k.rsplit("_", 1)[1]): float(v) for k, v in context.items()
            if k.startswith("fusedattn_bf16_peak_flops_threads_")}


def shape_key(row):
    """What two rows must share to be the same problem: sizes, storage type, mask and threads."""
    return tuple(int(row.get(k, 0)) for k in ("b", "h", "h_kv", "s_q", "s_kv", "d")) + (
        row["dtype"], row["mask"], int(row.get("threads", 1)))


def shape_text(key):
    b, h, h_kv, s_q, s_kv, d, dtype, mask, threads = key
    s = "s%d" % s_q if s_q == s_kv else "sq%d_skv%d" % (s_q, s_kv)
    hk = "" if h_kv == h else "_hkv%d" % h_kv
    return "b%d_h%d%s_%s_d%d %s %s t%d" % (b, h, hk, s, d, dtype, mask, threads)


def median(values):
    return statistics.median(values) if values else float("nan")
