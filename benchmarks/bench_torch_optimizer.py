#!/usr/bin/env python3
# bench_torch_optimizer.py - fsdp.torch's step with a torch optimizer on the shards against libfsdp's own AdamW.
"""Times a Hugging Face GPT-2 training step through fsdp.torch two ways and prints JSON lines:

  python benchmarks/bench_torch_optimizer.py [--rounds R] [--steps S] [--worlds 1,2]

- builtin: shard(model, units=GPT2Block, lr=...), loss.backward(), sharded.step() (libfsdp's AdamW);
- torch: shard(..., optimizer="torch"), torch.optim.AdamW(sharded.parameters(), fused=True),
  loss.backward(), opt.step(), opt.zero_grad() (the host's update between fsdp_step_begin and _end).

GPT2LMHeadModel with 4 layers, width 256, vocab 1024, batch 8 x 64 tokens (each rank its share), fp32, on
the CPU; thread ranks (fsdp.run_ranks) at each world, cores / world intra-op threads per rank (what
libfsdp's CPU device gives its own optimizer). Each round runs both
sides in fresh processes in alternating order; a side reports the median of its timed steps after 3
warm-up steps, and a world's ratio is the median over rounds of the per-round ratio torch / builtin (the
goal: at most 1.05). Run it with the Python of a venv that has torch, transformers and the fsdp package
(tools/test_python.sh keeps one: ~/.cache/libfsdp/frameworks-venv)."""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time


OPT_KW = {"fused": True}  # torch's one-pass AdamW on the CPU (foreach=True: several passes, slower)


def worker(side, world, steps):
    import torch
    import fsdp
    import fsdp.torch as ft
    from bench_torch_adapter import build  # the same GPT-2 and batch as bench_torch_adapter's gpt2 rows
    # Each rank gets cores / world intra-op threads, as libfsdp's CPU device gives its optimizer.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    init, GPT2Block, loss_of, batch = build("gpt2")

    def rank_fn(rank, group):
        import copy
        model = copy.deepcopy(init)
        rows = slice(rank * batch // world, (rank + 1) * batch // world)
        opts = dict(lr=1e-4, weight_decay=0.01)
        if side == "torch":
            sh = ft.shard(model, units=GPT2Block, group=group, rank=rank, optimizer="torch")
            opt = torch.optim.AdamW(sh.parameters(), lr=1e-4, weight_decay=0.01, **OPT_KW)
        else:
            sh = ft.shard(model, units=GPT2Block, group=group, rank=rank, **opts)
            opt = None
        times = []
        for s in range(3 + steps):
            t0 = time.perf_counter()
            loss_of(model, rows).backward()
            if opt is not None:
                opt.step()
                opt.zero_grad()
            else:
                sh.step()
            sh.ctx.step_count  # the step's results: waits for it
            times.append(time.perf_counter() - t0)
        sh.close()
        return statistics.median(times[3:])

    t = max(fsdp.run_ranks(world, rank_fn))
    print(json.dumps({"side": side, "world": world, "step_s": t}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--worlds", default="1,2")
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a.worker[0], int(a.worker[1]), a.steps)
        return
    for world in [int(w) for w in a.worlds.split(",")]:
        ratios, got = [], {"builtin": [], "torch": []}
        for r in range(a.rounds):
            order = ("builtin", "torch") if r % 2 == 0 else ("torch", "builtin")
            this = {}
            for side in order:
                out = subprocess.run([sys.executable, __file__, "--steps", str(a.steps), "--worker", side, str(world)],
                                     check=True, capture_output=True, text=True).stdout
                this[side] = json.loads(out.strip().splitlines()[-1])["step_s"]
                got[side].append(this[side])
            ratios.append(this["torch"] / this["builtin"])
        print(json.dumps({"bench": "torch_optimizer", "model": "gpt2 4x256, batch 8x64, fp32, cpu", "world": world,
                          "rounds": a.rounds, "builtin_step_ms": 1e3 * statistics.median(got["builtin"]),
                          "torch_step_ms": 1e3 * statistics.median(got["torch"]),
                          "ratio_torch_to_builtin": statistics.median(ratios), "goal": 1.05}))


if __name__ == "__main__":
    main()
