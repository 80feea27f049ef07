#!/usr/bin/env python3
"""The PyTorch side of the libfsdp-vs-PyTorch GPT benchmark (benchmarks/vs_pytorch/run.py runs it).

Trains the same small GPT as examples/gpt (train_gpt), for timing and memory only:

  byte vocab V=256; wte [V, C] and wpe [context, C] (learned positions); L pre-norm blocks
      x = x + proj(attn(ln1(x)));  x = x + fc2(gelu_tanh(fc(ln2(x))))
  attn: one fused qkv Linear(C, 3C) (q, k, v the three C-wide column blocks in that order, each
  split into H heads of C/H), causal softmax attention with scale 1/sqrt(C/H)
  (F.scaled_dot_product_attention(is_causal=True), whose default scale is that), proj Linear(C, C);
  MLP fc Linear(C, 4C), GELU (tanh form), fc2 Linear(4C, C); every Linear with a bias; LayerNorm
  eps 1e-5 with weight and bias; final LayerNorm lnf; tied head logits = lnf(x) @ wte^T (no bias).
  Loss: mean cross-entropy over every token of the batch (computed in fp32).
  Init (GPT-2's): Linear weights N(0, 0.02), attn proj and mlp fc2 weights N(0, 0.02/sqrt(2L)),
  biases 0, LayerNorm weight 1 and bias 0, wte and wpe N(0, 0.02). Values are not bitwise
  those of the C++ side: this is a speed and memory benchmark.
  AdamW lr 3e-4, betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on the 2-D Linear weights and 0
  on biases, LayerNorm params and the embeddings; torch's default AdamW implementation for the
  params (foreach), or --adamw fused|foreach; grad-norm clipping at 1.0
  (torch.nn.utils.clip_grad_norm_). Grads are dropped after each step (zero_grad(set_to_none=True),
  torch's default).
  Data: random bytes from a fixed seed (--seed), or windows of a text file (--text); every rank
  draws the same global batch of --batch sequences of context+1 bytes and takes its own
  contiguous --batch/world of them.

Modes:
  single  the plain model in one process, no torch.distributed. fp32: fp32 params and compute.
          bf16: the same numerics FSDP2's mixed precision is compared with: fp32 master params
          (and fp32 grads and AdamW state), the forward and backward under
          torch.autocast(device_type, dtype=torch.bfloat16) (autocast's op lists: the matmuls and
          attention in bf16, the ops it keeps in fp32 in fp32). The params are never stored in
          bf16 and no explicit .to(bf16) is done.
  fsdp2   launched by torchrun (torchrun --standalone --nproc_per_node N torch_gpt.py --mode fsdp2
          ...); process group gloo on cpu, nccl on cuda; FSDP2 (torch.distributed.fsdp.fully_shard)
          on each block, then on the root (which holds wte, wpe and lnf), reshard_after_forward=True
          (FULL_SHARD; FSDP2 keeps the root's own params gathered between forward and backward).
          bf16: MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32):
          fp32 sharded master params, grads and AdamW state, every param gathered in bf16 and the
          whole forward/backward in bf16, grads reduce-scattered in fp32. No autocast.

Measured per rank: each step's wall time (time.perf_counter around forward + backward + clip +
optimizer step + zero_grad; torch.cuda.synchronize() before the clock is read on cuda), after 2
warm-up steps that are not timed; the median; peak RSS (getrusage ru_maxrss); the library's own
memory counters: params_bytes (this rank's param storage: the local shard of each DTensor param,
or the params' nbytes in single mode), grads_bytes (the same over .grad after backward, before
zero_grad, measured in the warm-up steps), optim_bytes (every tensor in optimizer.state, local
shards, after the last step), device_peak_bytes (torch.cuda.max_memory_allocated; null on cpu).
Rank 0 gathers the per-rank figures (dist.all_gather_object) and writes one JSON object to --json
with the fields that train_gpt --bench-json writes (framework "pytorch-fsdp2" / "pytorch-single").

Threads: torch.set_num_threads(--threads, default max(1, usable cores // world)) so N ranks on one
machine do not oversubscribe its cores; printed at start.

  torch_gpt.py --mode single|fsdp2 [--layers 6 --width 384 --heads 6 --context 256 --batch 8
               --steps 10 --dtype bf16|fp32 --device cpu|cuda --json FILE --threads N
               --seed N --text FILE --adamw default|foreach|fused]
"""
import argparse
import json
import math
import os
import resource
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 256
WARMUP = 2


class Block(nn.Module):
    def __init__(self, c, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(c, eps=1e-5)
        self.qkv = nn.Linear(c, 3 * c)
        self.proj = nn.Linear(c, c)
        self.ln2 = nn.LayerNorm(c, eps=1e-5)
        self.fc = nn.Linear(c, 4 * c)
        self.fc2 = nn.Linear(4 * c, c)

    def attn(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=-1)  # the three C-wide column blocks, in that order
        q = q.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        k = k.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        v = v.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # scale 1/sqrt(C/H)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, layers, width, heads, context):
        super().__init__()
        self.context = context
        self.wte = nn.Embedding(VOCAB, width)
        self.wpe = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.lnf = nn.LayerNorm(width, eps=1e-5)
        self.init_weights(layers)

    @torch.no_grad()
    def init_weights(self, layers):
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, 0.02)
            if isinstance(m, nn.Linear):
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        for block in self.blocks:  # the residual projections
            nn.init.normal_(block.proj.weight, 0.0, 0.02 / math.sqrt(2 * layers))
            nn.init.normal_(block.fc2.weight, 0.0, 0.02 / math.sqrt(2 * layers))

    def forward(self, idx, targets):
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.lnf(x), self.wte.weight)  # tied head, no bias
        return F.cross_entropy(logits.float().view(-1, VOCAB), targets.reshape(-1))


def param_groups(model):
    """Weight decay 0.1 on the 2-D Linear weights; 0 on biases, LayerNorm params and embeddings."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        is_embedding = name.startswith("wte.") or name.startswith("wpe.")
        (decay if p.dim() == 2 and not is_embedding else no_decay).append(p)
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def local_nbytes(t):
    """Bytes of this rank's storage of t: the local shard of a DTensor, else the tensor itself."""
    if hasattr(t, "to_local"):
        t = t.to_local()
    return t.numel() * t.element_size()


def make_batches(args, world, rank, device):
    """The batches of every step (warm-up included), made before the timed loop: this rank's
    [batch/world, context] inputs and targets, cut from the same global batch on every rank."""
    gen = torch.Generator().manual_seed(args.seed)
    text = None
    if args.text:
        with open(args.text, "rb") as f:
            text = torch.frombuffer(bytearray(f.read().replace(b"\r", b"")), dtype=torch.uint8)
        if text.numel() < args.context + 2:
            sys.exit(f"torch_gpt.py: {args.text} has fewer than context+2 = {args.context + 2} bytes")
    per_rank = args.batch // world
    out = []
    for _ in range(WARMUP + args.steps):
        if text is None:
            seqs = torch.randint(0, VOCAB, (args.batch, args.context + 1), generator=gen, dtype=torch.int64)
        else:
            starts = torch.randint(0, text.numel() - args.context - 1, (args.batch,), generator=gen)
            seqs = torch.stack([text[s:s + args.context + 1] for s in starts.tolist()]).long()
        mine = seqs[rank * per_rank:(rank + 1) * per_rank]
        out.append((mine[:, :-1].contiguous().to(device), mine[:, 1:].contiguous().to(device)))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=["fsdp2", "single"], required=True)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=384)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8, help="global sequences per step, split evenly over ranks")
    ap.add_argument("--steps", type=int, default=10, help="timed steps (after %d warm-up steps)" % WARMUP)
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--json", help="write the result here (rank 0)")
    ap.add_argument("--threads", type=int, help="torch threads per rank (default: usable cores // world)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--text", help="train on windows of this file instead of random bytes")
    ap.add_argument("--adamw", choices=["default", "foreach", "fused"], default="default",
                    help="torch.optim.AdamW implementation (default: torch's own choice, foreach)")
    args = ap.parse_args()
    if args.width % args.heads:
        sys.exit(f"torch_gpt.py: --width {args.width} is not a multiple of --heads {args.heads}")
    if args.steps < 1:
        sys.exit("torch_gpt.py: --steps must be at least 1")

    import torch.distributed as dist
    if args.mode == "fsdp2":  # imported before the import RSS below is read (single mode does without)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    import_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    if args.mode == "fsdp2":
        if "WORLD_SIZE" not in os.environ:
            sys.exit("torch_gpt.py: --mode fsdp2 runs under torchrun "
                     "(torchrun --standalone --nproc_per_node N torch_gpt.py --mode fsdp2 ...)")
        world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
    else:
        world, rank, local_rank = 1, 0, 0
    if args.batch % world:
        sys.exit(f"torch_gpt.py: --batch {args.batch} does not split evenly over {world} ranks")

    if args.device == "cuda":
        if not torch.cuda.is_available():
            sys.exit("torch_gpt.py: --device cuda but torch sees no GPU")
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")

    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count() or 1
    threads = args.threads or max(1, usable // world)
    torch.set_num_threads(threads)

    if args.mode == "fsdp2":
        dist.init_process_group(backend="nccl" if args.device == "cuda" else "gloo",
                                device_id=device if args.device == "cuda" else None)
    if rank == 0:
        print(f"torch_gpt.py: torch {torch.__version__}, mode {args.mode}, world {world}, device {args.device}, "
              f"dtype {args.dtype}, threads per rank {threads} (of {usable} usable cores); "
              f"peak RSS after importing torch {import_rss / 2**20:.1f} MiB", flush=True)

    torch.manual_seed(args.seed)
    model = GPT(args.layers, args.width, args.heads, args.context).to(device)
    n_params = sum(p.numel() for p in model.parameters())

    autocast = None
    if args.mode == "fsdp2":
        mesh = init_device_mesh(args.device, (world,))
        kw = dict(mesh=mesh, reshard_after_forward=True)
        if args.dtype == "bf16":
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, **kw)
        fully_shard(model, **kw)
    elif args.dtype == "bf16":
        autocast = lambda: torch.autocast(device_type=args.device, dtype=torch.bfloat16)  # noqa: E731

    opt_kw = {}
    if args.adamw != "default":
        opt_kw[args.adamw] = True
    opt = torch.optim.AdamW(param_groups(model), lr=3e-4, betas=(0.9, 0.95), eps=1e-8, **opt_kw)
    params = list(model.parameters())
    params_bytes = sum(local_nbytes(p) for p in params)
    if rank == 0:
        print(f"torch_gpt.py: {n_params} params ({n_params / 1e6:.2f} M), layers {args.layers} width {args.width} "
              f"heads {args.heads} context {args.context}, global batch {args.batch} "
              f"({args.batch // world} per rank), {args.steps} timed steps after {WARMUP} warm-up", flush=True)

    batches = make_batches(args, world, rank, device)
    tokens_per_step = args.batch * args.context
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    grads_bytes = 0
    step_times, losses = [], []
    for i, (x, y) in enumerate(batches):
        timed = i >= WARMUP
        sync()
        t0 = time.perf_counter()
        if autocast is not None:
            with autocast():
                loss = model(x, y)
        else:
            loss = model(x, y)
        loss.backward()
        if not timed:  # the library's grad counter, outside the timed steps
            grads_bytes = max(grads_bytes, sum(local_nbytes(p.grad) for p in params if p.grad is not None))
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        dt = time.perf_counter() - t0
        lv = loss.item()  # this rank's loss, outside the timing
        losses.append(lv)
        if timed:
            step_times.append(dt)
        if rank == 0:
            print(f"step {i - WARMUP if timed else 'warm-up %d' % i}: {dt * 1e3:.1f} ms, rank-0 loss {lv:.4f}",
                  flush=True)

    optim_bytes = sum(local_nbytes(v) for st in opt.state.values() for v in st.values() if torch.is_tensor(v))
    mine = dict(
        step_times_s=step_times,
        median_step_s=statistics.median(step_times),
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        params_bytes=params_bytes,
        grads_bytes=grads_bytes,
        optim_bytes=optim_bytes,
        device_peak_bytes=torch.cuda.max_memory_allocated(device) if args.device == "cuda" else None,
    )
    if args.mode == "fsdp2":
        every = [None] * world
        dist.all_gather_object(every, mine)
    else:
        every = [mine]

    if rank == 0:
        med = every[0]["median_step_s"]
        out = dict(
            framework="pytorch-fsdp2" if args.mode == "fsdp2" else "pytorch-single",
            world=world, device=args.device, layers=args.layers, width=args.width, heads=args.heads,
            context=args.context, global_batch=args.batch, dtype=args.dtype, steps=args.steps,
            median_step_s=med, tokens_per_s=tokens_per_step / med, step_times_s=every[0]["step_times_s"],
            peak_rss_bytes=[r["peak_rss_bytes"] for r in every],
            params_bytes=[r["params_bytes"] for r in every],
            grads_bytes=[r["grads_bytes"] for r in every],
            optim_bytes=[r["optim_bytes"] for r in every],
            device_peak_bytes=[r["device_peak_bytes"] for r in every],
            torch_version=torch.__version__,
            threads_per_rank=threads,
        )
        print(f"torch_gpt.py: median step {med * 1e3:.1f} ms, {out['tokens_per_s']:.0f} tokens/s, "
              f"peak RSS per rank {[round(b / 2**20, 1) for b in out['peak_rss_bytes']]} MiB", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
                f.write("\n")
    if args.mode == "fsdp2":
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
