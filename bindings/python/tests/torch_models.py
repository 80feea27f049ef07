# torch_models.py - models, data and the unsharded torch references of the fsdp.torch tests (and their mpirun job).
import copy

import torch
import torch.nn as nn

# lr 1e-3, torch's AdamW betas and eps, decay set on both sides (libfsdp's default differs from torch's).
HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
BATCH = 8  # divisible by worlds 1, 2 and 4: each rank takes BATCH / world rows


class Block(nn.Module):
    """A pre-norm residual MLP block: one unit."""

    def __init__(self, d):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(x))))


class Net(nn.Module):
    """inp -> 3 Blocks -> ln_f -> out: the Blocks are units, inp/ln_f/out the root unit."""

    def __init__(self, din=6, d=16, dout=3, n=3):
        super().__init__()
        self.inp = nn.Linear(din, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(n)])
        self.ln_f = nn.LayerNorm(d)
        self.out = nn.Linear(d, dout)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(self.ln_f(h))


def make_net(seed=0):
    torch.manual_seed(seed)
    return Net()


def make_data(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 3, generator=g)


def mse(model, x, y):
    return ((model(x) - y) ** 2).mean()


def reference_train(init, x, y, steps, dtype=torch.float32, micro=1, on_step=None, device="cpu"):
    """Plain torch on the whole batch: fp32 master params and torch.optim.AdamW; with dtype bf16 the forward
    and backward run on a bf16 copy of the master (what libfsdp's param_dtype=bf16 does), the grads are
    converted to fp32 for the update. micro > 1: the batch in `micro` micro-batches, grads summed (each
    micro-batch's loss divided by micro. on_step(model, step) runs before each step's forward (a test's
    change of requires_grad). On `device` (a torch device: the model and data are moved there). Returns
    (per-step losses, the first step's grads, final params)."""
    master = copy.deepcopy(init).to(device)
    x, y = x.to(device), y.to(device)
    compute = master if dtype == torch.float32 else copy.deepcopy(init).to(device=device, dtype=dtype)
    opt = torch.optim.AdamW(master.parameters(), lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]),
                            eps=HYPER["eps"], weight_decay=HYPER["weight_decay"], foreach=False)
    losses, grads0 = [], None
    mp, cp = list(master.parameters()), list(compute.parameters())
    for step in range(steps):
        if on_step is not None:
            on_step(master, step)
        if compute is not master:
            with torch.no_grad():
                for c, m in zip(cp, mp):
                    c.copy_(m)
        total = 0.0
        for xs, ys in zip(x.chunk(micro), y.chunk(micro)):
            loss = mse(compute, xs.to(dtype), ys.to(dtype)) / micro
            loss.backward()
            total += loss.item()
        if compute is not master:
            for c, m in zip(cp, mp):
                m.grad = c.grad.float()
                c.grad = None
        if step == 0:
            grads0 = {n: p.grad.detach().clone() for n, p in master.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, grads0, {n: p.detach().clone() for n, p in master.named_parameters()}


def make_gpt2(seed=0, layers=4, width=64, vocab=128, positions=32):
    """transformers' GPT2LMHeadModel of a small config (tied embeddings), random init, no dropout."""
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(n_layer=layers, n_embd=width, n_head=4, vocab_size=vocab, n_positions=positions,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    return GPT2LMHeadModel(cfg)
