#!/usr/bin/env python3
# gpu_gpt2.py - GPT-2 124M on one GPU, side by side: fsdp.torch, FSDP2 fully_shard and plain torch.
"""The same Hugging Face GPT2LMHeadModel (GPT-2 small: 12 layers, width 768, 12 heads, context 1024, vocab
50304; no dropout), the same synthetic batch (B sequences of 1024 tokens per step), bf16 compute with fp32
master weights, fp32 grad reduction and AdamW (lr 3e-4, betas 0.9/0.95, weight decay 0.1), on one GPU:

  fsdp     (a) through fsdp.torch, one unit per GPT2Block (the rest the root unit), param_dtype=bf16,
               reduce_dtype=fp32, libfsdp's AdamW on the device; --world 2: two thread ranks sharing the GPU
               (the local communicator), each taking half the batch.
  fsdp2    (b) torch.distributed.fsdp.fully_shard on every block and the root at world 1 (NCCL), with
               MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), torch.optim.AdamW(fused=True).
  plain    (c) no sharding: fp32 params, torch.autocast(bfloat16), torch.optim.AdamW(fused=True).

(d), libfsdp's own C GPT (examples/gpt/cuda) at this configuration, is not here yet: its example has no
vocab of 50304 (docs/gpu.md says what is missing).

Each measurement runs in a fresh process (`--variant V`, one JSON line); the driver (no --variant) runs the
variants alternately for --rounds rounds and prints, per variant, the median over rounds of: tokens/s, MFU
(6N + 12*L*T*d FLOPs per token, N every param, against the GPU's dense bf16 peak, named in the output), peak
GPU memory (torch's allocator plus libfsdp's own pool), the host's time per step (the Python thread's time
from the step's first call until it queued the last, not waiting for the GPU) and the ratio of each variant's
step time to fsdp's in the same round (median of the per-round ratios).

    python3 benchmarks/gpu_gpt2.py --rounds 3 --steps 20 --batch 8          # the table, as JSON lines
    python3 benchmarks/gpu_gpt2.py --variant fsdp --world 2 --steps 20       # one measurement

Needs a CUDA GPU, torch with CUDA, transformers, and libfsdp built with CUDA (FSDP_LIBRARY or the
installed package). Written and run through a CPU-only syntax check here: compiled only until a GPU run
(docs/gpu.md "GPU runs")."""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

LAYERS, WIDTH, HEADS, CONTEXT, VOCAB = 12, 768, 12, 1024, 50304
LR, BETAS, WD = 3e-4, (0.9, 0.95), 0.1
# Dense bf16 tensor-core peaks (no sparsity), by the name torch gives the GPU: NVIDIA's datasheets.
PEAKS = [("H200", 989.4e12, "H200 SXM dense bf16"), ("H100 PCIe", 756.0e12, "H100 PCIe dense bf16"),
         ("H100", 989.4e12, "H100 SXM dense bf16"), ("A100", 312.0e12, "A100 dense bf16")]


def peak_flops(torch, given):
    name = torch.cuda.get_device_name(0)
    if given:
        return given * 1e12, f"{name}: {given} TFLOP/s (--peak-tflops)"
    for key, flops, what in PEAKS:
        if key in name:
            return flops, f"{name}: {flops / 1e12:.1f} TFLOP/s ({what})"
    raise SystemExit(f"gpu_gpt2: no known bf16 peak for {name!r}; pass --peak-tflops")


def make_model(torch, seed=0):
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(n_layer=LAYERS, n_embd=WIDTH, n_head=HEADS, n_positions=CONTEXT, vocab_size=VOCAB,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(seed)
    return GPT2LMHeadModel(cfg)


def batch(torch, rows, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (rows, CONTEXT), generator=g).cuda()


def timed_loop(torch, steps, warmup, step_fn):
    """Runs warmup + steps steps; returns (seconds per step, host seconds per step) over the timed ones."""
    for _ in range(warmup):
        step_fn()
    torch.cuda.synchronize()
    host = 0.0
    t0 = time.perf_counter()
    for _ in range(steps):
        h0 = time.perf_counter()
        step_fn()
        host += time.perf_counter() - h0
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps, host / steps


def run_fsdp(torch, args):
    import fsdp
    import fsdp.torch as ft
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    init = make_model(torch)
    n = sum(p.numel() for p in init.parameters())  # the tied embedding once
    ids = batch(torch, args.batch)

    def rank_fn(rank, group):
        model = make_model(torch).cuda() if rank else init.cuda()
        rows = ids[rank * args.batch // args.world:(rank + 1) * args.batch // args.world]
        with ft.shard(model, units=GPT2Block, group=group, rank=rank, device="cuda:0", param_dtype="bf16",
                      reduce_dtype="fp32", optimizer="adamw", lr=LR, beta1=BETAS[0], beta2=BETAS[1],
                      weight_decay=WD, loss_scale="off") as sh:
            def step():
                model(rows, labels=rows).loss.backward()
                sh.step()
            sec, host = timed_loop(torch, args.steps, args.warmup, step)
            mem = sh.ctx.memory_stats()
            return sec, host, mem.total_peak_nbytes

    out = fsdp.run_ranks(args.world, rank_fn)
    sec = max(o[0] for o in out)
    return sec, out[0][1], torch.cuda.max_memory_allocated() + sum(o[2] for o in out), n


def run_fsdp2(torch, args):
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    model = make_model(torch).cuda()
    n = sum(p.numel() for p in model.parameters())
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.transformer.h:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WD, fused=True)
    ids = batch(torch, args.batch)

    def step():
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    sec, host = timed_loop(torch, args.steps, args.warmup, step)
    dist.destroy_process_group()
    return sec, host, torch.cuda.max_memory_allocated(), n


def run_plain(torch, args):
    model = make_model(torch).cuda()
    n = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WD, fused=True)
    ids = batch(torch, args.batch)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    sec, host = timed_loop(torch, args.steps, args.warmup, step)
    return sec, host, torch.cuda.max_memory_allocated(), n


def measure(args):
    import torch
    if not torch.cuda.is_available():
        raise SystemExit("gpu_gpt2: torch sees no GPU")
    peak, peak_what = peak_flops(torch, args.peak_tflops)
    run = {"fsdp": run_fsdp, "fsdp2": run_fsdp2, "plain": run_plain}[args.variant]
    sec, host, mem, n = run(torch, args)
    tokens = args.batch * CONTEXT
    flops_per_token = 6 * n + 12 * LAYERS * CONTEXT * WIDTH
    print(json.dumps({"variant": args.variant, "world": args.world, "batch": args.batch, "context": CONTEXT,
                      "params": n, "step_s": sec, "host_s": host, "tokens_per_s": tokens / sec,
                      "mfu": flops_per_token * tokens / sec / peak, "peak": peak_what, "peak_mem_bytes": mem}))


def drive(args):
    variants = [("fsdp", 1), ("fsdp2", 1), ("plain", 1)] + ([("fsdp", 2)] if args.world2 else [])
    rows = {v: [] for v in variants}
    for r in range(args.rounds):
        for v, w in variants:
            cmd = [sys.executable, os.path.abspath(__file__), "--variant", v, "--world", str(w), "--steps",
                   str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch)]
            if args.peak_tflops:
                cmd += ["--peak-tflops", str(args.peak_tflops)]
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            if out.returncode != 0:
                raise SystemExit(f"gpu_gpt2: {' '.join(cmd)} failed:\n{out.stdout}\n{out.stderr}")
            rows[(v, w)].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"round {r}: {v} world {w}: {rows[(v, w)][-1]['step_s'] * 1e3:.1f} ms/step", file=sys.stderr)
    base = rows[("fsdp", 1)]
    for (v, w), runs in rows.items():
        med = {k: statistics.median(x[k] for x in runs) for k in ("step_s", "host_s", "tokens_per_s", "mfu",
                                                                   "peak_mem_bytes")}
        ratio = statistics.median(x["step_s"] / b["step_s"] for x, b in zip(runs, base))
        print(json.dumps({"variant": v, "world": w, "rounds": len(runs), **med, "step_vs_fsdp_w1": ratio,
                          "peak": runs[0]["peak"], "batch": args.batch}))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", choices=["fsdp", "fsdp2", "plain"])
    ap.add_argument("--world", type=int, default=1, help="thread ranks sharing the GPU (fsdp only)")
    ap.add_argument("--world2", action="store_true", help="the driver also runs fsdp at world 2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8, help="sequences of 1024 tokens per step (all ranks)")
    ap.add_argument("--peak-tflops", type=float, default=0.0, help="the GPU's dense bf16 peak, where unknown")
    args = ap.parse_args()
    if args.variant is None:
        drive(args)
    else:
        if args.world != 1 and args.variant != "fsdp":
            raise SystemExit("gpu_gpt2: --world > 1 is for --variant fsdp (thread ranks on one GPU)")
        measure(args)


if __name__ == "__main__":
    main()
