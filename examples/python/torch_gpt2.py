#!/usr/bin/env python3
# torch_gpt2.py - Hugging Face GPT-2 trained through fsdp.torch by N ranks, its loss beside plain torch's.
"""Train transformers' GPT2LMHeadModel (a small config, random init, no download) with fsdp.torch and
print each step's loss beside the same model trained by plain torch (one process, the whole batch,
torch.optim.AdamW), then each rank's memory.

  python examples/python/torch_gpt2.py [--ranks N] [--steps S] [--sharding S] [--dtype fp32|bf16] [--check]
  mpirun -np N python examples/python/torch_gpt2.py [--steps S] ...

Each rank is a thread of this process (fsdp.run_ranks); under mpirun each process is one rank. The
training loop is torch's; against the plain loop it changes these lines (marked "# fsdp" below):

    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
  + sharded = fsdp.torch.shard(model, units=GPT2Block, group=group, rank=rank, lr=LR, weight_decay=WD)
  + ids = ids[rank * per_rank:(rank + 1) * per_rank]        # each rank its share of the batch
    loss = model(ids, labels=ids).loss
    loss.backward()
    opt.step(); opt.zero_grad()
  + sharded.step()
  + mean_loss = sharded.ctx.metrics_reduce([loss.item()], "avg")[0]   # for printing

plus fsdp.run_ranks around the loop for thread ranks. --check exits 1 unless every step's loss is within
1e-4 (relative) of plain torch's (fp32; bf16 is compared with torch in bf16 only in the tests)."""
import argparse
import copy
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.models.gpt2.modeling_gpt2 import GPT2Block

import fsdp
import fsdp.torch

LR, WD = 1e-3, 0.1
BATCH, SEQ = 8, 32
MIB = 1 << 20


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[1:]))
    ap.add_argument("--ranks", type=int, default=2, help=f"thread ranks (must divide {BATCH}); ignored under mpirun")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--sharding", default="FULL_SHARD")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="param_dtype")
    ap.add_argument("--check", action="store_true", help="exit 1 unless the losses match plain torch's")
    args = ap.parse_args()
    launched = fsdp.launcher_world()
    if launched:
        args.ranks = launched[1]
    if BATCH % args.ranks:
        ap.error(f"--ranks must divide the batch of {BATCH}")
    return args


def make_model():
    cfg = GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=1024, n_positions=SEQ, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return GPT2LMHeadModel(cfg)


def batches(steps):
    """Two batches of random tokens, in turn: learnable, so that the loss falls within a few steps."""
    g = torch.Generator().manual_seed(1)
    two = [torch.randint(0, 1024, (BATCH, SEQ), generator=g) for _ in range(2)]
    return [two[k % 2] for k in range(steps)]


def plain_torch(init, data):
    model = copy.deepcopy(init)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    losses = []
    for ids in data:
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def main():
    args = parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads() // args.ranks))  # thread ranks share torch's pool
    init, data = make_model(), batches(args.steps)
    reference = plain_torch(init, data)
    per_rank = BATCH // args.ranks

    def rank_fn(rank, group):
        model = copy.deepcopy(init)
        sharded = fsdp.torch.shard(model, units=GPT2Block, group=group, rank=rank, lr=LR, weight_decay=WD,  # fsdp
                                   sharding=args.sharding, param_dtype=args.dtype)
        losses = []
        with sharded:
            for ids in data:
                ids = ids[rank * per_rank:(rank + 1) * per_rank]  # fsdp
                loss = model(ids, labels=ids).loss
                loss.backward()
                sharded.step()  # fsdp
                losses.append(float(sharded.ctx.metrics_reduce([loss.item()], "avg")[0]))  # fsdp
            m = sharded.ctx.memory_stats()
            mine = [m.sharded_params_nbytes, m.sharded_grads_nbytes, m.optimizer_state_nbytes,
                    m.gathered_params_peak_nbytes, m.total_peak_nbytes]
            slots = [0.0] * (5 * args.ranks)
            slots[5 * rank:5 * rank + 5] = mine
            table = sharded.ctx.metrics_reduce(slots, "sum")
            sharded.ctx.finalize()
        return losses, table, [u.name for u in sharded.units]

    losses, table, units = fsdp.run_ranks(args.ranks, rank_fn)[0]
    if fsdp.launcher_world() and fsdp.launcher_world()[0] != 0:
        return 0
    print(f"GPT2LMHeadModel 4x256, {args.ranks} ranks, {args.sharding}, {args.dtype}; units: {', '.join(units)}")
    print(f"{'step':>4}  {'fsdp.torch':>10}  {'plain torch':>11}")
    worst = 0.0
    for k, (a, b) in enumerate(zip(losses, reference)):
        worst = max(worst, abs(a - b) / abs(b))
        if k < 3 or k % 5 == 4 or k == len(losses) - 1:
            print(f"{k + 1:>4}  {a:>10.6f}  {b:>11.6f}")
    print(f"largest relative loss difference: {worst:.2e}")
    print(f"{'rank':>4}  {'params':>8}  {'grads':>8}  {'optim':>8}  {'gathered-peak':>13}  {'total-peak':>10}  (MiB)")
    for r in range(args.ranks):
        row = table[5 * r:5 * r + 5] / MIB
        print(f"{r:>4}  {row[0]:>8.2f}  {row[1]:>8.2f}  {row[2]:>8.2f}  {row[3]:>13.2f}  {row[4]:>10.2f}")
    if args.check and args.dtype == "fp32" and worst > 1e-4:
        print(f"check failed: the losses differ from plain torch's by {worst:.2e} (relative)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
