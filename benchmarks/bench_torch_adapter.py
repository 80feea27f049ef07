#!/usr/bin/env python3
# bench_torch_adapter.py - fsdp.torch against plain torch (world 1) and FSDP2 (world 2): step time, peak RSS.
"""Times the step of a torch training loop three ways, each in its own processes, and prints JSON.

  python benchmarks/bench_torch_adapter.py [--rounds R] [--steps S] [--what gpt2,mlp] [--out FILE]

Run it with the Python of a venv that has torch, transformers and the fsdp package (tools/test_python.sh
makes one: ~/.cache/libfsdp/frameworks-venv). Rows:

- gpt2 world 1: Hugging Face GPT2LMHeadModel (4 layers, width 256, tied embeddings, batch 8 x 64, fp32)
  trained by plain torch (torch.optim.AdamW, foreach) and by fsdp.torch (units: the GPT2Blocks).
- gpt2 world 2: the same, fsdp.torch under mpirun (2 processes) and PyTorch FSDP2 (fully_shard on each
  block and the model, gloo) under torch.distributed's launcher, each rank one intra-op thread.
- mlp world 1: 8 Linear(1024, 1024) layers with ReLU, batch 64, fp32: plain torch with
  torch.optim.AdamW(fused=True) against fsdp.torch (a unit per layer), in the default environment
  (OMP_WAIT_POLICY unset): libfsdp's optimizer threads against torch's spinning OpenMP workers.

Each round runs every side once, in alternating order (ABAB...), each a fresh process that warms up for 3
steps and reports the median of its timed steps; a row's ratio is the median over rounds of the
per-round ratio fsdp / reference, so that a machine that drifts between rounds cancels out. Peak RSS is
each rank's ru_maxrss (the largest over ranks)."""
import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


# ---- workers: one configuration in this process, prints one JSON line ----

def build(what):
    import torch
    if what == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block
        cfg = GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=1024, n_positions=64, resid_pdrop=0.0,
                         embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        torch.manual_seed(0)
        model = GPT2LMHeadModel(cfg)
        ids = torch.randint(0, 1024, (8, 64), generator=torch.Generator().manual_seed(1))

        def loss_of(m, rows):
            x = ids[rows]
            return m(x, labels=x).loss
        return model, GPT2Block, loss_of, 8
    layers = [torch.nn.Linear(1024, 1024) for _ in range(8)]
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for lin in layers for m in (lin, torch.nn.ReLU())])
    x = torch.randn(64, 1024, generator=torch.Generator().manual_seed(1))

    def loss_of(m, rows):
        return m(x[rows]).pow(2).mean()
    return model, torch.nn.Linear, loss_of, 64


def worker(args):
    import torch
    if args.threads:
        torch.set_num_threads(args.threads)
    model, unit_class, loss_of, batch = build(args.what)
    rank, world = 0, 1
    if args.side == "fsdp2":
        import torch.distributed as dist
        from torch.distributed.fsdp import fully_shard
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        for m in model.modules():
            if isinstance(m, unit_class):
                fully_shard(m)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        step = opt.step
        zero = opt.zero_grad
    elif args.side == "torch":
        fused = args.what == "mlp"
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused or None)
        step, zero = opt.step, opt.zero_grad
    else:
        import fsdp
        import fsdp.torch
        lw = fsdp.launcher_world()
        rank, world = lw if lw else (0, 1)
        sharded = fsdp.torch.shard(model, units=unit_class, lr=1e-4)
        step, zero = sharded.step, (lambda: None)
    rows = slice(rank * batch // world, (rank + 1) * batch // world)
    times = []
    for k in range(args.steps + 3):
        t0 = time.perf_counter()
        loss = loss_of(model, rows)
        loss.backward()
        step()
        zero()
        if k >= 3:
            times.append(time.perf_counter() - t0)
    out = {"median_s": statistics.median(times), "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if args.side == "fsdp2":
        import torch.distributed as dist
        every = [None] * world
        dist.all_gather_object(every, out)
        dist.destroy_process_group()
        out = {"median_s": max(o["median_s"] for o in every), "rss_mib": max(o["rss_mib"] for o in every)}
    elif args.side == "fsdp" and world > 1:
        vals = sharded.ctx.metrics_reduce([out["median_s"], out["rss_mib"]], "max")
        out = {"median_s": vals[0], "rss_mib": vals[1]}
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)
    if args.side == "fsdp2":
        # torch 2.15's gloo teardown aborts now and then at interpreter exit ("terminate called without an
        # active exception") after destroy_process_group; the result is out, skip the teardown.
        sys.stdout.flush()
        os._exit(0)


# ---- the driver ----

def run_side(what, side, world, steps):
    me = [sys.executable, os.path.abspath(__file__), "--worker", "--what", what, "--side", side,
          "--steps", str(steps)]
    env = dict(os.environ)
    if world > 1:
        me += ["--threads", "1"]
        if side == "fsdp2":
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
                   "--master-port", "29517"] + me[1:]
        else:
            cmd = ["mpirun", "--oversubscribe", "-np", str(world)] + me
            env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    else:
        cmd = me
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    if r.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
    return json.loads(lines[0][7:])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--side", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--what", default="gpt2,mlp")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    rows = []
    plan = []
    for what in args.what.split(","):
        plan.append((what, 1, "torch"))
        if what == "gpt2" and shutil.which("mpirun"):
            plan.append((what, 2, "fsdp2"))
    for what, world, ref in plan:
        ratios, per = [], {"fsdp": [], ref: []}
        for r in range(args.rounds):
            order = ["fsdp", ref] if r % 2 == 0 else [ref, "fsdp"]
            got = {side: run_side(what, side, world, args.steps) for side in order}
            for side in got:
                per[side].append(got[side])
            ratios.append(got["fsdp"]["median_s"] / got[ref]["median_s"])
        row = {"model": what, "world": world, "reference": ref,
               "step_ratio_median": statistics.median(ratios), "step_ratios": ratios,
               "fsdp_step_ms": 1e3 * statistics.median(x["median_s"] for x in per["fsdp"]),
               "ref_step_ms": 1e3 * statistics.median(x["median_s"] for x in per[ref]),
               "fsdp_rss_mib": max(x["rss_mib"] for x in per["fsdp"]),
               "ref_rss_mib": max(x["rss_mib"] for x in per[ref]),
               "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(unset)")}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
