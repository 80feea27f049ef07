# test_cuda.py - the binding on a CUDA context: params and grads reach PyTorch (DLPack, kDLCUDA) and CuPy
# (__cuda_array_interface__) zero-copy, the host computes on its own stream, and training on one GPU, alone
# or as two thread-ranks sharing it, gives the bits of the same loop on device=cpu. Skips, saying so, where
# the build has no CUDA device, no GPU can be used, or neither torch nor cupy is installed
# (tools/gpu-check.sh runs it on a machine with a GPU).
import numpy as np
import pytest

import fsdp
from fsdp import ranks

try:
    import torch
except ImportError:
    torch = None
try:
    import cupy
except ImportError:
    cupy = None

SHAPE = (16, 12)
STEPS = 4


def _gpu_usable():
    if "cuda" not in fsdp.build_info():
        return "this libfsdp has no CUDA device (fsdp_build_info)"
    if torch is None and cupy is None:
        return "neither torch nor cupy is installed"
    if torch is not None and not torch.cuda.is_available():
        return "no CUDA device can be used here"
    if torch is None and cupy.cuda.runtime.getDeviceCount() == 0:
        return "no CUDA device can be used here"
    return None


pytestmark = pytest.mark.skipif(_gpu_usable() is not None, reason=f"GPU test not run: {_gpu_usable()}")

INIT = np.linspace(-1.0, 1.0, SHAPE[0] * SHAPE[1], dtype=np.float32).reshape(SHAPE)
TARGET = np.cos(np.arange(SHAPE[0] * SHAPE[1], dtype=np.float32)).reshape(SHAPE)


def _train(device, world, rank, group, lib):
    """STEPS of AdamW on loss = sum((w - target)^2) / world per rank; grads 2 (w - target) / world, each
    an IEEE sub and two muls, which numpy, torch and cupy round alike. Returns the gathered weights."""
    with fsdp.Context(fsdp.Config(device=device, sharding="FULL_SHARD", optimizer="adamw", lr=0.05,
                                  weight_decay=0.01, timeout_s=60), group=group, rank=rank) as ctx:
        u = ctx.register_unit("layer", [("w", SHAPE)])
        u.set_values("w", INIT)
        for _ in range(STEPS):
            with u.forward():
                pass
            with u.backward():
                if device == "cpu":
                    u.grad(0)[...] += (u.param(0) - TARGET) * np.float32(2.0) * np.float32(1.0 / world)
                else:
                    _add_grad_on_gpu(u, lib)
            ctx.step()
        out = u.gather(0)
        ctx.finalize()
        return out


def _add_grad_on_gpu(u, lib):
    pa, ga = u.param_array(0), u.grad_array(0)
    assert pa.device == "cuda" and ga.device == "cuda"
    if lib == "torch":
        w, g = torch.from_dlpack(pa), torch.from_dlpack(ga)
        assert w.is_cuda and w.data_ptr() == pa.ptr and g.data_ptr() == ga.ptr  # zero-copy
        t = torch.from_numpy(TARGET).cuda()
        g += (w - t) * 2.0 * (1.0 / u.ctx.world_size)
        torch.cuda.synchronize()
    else:
        w, g = cupy.asarray(pa), cupy.asarray(ga)  # __cuda_array_interface__
        assert w.data.ptr == pa.ptr and g.data.ptr == ga.ptr  # zero-copy
        t = cupy.asarray(TARGET)
        g += (w - t) * cupy.float32(2.0) * cupy.float32(1.0 / u.ctx.world_size)
        cupy.cuda.runtime.deviceSynchronize()


def _libs():
    return [name for name, mod in (("torch", torch), ("cupy", cupy)) if mod is not None]


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("lib", _libs() or ["none"])
def test_gpu_training_through_zero_copy_arrays_matches_cpu_bitwise(lib, world):
    def on(device):
        if world == 1:
            return [_train(device, 1, 0, None, lib)]
        return ranks.run_ranks(world, lambda rank, group: _train(device, world, rank, group, lib))
    cpu, gpu = on("cpu"), on("cuda:0")
    for r in range(world):
        np.testing.assert_array_equal(gpu[r], cpu[r])
    assert not np.array_equal(cpu[0], INIT)  # it trained
