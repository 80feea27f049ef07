# test_cuda.py - the binding on a CUDA context, with no device-wide synchronize anywhere: params and grads
# reach PyTorch, CuPy and JAX zero-copy (DLPack, and the CUDA Array Interface for fp32/fp16), each host
# computes on its own stream (the legacy default stream, a stream handed to the unit, or a side stream that
# the DLPack export orders with an event), and training on one GPU, alone or as two thread-ranks sharing
# it, gives the bits of the same loop on device=cpu. The grads land late on purpose (a kernel that spins
# first), so a *_end that did not wait for the host's stream would reduce zeros. Every test skips, saying
# why, where the build has no CUDA device, no GPU is there to use, or its library is not installed. It
# fails instead where nvidia-smi lists a GPU that CUDA cannot use (the rule of tests/gpu_presence.h), and
# for any of those reasons with FSDP_REQUIRE_GPU=1.
import functools
import importlib
import json
import os
import subprocess
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX shares the GPU with libfsdp, torch, CuPy

import numpy as np
import pytest

import fsdp
from fsdp import cudart, ranks


def _optional(name):
    """The module, or the reason it cannot be used (a broken install counts as missing, and says why)."""
    try:
        return importlib.import_module(name), None
    except Exception as e:  # noqa: BLE001 - reported in the skip message
        return None, f"{name} cannot be imported ({type(e).__name__}: {e})"


torch, _torch_why = _optional("torch")
cupy, _cupy_why = _optional("cupy")
jax, _jax_why = _optional("jax")
if jax is not None:
    import jax.dlpack  # noqa: E402
    import jax.numpy as jnp  # noqa: E402

SHAPE = (16, 12)
STEPS = 4
SPIN_CYCLES = 50_000_000  # ~25 ms at 2 GHz: long enough that unordered work would visibly run first


from gpu_env import PROBLEM as _PROBLEM, PROBLEM_FAILS as _PROBLEM_FAILS, not_run as _not_run  # noqa: E402


@pytest.fixture(autouse=True)
def _gpu():
    if _PROBLEM is not None:
        _not_run(_PROBLEM, _PROBLEM_FAILS)


def _need(mod, why):
    if mod is None:
        _not_run(why)


def _need_jax_gpu():
    _need(jax, _jax_why)
    try:
        jax.devices("gpu")
    except RuntimeError as e:
        _not_run(f"this jax has no CUDA backend ({e})")


INIT = np.linspace(-1.0, 1.0, SHAPE[0] * SHAPE[1], dtype=np.float32).reshape(SHAPE)
TARGET = np.cos(np.arange(SHAPE[0] * SHAPE[1], dtype=np.float32)).reshape(SHAPE)


def _train(device, world, rank, group, host, mp="fp32"):
    """STEPS of AdamW on loss = sum((w - target)^2) / world per rank; grads 2 (w - target) / world, an IEEE
    sub and two multiplications by powers of 2, then added into the grad buffer in fp32 and rounded once to
    the param dtype, which numpy, torch, CuPy and JAX all do alike. Returns the gathered weights."""
    cfg = fsdp.Config(device=device, sharding="FULL_SHARD", optimizer="adamw", lr=0.05, weight_decay=0.01,
                      param_dtype=mp, loss_scale="off", timeout_s=60)
    with fsdp.Context(cfg, group=group, rank=rank) as ctx:
        s = None if device == "cpu" else host.unit_stream()
        u = ctx.register_unit("layer", [("w", SHAPE)])
        u.set_values("w", INIT)
        for _ in range(STEPS):
            with u.forward(s):
                pass
            with u.backward(s):
                if device == "cpu":
                    u.add_grad(0, (u.param_f32(0) - TARGET) * np.float32(2.0) * np.float32(1.0 / world))
                else:
                    host.add_grad(u, world)
            ctx.step(s)
        out = u.gather(0)
        ctx.finalize()
        return out


def _on_cpu_and_gpu(world, make_host, mp="fp32"):
    def on(device):
        if world == 1:
            return [_train(device, 1, 0, None, make_host(), mp)]
        return ranks.run_ranks(world, lambda rank, group: _train(device, world, rank, group, make_host(), mp))
    cpu, gpu = on("cpu"), on("cuda:0")
    for r in range(world):
        np.testing.assert_array_equal(gpu[r], cpu[r])
    assert not np.array_equal(cpu[0], INIT)  # it trained


# ---- the hosts: where they compute, how they import params and grads ----

class TorchHost:
    """where: "legacy" (torch's default stream, the unit's NULL stream), "unit" (a torch.cuda.Stream handed
    to the unit as an object: one stream for both), "side" (the unit on NULL, torch on its own stream: the
    DLPack import makes that stream wait with an event, and the host orders NULL after it before *_end)."""

    def __init__(self, where):
        self.where = where
        self.stream = torch.cuda.Stream() if where != "legacy" else None

    def unit_stream(self):
        return self.stream if self.where == "unit" else None

    def add_grad(self, u, world):
        pa, ga = u.param_array(0), u.grad_array(0)
        with torch.cuda.stream(self.stream) if self.stream is not None else _nothing():
            w, g = torch.from_dlpack(pa), torch.from_dlpack(ga)
            assert w.is_cuda and w.data_ptr() == pa.ptr and g.data_ptr() == ga.ptr  # zero-copy
            assert w.dtype == {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[pa.dtype]
            t = torch.from_numpy(TARGET).cuda()
            torch.cuda._sleep(SPIN_CYCLES)  # the grads land late
            g.copy_((g.float() + (w.float() - t) * 2.0 * (1.0 / world)).to(g.dtype))
        if self.where == "side":
            torch.cuda.default_stream().wait_stream(self.stream)  # *_end(NULL) then comes after the grads


class CupyHost:
    """how: "cai" (cupy.asarray through __cuda_array_interface__) or "dlpack" (cupy.from_dlpack); where as
    for TorchHost, with a non-blocking cupy.cuda.Stream."""

    def __init__(self, how, where):
        self.how, self.where = how, where
        self.stream = cupy.cuda.Stream(non_blocking=True) if where != "legacy" else None

    def unit_stream(self):
        return self.stream if self.where == "unit" else None

    def add_grad(self, u, world):
        pa, ga = u.param_array(0), u.grad_array(0)
        with self.stream if self.stream is not None else _nothing():
            imp = cupy.asarray if self.how == "cai" else cupy.from_dlpack
            w, g = imp(pa), imp(ga)
            assert w.data.ptr == pa.ptr and g.data.ptr == ga.ptr  # zero-copy
            t = cupy.asarray(TARGET)
            _spin()
            x = (w.astype(cupy.float32) - t) * cupy.float32(2.0) * cupy.float32(1.0 / world)
            g[...] = (g.astype(cupy.float32) + x).astype(g.dtype)
        if self.where == "side":
            cupy.cuda.Stream.null.wait_event(self.stream.record())


class JaxHost:
    """JAX computes on XLA's own stream, which jax.dlpack.from_dlpack names to the export (the review's P1:
    refused before); JAX arrays are immutable, so the result is added into the grad buffer from JAX's memory
    by Unit.grad_accumulate (fsdp_grad_accumulate) on the legacy stream, after JAX is done computing it and
    before JAX may reuse its memory (the stream is synchronized)."""

    def unit_stream(self):
        return None

    def add_grad(self, u, world):
        w = jax.dlpack.from_dlpack(u.param_array(0))
        x = jax.block_until_ready((w - jnp.asarray(TARGET)) * 2.0 * (1.0 / world))
        u.grad_accumulate(0, x)
        cudart.load().stream_synchronize(0, 0)
        del w, x


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_SPIN_KERNEL = None


def _spin():
    """A kernel that spins SPIN_CYCLES on CuPy's current stream (what torch.cuda._sleep is for torch)."""
    global _SPIN_KERNEL
    if _SPIN_KERNEL is None:
        _SPIN_KERNEL = cupy.RawKernel(r'''
extern "C" __global__ void spin(long long cycles) {
  long long start = clock64();
  while (clock64() - start < cycles) {}
}''', "spin")
    _SPIN_KERNEL((1,), (1,), (cupy.int64(SPIN_CYCLES),))


# ---- training, bit for bit against the CPU ----

@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("where", ["legacy", "unit", "side"])
def test_torch_on_any_stream_trains_like_the_cpu(where, world):
    _need(torch, _torch_why)
    _on_cpu_and_gpu(world, lambda: TorchHost(where))


@pytest.mark.parametrize("world", [1, 2])
def test_bf16_reaches_torch_as_bfloat16_and_trains_like_the_cpu(world):
    _need(torch, _torch_why)
    _on_cpu_and_gpu(world, lambda: TorchHost("legacy"), mp="bf16")


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("how,where", [("cai", "legacy"), ("dlpack", "legacy"), ("dlpack", "unit"),
                                       ("dlpack", "side"), ("cai", "unit")])
def test_cupy_trains_like_the_cpu(how, where, world):
    _need(cupy, _cupy_why)
    _on_cpu_and_gpu(world, lambda: CupyHost(how, where))


@pytest.mark.parametrize("world", [1, 2])
def test_fp16_reaches_cupy_through_the_cuda_array_interface(world):
    _need(cupy, _cupy_why)
    _on_cpu_and_gpu(world, lambda: CupyHost("cai", "legacy"), mp="fp16")


@pytest.mark.parametrize("world", [1, 2])
def test_jax_imports_params_on_its_own_stream_and_trains_like_the_cpu(world):
    _need_jax_gpu()
    _on_cpu_and_gpu(world, JaxHost)


# ---- the DLPack handshake itself ----

def test_a_consumer_on_another_stream_waits_for_the_producers_work():
    """The producer's stream writes 7s after a long spin; a consumer on another stream imports the buffer
    and copies it at once. Only the event of the export orders the copy after the write."""
    _need(torch, _torch_why)
    buf = torch.zeros(SHAPE, device="cuda:0")
    torch.cuda.synchronize()  # setup only: nothing of libfsdp is in flight
    producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(producer):
        torch.cuda._sleep(4 * SPIN_CYCLES)
        buf.fill_(7.0)
    arr = fsdp.DeviceArray(buf.data_ptr(), SHAPE, "float32", device="cuda", device_id=0,
                           stream=producer.cuda_stream, owner=buf,
                           sync=functools.partial(cudart.stream_wait, device_id=0))
    with torch.cuda.stream(consumer):
        seen = torch.from_dlpack(arr).clone()  # torch names `consumer` to __dlpack__
    consumer.synchronize()
    assert bool((seen == 7.0).all()), "the consumer read before the producer's write: no event ordered them"


def test_cupy_bf16_points_at_dlpack():
    _need(cupy, _cupy_why)
    with fsdp.Context(fsdp.Config(device="cuda:0", param_dtype="bf16")) as ctx:
        u = ctx.register_unit("u", [("w", SHAPE)])
        with u.forward():
            pa = u.param_array(0)
            with pytest.raises(AttributeError, match="from_dlpack"):
                pa.__cuda_array_interface__
            with pytest.raises(TypeError, match="from_dlpack"):
                cupy.asarray(pa)  # CuPy falls back to numpy's conversion, which DeviceArray refuses so


_PTDS_SCRIPT = r"""
import json, sys
import numpy as np, cupy, fsdp
from fsdp import dlpack
seen, waits = [], []
real_sync_for = dlpack.DeviceArray._sync_for
def sync_for(self, stream):
    seen.append(stream)
    return real_sync_for(self, stream)
dlpack.DeviceArray._sync_for = sync_for
real_wait = fsdp.cudart.stream_wait
fsdp.cudart.stream_wait = lambda *a, **k: (waits.append(a), real_wait(*a, **k))
spin = cupy.RawKernel(r'''extern "C" __global__ void spin(long long cycles) {
  long long start = clock64();
  while (clock64() - start < cycles) {}
}''', "spin")
init = np.array(json.loads(sys.argv[1]), np.float32).reshape(%(shape)r)
target = np.array(json.loads(sys.argv[2]), np.float32).reshape(%(shape)r)
cfg = fsdp.Config(device="cuda:0", sharding="FULL_SHARD", optimizer="adamw", lr=0.05, weight_decay=0.01,
                  loss_scale="off", timeout_s=60)
with fsdp.Context(cfg) as ctx:
    u = ctx.register_unit("layer", [("w", %(shape)r)])
    u.set_values("w", init)
    for _ in range(%(steps)d):
        with u.forward():
            pass
        with u.backward():
            w, g = cupy.from_dlpack(u.param_array(0)), cupy.from_dlpack(u.grad_array(0))
            t = cupy.asarray(target)
            spin((1,), (1,), (cupy.int64(%(cycles)d),))  # the grads land late
            g += (w - t) * cupy.float32(2.0) * cupy.float32(1.0)
        ctx.step()
    out = u.gather(0)
    ctx.finalize()
print(json.dumps({"streams": sorted(set(seen)), "waits": len(waits), "out": out.view(np.uint32).ravel().tolist()}))
"""


def test_cupy_on_per_thread_default_streams_needs_no_event():
    """CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1: CuPy computes on the per-thread default stream and names it (2)
    to __dlpack__, while the unit's NULL stream is the legacy one (1). The two synchronize with each other,
    so no event is made, and the training matches the CPU (in a process of its own: CuPy reads the variable
    when it is imported)."""
    _need(cupy, _cupy_why)
    env = dict(os.environ, CUPY_CUDA_PER_THREAD_DEFAULT_STREAM="1", FSDP_LIBRARY=fsdp.LIB_PATH,
               PYTHONPATH=os.pathsep.join(filter(None, [os.path.dirname(os.path.dirname(fsdp.__file__)),
                                                         os.environ.get("PYTHONPATH")])))
    script = _PTDS_SCRIPT % {"shape": SHAPE, "steps": STEPS, "cycles": SPIN_CYCLES}
    r = subprocess.run([sys.executable, "-c", script, json.dumps(INIT.ravel().tolist()),
                        json.dumps(TARGET.ravel().tolist())], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["streams"] == [2] and got["waits"] == 0, got  # CuPy named the per-thread stream; no event
    cpu = _train("cpu", 1, 0, None, None)
    np.testing.assert_array_equal(np.array(got["out"], np.uint32).view(np.float32).reshape(SHAPE), cpu)
