#!/usr/bin/env python3
"""Markdown table of the engine-overhead benchmarks' JSON lines (bench_step and bench_step.py).

  bench_table.py [--median] [FILE ...]       (no FILE, or "-": standard input)

With --median, rows of the same configuration from several runs (several
files, or one file holding several runs) become one row of the per-field
medians: on a shared machine one run's numbers drift.

One row per configuration: the way (baseline / libfsdp), world, launcher, sharding, threads per
rank, the step's median wall time, its ratio, the step minus the compute (what the engine or the
plain optimizer adds; steadier than the ratio where the machine's compute speed drifts between
runs), the median host time inside each libfsdp call
(summed over units; for the baseline, the plain optimizer and the grad memset), for the Python
benchmark the time spent making numpy/torch views of libfsdp's buffers, the compute, and
the CPU time per wall time. Lines that are not JSON objects of these benchmarks are skipped, so
the plain output of bench_step (with its '#' lines) can be piped in as it is.

The ratio is the one the benchmark printed: libfsdp world 1 against the baseline, world N against
world 1 of the same sharding and threads per rank. A run under mpirun cannot time world 1 itself,
so its ratio is taken against a world-1 row of the same benchmark, model and threads from the
other inputs, and marked with *. Standard library only."""
import json
import statistics
import sys

STEP_KINDS = ("engine_step", "engine_step_py")
PHASES = [("forward_begin_ms", "fwd begin"), ("forward_end_ms", "fwd end"), ("backward_begin_ms", "bwd begin"),
          ("backward_end_ms", "bwd end"), ("step_call_ms", "step / optim"), ("zero_grad_ms", "zero grad"),
          ("views_ms", "views"), ("compute_ms", "compute")]


def read(streams):
    rows, checks = [], []
    for f in streams:
        for line in f:
            line = line.strip()
            if not line.startswith("{"):
                continue
            try:
                d = json.loads(line)
            except json.JSONDecodeError:
                continue
            if d.get("benchmark") in STEP_KINDS:
                rows.append(d)
            elif str(d.get("benchmark", "")).startswith("engine_step") and "ok" in d:
                checks.append(d)
    return rows, checks


CONFIG_KEYS = ("benchmark", "width", "layers", "batch", "way", "world", "launcher", "sharding", "threads")


def medians(rows):
    """One row per configuration: each numeric field the median over that configuration's rows."""
    groups = {}
    for d in rows:
        groups.setdefault(tuple(d.get(k) for k in CONFIG_KEYS), []).append(d)
    out = []
    for same in groups.values():
        merged = dict(same[0])
        for key, value in same[0].items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key not in CONFIG_KEYS:
                values = [r[key] for r in same if isinstance(r.get(key), (int, float))]
                merged[key] = statistics.median(values)
        merged["runs"] = len(same)
        out.append(merged)
    return out


def model(d):
    return d.get("benchmark"), d.get("width"), d.get("layers"), d.get("batch")


def fill_ratio(d, rows):
    """The printed ratio, or for a row without one (mpirun) one against a world-1 row of the inputs."""
    if d.get("ratio") is not None:
        return f"{d['ratio']:.2f}", d.get("ratio_to", "")
    if d.get("world", 1) > 1:
        for r in rows:
            if (model(r) == model(d) and r.get("way") == "libfsdp" and r.get("world") == 1
                    and r.get("threads") == d.get("threads") and r.get("sharding") == d.get("sharding")):
                return f"{d['step_ms'] / r['step_ms']:.2f}*", f"world1 {r['sharding']}"
    return "", ""


def ms(v):
    if v is None:
        return ""
    return f"{v:.2f}" if v < 100 else f"{v:.1f}"


def table(rows, checks):
    head = ["bench", "model", "way", "world", "launcher", "sharding", "threads", "step ms", "ratio", "ratio to",
            "non-compute ms"]
    head += [name + " ms" for _, name in PHASES] + ["cpu/wall", "cpu/compute"]
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    marked = False
    for d in rows:
        ratio, to = fill_ratio(d, rows)
        marked = marked or ratio.endswith("*")
        is_fsdp = d.get("way") == "libfsdp"
        cells = ["C" if d["benchmark"] == "engine_step" else "py",
                 f"{d.get('layers')}x{d.get('width')} b{d.get('batch')}", d.get("way", ""), str(d.get("world", "")),
                 d.get("launcher", ""), d.get("sharding", ""), str(d.get("threads", "")), ms(d.get("step_ms")),
                 ratio, to, ms(d["step_ms"] - d["compute_ms"]) if "compute_ms" in d else ""]
        for key, _ in PHASES:
            fsdp_only = key.startswith(("forward", "backward"))
            cells.append("" if (fsdp_only and not is_fsdp) or (key == "zero_grad_ms" and is_fsdp) else ms(d.get(key)))
        cpw = d.get("cpu_per_wall")
        cells += ["" if cpw is None else f"{cpw:.2f}",
                  "" if d.get("cpu_over_compute") is None else f"{d['cpu_over_compute']:.2f}"]
        out.append("| " + " | ".join(cells) + " |")
    notes = []
    if marked:
        notes.append("\\* ratio against a world-1 row from another run (mpirun cannot time world 1 itself).")
    scopes = sorted({d["cpu_scope"] for d in rows if d.get("cpu_scope")})
    if scopes:
        notes.append("cpu/wall: process CPU time over wall time (" + "; ".join(scopes) + ").")
    runs = sorted({d["runs"] for d in rows if "runs" in d})
    if runs:
        notes.append("each row: the medians of " + " or ".join(map(str, runs)) + " runs.")
    seen = set()
    for c in checks:
        key = json.dumps(c, sort_keys=True)
        if key in seen:  # the same check from several runs
            continue
        seen.add(key)
        figures = ", ".join(f"{k}={json.dumps(v)}" for k, v in c.items() if k not in ("benchmark", "what"))
        notes.append(f"check ({c.get('benchmark')}: {c.get('what', '')}): {figures}")
    return "\n".join(out + ([""] + notes if notes else []))


def main(argv):
    args = argv[1:]
    use_median = "--median" in args
    names = [a for a in args if a != "--median"] or ["-"]
    streams = [sys.stdin if n == "-" else open(n, encoding="utf-8") for n in names]
    try:
        rows, checks = read(streams)
    finally:
        for s in streams:
            if s is not sys.stdin:
                s.close()
    if not rows:
        print("bench_table: no engine_step lines in the input", file=sys.stderr)
        return 1
    print(table(medians(rows) if use_median else rows, checks))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
