# test_async_ckpt.py - Context.save_async/save_wait/snapshot/restore (and fsdp.torch's) against the same run
# uninterrupted, computed in the test: same init, same data, same ranks, no checkpoint calls.
"""The MLP of mlp_ref.py trains at world 2 (thread ranks, rank r on its half of the rows). The reference is that
run without any checkpoint call, its params gathered after each step. A checkpoint call may not change the
run (the params after it equal the reference's bit for bit), and what it saved must come back bit for bit in a
fresh context (params, and the optimizer state and step: the next step lands where the reference's does)."""
import shutil

import numpy as np
import pytest

import fsdp
from mlp_ref import BATCH, OPTS, init_params, lib_pass, make_data, register_mlp

WORLD = 2
OPTS2 = dict(OPTS, sharding="FULL_SHARD")


def _rows(rank):
    x, t = make_data()
    rows = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
    return x[rows], t[rows]


def _gather(units):
    return {n: u.gather(n) for u in units for n in u.names}


def _train(ctx, units, rank, steps):
    xs, ts = _rows(rank)
    for _ in range(steps):
        lib_pass(units, xs, ts)
        ctx.step()


def _reference(steps):
    """Rank 0's params after each step 0..steps of the run without checkpoint calls."""
    params = init_params()

    def fn(rank, group):
        with fsdp.Context(fsdp.Config(**OPTS2), group, rank) as ctx:
            units = register_mlp(ctx, params)
            out = [_gather(units)]
            for _ in range(steps):
                _train(ctx, units, rank, 1)
                out.append(_gather(units))
            return out

    return fsdp.run_ranks(WORLD, fn)[0]


def _equal(got, want, what):
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=f"{what}: {k}")


def _fresh(fn):
    """fn(ctx, units, rank) on WORLD fresh contexts over the initial params; rank 0's result."""
    params = init_params()

    def body(rank, group):
        with fsdp.Context(fsdp.Config(**OPTS2), group, rank) as ctx:
            return fn(ctx, register_mlp(ctx, params), rank)

    return fsdp.run_ranks(WORLD, body)[0]


def test_save_async_saves_the_state_at_the_call_while_training_goes_on(tmp_path):
    ref = _reference(5)
    assert not np.array_equal(ref[3]["layer0.weight"], ref[5]["layer0.weight"])  # the steps move the params
    ck = str(tmp_path / "ck")

    def run(ctx, units, rank):
        _train(ctx, units, rank, 3)
        ctx.save_async(ck)
        _train(ctx, units, rank, 2)  # the save's copy was taken at the call: these steps are not in it
        ctx.save_wait()
        ctx.save_wait()  # none pending: returns at once
        return _gather(units)

    _equal(_fresh(run), ref[5], "the run with save_async")

    def load(ctx, units, rank):
        ctx.load(ck)
        loaded, step = _gather(units), ctx.step_count
        _train(ctx, units, rank, 2)  # the optimizer state came back too
        return loaded, step, _gather(units)

    loaded, step, after = _fresh(load)
    _equal(loaded, ref[3], "loaded")
    assert step == 3
    _equal(after, ref[5], "trained on after the load")

    with fsdp.Context(fsdp.Config(**OPTS)) as ctx:  # a sharded checkpoint like fsdp_save's: any world size reads it
        units = register_mlp(ctx, {k: np.zeros_like(v) for k, v in init_params().items()})
        ctx.load(ck)
        _equal(_gather(units), ref[3], "loaded at world 1")


def test_restore_takes_the_newest_snapshot_else_the_checkpoint_else_nothing(tmp_path):
    ref = _reference(6)
    shm, ck = str(tmp_path / "shm"), str(tmp_path / "ck")

    def run(ctx, units, rank):
        _train(ctx, units, rank, 2)
        ctx.save_async(ck)
        _train(ctx, units, rank, 1)
        ctx.snapshot(shm)  # step 3
        _train(ctx, units, rank, 2)
        ctx.snapshot(shm)  # step 5, in the other slot
        _train(ctx, units, rank, 1)
        ctx.save_wait()
        return _gather(units)

    _equal(_fresh(run), ref[6], "the run with snapshots")

    def restore(path, checkpoint_dir):
        def fn(ctx, units, rank):
            source = ctx.restore(path, checkpoint_dir)
            got, step = _gather(units), ctx.step_count
            _train(ctx, units, rank, 1)
            return source, got, step, _gather(units)
        return _fresh(fn)

    source, got, step, after = restore(shm, ck)
    assert source == "snapshot"
    _equal(got, ref[5], "restored from the snapshot")
    assert step == 5
    _equal(after, ref[6], "trained on after the snapshot")

    source, got, step, _ = restore(shm, None)  # the checkpoint is not needed for a snapshot
    assert (source, step) == ("snapshot", 5)
    _equal(got, ref[5], "restored from the snapshot without a checkpoint_dir")

    shutil.rmtree(tmp_path / "shm" / "rank1")  # one rank's snapshot is gone: no step every rank holds
    source, got, step, after = restore(shm, ck)
    assert source == "checkpoint"
    _equal(got, ref[2], "restored from the checkpoint")
    assert step == 2
    _equal(after, ref[3], "trained on after the checkpoint")

    for checkpoint_dir in (None, "", str(tmp_path / "none")):
        source, got, step, after = restore(shm, checkpoint_dir)
        assert source == "nothing", checkpoint_dir
        _equal(got, ref[0], f"nothing restored ({checkpoint_dir!r}): the params as they were")
        assert step == 0
        _equal(after, ref[1], "trained on from the initial state")
    assert restore(None, None)[0] == "nothing"


def test_bad_calls_raise_and_a_failed_background_write_reaches_the_wait(tmp_path, monkeypatch):
    ck = str(tmp_path / "ck")

    def fn(ctx, units, rank):
        for call in (lambda: ctx.save_async(""), lambda: ctx.snapshot("")):
            with pytest.raises(fsdp.InvalidArgument):
                call()
        ctx.save_wait()  # nothing pending
        u = units[0]
        with u.forward():
            with pytest.raises(fsdp.InvalidState):
                ctx.save_async(ck)
            with pytest.raises(fsdp.InvalidState):
                ctx.snapshot(str(tmp_path / "shm"))
        if rank == 0:
            monkeypatch.setenv("FSDP_CKPT_FAULT", "io_error_rank=1")  # test-only: rank 1's shard write fails
        ctx.metrics_reduce([0])  # both ranks see the variable set before they save
        ctx.save_async(ck)  # the copy is taken; the write fails in the background
        with pytest.raises(fsdp.FsdpIOError) as err:
            ctx.save_wait()
        ctx.metrics_reduce([0])
        if rank == 0:
            monkeypatch.delenv("FSDP_CKPT_FAULT")
        ctx.save_wait()  # reported once
        return str(err.value)

    msg = _fresh(fn)
    assert "rank 1" in msg, msg
