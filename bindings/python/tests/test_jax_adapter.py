# test_jax_adapter.py - fsdp.jax against unsharded JAX: an MLP params pytree trained by libfsdp (whole-function and
# layer-wise modes, worlds 1/2/4, FULL_SHARD/SHARD_GRAD_OP/HYBRID_SHARD) matches a JAX run with a numpy AdamW.
# The cases marked by a `device` parameter also run with device=cuda against JAX's own run on the GPU (thread
# ranks sharing it through the local communicator); they skip saying why where no GPU is usable (gpu_env.py).
import functools
import importlib.util
import os
import re
import shutil
import subprocess
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX shares the GPU with libfsdp

import numpy as np
import pytest

import gpu_env

try:
    import jax
    import jax.numpy as jnp
except Exception as e:  # not installed, or a broken install: counted as a skip that says why
    pytest.skip(f"jax not installed: {type(e).__name__}: {e}", allow_module_level=True)

import fsdp
import fsdp.jax as fj

jax.config.update("jax_enable_x64", False)  # fp32 throughout, as libfsdp's fp32 params
# On a GPU XLA would multiply fp32 in TF32 by default: the sharded run (each rank's rows) and the reference (the
# whole batch) would then differ by TF32's rounding, not fp32's, and the tolerances below are fp32's.
jax.config.update("jax_default_matmul_precision", "highest")
DEVICES = ["cpu", "cuda"]


def on_device(device):
    """The JAX device the test's own computations run on for a libfsdp context of `device` (skips the cuda
    cases where no GPU is usable, saying why)."""
    if device == "cuda":
        gpu_env.need_jax_gpu(jax)
        return jax.devices("gpu")[0]
    return jax.devices("cpu")[0]

DIMS = [8, 32, 32, 24, 4]  # three tanh layers ("layers.0".."layers.2") and a linear head: 4 units of unequal size
BATCH = 16                 # the global batch; each rank takes BATCH / world rows
STEPS = 10
LR, BETA1, BETA2, EPS, WD = 1e-2, 0.9, 0.999, 1e-8, 0.01
# Every sharded run uses these; the reference implements exactly them. debug_poison=1: every gathered buffer is
# filled with NaN once its unit's *_end is done with it, so a JAX array read past its block shows as NaN in the
# loss or the params (worlds 2 and 4; at world 1 nothing is gathered and the views are the master weights).
OPTS = dict(optimizer="adamw", lr=LR, beta1=BETA1, beta2=BETA2, eps=EPS, weight_decay=WD, no_weight_decay="*.b",
            loss_scale="off", timeout_s=30, debug_poison=1)
EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "examples", "python",
                       "jax_mlp.py")
HAVE_MPI = shutil.which("mpirun") is not None and "mpi" in fsdp.build_info().split("comms=")[-1]


def init_params(seed=0):
    rng = np.random.default_rng(seed)

    def dense(i):
        bound = 1 / np.sqrt(DIMS[i])
        return {"w": rng.uniform(-bound, bound, (DIMS[i], DIMS[i + 1])).astype(np.float32),
                "b": rng.uniform(-bound, bound, DIMS[i + 1]).astype(np.float32)}
    n = len(DIMS) - 1
    return {"layers": [dense(i) for i in range(n - 1)], "head": dense(n - 1)}


def make_data(seed=1):
    rng = np.random.default_rng(seed)
    x = rng.uniform(-1, 1, (BATCH, DIMS[0])).astype(np.float32)
    return x, np.sin(2 * x[:, :DIMS[-1]]).astype(np.float32)


def _example():
    spec = importlib.util.spec_from_file_location("jax_mlp_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The model is the example's (dimension-free JAX functions): tanh layers hidden(p, x), a linear head, the mean
# squared error, and loss_fn(params, x, t) over {"layers": [...], "head": ...}; the sizes and data are the test's.
_ex = _example()
hidden, head, mse, model_loss = _ex.hidden, _ex.head, _ex.mse, _ex.loss_fn
LAYERS = {"layers.0": hidden, "layers.1": hidden, "layers.2": hidden, "head": head}  # execution order


def adamw(p, g, m, v, step, name):
    """libfsdp's AdamW (kernels/optim.h AdamOp, torch.optim.AdamW's formula) in the same float32 arithmetic:
    decoupled decay p *= 1 - lr*wd first, bias corrections in double (of the options rounded to float, as the
    library holds them) as lr/bc1 and 1/sqrt(bc2), eps added after the corrected sqrt(v). Biases ("*.b", as
    OPTS' no_weight_decay) are not decayed. In place."""
    f = np.float32
    lr, beta1, beta2 = (float(f(a)) for a in (LR, BETA1, BETA2))
    wd = 0.0 if name.endswith(".b") else WD
    step_size = f(lr / (1.0 - beta1 ** step))
    inv_bc2_sqrt = f(1.0 / np.sqrt(1.0 - beta2 ** step))
    p *= f(1.0) - f(lr) * f(wd)
    m[...] = f(BETA1) * m + (f(1.0) - f(BETA1)) * g
    v[...] = f(BETA2) * v + (f(1.0) - f(BETA2)) * g * g
    p -= step_size * (m / (np.sqrt(v) * inv_bc2_sqrt + f(EPS)))


@functools.lru_cache(maxsize=None)
def reference(device="cpu"):
    """Unsharded JAX on `device`: the whole batch's mean loss, its grads (jax.grad), the AdamW above. Returns
    (losses per step, {name: grad} of step 1, {name: param} after STEPS)."""
    with jax.default_device(on_device(device)):
        return _reference()


def _reference():
    x, t = make_data()
    flat, treedef = jax.tree_util.tree_flatten_with_path(init_params())
    names = [fj.path_name(p) for p, _ in flat]
    ps = [np.array(a) for _, a in flat]
    ms, vs = [np.zeros_like(a) for a in ps], [np.zeros_like(a) for a in ps]
    vg = jax.jit(jax.value_and_grad(model_loss))
    losses, grads1 = [], None
    for step in range(1, STEPS + 1):
        loss, g = vg(treedef.unflatten(ps), x, t)
        g = [np.asarray(a) for a in jax.tree_util.tree_leaves(g)]
        losses.append(float(loss))
        if step == 1:
            grads1 = dict(zip(names, g))
        for k in range(len(ps)):
            adamw(ps[k], g[k], ms[k], vs[k], step, names[k])
    return losses, grads1, dict(zip(names, ps))


def named(tree):
    return {fj.path_name(p): np.asarray(a) for p, a in jax.tree_util.tree_flatten_with_path(tree)[0]}


def train(world, sharding, mode, steps=STEPS, device="cpu", **extra):
    """libfsdp through fsdp.jax on `world` thread-ranks: (global mean loss per step, {name: reduced grad} after
    the first backward, {name: param} after the last step, each rank's MemoryStats)."""
    x, t = make_data()
    params = init_params()
    opts = dict(OPTS, sharding=sharding, device="cuda:0" if device == "cuda" else "cpu", **extra)
    if sharding.startswith("HYBRID"):
        opts.setdefault("shard_group_size", 2)

    def rank_fn(rank, group):
        with fj.shard(params, units=2, group=group, rank=rank, **opts) as sp:
            rows = BATCH // sp.ctx.world_size
            xs, ts = x[rank * rows:(rank + 1) * rows], t[rank * rows:(rank + 1) * rows]
            run = sp.value_and_grad(model_loss) if mode == "whole" else sp.layerwise(LAYERS, mse)
            losses, grads1 = [], None
            for s in range(steps):
                loss = run(xs, ts)  # this rank's rows' mean; the ranks' mean is the batch's (equal rows)
                losses.append(float(sp.ctx.metrics_reduce([loss], "avg")[0]))
                if s == 0:
                    grads1 = named(sp.gather_grads())
                sp.step()
            final = named(sp.gather())
            stats = sp.memory_stats()
            sp.finalize()
        return losses, grads1, final, stats

    results = fsdp.run_ranks(world, rank_fn)
    return results[0][:3] + ([r[3] for r in results],)


CASES = [(1, "FULL_SHARD"), (2, "FULL_SHARD"), (4, "FULL_SHARD"), (1, "SHARD_GRAD_OP"), (2, "SHARD_GRAD_OP"),
         (4, "SHARD_GRAD_OP"), (4, "HYBRID_SHARD")]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["whole", "layerwise"])
@pytest.mark.parametrize("world,sharding", CASES, ids=[f"{s}-w{w}" for w, s in CASES])
def test_matches_unsharded_jax(world, sharding, mode, device):
    ref_losses, ref_grads, ref_params = reference(device)
    losses, grads, params, _ = train(world, sharding, mode, device=device)
    # Step 1's reduced grads: the same fp32 math as the reference, summed in another order (each rank's rows,
    # then the ranks' mean). Seen: bitwise at world 1, at most 1.7e-7 of each param's largest grad at worlds 2
    # and 4 (a couple of ulp); 1e-6 keeps a 6x margin while a dropped or doubled term (1/world of a grad) fails.
    for name, ref in ref_grads.items():
        scale = float(np.max(np.abs(ref)))
        err = float(np.max(np.abs(grads[name] - ref)))
        assert err <= 1e-6 * scale, f"{name}: step-1 grad differs by {err:.3g} (largest grad {scale:.3g})"
        if world == 1 and mode == "whole":  # one jax.value_and_grad of the same function: the adapter adds nothing
            np.testing.assert_array_equal(grads[name], ref, err_msg=name)
    assert np.all(np.isfinite(losses)), losses  # a read of poisoned (freed) memory would be NaN here
    # Losses: seen within 1.1e-7 relative (the layer-wise chain is jitted per unit, so its loss may round
    # differently from the reference's one jit even at world 1).
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6, err_msg="loss per step")
    # After 10 steps: the AdamW above is libfsdp's bit for bit (bitwise at world 1); the grads' ulps
    # propagate through Adam's m/sqrt(v), which divides out their scale: seen at most 1.8e-7 over params up
    # to 0.5. 2e-6 keeps a 10x margin and is 1/5000 of one step's update (lr 1e-2).
    for name, ref in ref_params.items():
        err = float(np.max(np.abs(params[name] - ref)))
        assert err <= 2e-6, f"{name}: differs by {err:.3g} after {STEPS} steps"
        if world == 1 and mode == "whole":
            np.testing.assert_array_equal(params[name], ref, err_msg=name)


def test_one_import_per_param_where_a_unit_is_not_contiguous(monkeypatch):
    """The fallback for params that do not lie at their flat_range offsets (Unit.flat_array None; never the
    case today): one DLPack import per param trains the same, in both modes (world 2, FULL_SHARD, 3 steps)."""
    monkeypatch.setattr(fsdp.Unit, "flat_array", lambda self, grad=False: None)
    ref_losses = reference()[0]
    for mode in ("whole", "layerwise"):
        losses = train(2, "FULL_SHARD", mode, steps=3)[0]
        np.testing.assert_allclose(losses, ref_losses[:3], rtol=1e-6, err_msg=mode)


def test_units_names_and_order():
    """Units by depth, predicate and list; names are dotted key paths in JAX's leaf order (dict keys sorted,
    lists by index: layers.10 after layers.9), param(0) of a unit is its first leaf, leftovers go to "root"."""
    leaf = lambda *shape: np.zeros(shape, np.float32)  # noqa: E731
    params = {"layers": [{"w": leaf(2, 2), "b": leaf(2)} for _ in range(11)], "head": {"w": leaf(2, 3)},
              "scale": leaf(1)}
    with fj.shard(params, units=2) as sp:
        assert sp.unit_names == ["head"] + [f"layers.{i}" for i in range(11)] + ["root"]
        assert sp.names[:4] == ["head.w", "layers.0.b", "layers.0.w", "layers.1.b"]
        assert sp.names[-3:] == ["layers.10.b", "layers.10.w", "scale"]
        u = sp.units[sp.unit_names.index("layers.10")]
        assert u.names == ["layers.10.b", "layers.10.w"] and u.shapes == [(2,), (2, 2)]
        assert sp.unit_of("scale").name == "root" and sp.units[-1].names == ["scale"]
    with fj.shard(params, units=1) as sp:
        assert sp.unit_names == ["head", "layers", "root"] and len(sp.units[1].names) == 22
    with fj.shard(params, units=0) as sp:
        assert sp.unit_names == ["root"] and sp.units[0].names == sp.names
    with fj.shard(params, units=lambda p: re.fullmatch(r"layers\.(1|3)", p) is not None) as sp:
        assert sp.unit_names == ["root", "layers.1", "layers.3"]  # by first leaf: head.w comes first
        assert sp.units[0].names[:3] == ["head.w", "layers.0.b", "layers.0.w"]
    with fj.shard(params, units=["layers.2", "head", "layers.0"]) as sp:
        assert sp.unit_names == ["layers.2", "head", "layers.0", "root"]  # a list's order, the root last
    with pytest.raises(ValueError, match=r"units names 'layers\.11', which is no subtree"):
        fj.shard(params, units=["layers.11"])
    with pytest.raises(ValueError, match=r"leaf 'step' has dtype int32"):
        fj.shard({"w": leaf(2), "step": np.zeros((), np.int32)})


def test_rank0_values_win_and_gather_keeps_the_structure():
    """sync_module_states=1 by default: ranks that initialised differently start from rank 0's values; gather()
    gives the same pytree structure (tuples stay tuples, None stays None) with numpy fp32 arrays."""
    def rank_fn(rank, group):
        # Big enough that each rank's shard holds part of each param (a shard is at least one 64-byte block).
        params = {"a": (np.full((40, 2), rank + 1.0, np.float32), None), "b": [np.arange(50, dtype=np.float32) * rank]}
        with fj.shard(params, units=1, group=group, rank=rank, timeout_s=20) as sp:
            return sp.gather(), sp.treedef == jax.tree_util.tree_structure(params)
    for got, same in fsdp.run_ranks(2, rank_fn):
        assert same and isinstance(got["a"], tuple) and got["a"][1] is None
        np.testing.assert_array_equal(got["a"][0], np.ones((40, 2), np.float32))
        np.testing.assert_array_equal(got["b"][0], np.zeros(50, np.float32))
        assert got["b"][0].dtype == np.float32


def test_a_changed_pytree_is_refused_naming_the_leaf():
    params = init_params()
    with fj.shard(params, units=2, **OPTS) as sp:
        bigger = init_params()
        bigger["layers"][1]["w"] = np.zeros((32, 33), np.float32)
        with pytest.raises(ValueError, match=r"ShardedParams\.set: .*leaf 'layers\.1\.w' has shape \(32, 33\); "
                                             r"shard\(\) saw \(32, 32\)"):
            sp.set(bigger)
        fewer = init_params()
        del fewer["layers"][2]
        with pytest.raises(ValueError, match=r"leaf 'layers\.2\.b' is missing"):
            sp.set(fewer)
        more = dict(init_params(), extra={"w": np.zeros(3, np.float32)})
        with pytest.raises(ValueError, match=r"leaf 'extra\.w' is new \(where shard\(\) saw 'head\.b'\)"):
            sp.check(more)
        as_tuple = dict(init_params(), layers=tuple(init_params()["layers"]))
        with pytest.raises(ValueError, match=r"same leaves and shapes, but the structure is"):
            sp.check(as_tuple)
        with pytest.raises(ValueError, match=r"layerwise: no unit 'layers\.3'"):
            sp.layerwise(dict(LAYERS, **{"layers.3": hidden}), mse)
        with pytest.raises(ValueError, match=r"layerwise: no function for unit\(s\) \['head'\]"):
            sp.layerwise({k: f for k, f in LAYERS.items() if k != "head"}, mse)
        with pytest.raises(ValueError, match=r"layerwise: 3 layer functions for 4 units"):
            sp.layerwise([hidden] * 3, mse)
        # A refused set() changed nothing: the values are still the pytree's.
        sp.set(params)
        for name, a in named(sp.gather()).items():
            np.testing.assert_array_equal(a, named(params)[name])


def test_layerwise_keeps_at_most_the_documented_units_gathered():
    """FULL_SHARD at world 2, prefetch on both ways: layer-wise holds the unit computing plus at most one
    prefetched (limit_all_gathers=2), exactly one with limit_all_gathers=1; the whole-function mode holds all."""
    x, t = make_data()

    def rank_fn(rank, group):
        rows = BATCH // 2
        xs, ts = x[rank * rows:(rank + 1) * rows], t[rank * rows:(rank + 1) * rows]
        sizes = {}
        with fj.shard(init_params(), units=2, group=group, rank=rank, **OPTS) as sp:
            for u in sp.units:  # each unit's gathered bytes, alone
                with u.forward():
                    sizes[u.name] = sp.memory_stats().gathered_params_nbytes
            sp.finalize()  # collective: drains the comm stream before the next context on this group
        peaks = {}
        for label, mode, limit in [("layerwise2", "layerwise", 2), ("layerwise1", "layerwise", 1),
                                   ("whole", "whole", 2)]:
            with fj.shard(init_params(), units=2, group=group, rank=rank, forward_prefetch=1,
                          backward_prefetch="pre", limit_all_gathers=limit, **OPTS) as sp:
                run = sp.layerwise(LAYERS, mse) if mode == "layerwise" else sp.value_and_grad(model_loss)
                for s in range(3):  # the first step records the order; prefetch runs from the second
                    if s == 1:
                        sp.ctx.reset_peak_memory()
                    run(xs, ts)
                    sp.step()
                peaks[label] = sp.memory_stats().gathered_params_peak_nbytes
                sp.finalize()
        return sizes, peaks
    for sizes, peaks in fsdp.run_ranks(2, rank_fn):
        big = sorted(sizes.values(), reverse=True)
        assert all(v > 0 for v in big), sizes
        assert big[0] < peaks["layerwise2"] <= big[0] + big[1], (sizes, peaks)  # a prefetch overlapped, no more
        assert peaks["layerwise1"] == big[0], (sizes, peaks)
        assert peaks["whole"] == sum(big), (sizes, peaks)


def test_no_import_outlives_its_block_and_aliasing_outputs_are_copied(monkeypatch):
    """One DLPack import per unit and block; after passes in both modes no export is alive (each import was
    dropped before its *_end); a layer
    that returns a param unchanged (its output may alias the unit's gathered memory) still trains right under
    debug_poison, because the adapter copies such an output before forward_end."""
    w0 = np.linspace(0.25, 2, 8 * 4, dtype=np.float32).reshape(8, 4)
    params = {"a": {"w": w0}, "b": {"w": np.full((8, 4), 0.5, np.float32)}}
    passthrough = lambda p, x: p["w"]  # noqa: E731 - ignores x: its output is the param itself
    mul = lambda p, x: x * p["w"]  # noqa: E731
    loss = lambda y: jnp.sum(y)  # noqa: E731

    imports = []
    real = jax.dlpack.from_dlpack
    monkeypatch.setattr(jax.dlpack, "from_dlpack", lambda *a, **k: imports.append(1) or real(*a, **k))

    def rank_fn(rank, group):
        with fj.shard(params, units=1, group=group, rank=rank, optimizer="sgd", lr=1.0, timeout_s=20,
                      debug_poison=1) as sp:
            run = sp.layerwise({"a": passthrough, "b": mul}, loss)
            got = [run(np.zeros((8, 4), np.float32))]
            grads = sp.gather_grads()
            got.append(run(np.zeros((8, 4), np.float32)))
            got.append(sp.value_and_grad(lambda p: jnp.sum(p["a"]["w"] * p["b"]["w"]))())
            # has_aux: an aux output that is a param comes back as a numpy copy, intact after the pass's *_end
            value, aux = sp.value_and_grad(lambda p: (jnp.sum(p["a"]["w"] * p["b"]["w"]), p["a"]), has_aux=True)()
            got.append(value)
            got.append(sp.step_fn(lambda p: jnp.sum(p["a"]["w"] * p["b"]["w"]))())  # then steps (SGD)
            return got, grads, aux
    for got, grads, aux in fsdp.run_ranks(2, rank_fn):
        assert got == pytest.approx([float(np.sum(w0 * 0.5))] * 5, rel=1e-6), got
        np.testing.assert_array_equal(grads["a"]["w"], np.full((8, 4), 0.5, np.float32))
        np.testing.assert_array_equal(grads["b"]["w"], w0)
        assert isinstance(aux["w"], np.ndarray)
        np.testing.assert_array_equal(aux["w"], w0)
    # 2 ranks x (2 layer-wise passes x 2 units x forward and backward + 3 whole-function passes x 2 units)
    assert len(imports) == 2 * (2 * 2 * 2 + 3 * 2)
    assert fsdp.dlpack.live_exports() == 0
    # jax 0.10's jit copied the pass-through output above on its own; the guard itself, on an aliasing array:
    a = jnp.arange(8, dtype=jnp.float32)
    lo = a.unsafe_buffer_pointer()
    out = fj._unalias(jax, {"in": a, "out": a + 1}, (lo, lo + 32))
    assert out["in"].unsafe_buffer_pointer() != lo and out["out"] is not a
    np.testing.assert_array_equal(out["in"], np.arange(8, dtype=np.float32))
    assert fj._unalias(jax, {"in": a}, (lo + 32, lo + 64))["in"] is a  # outside the span: untouched


def test_a_root_unit_runs_in_the_chain():
    """Layer-wise with the root unit (leaves outside the chosen subtrees): its function gets the whole pytree
    with the other units' leaves None; grads match jax.grad of the same chain."""
    rng = np.random.default_rng(3)
    params = {"embed": {"w": rng.normal(size=(4, 6)).astype(np.float32)}, "gain": rng.normal(size=6).astype(np.float32),
              "out": rng.normal(size=(6, 2)).astype(np.float32)}
    x = rng.normal(size=(5, 4)).astype(np.float32)

    def rest(p, h):
        assert p["embed"]["w"] is None  # another unit's leaf
        return jnp.tanh(h * p["gain"]) @ p["out"]

    def chain(p, x):
        return jnp.sum(rest({"embed": {"w": None}, "gain": p["gain"], "out": p["out"]}, x @ p["embed"]["w"]) ** 2)
    want = named(jax.grad(chain)(params, x))
    with fj.shard(params, units=lambda path: path == "embed") as sp:
        assert sp.unit_names == ["embed", "root"] and sp.units[1].names == ["gain", "out"]
        loss = sp.layerwise({"embed": lambda p, x: x @ p["w"], "root": rest}, lambda y: jnp.sum(y ** 2))(x)
        assert loss == pytest.approx(float(chain(params, x)), rel=1e-6)
        for name, g in named(sp.gather_grads()).items():
            np.testing.assert_allclose(g, want[name], rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("device", DEVICES)
def test_naive_glue_reads_nan_under_debug_poison(device):
    """The failure the adapter avoids, shown to be caught: JAX arrays imported from a unit's views inside its
    forward block and used after forward_end read NaN with debug_poison=1 (world 2, FULL_SHARD), so the
    poisoned runs above would have failed had the adapter read freed memory."""
    dev = on_device(device)

    def rank_fn(rank, group):
        with fj.shard(init_params(), units=2, group=group, rank=rank, device=str(device), **OPTS) as sp:
            kept = {}
            for u in sp.units:
                with u.forward():  # the naive way: import each param, compute later
                    kept.update({n: jax.dlpack.from_dlpack(u.param_array(i)) for i, n in enumerate(u.names)})
            sp.ctx.metrics_reduce([0.0])  # a collective: the NaN fills queued on the comm stream are done
            params = jax.tree_util.tree_unflatten(sp.treedef, [kept[n] for n in sp.names])
            x, t = (jax.device_put(a, dev) for a in make_data())
            out = float(model_loss(params, x, t))
            del params, kept
            return out
    assert all(np.isnan(v) for v in fsdp.run_ranks(2, rank_fn))


@pytest.mark.parametrize("device", DEVICES)
def test_no_sync_accumulates_and_bf16_trains(device):
    """Two passes, the first inside no_sync(), add their grads (the sum of the two batches' mean grads); a bf16
    context computes in bf16 (leaves arrive as bfloat16) and its first loss is the fp32 one to bf16's precision."""
    x, t = make_data()
    params = init_params()
    vg = jax.jit(jax.grad(model_loss))
    h = BATCH // 2
    with jax.default_device(on_device(device)):
        want = jax.tree_util.tree_map(lambda a, b: np.asarray(a) + np.asarray(b), vg(params, x[:h], t[:h]),
                                      vg(params, x[h:], t[h:]))
    opts = dict(OPTS, device=device)
    seen = []

    def bf16_loss(p, x, t):
        seen.append(jax.tree_util.tree_leaves(p)[0].dtype)
        return model_loss(jax.tree_util.tree_map(lambda a: a.astype(jnp.float32), p), x, t)

    def rank_fn(rank, group):
        q = BATCH // 4  # each rank's share of each half
        with fj.shard(params, units=2, group=group, rank=rank, **opts) as sp:
            run = sp.value_and_grad(model_loss)
            with sp.no_sync():
                run(x[rank * q:(rank + 1) * q], t[rank * q:(rank + 1) * q])
            run(x[h + rank * q:h + (rank + 1) * q], t[h + rank * q:h + (rank + 1) * q])
            grads = named(sp.gather_grads())
            sp.finalize()
        with fj.shard(params, units=2, group=group, rank=rank, param_dtype="bf16", **opts) as sp:
            loss = sp.value_and_grad(bf16_loss)(x[rank * h:(rank + 1) * h], t[rank * h:(rank + 1) * h])
            loss = float(sp.ctx.metrics_reduce([loss], "avg")[0])
            sp.step()
            sp.finalize()
        return grads, loss
    for grads, loss in fsdp.run_ranks(2, rank_fn):
        for name, ref in named(want).items():
            assert float(np.max(np.abs(grads[name] - ref))) <= 1e-6 * float(np.max(np.abs(ref))), name
        assert loss == pytest.approx(reference(device)[0][0], rel=2e-2)  # bf16 params: 8 bits of mantissa
    assert seen and all(d == jnp.bfloat16 for d in seen)


def run_example(*args, launcher=()):
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               FSDP_LIBRARY=fsdp.LIB_PATH, PYTHONPATH=os.path.dirname(os.path.dirname(fsdp.__file__)))
    r = subprocess.run([*launcher, sys.executable, EXAMPLE, *map(str, args)], capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 0, f"{args}: exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r.stdout


def test_example_thread_ranks():
    out = run_example("--ranks", 4, "--steps", 3, "--mode", "layerwise", "--check")
    assert "check passed" in out and re.search(r"^\s*3\s+\d+\.\d+\s+\d+\.\d+", out, re.M), out


@pytest.mark.skipif(not HAVE_MPI, reason="needs mpirun and a libfsdp built with MPI")
def test_example_under_mpirun():
    out = run_example("--steps", 3, "--mode", "whole", "--check", launcher=("mpirun", "--oversubscribe", "-np", "2"))
    assert "over 2 processes (mpirun)" in out and "check passed" in out, out
