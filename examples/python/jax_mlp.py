#!/usr/bin/env python3
# jax_mlp.py - libfsdp from JAX (fsdp.jax): an MLP params pytree trained by N ranks beside the same model in plain JAX.
"""Train a JAX MLP through fsdp.jax and print its loss beside the unsharded JAX run's.

  python examples/python/jax_mlp.py [--ranks N] [--steps S] [--mode whole|layerwise] [--sharding S] [--check]
  mpirun -np N python examples/python/jax_mlp.py [--steps S] ...

The params are a Flax-style pytree, {"layers": [{"w", "b"}, ...], "head": {"w", "b"}}; fsdp.jax.shard(params,
units=2) makes each layer and the head a unit. --mode whole runs jax.value_and_grad over the whole model
(every unit gathered during the pass); --mode layerwise runs the layers one unit at a time with jax.vjp
(one unit gathered, plus one prefetched). Each rank is a thread of this process (fsdp.run_ranks); started
by mpirun, each process is one rank and --ranks is ignored. Each rank trains on its slice of the global
batch; the unsharded run trains on the whole batch with the same AdamW (libfsdp's formula, written here in
JAX), so the two losses agree to fp32 rounding. Rank 0 prints every step's two losses, then each run's
median step time and its gathered-params peak. --check exits with status 1 if a step's losses differ by
more than 1e-5 relative (seen: 1e-7)."""
import argparse
import sys
import time

import numpy as np

import fsdp
import fsdp.jax

DIMS = [32, 128, 128, 128, 128, 128, 128, 8]  # six tanh layers and a linear head
BATCH = 64  # global batch, split evenly over the ranks
LR, WD = 3e-3, 0.01
TOLERANCE = 1e-5


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[1:]))
    ap.add_argument("--ranks", type=int, default=2, help="thread-ranks (must divide %d); ignored under mpirun" % BATCH)
    ap.add_argument("--steps", type=int, default=20, help="training steps to run")
    ap.add_argument("--mode", default="whole", choices=["whole", "layerwise"], help="fsdp.jax's mode")
    ap.add_argument("--sharding", default="FULL_SHARD", help="FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD, ...")
    ap.add_argument("--check", action="store_true", help="exit 1 if a step's losses differ by more than %g" % TOLERANCE)
    args = ap.parse_args()
    launched = fsdp.launcher_world()
    args.world = launched[1] if launched else args.ranks
    args.rank0 = launched is None or launched[0] == 0
    args.launcher = launched is not None
    if args.world < 1 or BATCH % args.world:
        ap.error(f"the number of ranks ({args.world}) must divide the batch of {BATCH}")
    if args.steps < 1:
        ap.error("--steps must be >= 1")
    return args


def make_model():
    rng = np.random.default_rng(0)

    def dense(i):
        b = 1 / np.sqrt(DIMS[i])
        return {"w": rng.uniform(-b, b, (DIMS[i], DIMS[i + 1])).astype(np.float32),
                "b": np.zeros(DIMS[i + 1], np.float32)}
    params = {"layers": [dense(i) for i in range(len(DIMS) - 2)], "head": dense(len(DIMS) - 2)}
    x = rng.uniform(-1, 1, (BATCH, DIMS[0])).astype(np.float32)
    t = np.sin(x[:, :DIMS[-1]] * 2).astype(np.float32)  # a smooth target the MLP can learn
    return params, x, t


# The model, in JAX: what fsdp.jax runs on the gathered params.
def hidden(p, x):
    import jax.numpy as jnp
    return jnp.tanh(x @ p["w"] + p["b"])


def head(p, x):
    return x @ p["w"] + p["b"]


def mse(y, t):
    import jax.numpy as jnp
    return jnp.mean((y - t) ** 2)


def loss_fn(params, x, t):
    for p in params["layers"]:
        x = hidden(p, x)
    return mse(head(params["head"], x), t)


def unsharded(params, x, t, steps):
    """The same training in plain JAX on the whole batch: (losses, median seconds per step). AdamW as libfsdp
    computes it (kernels/optim.h) in the same float32 operations: decoupled decay first, the bias corrections
    made in double as lr/bc1 and 1/sqrt(bc2), eps added after; biases ("*.b") not decayed; torch's defaults."""
    import jax
    import jax.numpy as jnp
    f32 = np.float32
    lr, b1, b2, eps = (float(f32(a)) for a in (LR, 0.9, 0.999, 1e-8))  # the options as the library holds them
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    decay = treedef.unflatten([f32(1) - f32(lr) * f32(0.0 if fsdp.jax.path_name(k).endswith(".b") else WD)
                               for k, _ in flat])

    @jax.jit
    def train_step(p, m, v, step_size, inv_bc2_sqrt):
        loss, g = jax.value_and_grad(loss_fn)(p, x, t)
        m = jax.tree_util.tree_map(lambda m, g: f32(b1) * m + (f32(1) - f32(b1)) * g, m, g)
        v = jax.tree_util.tree_map(lambda v, g: f32(b2) * v + (f32(1) - f32(b2)) * g * g, v, g)
        p = jax.tree_util.tree_map(lambda p, m, v, d: p * d - step_size * (m / (jnp.sqrt(v) * inv_bc2_sqrt + f32(eps))),
                                   p, m, v, decay)
        return p, m, v, loss

    p = jax.tree_util.tree_map(jnp.asarray, params)
    m = jax.tree_util.tree_map(jnp.zeros_like, p)
    v = jax.tree_util.tree_map(jnp.zeros_like, p)
    losses, times = [], []
    for step in range(1, steps + 1):
        start = time.perf_counter()
        p, m, v, loss = train_step(p, m, v, f32(lr / (1 - b1 ** step)), f32(1 / np.sqrt(1 - b2 ** step)))
        losses.append(float(loss))  # blocks
        times.append(time.perf_counter() - start)
    return losses, float(np.median(times[1:] or times))


def main():
    args = parse_args()
    params, x, t = make_model()
    ref = unsharded(params, x, t, args.steps) if args.rank0 else None

    def rank_fn(rank, group):
        sharded = fsdp.jax.shard(params, units=2, group=group, rank=rank if group is not None else None,
                                 sharding=args.sharding, lr=LR, weight_decay=WD, no_weight_decay="*.b",
                                 forward_prefetch=1, timeout_s=60)
        with sharded:
            ctx = sharded.ctx
            out = sys.stdout if ctx.rank == 0 else None

            def say(line=""):
                if out:
                    print(line, file=out, flush=True)

            rows = BATCH // ctx.world_size
            xs, ts = x[ctx.rank * rows:(ctx.rank + 1) * rows], t[ctx.rank * rows:(ctx.rank + 1) * rows]
            if args.mode == "whole":
                train = sharded.value_and_grad(loss_fn)
            else:
                chain = {f"layers.{i}": hidden for i in range(len(DIMS) - 2)}
                chain["head"] = head
                train = sharded.layerwise(chain, mse)
            how = "processes (mpirun)" if args.launcher else "thread-ranks"
            say(f"MLP {DIMS} as a JAX pytree, units {sharded.unit_names}, global batch {BATCH} over "
                f"{ctx.world_size} {how}, {sharded.sharding}, fsdp.jax {args.mode} mode, AdamW")
            say("\nloss: mean squared error over the whole batch before that step's update; libfsdp: this run, "
                "jax: unsharded JAX")
            say(f"{'step':>6}  {'libfsdp':>10}  {'jax':>10}  {'rel diff':>9}")
            worst, times = 0.0, []
            for s in range(args.steps):
                start = time.perf_counter()
                local = train(xs, ts)
                sharded.step()
                times.append(time.perf_counter() - start)
                loss = float(ctx.metrics_reduce([local], "avg")[0])  # equal rows per rank: the batch's mean
                if out:
                    diff = abs(loss - ref[0][s]) / abs(ref[0][s])
                    worst = max(worst, diff)
                    say(f"{s + 1:6d}  {loss:10.6f}  {ref[0][s]:10.6f}  {diff:9.2e}")
            step_s = float(ctx.metrics_reduce([np.median(times[1:] or times)], "max")[0])
            peak = ctx.metrics_reduce([sharded.memory_stats().gathered_params_peak_nbytes], "max")[0]
            if out:  # ref: rank 0's alone
                say(f"\nmedian step: libfsdp {step_s * 1e3:.2f} ms (slowest rank), unsharded JAX {ref[1] * 1e3:.2f} "
                    f"ms (compiles excluded); gathered params peak {peak / 1024:.1f} KiB per rank")
            sharded.finalize()
        if args.check and out:
            ok = worst <= TOLERANCE
            print(f"check {'passed' if ok else 'FAILED'}: the largest relative difference is {worst:.2e} "
                  f"(tolerance {TOLERANCE:g})", file=sys.stdout if ok else sys.stderr, flush=True)
            return ok
        return True

    ok = fsdp.run_ranks(args.world, rank_fn)  # under mpirun: this process's rank only
    if args.check and not all(ok):
        sys.exit(1)


if __name__ == "__main__":
    main()
