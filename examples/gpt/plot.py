#!/usr/bin/env python3
"""Draws the GPT demo's figures from what `train_gpt --plot DIR` wrote there.

    pip install matplotlib
    python3 examples/gpt/plot.py DIR

Reads DIR/metrics.json (loss lines, per-rank memory) and DIR/trace.json (the
Chrome trace of the first phase's last two steps) and writes:

- DIR/loss.png: train and validation loss by step, both phases, with the
  unigram baseline;
- DIR/memory.png: each rank's params / grads / optimizer state beside one
  unsharded rank's, per phase;
- DIR/timeline.png: per rank, libfsdp's calls and its comm stream's
  collectives over those two steps.
"""
import json
import os
import sys

try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    sys.exit("plot.py needs matplotlib: pip install matplotlib")

MIB = 1024.0 * 1024.0


def plot_loss(m, out):
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, ph in enumerate(m["phases"]):
        steps = [ln["step"] for ln in ph["lines"]]
        ax.plot(steps, [ln["train"] for ln in ph["lines"]], "-o", ms=3, color=f"C{2 * i}",
                label=f"train, {ph['world']} ranks")
        ax.plot(steps, [ln["val"] for ln in ph["lines"]], "--s", ms=3, color=f"C{2 * i + 1}",
                label=f"validation, {ph['world']} ranks")
    ax.axhline(m["unigram"], color="gray", lw=1, ls=":", label="unigram baseline")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/byte)")
    ax.set_title("GPT on Alice in Wonderland, trained with libfsdp")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def plot_memory(m, out):
    cats = ["params", "grads", "optim"]
    labels, rows = [], []
    for ph in m["phases"]:
        for r, mem in enumerate(ph["memory"]):
            labels.append(f"rank {r}/{ph['world']}")
            rows.append([mem[c] / MIB for c in cats])
    labels.append("unsharded")
    rows.append([m["phases"][0]["unsharded"][c] / MIB for c in cats])
    fig, ax = plt.subplots(figsize=(7, 4))
    bottom = [0.0] * len(rows)
    for k, c in enumerate(cats):
        vals = [row[k] for row in rows]
        ax.bar(labels, vals, bottom=bottom, label=c)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("MiB per rank")
    ax.set_title("libfsdp's sharded state per rank")
    ax.legend()
    plt.setp(ax.get_xticklabels(), rotation=30, ha="right")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def plot_timeline(trace, out):
    events = trace["traceEvents"]
    spans = {}  # (pid, tid) -> [(start, end, name)]
    open_ = {}
    for e in events:
        if e.get("ph") == "B":
            open_.setdefault((e["pid"], e["tid"]), []).append(e)
        elif e.get("ph") == "E" and open_.get((e["pid"], e["tid"])):
            b = open_[(e["pid"], e["tid"])].pop()
            spans.setdefault((e["pid"], e["tid"]), []).append((b["ts"], e["ts"], b["name"]))
        elif e.get("ph") == "X":
            spans.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e.get("dur", 0), e["name"]))
    if not spans:
        return
    t0 = min(s for v in spans.values() for s, _, _ in v)
    keys = sorted(spans)
    fig, ax = plt.subplots(figsize=(10, 0.5 * len(keys) + 1.5))
    names = {0: "calls", 1: "comm stream", 2: "copy streams"}
    for y, key in enumerate(keys):
        for s, e, name in spans[key]:
            color = "C0" if key[1] == 0 else ("C1" if "gather" in name else "C2")
            ax.barh(y, (e - s) / 1000.0, left=(s - t0) / 1000.0, height=0.6, color=color)
    ax.set_yticks(range(len(keys)))
    ax.set_yticklabels([f"rank {p} {names.get(t, t)}" for p, t in keys])
    ax.set_xlabel("ms (blue: libfsdp calls on the host; orange: all-gathers; green: other collectives)")
    ax.set_title("two training steps")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    d = sys.argv[1]
    with open(os.path.join(d, "metrics.json")) as f:
        m = json.load(f)
    plot_loss(m, os.path.join(d, "loss.png"))
    plot_memory(m, os.path.join(d, "memory.png"))
    written = ["loss.png", "memory.png"]
    trace_path = os.path.join(d, "trace.json")
    if os.path.exists(trace_path):
        with open(trace_path) as f:
            plot_timeline(json.load(f), os.path.join(d, "timeline.png"))
        written.append("timeline.png")
    print("wrote " + ", ".join(os.path.join(d, w) for w in written))


if __name__ == "__main__":
    main()
