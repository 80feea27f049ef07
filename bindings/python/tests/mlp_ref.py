# mlp_ref.py - test helpers: a numpy MLP with hand-written backward, a numpy AdamW reference, and libfsdp drivers.
import numpy as np

import fsdp

DIMS = [8, 16, 16, 4]  # Linear+tanh, Linear+tanh, Linear
BATCH = 24             # divisible by 1, 2, 3, 4 ranks
LR, BETA1, BETA2, EPS, WD = 1e-2, 0.9, 0.999, 1e-8, 0.01
STEPS = 6
# Options shared by every libfsdp run; the reference implements exactly these.
OPTS = dict(optimizer="adamw", lr=LR, weight_decay=WD, no_weight_decay="*bias", loss_scale="off", timeout_s=20)


def init_params(seed=0):
    """{name: fp32 array} in forward order: layerI.weight [out, in], layerI.bias [out]."""
    rng = np.random.default_rng(seed)
    p = {}
    for i in range(len(DIMS) - 1):
        bound = 1.0 / np.sqrt(DIMS[i])
        p[f"layer{i}.weight"] = rng.uniform(-bound, bound, (DIMS[i + 1], DIMS[i])).astype(np.float32)
        p[f"layer{i}.bias"] = rng.uniform(-bound, bound, DIMS[i + 1]).astype(np.float32)
    return p


def make_data(seed=1):
    rng = np.random.default_rng(seed)
    x = rng.uniform(-1, 1, (BATCH, DIMS[0])).astype(np.float32)
    t = rng.uniform(-0.8, 0.8, (BATCH, DIMS[-1])).astype(np.float32)
    return x, t


def layer_forward(i, w, b, x):
    z = x @ w.T + b
    return np.tanh(z) if i + 1 < len(DIMS) - 1 else z


def layer_backward(i, w, x, h, dh):
    """(dW, db, dx) given the layer input x, its output h and dL/dh."""
    dz = dh * (1 - h * h) if i + 1 < len(DIMS) - 1 else dh
    return dz.T @ x, dz.sum(0), dz @ w


def loss_and_grad(y, t):
    """Mean over rows and outputs of (y - t)^2, and its grad."""
    d = y - t
    return float(np.mean(d * d)), (2.0 * d / d.size).astype(np.float32)


def grads(params, x, t):
    n = len(DIMS) - 1
    acts = [x]
    for i in range(n):
        acts.append(layer_forward(i, params[f"layer{i}.weight"], params[f"layer{i}.bias"], acts[-1]))
    loss, dh = loss_and_grad(acts[-1], t)
    g = {}
    for i in reversed(range(n)):
        g[f"layer{i}.weight"], g[f"layer{i}.bias"], dh = layer_backward(i, params[f"layer{i}.weight"], acts[i],
                                                                        acts[i + 1], dh)
    return loss, g


def reference_train(params, x, t, steps=STEPS):
    """Unsharded fp32 training: full-batch mean-loss grads, PyTorch's AdamW (bias: no decay)."""
    p = {k: v.copy() for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v = {k: np.zeros_like(a) for k, a in p.items()}
    losses = []
    for step in range(1, steps + 1):
        loss, g = grads(p, x, t)
        losses.append(loss)
        adamw_update(p, g, m, v, step)
    return p, losses


def adamw_update(p, g, m, v, step):
    """One step of PyTorch's AdamW (OPTS: LR, betas, EPS, WD; params named *bias: no decay) on the dicts
    p (params), m, v (moments, zeros before step 1) in place; step counts from 1."""
    bc1, bc2_sqrt = np.float32(1 - BETA1 ** step), np.float32(np.sqrt(1 - BETA2 ** step))
    for k in p:
        wd = 0.0 if k.endswith("bias") else WD
        p[k] *= np.float32(1 - LR * wd)
        m[k] = np.float32(BETA1) * m[k] + np.float32(1 - BETA1) * g[k]
        v[k] = np.float32(BETA2) * v[k] + np.float32(1 - BETA2) * g[k] * g[k]
        p[k] -= np.float32(LR) / bc1 * m[k] / (np.sqrt(v[k]) / bc2_sqrt + np.float32(EPS))


def lib_pass(units, x, t, grad_hook=None):
    """One forward + backward through libfsdp units (one per layer) on rows x; returns the loss.
    grad_hook(i, unit) runs inside each backward block after the grads are added."""
    acts = [x]
    for i, u in enumerate(units):
        with u.forward():
            acts.append(layer_forward(i, u.param(0), u.param(1), acts[-1]))
    loss, dh = loss_and_grad(acts[-1], t)
    for i in reversed(range(len(units))):
        u = units[i]
        with u.backward():
            dw, db, dh = layer_backward(i, u.param(0), acts[i], acts[i + 1], dh)
            u.grad(0)[...] += dw
            u.grad(1)[...] += db
            if grad_hook:
                grad_hook(i, u)
    return loss


def register_mlp(ctx, params):
    units = []
    for i in range(len(DIMS) - 1):
        names = [f"layer{i}.weight", f"layer{i}.bias"]
        u = ctx.register_unit(f"layer{i}", {n: params[n].shape for n in names})
        for n in names:
            u.set_values(n, params[n])
        units.append(u)
    return units


def lib_train(world, steps=STEPS, use_wrap=False, **options):
    """Trains on `world` thread-ranks (rank r takes rows [r*B/world, (r+1)*B/world)); returns each rank's
    gathered params {name: array} and rank 0's per-step losses of its own rows."""
    params, (x, t) = init_params(), make_data()
    rows = BATCH // world

    def rank_fn(rank, group):
        opts = dict(OPTS, **options)
        if use_wrap:  # names "layers.I.weight": block="layers" makes one unit per layer, as register_mlp
            named = {k.replace("layer", "layers."): v for k, v in params.items()}
            w = fsdp.wrap(named, block="layers", group=group, rank=rank, **opts)
            ctx, units = w.ctx, w.units
        else:
            ctx = fsdp.Context(fsdp.Config(**opts), group, rank)
            units = register_mlp(ctx, params)
        with ctx:
            xs, ts = x[rank * rows:(rank + 1) * rows], t[rank * rows:(rank + 1) * rows]
            losses = []
            for _ in range(steps):
                losses.append(lib_pass(units, xs, ts))
                ctx.step()
            out = {n: u.gather(n) for u in units for n in u.names}
            ctx.finalize()
        return out, losses

    return fsdp.run_ranks(world, rank_fn)


def max_rel_err(got, ref):
    """Largest over tensors of max|got - ref| / max|ref| (the C++ equivalence tests' metric)."""
    return max(float(np.max(np.abs(got[k] - ref[k])) / np.max(np.abs(ref[k]))) for k in ref)
