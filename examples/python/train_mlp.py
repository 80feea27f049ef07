#!/usr/bin/env python3
# train_mlp.py - libfsdp from Python: a numpy MLP regression trained by N thread-ranks, printing loss and memory.
"""Usage: python examples/python/train_mlp.py [--ranks N] [--steps S] [--sharding S] [--mp fp32|bf16|fp16]

Each rank is a thread (fsdp.run_ranks); under `mpirun -np N python train_mlp.py` each process is one.
The model code (forward and backward of Linear+tanh by hand, in numpy) is what a host framework
provides; libfsdp owns the params, grads, optimizer state and collectives. FSDP_LIBRARY=path/to/libfsdp.so
picks the library."""
import argparse

import numpy as np

import fsdp

DIMS = [32, 128, 128, 8]
BATCH = 64


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--sharding", default="FULL_SHARD")
    ap.add_argument("--mp", default="fp32", choices=["fp32", "bf16", "fp16"])
    args = ap.parse_args()

    rng = np.random.default_rng(0)
    params = {}
    for i in range(len(DIMS) - 1):
        b = 1 / np.sqrt(DIMS[i])
        params[f"layers.{i}.weight"] = rng.uniform(-b, b, (DIMS[i + 1], DIMS[i])).astype(np.float32)
        params[f"layers.{i}.bias"] = np.zeros(DIMS[i + 1], np.float32)
    x = rng.uniform(-1, 1, (BATCH, DIMS[0])).astype(np.float32)
    t = np.sin(x[:, :DIMS[-1]] * 2).astype(np.float32)  # a smooth target the MLP can learn

    def rank_fn(rank, group):
        w = fsdp.wrap(params, block="layers", shard_strat=args.sharding, mp=args.mp, group=group,
                      rank=rank, lr=3e-3, weight_decay=0.01, no_weight_decay="*bias", timeout_s=60)
        with w:
            ctx, units, last = w.ctx, w.units, len(w.units) - 1
            rows = BATCH // ctx.world_size
            xs, ts = x[ctx.rank * rows:(ctx.rank + 1) * rows], t[ctx.rank * rows:(ctx.rank + 1) * rows]
            for step in range(args.steps):
                acts = [xs]
                for i, u in enumerate(units):
                    with u.forward():
                        z = acts[-1] @ u.param_f32(0).T + u.param_f32(1)  # bf16/fp16 -> fp32
                        acts.append(np.tanh(z) if i < last else z)
                diff = acts[-1] - ts
                loss = float(np.mean(diff * diff))
                dh = 2 * diff / diff.size * ctx.loss_scale
                for i in reversed(range(len(units))):
                    u = units[i]
                    with u.backward():
                        dz = dh * (1 - acts[i + 1] ** 2) if i < last else dh
                        u.add_grad(0, dz.T @ acts[i])  # grad(0) += ..., in the param dtype
                        u.add_grad(1, dz.sum(0))
                        dh = dz @ u.param_f32(0)
                ctx.step()
                if ctx.rank == 0:
                    print(f"step {step:3d}  loss(rank 0 rows) {loss:.5f}  grad norm {ctx.last_grad_norm:.4f}",
                          flush=True)
            mem = ctx.memory_stats()
            ctx.finalize()
        return ctx.rank, mem

    for r, m in fsdp.run_ranks(args.ranks, rank_fn):  # under mpirun: this process's rank only
        print(f"rank {r}: sharded params {m.sharded_params_nbytes} B, optimizer {m.optimizer_state_nbytes} B, "
              f"gathered peak {m.gathered_params_peak_nbytes} B, total peak {m.total_peak_nbytes} B")


if __name__ == "__main__":
    main()
