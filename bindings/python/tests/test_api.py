# test_api.py - zero-copy views, dtypes, no_sync, backward without forward, checkpoints, memory stats, traces,
# metrics_reduce, config, wrap() grouping and its default strategy.
import ctypes
import json
import os

import numpy as np
import pytest

import fsdp
from mlp_ref import OPTS, adamw_update, init_params, lib_pass, make_data, register_mlp

SGD = dict(optimizer="sgd", lr=1.0, timeout_s=20)  # param -= grad: the step shows exactly what was reduced


def test_grad_view_is_zero_copy(tmp_path):
    """Each rank writes rank+1 through the grad view; the reduced (averaged) grad is the mean."""
    init = np.linspace(-1, 1, 10, dtype=np.float32)

    def fn(rank, group):
        with fsdp.Context(fsdp.Config(sharding="FULL_SHARD", **SGD), group, rank) as ctx:
            u = ctx.register_unit("u", [("w", (2, 5))])
            u.set_values("w", init.reshape(2, 5))
            with u.forward():
                pass
            with u.backward():
                g = u.grad(0)
                assert g.shape == (2, 5) and g.dtype == np.float32 and np.all(g == 0)
                assert np.shares_memory(g, u.grad(0)) and g.flags.writeable
                g += rank + 1
            ctx.step()
            assert ctx.last_grad_norm == pytest.approx(np.sqrt(10) * 2.5, rel=1e-6)
            return u.gather(0)

    for got in fsdp.run_ranks(4, fn):
        np.testing.assert_allclose(got.ravel(), init - 2.5, rtol=1e-6)


def test_param_view_reflects_set_values():
    with fsdp.Context(fsdp.Config(sharding="NO_SHARD")) as ctx:
        u = ctx.register_unit("u", {"w": (3,), "s": ()})
        u.set_values(0, [1, 2, 3])
        u.set_values("s", 7)
        with u.forward():
            p = u.param(0)
            np.testing.assert_array_equal(p, [1, 2, 3])
            assert not p.flags.writeable and u.param("s").shape == () and u.param("s") == 7
        u.set_values(0, [4, 5, 6])
        with u.forward():
            np.testing.assert_array_equal(u.param(0), [4, 5, 6])


@pytest.mark.parametrize("mp,dtype", [("bf16", np.uint16), ("fp16", np.float16), ("fp32", np.float32)])
def test_param_dtypes(mp, dtype):
    vals = np.array([1.0, -2.5, 0.333333], dtype=np.float32)
    with fsdp.Context(fsdp.Config(param_dtype=mp)) as ctx:
        assert ctx.param_dtype == mp and ctx.np_dtype == dtype
        u = ctx.register_unit("u", {"w": (3,)})
        u.set_values(0, vals)
        with u.forward():
            p = u.param(0)
            assert p.dtype == dtype
            if mp == "bf16":  # raw bits: the top half of the fp32 pattern, rounded to nearest even
                as_f32 = (p.astype(np.uint32) << 16).view(np.float32)
                np.testing.assert_allclose(as_f32, vals, rtol=2 ** -8)
            else:
                np.testing.assert_array_equal(p, vals.astype(dtype))
        np.testing.assert_array_equal(u.gather(0), vals)  # the fp32 master is exact


def test_no_sync_accumulates():
    def fn(rank, group):
        with fsdp.Context(fsdp.Config(sharding="SHARD_GRAD_OP", **SGD), group, rank) as ctx:
            u = ctx.register_unit("u", {"w": (6,)})
            u.set_values(0, np.zeros(6))
            for k, sync in ((1, False), (2, True)):  # micro-batch 1 accumulates locally, 2 reduces
                ctx.set_grad_sync(sync)
                with u.forward():
                    pass
                with u.backward():
                    u.grad(0)[...] += k * (rank + 1)
            ctx.step()
            with ctx.no_sync():
                pass
            return u.gather(0)

    for got in fsdp.run_ranks(2, fn):
        np.testing.assert_allclose(got, -3 * 1.5)  # (1 + 2) * mean(rank + 1)


def test_backward_without_forward():
    """Units may start a step with backward_begin (one gather per step, for hosts that differentiate a whole
    function at once): backward_begin on every unit gathers its params, the host reads them all and adds the
    grads, backward_end on every unit (reverse order) reduces, step updates. 2 ranks, FULL_SHARD, AdamW,
    against the numpy AdamW of the same mean grads."""
    rng = np.random.default_rng(3)
    shapes = {"a": {"a.weight": (5, 3), "a.bias": (5,)}, "b": {"b.weight": (2, 5)}}
    init = {n: rng.uniform(-1, 1, s).astype(np.float32) for unit in shapes.values() for n, s in unit.items()}

    def grad_of(p, rank):  # each rank's grad depends on the gathered params, so a wrong gather shows
        return {k: (np.float32(rank + 1) * p[k] + np.float32(0.25 * (rank - 0.5))).astype(np.float32) for k in p}

    def fn(rank, group):
        with fsdp.Context(fsdp.Config(sharding="FULL_SHARD", **OPTS), group, rank) as ctx:
            units = [ctx.register_unit(name, unit) for name, unit in shapes.items()]
            for u in units:
                for k in u.names:
                    u.set_values(k, init[k])
            seen = []
            for _ in range(3):
                for u in units:  # no forward in this step
                    u.backward_begin()
                p = {k: u.param(k).copy() for u in units for k in u.names}
                seen.append(p)
                g = grad_of(p, rank)
                for u in units:
                    for k in u.names:
                        u.grad(k)[...] += g[k]
                for u in reversed(units):
                    u.backward_end()
                ctx.step()
            return seen, {k: u.gather(k) for u in units for k in u.names}

    p = {k: v.copy() for k, v in init.items()}
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v = {k: np.zeros_like(a) for k, a in p.items()}
    ref_seen = []
    for step in range(1, 4):
        ref_seen.append({k: a.copy() for k, a in p.items()})
        g0, g1 = grad_of(p, 0), grad_of(p, 1)
        adamw_update(p, {k: (g0[k] + g1[k]) / np.float32(2) for k in p}, m, v, step)
    for seen, final in fsdp.run_ranks(2, fn):
        for got, ref in zip(seen, ref_seen):  # what backward_begin gathered, step by step
            for k in ref:
                np.testing.assert_allclose(got[k], ref[k], rtol=1e-6, atol=1e-7)
        for k in p:
            np.testing.assert_allclose(final[k], p[k], rtol=1e-6, atol=1e-7)
            assert not np.allclose(final[k], init[k])  # the steps did move the params


def test_metrics_reduce():
    """3 ranks: sum/avg/max/min against numpy, the same bits on every rank; rank r's slot of a world-sized
    vector summed gives rank 0 every rank's numbers; a bad op is a ValueError before any collective."""
    def fn(rank, group):
        with fsdp.Context(fsdp.Config(timeout_s=20), group, rank) as ctx:
            vals = np.array([rank + 0.1, -2.0 * rank, 1e-3 / (rank + 1), 7.0, rank * 1e300])
            before = vals.copy()
            out = {op: ctx.metrics_reduce(vals, op) for op in ("sum", "avg", "max", "min")}
            np.testing.assert_array_equal(vals, before)  # the input is not changed
            slots = np.zeros((3, 2))
            slots[rank] = [10.0 * rank, rank + 0.5]
            table = ctx.metrics_reduce(slots, op="sum")
            scalar = ctx.metrics_reduce(rank + 1, "max")
            empty = ctx.metrics_reduce([], "min")
            with pytest.raises(ValueError, match="op must be one of sum, avg, max, min, not 'mean'"):
                ctx.metrics_reduce(vals, "mean")
            return vals, out, table, scalar, empty

    res = fsdp.run_ranks(3, fn)
    stack = np.stack([r[0] for r in res])
    ref = {"sum": stack[0] + stack[1] + stack[2], "avg": (stack[0] + stack[1] + stack[2]) / 3,
           "max": stack.max(0), "min": stack.min(0)}
    for vals, out, table, scalar, empty in res:
        for op, want in ref.items():
            assert out[op].dtype == np.float64 and out[op].shape == (5,)
            np.testing.assert_allclose(out[op], want, rtol=1e-15, err_msg=op)
            assert out[op].tobytes() == res[0][1][op].tobytes()  # same bits everywhere
        np.testing.assert_array_equal(table, [[0.0, 0.5], [10.0, 1.5], [20.0, 2.5]])
        assert scalar.shape == () and scalar == 3.0
        assert empty.shape == (0,)


def test_step_count_counts_updates_and_load_restores_it(tmp_path):
    """Context.step_count (fsdp_ctx_step): the optimizer steps taken; a loaded checkpoint's at load."""
    def fn(rank, group):
        with fsdp.Context(group=group, rank=rank, timeout_s=20) as ctx:
            u = ctx.register_unit("u", {"w": (6,)})
            u.set_values(0, np.ones(6))
            assert ctx.step_count == 0
            for _ in range(3):
                with u.backward():
                    u.grad(0)[...] += 0.5
                ctx.step()
            assert ctx.step_count == 3
            ctx.save(str(tmp_path / "ck"))
            with u.backward():
                u.grad(0)[...] += 0.5
            ctx.step()
            assert ctx.step_count == 4
            ctx.load(str(tmp_path / "ck"))
            return ctx.step_count

    assert fsdp.run_ranks(2, fn) == [3, 3]


def test_load_by_name_into_other_units_strict_and_partial(tmp_path):
    """A checkpoint saved by 2 ranks with units a = {x, y}, b = {z} loads by name into 3 ranks' units
    other = {z, x}, new = {w}: strictly refused naming both offenders; not strictly, x and z load, w keeps
    its values, y is ignored, and the report says so."""
    def save(rank, group):
        with fsdp.Context(group=group, rank=rank, timeout_s=20) as ctx:
            a = ctx.register_unit("a", {"x": (5,), "y": (3,)})
            b = ctx.register_unit("b", {"z": (4,)})
            a.set_values("x", np.arange(5))
            a.set_values("y", [7, 8, 9])
            b.set_values("z", [1, 2, 3, 4])
            ctx.save(str(tmp_path / "ck"))

    fsdp.run_ranks(2, save)

    def load(rank, group):
        with fsdp.Context(group=group, rank=rank, timeout_s=20) as ctx:
            u = ctx.register_unit("other", {"z": (4,), "x": (5,)})
            v = ctx.register_unit("new", {"w": (2,)})
            v.set_values("w", [5, 6])
            with pytest.raises(fsdp.InvalidArgument, match=r"not in the checkpoint: 'w'.*not registered: 'y'"):
                ctx.load(str(tmp_path / "ck"))
            report = ctx.load(str(tmp_path / "ck"), strict=False)
            return report, u.gather("z").tolist(), u.gather("x").tolist(), v.gather("w").tolist()

    for report, z, x, w in fsdp.run_ranks(3, load):
        assert report == {"missing": ["w"], "unexpected": ["y"]}
        assert (z, x, w) == ([1, 2, 3, 4], [0, 1, 2, 3, 4], [5, 6])


def test_wrap_refuses_framework_tensors_pointing_at_the_adapters():
    """wrap() groups numpy arrays by name; a torch tensor (from a module's state_dict, say) would lose its
    ties and its modules' order, so it is refused with the adapter to use instead (whether or not torch
    is installed: the check is by the value's type's module)."""
    Tensor = type("Tensor", (), {"__module__": "torch"})
    with pytest.raises(fsdp.InvalidArgument, match=r"fsdp\.torch\.shard"):
        fsdp.wrap({"w": Tensor()})


def test_wrap_defaults_to_full_shard():
    """wrap() without shard_strat shards like the library's default: at 2 ranks each holds about half of a
    unit, and its repr says FULL_SHARD; NO_SHARD, asked for, holds all of it."""
    params = {"layers.0.weight": np.ones((64, 32), np.float32), "layers.0.bias": np.zeros(64, np.float32)}
    n = 64 * 32 + 64

    def fn(rank, group, **kw):
        with fsdp.wrap(params, block="layers", group=group, rank=rank, timeout_s=20, **kw) as w:
            shard, off = w.units[0].shard_info()
            return repr(w), w.sharding, shard.size, off

    res = fsdp.run_ranks(2, fn)
    for rank, (text, sharding, size, off) in enumerate(res):
        assert sharding == "FULL_SHARD"
        assert text.startswith("Wrapped(FULL_SHARD, param_dtype=fp32, rank %d of 2" % rank), text
        assert n / 2 <= size <= n / 2 + 64, size  # half the unit, plus at most alignment padding
    assert res[0][3] == 0 and res[1][3] == res[0][2]
    for text, sharding, size, _ in fsdp.run_ranks(2, lambda r, g: fn(r, g, shard_strat="NO_SHARD")):
        assert sharding == "NO_SHARD" and "NO_SHARD" in text and size >= n
    w = fsdp.wrap(params, shard_strat="SHARD_GRAD")  # the canonical name, as the library reports it
    assert w.sharding == "SHARD_GRAD_OP" and repr(w).startswith("Wrapped(SHARD_GRAD_OP,")
    w.close()
    assert repr(w).endswith("closed, units=['root'])")


def _train(ctx, units, steps):
    x, t = make_data()
    for _ in range(steps):
        lib_pass(units, x, t)
        ctx.step()
    return {n: u.gather(n) for u in units for n in u.names}


@pytest.mark.parametrize("kind", ["sharded", "full"])
def test_save_load_round_trip(tmp_path, kind):
    params = init_params()
    ck = str(tmp_path / "ck")

    def fn(rank, group):
        with fsdp.Context(fsdp.Config(sharding="FULL_SHARD", **OPTS), group, rank) as ctx:
            units = register_mlp(ctx, params)
            saved = _train(ctx, units, 2)
            ctx.save(ck, kind=kind)
            after3 = _train(ctx, units, 1)
            ctx.load(ck)
            loaded = {n: u.gather(n) for u in units for n in u.names}
            again3 = _train(ctx, units, 1)  # the optimizer state and step were restored too
            return saved, loaded, after3, again3

    for saved, loaded, after3, again3 in fsdp.run_ranks(2, fn):
        for k in saved:
            np.testing.assert_array_equal(loaded[k], saved[k])
            np.testing.assert_array_equal(again3[k], after3[k])
    assert os.path.exists(os.path.join(ck, "model.safetensors" if kind == "full" else "fsdp_checkpoint.json"))

    with fsdp.Context(fsdp.Config(**OPTS)) as ctx:  # a different world size reads it as well
        units = register_mlp(ctx, {k: np.zeros_like(v) for k, v in params.items()})
        ctx.load(ck)
        for u in units:
            for n in u.names:
                np.testing.assert_array_equal(u.gather(n), saved[n])


def test_memory_stats_and_trace(tmp_path):
    params = init_params()

    def fn(rank, group):
        with fsdp.Context(fsdp.Config(sharding="FULL_SHARD", **OPTS), group, rank) as ctx:
            units = register_mlp(ctx, params)
            ctx.trace_begin()
            m0 = ctx.memory_stats()
            with units[0].forward():
                during = ctx.memory_stats()
            _train(ctx, units, 1)
            m1 = ctx.memory_stats()
            ctx.trace_write(tmp_path / f"trace{rank}.json")
            ctx.reset_peak_memory()
            return m0, during, m1, ctx.memory_stats()

    n_params = sum(v.size for v in params.values())
    for rank, (m0, during, m1, m2) in enumerate(fsdp.run_ranks(2, fn)):
        assert isinstance(m0, fsdp.MemoryStats)
        assert m0.gathered_params_nbytes == 0 and m0.host_nbytes == 0
        assert 0 < m0.sharded_params_nbytes < 4 * n_params  # half the model (+ padding) as master + fp32
        assert during.gathered_params_nbytes >= 4 * params["layer0.weight"].size
        assert m1.optimizer_state_nbytes > 0 and m1.unsharded_grads_peak_nbytes > 0
        assert m1.total_peak_nbytes >= m1.total_nbytes >= m1.sharded_params_nbytes + m1.optimizer_state_nbytes
        assert m1.device_nbytes == m1.total_nbytes
        assert m2.total_peak_nbytes == m2.total_nbytes
        trace = json.load(open(tmp_path / f"trace{rank}.json"))
        assert trace  # Chrome trace JSON


def test_config_values_and_scalars():
    cfg = fsdp.Config(shard_strat="SHARD_GRAD", forward_prefetch=True, lr=0.5)
    assert cfg.get("sharding") == "SHARD_GRAD_OP" and cfg.get("forward_prefetch") in ("1", "true")
    assert float(cfg.get("lr")) == 0.5
    with fsdp.Context(cfg) as ctx:
        cfg.set("lr", 0.1)  # the context keeps its copy
        assert ctx.rank == 0 and ctx.world_size == 1
        assert ctx.loss_scale == 1.0 and ctx.skipped_steps == 0
        ctx.set_lr(0.25)
    cfg.close()
    assert fsdp.version() >= 100 and "libfsdp" in fsdp.build_info()


def test_loss_scale_address_is_where_the_steps_keep_the_scale():
    """loss_scale_address(): the scale in the step's own memory (host memory on the CPU device), which a
    step that skips (inf grads) halves and clean steps grow, as loss_scale reads it."""
    cfg = fsdp.Config(param_dtype="fp16", loss_scale="dynamic", loss_scale_init=1024.0,
                      loss_scale_growth_interval=2, **SGD)
    with fsdp.Context(cfg) as ctx:
        u = ctx.register_unit("u", {"w": (8,)})
        u.set_values(0, np.ones(8, np.float32))
        scale_at = ctypes.c_double.from_address(ctx.loss_scale_address())
        seen = []
        for g in (1.0, float("inf"), 1.0, 1.0):
            with u.backward():
                u.grad(0)[...] += np.float16(g)
            ctx.step()
            seen.append((scale_at.value, ctx.loss_scale))
        assert [a for a, _ in seen] == [b for _, b in seen]
        assert [a for a, _ in seen] == [1024.0, 512.0, 512.0, 1024.0]


def test_group_params():
    shapes = {"embed.w": (4, 2), "layers.0.w": (2, 2), "layers.0.b": (2,), "layers.1.w": (2, 2),
              "layers.1.b": (2,), "head.w": (2, 3), "head.b": (3,)}
    params = {k: np.zeros(s, np.float32) for k, s in shapes.items()}
    assert fsdp.group_params(params, block="layers") == [
        ("embed", ["embed.w"]), ("layers.0", ["layers.0.w", "layers.0.b"]),
        ("layers.1", ["layers.1.w", "layers.1.b"]), ("head", ["head.w", "head.b"])]
    assert fsdp.group_params(params, min_num_params=6) == [
        ("unit0", ["embed.w"]), ("unit1", ["layers.0.w", "layers.0.b"]),
        ("unit2", ["layers.1.w", "layers.1.b"]), ("unit3", ["head.w"]), ("unit4", ["head.b"])]
    assert fsdp.group_params(params) == [("root", list(shapes))]
    with pytest.raises(ValueError):
        fsdp.group_params(params, auto_wrap="block")


@pytest.mark.parametrize("mp", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("strat", ["FULL_SHARD", "SHARD_GRAD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"])
def test_wrap_options(mp, strat):
    params = {"layers.0.w": np.ones((2, 3)), "layers.0.b": np.arange(2.0), "head.w": np.full(3, 2.0)}
    with fsdp.wrap(params, mp=mp, shard_strat=strat, block="layers", lr=0.1) as w:
        assert [u.name for u in w.units] == ["layers.0", "head"] and w.ctx.param_dtype == mp
        assert w.unit_of("layers.0.b") is w.units[0]
        with w.units[0].forward():
            assert set(w.params("layers.0")) == {"layers.0.w", "layers.0.b"}
        g = w.gather()
        np.testing.assert_array_equal(g["layers.0.b"], [0, 1])
    with pytest.raises(fsdp.InvalidArgument, match="param_dtype"):
        fsdp.wrap(params, mp="int8")


@pytest.mark.parametrize("mp", ["bf16", "fp16"])
def test_add_grad_low_precision(mp):
    """add_grad converts fp32 grads to the param dtype (bf16 bits rounded to nearest even)."""
    assert fsdp.f32_to_bf16(np.float32([1.0, 1.00390625, 1.01171875])).tolist() == [0x3F80, 0x3F80, 0x3F82]
    np.testing.assert_array_equal(fsdp.bf16_to_f32(fsdp.f32_to_bf16([0.5, -3.0])), [0.5, -3.0])

    def fn(rank, group):
        with fsdp.Context(fsdp.Config(param_dtype=mp, loss_scale="off", **SGD), group, rank) as ctx:
            u = ctx.register_unit("u", {"w": (4,)})
            u.set_values(0, [1, 2, 3, 4])
            with u.forward():
                np.testing.assert_array_equal(u.param_f32(0), [1, 2, 3, 4])
            with u.backward():
                u.add_grad(0, np.full(4, rank + 1.0))
                u.add_grad(0, np.full(4, 0.5))
            ctx.step()
            return u.gather(0)

    for got in fsdp.run_ranks(2, fn):
        np.testing.assert_array_equal(got, np.float32([1, 2, 3, 4]) - 2.0)  # mean(1, 2) + 0.5


def test_add_grad_fp16_rounds_once():
    # 1 + (2^-11 + 2^-22) lies just above the midpoint of 1 and the next fp16, 1 + 2^-10. Rounding g to
    # fp16 first gives 2^-11 (a tie, to even), and then 1 + 2^-11 is a tie that rounds down to 1.
    g = np.float32(2.0 ** -11 + 2.0 ** -22)
    once = np.float16(1.0 + float(g))
    assert once == np.float16(1.0 + 2.0 ** -10) and np.float16(1.0) + np.float16(g) == np.float16(1.0)
    with fsdp.Context(fsdp.Config(param_dtype="fp16", loss_scale="off", **SGD)) as ctx:
        u = ctx.register_unit("u", {"w": (1,)})
        with u.backward():
            u.add_grad(0, [1.0])
            u.add_grad(0, [g])
            assert u.grad(0)[0] == once


@pytest.mark.parametrize("mp", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("src_dtype", ["float32", "bfloat16", "float16"])
def test_grad_accumulate_adds_as_add_grad_does_from_any_dtype(mp, src_dtype):
    """Unit.grad_accumulate (fsdp_grad_accumulate) reads the framework's array in its own dtype and adds it as
    add_grad adds: the same bits in the grad buffer, and the same reduced grad over 2 ranks."""
    rng = np.random.default_rng(3)
    g1 = rng.uniform(-1, 1, (2, 6)).astype(np.float32)
    g2 = rng.uniform(-1, 1, (2, 6)).astype(np.float32)

    def src(values):  # the framework's array in src_dtype, and its values as fp32
        if src_dtype == "bfloat16":
            bits = fsdp.f32_to_bf16(values)
            return bits, fsdp.bf16_to_f32(bits).astype(np.float32)
        a = values.astype(src_dtype)
        return a, a.astype(np.float32)

    def fn(rank, group):
        with fsdp.Context(fsdp.Config(param_dtype=mp, loss_scale="off", **SGD), group, rank) as ctx:
            acc = ctx.register_unit("acc", {"acc.w": (2, 6)})
            ref = ctx.register_unit("ref", {"ref.w": (2, 6)})
            a1, f1 = src(g1 + rank)
            a2, f2 = src(g2)
            kw = {"dtype": "bfloat16"} if src_dtype == "bfloat16" else {}
            with acc.backward(), ref.backward():
                acc.grad_accumulate(0, a1, **kw)
                acc.grad_accumulate("acc.w", a2, **kw)
                ref.add_grad(0, f1)
                ref.add_grad(0, f2)
                mine, want = np.array(acc.grad(0)), np.array(ref.grad(0))
            return mine, want, acc.gather_grad(0), ref.gather_grad(0)

    for mine, want, reduced, reduced_ref in fsdp.run_ranks(2, fn):
        np.testing.assert_array_equal(mine.view(np.uint8), want.view(np.uint8))
        np.testing.assert_array_equal(reduced, reduced_ref)
        assert np.abs(reduced).max() > 0.1  # something was added


def test_grad_accumulate_takes_torch_tensors_and_refuses_what_it_cannot_read():
    torch = pytest.importorskip("torch")
    with fsdp.Context(fsdp.Config(param_dtype="bf16", loss_scale="off", **SGD)) as ctx:
        u = ctx.register_unit("u", {"w": (3, 4)})
        t = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4) / 8
        with pytest.raises(fsdp.InvalidState, match="fsdp_grad_accumulate"):
            u.grad_accumulate(0, t)  # outside backward
        with u.backward():
            u.grad_accumulate(0, t)
            with pytest.raises(ValueError, match="not contiguous"):
                u.grad_accumulate(0, t.t())
            with pytest.raises(fsdp.InvalidArgument, match="12 elements, not 4"):
                u.grad_accumulate(0, t[0])
            with pytest.raises(ValueError, match="none of float32"):
                u.grad_accumulate(0, np.zeros(12, np.float64))
            with pytest.raises(ValueError, match="holds float32"):
                u.grad_accumulate(0, np.zeros(12, np.float32), dtype="float16")
            with pytest.raises(TypeError, match="needs dtype"):
                u.grad_accumulate(0, np.zeros(12, np.float32).ctypes.data)
            with pytest.raises(TypeError, match="no array"):
                u.grad_accumulate(0, [1.0] * 12)
            got = fsdp.bf16_to_f32(np.array(u.grad(0)))
        np.testing.assert_array_equal(got, (torch.arange(12).reshape(3, 4) / 8).numpy())


def test_frozen_unit_has_no_grads_and_stays_as_it_was():
    """Unit.set_trainable(False): the grad shard and the moments go (memory_stats), the params stay bitwise,
    grad views are refused; the unit beside it trains exactly as SGD says (param -= mean grad)."""
    init = np.linspace(-1, 1, 12, dtype=np.float32)

    def fn(rank, group):
        with fsdp.Context(fsdp.Config(sharding="FULL_SHARD", optimizer="adamw", lr=0.1, timeout_s=20),
                          group, rank) as ctx:
            frozen = ctx.register_unit("frozen", {"w": (3, 4)})
            live = ctx.register_unit("live", {"w": (12,)})
            for u in (frozen, live):
                u.set_values(0, init.reshape(u.shapes[0]))
            before = ctx.memory_stats()
            frozen.set_trainable(False)
            after = ctx.memory_stats()
            assert not frozen.trainable and live.trainable
            ctx.reset_comm_stats()
            with frozen.backward():
                with pytest.raises(fsdp.InvalidState, match="frozen"):
                    frozen.grad(0)
            with live.backward():
                live.grad(0)[...] += rank + 1
            ctx.step()
            comm = ctx.comm_stats()
            return before, after, comm, live.shard_info()[0].size, frozen.gather(0), live.gather(0)

    for before, after, comm, live_shard, w_frozen, w_live in fsdp.run_ranks(2, fn):
        # One reduce-scatter, of the live unit's padded fp32 grads (both ranks' shards); none for the frozen one.
        assert (comm.reduce_scatter_calls, comm.reduce_scatter_nbytes) == (1, 2 * live_shard * 4)
        assert comm.all_gather_calls == 2  # each unit's backward gathers its params
        assert comm.host_waits == 0  # the step was queued; nothing blocked the host but its own stream
        # The two units have the same padded shard: freezing one halves the grads and the moments.
        assert after.sharded_grads_nbytes * 2 == before.sharded_grads_nbytes > 0
        assert after.optimizer_state_nbytes * 2 == before.optimizer_state_nbytes > 0
        assert after.sharded_params_nbytes == before.sharded_params_nbytes
        np.testing.assert_array_equal(w_frozen.ravel(), init)
        # AdamW's first step (no decay) moves every element by lr: the mean grad is 1.5 everywhere.
        np.testing.assert_allclose(w_live, init - 0.1, rtol=1e-5, atol=1e-6)


def test_frozen_param_inside_a_unit_keeps_its_values_and_its_unit_trains_the_rest():
    """Unit.set_param_trainable(0, False): the weight keeps its values bitwise and refuses its grad, the bias
    in the same unit trains as SGD says; the grads and the reduction cover the bias's block alone."""
    def fn(rank, group):
        with fsdp.Context(fsdp.Config(sharding="FULL_SHARD", **SGD), group, rank) as ctx:
            u = ctx.register_unit("u", {"w": (40, 3), "b": (120,)})  # 120 each: whole 64-byte blocks per rank
            for i, shape in enumerate(u.shapes):
                u.set_values(i, np.ones(shape, np.float32))
            before = ctx.memory_stats()
            u.set_param_trainable(0, False)
            after = ctx.memory_stats()
            assert not u.param_trainable(0) and u.param_trainable(1)
            ctx.reset_comm_stats()
            with u.backward():
                with pytest.raises(fsdp.InvalidState, match="is frozen"):
                    u.grad(0)
                u.grad(1)[...] += rank + 1
            ctx.step()
            return before, after, ctx.comm_stats(), u.gather(0), u.gather(1)

    for before, after, comm, w, b in fsdp.run_ranks(2, fn):
        assert after.sharded_grads_nbytes * 2 == before.sharded_grads_nbytes > 0  # two params of 120, one left
        assert comm.reduce_scatter_calls == 1 and comm.reduce_scatter_nbytes == 2 * after.sharded_grads_nbytes
        np.testing.assert_array_equal(w, np.ones((40, 3), np.float32))
        np.testing.assert_array_equal(b, np.full(120, 1 - 1.5, np.float32))


def test_param_group_scales_the_lr_of_the_params_it_matches():
    """SGD with lr 1: a group at lr_scale 0.25 moves by a quarter of the mean grad, the rest by all of it;
    set_lr keeps scaling the group; misuse raises and changes nothing."""
    def fn(rank, group):
        with fsdp.Context(fsdp.Config(sharding="FULL_SHARD", **SGD), group, rank) as ctx:
            a = ctx.register_unit("a", {"enc.w": (4,), "enc.b": (2,)})
            b = ctx.register_unit("b", {"dec.w": (4,)})
            for u in (a, b):
                for i, shape in enumerate(u.shapes):
                    u.set_values(i, np.ones(shape, np.float32))
            assert ctx.set_param_group("enc.*", lr_scale=0.25) == 2
            with pytest.raises(fsdp.InvalidArgument, match="matches no registered param"):
                ctx.set_param_group("nothing.*", lr_scale=2)
            with pytest.raises(fsdp.InvalidArgument, match="sgd has no betas"):
                ctx.set_param_group("*", beta1=0.9)
            for lr in (1.0, 2.0):
                ctx.set_lr(lr)
                for u in (a, b):
                    with u.backward():
                        for i in range(len(u.shapes)):
                            u.grad(i)[...] += rank + 1
                ctx.step()
            return a.gather(0), a.gather(1), b.gather(0)

    for enc_w, enc_b, dec_w in fsdp.run_ranks(2, fn):
        np.testing.assert_array_equal(enc_w, np.full(4, 1 - 0.375 - 0.75, np.float32))
        np.testing.assert_array_equal(enc_b, np.full(2, 1 - 0.375 - 0.75, np.float32))
        np.testing.assert_array_equal(dec_w, np.full(4, 1 - 1.5 - 3.0, np.float32))


def test_host_optimizer_updates_the_shards_between_step_begin_and_step_end():
    """optimizer=host, host_state=1: SGD with momentum written here on the shard views; with lr 1 and
    momentum 0.5 the params follow p -= buf, buf = 0.5 buf + mean grad, exactly."""
    def fn(rank, group):
        with fsdp.Context(fsdp.Config(sharding="FULL_SHARD", optimizer="host", host_state=1, timeout_s=20),
                          group, rank) as ctx:
            u = ctx.register_unit("u", {"w": (5,), "b": (3,)})
            u.set_values("w", np.ones(5, np.float32))
            u.set_values("b", np.ones(3, np.float32))
            with pytest.raises(fsdp.InvalidState, match="fsdp_step_begin"):
                ctx.step()
            for step in range(2):
                with u.backward():
                    for i in range(2):
                        u.grad(i)[...] += rank + 1
                update, scale = ctx.step_begin()
                assert update and scale == 1.0 and ctx.step_count == step
                p, g, (buf,) = u.shard_tensors()
                buf *= 0.5
                buf += g * scale
                p -= buf
                ctx.step_end()
            return u.gather("w"), u.gather("b"), ctx.step_count

    for w, b, steps in fsdp.run_ranks(2, fn):
        # step 1: buf 1.5, p 1 - 1.5; step 2: buf 0.75 + 1.5, p -0.5 - 2.25
        np.testing.assert_array_equal(w, np.full(5, -2.75, np.float32))
        np.testing.assert_array_equal(b, np.full(3, -2.75, np.float32))
        assert steps == 2


def test_the_checkpoint_reader_of_the_docs_reads_a_unit_with_a_frozen_param(tmp_path):
    """docs/checkpoints.md's load_param (numpy, no libfsdp) on a sharded checkpoint of world 3 whose unit
    holds a frozen param (two blocks): every param as gathered, the trainable ones' exp_avg as AdamW made it
    (0.1 times the mean grad, 2), the frozen one's none (zeros)."""
    import re
    doc = open(os.path.join(os.path.dirname(__file__), "..", "..", "..", "docs", "checkpoints.md")).read()
    code = re.search(r"```python\nimport json, os\nimport numpy as np\n(.*?)\nw = load_param", doc, re.S).group(1)
    ns = {}
    exec("import json, os\nimport numpy as np\n" + code, ns)
    d = str(tmp_path / "ck")

    def fn(rank, group):
        with fsdp.Context(fsdp.Config(sharding="FULL_SHARD", optimizer="adamw", lr=0.1, timeout_s=20,
                                      align_bytes=16), group, rank) as ctx:
            u = ctx.register_unit("u", {"a": (7, 3), "b": (5,), "c": (9,)})
            for i, s in enumerate(u.shapes):
                u.set_values(i, np.arange(np.prod(s), dtype=np.float32).reshape(s) + 100 * i)
            u.set_param_trainable(1, False)
            with u.backward():
                for i in (0, 2):
                    u.grad(i)[...] += 1.0 + rank
            ctx.step()
            ctx.save(d, "sharded")
            return [u.gather(i) for i in range(3)]

    got = fsdp.run_ranks(3, fn)[0]
    for i, name in enumerate("abc"):
        np.testing.assert_array_equal(ns["load_param"](d, "u", name), got[i])
    for name in "ac":
        np.testing.assert_allclose(ns["load_param"](d, "u", name, "exp_avg"), 0.2, rtol=1e-6)
    assert not ns["load_param"](d, "u", "b", "exp_avg").any()
