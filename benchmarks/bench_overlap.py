#!/usr/bin/env python3
"""Overlap benchmark: the demo model (examples/c/train_mlp) on 4 local ranks,
with prefetch off and on, and limit_all_gathers 1..3. Settings reach the demo
through FSDP_* environment variables (it calls fsdp_config_from_env). From the
Chrome traces of the last two steps it reports, as one JSON object per line:

  step_ms            wall time of a step (mean over ranks of the traced span / 2)
  comm_ms            time the comm stream was busy (sum of comm-track spans)
  exposed_ms         time the host waited for communication (the `wait ...` spans)
  exposed_fraction   exposed_ms / comm_ms: the share of communication not hidden
  gathered_peak_bytes  the highest gathered_params counter

Usage: bench_overlap.py [path/to/train_mlp] [steps]"""
import json
import os
import subprocess
import sys
import tempfile

exe = sys.argv[1] if len(sys.argv) > 1 else "build/default/examples/c/train_mlp"
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 12
world = 4


def spans(events, tid, prefix=""):
    """Sum of durations of B/E spans on `tid` whose name starts with prefix."""
    open_at, total = {}, 0.0
    for e in sorted(events, key=lambda e: e["args"]["seq"]):
        if e.get("tid") != tid or not e["name"].startswith(prefix):
            continue
        if e["ph"] == "B":
            open_at.setdefault(e["name"], []).append(e["ts"])
        elif e["ph"] == "E" and open_at.get(e["name"]):
            total += e["ts"] - open_at[e["name"]].pop()
    return total


def run(setting):
    env = dict(os.environ)
    env.update({"FSDP_" + k.upper(): str(v) for k, v in setting.items()})
    with tempfile.TemporaryDirectory() as d:
        prefix = os.path.join(d, "t")
        subprocess.run([exe, "--ranks", str(world), "--steps", str(steps), "--trace", prefix],
                       env=env, check=True, stdout=subprocess.DEVNULL)
        step_us = comm_us = exposed_us = 0.0
        peak = 0
        for r in range(world):
            with open(f"{prefix}.rank{r}.json") as f:
                ev = [e for e in json.load(f)["traceEvents"] if e["ph"] != "M"]
            ts = [e["ts"] for e in ev]
            step_us += (max(ts) - min(ts)) / 2 / world
            comm_us += spans(ev, 1) / world
            exposed_us += spans(ev, 0, "wait ") / world
            peak = max([peak] + [e["args"]["gathered_params"] for e in ev if e["ph"] == "C"])
    return {"benchmark": "overlap_demo_model", "world": world, **setting,
            "step_ms": round(step_us / 1e3, 3), "comm_ms": round(comm_us / 1e3, 3),
            "exposed_ms": round(exposed_us / 1e3, 3),
            "exposed_fraction": round(exposed_us / comm_us, 3) if comm_us else None,
            "gathered_peak_bytes": peak}


settings = [{"forward_prefetch": 0, "backward_prefetch": "none", "limit_all_gathers": 2},
            {"forward_prefetch": 1, "backward_prefetch": "pre", "limit_all_gathers": 2}]
settings += [{"forward_prefetch": 1, "backward_prefetch": "pre", "limit_all_gathers": k} for k in (1, 3)]
for s in settings:
    print(json.dumps(run(s)))
