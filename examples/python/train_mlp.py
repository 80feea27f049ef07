#!/usr/bin/env python3
# train_mlp.py - libfsdp from Python: a numpy MLP regression trained by N ranks, printing the loss and each rank's memory.
"""Train a numpy MLP with libfsdp and print the loss and each rank's memory.

  python examples/python/train_mlp.py [--ranks N] [--steps S] [--dtype fp32|bf16|fp16] [--sharding S]
                                      [--save DIR] [--resume DIR] [--check]
  mpirun -np N python examples/python/train_mlp.py [--steps S] ...

Each rank is a thread of this process (fsdp.run_ranks); started by mpirun, each process is one rank
and --ranks is ignored. Rank 0 prints everything: the loss of the whole batch (the ranks' means
averaged with Context.metrics_reduce) at the first step, every 10th and the last, and then every
rank's memory, gathered with metrics_reduce, so the ranks' output never interleaves.

--save DIR writes a sharded checkpoint after the last step; --resume DIR loads one (saved at any
rank count and sharding) before the first step and goes on counting steps from it. --check exits
with status 1 unless the loss of the last step is below that of the first (a smoke check).

The model code (forward and backward of Linear+tanh by hand, in numpy) is what a host framework
provides; libfsdp owns the params, grads, optimizer state and collectives."""
import argparse
import json
import os
import sys

import numpy as np

import fsdp

DIMS = [32, 128, 128, 8]
BATCH = 64  # global batch, split evenly over the ranks
MIB = 1 << 20
# (MemoryStats field, column name) of the memory table.
MEM_COLUMNS = [("sharded_params_nbytes", "params"), ("sharded_grads_nbytes", "grads"),
               ("optimizer_state_nbytes", "optim"), ("gathered_params_peak_nbytes", "gathered-peak"),
               ("total_peak_nbytes", "total-peak")]


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[1:]))
    ap.add_argument("--ranks", type=int, default=4, help="thread-ranks (must divide %d); ignored under mpirun" % BATCH)
    ap.add_argument("--steps", type=int, default=40, help="training steps to run")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"], help="param_dtype")
    ap.add_argument("--sharding", default="FULL_SHARD", help="FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD, ...")
    ap.add_argument("--save", metavar="DIR", help="after the last step, save a sharded checkpoint to DIR")
    ap.add_argument("--resume", metavar="DIR", help="before the first step, load the checkpoint in DIR")
    ap.add_argument("--check", action="store_true", help="exit 1 unless the loss fell (last step below the first)")
    args = ap.parse_args()
    launched = fsdp.launcher_world()
    args.world = launched[1] if launched else args.ranks
    args.launcher = launched is not None
    if args.world < 1 or BATCH % args.world:
        ap.error(f"the number of ranks ({args.world}) must divide the batch of {BATCH}")
    if args.steps < 1 or (args.check and args.steps < 2):
        ap.error("--steps must be >= 1, and >= 2 with --check (the loss must have a step to fall)")
    if args.resume and not os.path.isfile(os.path.join(args.resume, "fsdp_checkpoint.json")):
        ap.error(f"--resume {args.resume}: no libfsdp checkpoint there (no fsdp_checkpoint.json)")
    return args


def make_model():
    rng = np.random.default_rng(0)
    params = {}
    for i in range(len(DIMS) - 1):
        b = 1 / np.sqrt(DIMS[i])
        params[f"layers.{i}.weight"] = rng.uniform(-b, b, (DIMS[i + 1], DIMS[i])).astype(np.float32)
        params[f"layers.{i}.bias"] = np.zeros(DIMS[i + 1], np.float32)
    x = rng.uniform(-1, 1, (BATCH, DIMS[0])).astype(np.float32)
    t = np.sin(x[:, :DIMS[-1]] * 2).astype(np.float32)  # a smooth target the MLP can learn
    return params, x, t


def saved_world(ckpt_dir):
    """The rank count a checkpoint was saved by (its metadata's world_size), for the resume line."""
    with open(os.path.join(ckpt_dir, "fsdp_checkpoint.json")) as f:
        return int(json.load(f)["world_size"])


def train_step(ctx, units, xs, ts):
    """Forward and backward of this rank's rows; returns the mean loss of those rows."""
    last = len(units) - 1
    acts = [xs]
    for i, u in enumerate(units):
        with u.forward():
            z = acts[-1] @ u.param_f32(0).T + u.param_f32(1)  # bf16/fp16 -> fp32
            acts.append(np.tanh(z) if i < last else z)
    diff = acts[-1] - ts
    loss = float(np.mean(diff * diff))
    dh = 2 * diff / diff.size * ctx.loss_scale  # grads of this rank's mean loss; the library averages ranks
    for i in reversed(range(len(units))):
        u = units[i]
        with u.backward():
            dz = dh * (1 - acts[i + 1] ** 2) if i < last else dh
            u.add_grad(0, dz.T @ acts[i])  # grad(0) += ..., in the param dtype
            u.add_grad(1, dz.sum(0))
            dh = dz @ u.param_f32(0)
    ctx.step()
    return loss


def main():
    args = parse_args()
    params, x, t = make_model()

    def rank_fn(rank, group):
        w = fsdp.wrap(params, block="layers", shard_strat=args.sharding, mp=args.dtype, group=group,
                      rank=rank if group is not None else None,  # under mpirun: the launcher's rank
                      lr=3e-3, weight_decay=0.01, no_weight_decay="*bias", timeout_s=60)
        with w:
            ctx, units = w.ctx, w.units
            out = sys.stdout if ctx.rank == 0 else None

            def say(line=""):
                if out:
                    print(line, file=out, flush=True)

            rows = BATCH // ctx.world_size
            xs, ts = x[ctx.rank * rows:(ctx.rank + 1) * rows], t[ctx.rank * rows:(ctx.rank + 1) * rows]
            how = "processes (mpirun or srun)" if args.launcher else "thread-ranks"
            say(fsdp.build_info())
            say(f"MLP {DIMS}, {len(units)} units, global batch {BATCH} over {ctx.world_size} {how}, "
                f"{w.sharding}, param_dtype {ctx.param_dtype}, AdamW")
            first_step = 1
            if args.resume:
                ctx.load(args.resume)  # collective; any rank count and sharding
                first_step = ctx.step_count + 1  # the optimizer steps the checkpoint had taken, plus this one
                say(f"resumed from {args.resume} (saved after step {first_step - 1} by "
                    f"{saved_world(args.resume)} ranks)")
            say("\nstep: optimizer step (1-based, counting the steps of a resumed checkpoint); loss: mean squared "
                "error over the\nwhole batch before that step's update; grad norm: global L2 norm of its grads")
            say(f"{'step':>6}  {'loss':>10}  {'grad norm':>10}")
            losses = []
            for s in range(args.steps):
                local = train_step(ctx, units, xs, ts)
                loss = float(ctx.metrics_reduce([local], "avg")[0])  # equal rows per rank: the batch's mean
                losses.append(loss)
                step = first_step + s
                if s == 0 or step % 10 == 0 or s == args.steps - 1:
                    say(f"{step:6d}  {loss:10.6f}  {ctx.last_grad_norm:10.4f}")
            if args.save:
                ctx.save(args.save, "sharded")  # collective
                say(f"saved a sharded checkpoint of step {first_step + args.steps - 1} to {args.save}")

            # Every rank's memory, in its own row of a world-sized table, summed: rank 0 gets them all.
            m = ctx.memory_stats()
            table = np.zeros((ctx.world_size, len(MEM_COLUMNS)))
            table[ctx.rank] = [getattr(m, f) / MIB for f, _ in MEM_COLUMNS]
            table = ctx.metrics_reduce(table, "sum")
            say("\nmemory per rank, MiB: params = this rank's shard of the params (fp32 master, and a param_dtype copy where kept); "
                "grads = its\nsharded fp32 grads; optim = its optimizer state; gathered-peak = the most full "
                "(unsharded) params it\nheld at once; total-peak = the most it held in all")
            widths = [max(len(name), 7) + 2 for _, name in MEM_COLUMNS]
            say(f"{'':14}" + "".join(f"{name:>{wd}}" for (_, name), wd in zip(MEM_COLUMNS, widths)))
            for r in range(ctx.world_size):
                say(f"{f'rank {r} of {ctx.world_size}':14}" + "".join(f"{v:{wd}.3f}" for v, wd in zip(table[r], widths)))
            ctx.finalize()
        fell = losses[-1] < losses[0]  # the same on every rank: the losses were reduced
        if args.check and out:
            print(f"check {'passed: the loss fell' if fell else 'FAILED: the loss did not fall'}: {losses[0]:.6f} "
                  f"-> {losses[-1]:.6f}", file=sys.stdout if fell else sys.stderr, flush=True)
        return fell

    fell = fsdp.run_ranks(args.world, rank_fn)  # under mpirun: this process's rank only
    if args.check and not all(fell):
        sys.exit(1)


if __name__ == "__main__":
    main()
