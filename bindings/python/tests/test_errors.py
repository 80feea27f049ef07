# test_errors.py - every error path raises the right FsdpError subclass with the library's own message.
import glob
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import fsdp


def test_unknown_key_lists_valid_keys():
    with pytest.raises(fsdp.InvalidArgument) as e:
        fsdp.Config(bogus=1)
    assert e.value.status == 1 and "unknown key 'bogus'" in e.value.message and "sharding" in e.value.message
    assert e.value.status_name == "FSDP_ERR_INVALID_ARGUMENT"
    assert isinstance(e.value, fsdp.FsdpError) and isinstance(e.value, ValueError)


def test_bad_value_lists_valid_values():
    with pytest.raises(fsdp.InvalidArgument, match="valid: FULL_SHARD"):
        fsdp.Config(sharding="BOGUS")
    with pytest.raises(fsdp.InvalidArgument, match="'-1' is not a valid value for 'lr'"):
        fsdp.Config(lr=-1)


def test_cuda_is_unsupported_where_it_cannot_run():
    devices = fsdp.build_info().split("devices=")[1].split()[0].split(",")
    if "cuda" not in devices:
        with pytest.raises(fsdp.Unsupported, match="cuda") as e:
            fsdp.Config(device="cuda")
        assert e.value.status == 3
        return
    assert fsdp.Config(device="cuda:0").get("device") == "cuda:0"
    # With or without offload, a context runs where a GPU is, and says there is none elsewhere.
    for offload in ("none", "cpu"):
        try:
            with fsdp.Context(fsdp.Config(device="cuda:0", offload=offload)):
                pass  # a GPU is here (test_cuda.py trains on it)
        except fsdp.Unsupported as e:
            assert "no CUDA device" in str(e)


@pytest.fixture
def ctx_unit():
    with fsdp.Context(fsdp.Config(sharding="FULL_SHARD", timeout_s=5)) as ctx:
        yield ctx, ctx.register_unit("u", {"w": (3, 4), "b": (4,)})


def test_views_outside_blocks_are_invalid_state(ctx_unit):
    ctx, u = ctx_unit
    with pytest.raises(fsdp.InvalidState, match="fsdp_param_ptr on unit 'u'"):
        u.param(0)
    with pytest.raises(fsdp.InvalidState, match="expected the unit in backward"):
        u.grad("b")
    with u.forward():
        with pytest.raises(fsdp.InvalidState, match="but the unit is in forward"):
            u.grad(0)
        with pytest.raises(fsdp.InvalidState, match="call its \\*_end first"):
            ctx.step()
    with pytest.raises(fsdp.InvalidState):
        u.forward_end()  # not in forward any more


def test_block_that_raises_skips_end(ctx_unit):
    ctx, u = ctx_unit
    with pytest.raises(RuntimeError):
        with u.forward():
            raise RuntimeError("host failure")
    u.forward_end()  # still in forward: *_end was not called by the context manager


def test_set_values_bad_numel_and_index(ctx_unit):
    _, u = ctx_unit
    with pytest.raises(fsdp.InvalidArgument, match="param 'w' has 12 elements, not 5"):
        u.set_values(0, np.zeros(5))
    with pytest.raises(fsdp.InvalidArgument, match="index 5 is out of range"):
        u.set_values(5, np.zeros(12))
    with pytest.raises(KeyError):
        u.set_values("nope", np.zeros(12))


def test_load_missing_dir(ctx_unit, tmp_path):
    ctx, _ = ctx_unit
    with pytest.raises(fsdp.InvalidArgument, match="does not exist"):
        ctx.load(str(tmp_path / "missing"))


def test_corrupt_checkpoint(ctx_unit, tmp_path):
    ctx, u = ctx_unit
    u.set_values(0, np.arange(12, dtype=np.float32))
    ctx.save(tmp_path / "ck")
    shard = glob.glob(str(tmp_path / "ck" / "shard-*.safetensors"))[0]
    data = bytearray(open(shard, "rb").read())
    data[-5] ^= 0xFF  # flip bits inside the tensor bytes
    open(shard, "wb").write(bytes(data))
    with pytest.raises(fsdp.Corrupt) as e:
        ctx.load(tmp_path / "ck")
    assert e.value.status == 8 and "shard-" in e.value.message
    np.testing.assert_array_equal(u.gather(0).ravel(), np.arange(12))  # all or nothing


def test_save_io_error(ctx_unit):
    ctx, _ = ctx_unit
    with pytest.raises(fsdp.FsdpIOError) as e:
        ctx.save("/proc/forbidden/ck")
    assert e.value.status == 9


def test_trace_write_without_begin(ctx_unit, tmp_path):
    ctx, _ = ctx_unit
    with pytest.raises(fsdp.InvalidState, match="fsdp_trace_begin first"):
        ctx.trace_write(tmp_path / "t.json")


def test_after_finalize_and_close(ctx_unit):
    ctx, u = ctx_unit
    ctx.finalize()
    with pytest.raises(fsdp.InvalidState, match="finalized"):
        ctx.step()
    ctx.close()
    ctx.close()  # twice is fine
    for call in (ctx.step, lambda: ctx.memory_stats(), lambda: u.gather(0), lambda: u.set_values(0, np.zeros(12))):
        with pytest.raises(fsdp.InvalidState, match="closed"):
            call()


def test_config_and_group_close():
    cfg = fsdp.Config()
    cfg.close()
    cfg.close()
    with pytest.raises(fsdp.InvalidState, match="Config is closed"):
        cfg.set("lr", 1)
    g = fsdp.local_group(2)
    g.close()
    g.close()
    with pytest.raises(fsdp.InvalidState):
        fsdp.Context(None, g, 0)


def test_group_without_rank():
    with fsdp.local_group(1) as g:
        with pytest.raises(fsdp.InvalidArgument, match="without its rank"):
            fsdp.Context(None, g)


def test_registration_mismatch_fails_on_every_rank():
    errors = []

    def fn(rank, group):
        with fsdp.Context(fsdp.Config(timeout_s=5), group, rank) as ctx:
            try:
                ctx.register_unit("u", {"w": (4,) if rank == 0 else (5,)})
            except fsdp.Mismatch as e:
                errors.append(e)
                raise

    with pytest.raises(fsdp.Mismatch):
        fsdp.run_ranks(2, fn)
    assert len(errors) == 2 and all(e.status == 6 for e in errors)


def test_collective_timeout():
    done = threading.Event()

    def fn(rank, group):
        with fsdp.Context(fsdp.Config(timeout_s=0.3), group, rank) as ctx:
            if rank == 0:
                try:
                    ctx.step()  # rank 1 never joins
                finally:
                    done.set()
            else:
                done.wait(10)

    with pytest.raises(fsdp.Timeout) as e:
        fsdp.run_ranks(2, fn)
    assert e.value.status == 5 and isinstance(e.value, TimeoutError)


def test_run_ranks_reraises_first_exception():
    def fn(rank, group):
        if rank == 1:
            raise ZeroDivisionError("rank 1")
        return rank

    with pytest.raises(ZeroDivisionError, match="rank 1"):
        fsdp.run_ranks(3, fn)
    assert fsdp.run_ranks(3, lambda r, g: r * 10) == [0, 10, 20]


def test_a_failing_rank_aborts_the_group_so_the_others_do_not_wait():
    # timeout_s is long: without the abort, ranks 0 and 1 would fail with Timeout after it, not CommError.
    seen = {}

    def fn(rank, group):
        with fsdp.Context(fsdp.Config(timeout_s=60), group, rank) as ctx:
            u = ctx.register_unit("u", {"w": (8,)})
            if rank == 2:
                time.sleep(0.2)  # the others are waiting in forward's all-gather by now (or arrive later)
                raise KeyError("bad batch")
            try:
                with u.forward():
                    pass
                ctx.step()
            except fsdp.FsdpError as e:
                seen[rank] = e
                raise

    with pytest.raises(KeyError, match="bad batch"):
        fsdp.run_ranks(3, fn)
    assert sorted(seen) == [0, 1], seen
    for rank, e in seen.items():
        assert isinstance(e, fsdp.CommError), (rank, e)
        assert "rank 2 raised KeyError" in e.message and "bad batch" in e.message, (rank, e.message)


def test_group_abort_refuses_new_contexts():
    with fsdp.LocalGroup(2) as g:
        g.abort("stop here")
        g.abort()  # a second call changes nothing
        with pytest.raises(fsdp.CommError, match="stop here"):
            fsdp.Context(fsdp.Config(), g, 0)
    with pytest.raises(fsdp.InvalidState):
        g.abort("closed")


def _python(code, **env):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, **env))


def test_import_error_names_paths():
    r = _python("import fsdp", FSDP_LIBRARY="/nonexistent/libfsdp.so")
    assert r.returncode != 0 and "ImportError" in r.stderr and "/nonexistent/libfsdp.so" in r.stderr


def test_unclosed_handles_at_interpreter_exit():
    code = ("import fsdp, numpy as np\n"
            "g = fsdp.local_group(1); c = fsdp.Context(fsdp.Config(), g, 0)\n"
            "u = c.register_unit('u', {'w': (4,)}); u.set_values(0, np.ones(4)); cfg = fsdp.Config()\n"
            "u.forward_begin(); v = u.param(0)\n")
    r = _python(code)
    assert r.returncode == 0, r.stderr
    assert "Exception ignored" not in r.stderr and "Traceback" not in r.stderr


def test_comm_id_is_hex_text_or_unsupported_with_a_reason():
    try:
        text = fsdp.comm_id_create()
    except fsdp.Unsupported as e:  # no NCCL in this build, or none that this machine can load
        assert "nccl" in str(e).lower()
        return
    assert len(text) == 256 and set(text) <= set("0123456789abcdef")
    assert fsdp.Config(comm="nccl", comm_id=text, world_size=2).get("comm_id") == text
