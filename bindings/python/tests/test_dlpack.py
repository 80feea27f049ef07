# test_dlpack.py - fsdp.DeviceArray: DLPack export of params/grads on CPU, __cuda_array_interface__, capsule lifetime.
import ctypes
import gc
import os
import subprocess
import sys
import weakref

import numpy as np
import pytest

import fsdp
from fsdp import dlpack

_api = ctypes.PyDLL(ctypes.pythonapi._name, handle=ctypes.pythonapi._handle)  # not the shared pythonapi
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_GetName.restype = ctypes.c_char_p
_api.PyCapsule_GetName.argtypes = [ctypes.py_object]


def _addr(a):
    return a.__array_interface__["data"][0]


def _ctx(mp="fp32"):
    return fsdp.Context(fsdp.Config(param_dtype=mp, optimizer="sgd", lr=1.0, loss_scale="off", timeout_s=20))


def _managed(cap):
    """The DLManagedTensor inside an unconsumed legacy capsule."""
    assert _api.PyCapsule_GetName(cap) == b"dltensor"
    return ctypes.cast(_api.PyCapsule_GetPointer(cap, b"dltensor"), ctypes.POINTER(dlpack.DLManagedTensor)).contents


@pytest.mark.parametrize("mp,dtype", [("fp32", np.float32), ("fp16", np.float16)])
def test_numpy_from_dlpack_shares_library_memory(mp, dtype):
    init = np.linspace(-1, 1, 10, dtype=np.float32).reshape(2, 5)
    with _ctx(mp) as ctx:
        u = ctx.register_unit("u", [("w", (2, 5)), ("b", (5,))])
        u.set_values("w", init)
        base = dlpack.live_exports()
        with u.forward():
            pa = u.param_array("w")
            assert isinstance(pa, fsdp.DeviceArray) and pa.readonly and pa.device == "cpu"
            assert pa.__dlpack_device__() == (dlpack.kDLCPU, 0)
            p = np.from_dlpack(pa)
            assert p.shape == (2, 5) and p.dtype == dtype
            assert _addr(p) == _addr(u.param("w")) == pa.ptr
            np.testing.assert_array_equal(p, init.astype(dtype))
            assert not p.flags.writeable  # numpy asked for DLPack 1.x: the read-only flag is carried
            del p
        with u.backward():
            ga = u.grad_array(0)
            g = np.from_dlpack(ga)
            assert g.shape == (2, 5) and g.dtype == dtype and g.flags.writeable
            assert _addr(g) == _addr(u.grad(0)) and np.shares_memory(g, u.grad(0))
            g += 3                                # write through the DLPack import ...
            np.testing.assert_array_equal(u.grad(0), np.full((2, 5), 3, dtype))  # ... the library's view sees it
            gb = np.from_dlpack(u.grad_array("b"))
            assert gb.shape == (5,) and _addr(gb) == _addr(u.grad(1))
            assert dlpack.live_exports() == base + 2
            del g, gb
        assert dlpack.live_exports() == base
        ctx.step()  # sgd, lr 1: w -= 3
        np.testing.assert_allclose(u.gather("w"), init - 3, atol=1e-3)


def test_bf16_is_exported_as_dlpack_bfloat():
    with _ctx("bf16") as ctx:
        u = ctx.register_unit("u", [("w", (3, 4))])
        u.set_values("w", np.ones((3, 4), np.float32))
        base = dlpack.live_exports()
        with u.forward():
            pa = u.param_array(0)
            assert pa.dtype == "bfloat16" and pa.itemsize == 2 and pa.nbytes == 24
            cap = pa.__dlpack__()
            t = _managed(cap).dl_tensor
            assert (t.dtype.code, t.dtype.bits, t.dtype.lanes) == (dlpack.kDLBfloat, 16, 1)
            assert (t.device.device_type, t.device.device_id) == (dlpack.kDLCPU, 0) and t.byte_offset == 0
            assert t.ndim == 2 and [t.shape[0], t.shape[1]] == [3, 4] and [t.strides[0], t.strides[1]] == [4, 1]
            assert t.data == _addr(u.param(0))
            assert np.all(u.param(0) == 0x3F80)  # bf16 1.0 behind that pointer
            assert dlpack.live_exports() == base + 1
            del t, cap  # dropped unconsumed: the capsule destructor runs the deleter
            assert dlpack.live_exports() == base
            # numpy has no bfloat16: it refuses (the error is reported on stderr; see dlpack._take_pending_error)
            with pytest.raises((BufferError, RuntimeError, TypeError, SystemError)):
                np.from_dlpack(pa)
            gc.collect()
            assert dlpack.live_exports() == base
            with pytest.raises(AttributeError, match="CPU memory"):
                pa.__cuda_array_interface__


def test_cuda_array_interface_with_a_fake_pointer():
    # nothing dereferences the pointer: only the metadata is checked
    a = fsdp.DeviceArray(0xDEAD0000, (4, 8), "float32", device="cuda", device_id=1, stream=0x1234, readonly=True)
    cai = a.__cuda_array_interface__
    assert cai == {"shape": (4, 8), "typestr": "<f4", "data": (0xDEAD0000, True), "version": 3,
                   "strides": None, "stream": 0x1234}
    assert a.__dlpack_device__() == (dlpack.kDLCUDA, 1)
    h = fsdp.DeviceArray(0xDEAD0000, (3,), np.float16, device="cuda", stream=None)
    assert h.__cuda_array_interface__ == {"shape": (3,), "typestr": "<f2", "data": (0xDEAD0000, False),
                                          "version": 3, "strides": None, "stream": None}
    assert fsdp.DeviceArray(0, (0, 5), "float16", device="cuda").__cuda_array_interface__["data"] == (0, False)
    with pytest.raises(AttributeError, match="bfloat16"):
        fsdp.DeviceArray(0xDEAD0000, (3,), "bfloat16", device="cuda").__cuda_array_interface__
    with pytest.raises(AttributeError):
        fsdp.DeviceArray(0xDEAD0000, (3,), "float32").__cuda_array_interface__
    assert not hasattr(fsdp.DeviceArray(0xDEAD0000, (3,), "float32"), "__cuda_array_interface__")
    with pytest.raises(ValueError, match="ambiguous"):
        fsdp.DeviceArray(0xDEAD0000, (3,), "float32", device="cuda", stream=0)
    with pytest.raises(ValueError):
        fsdp.DeviceArray(0xDEAD0000, (3,), "int8")


def test_cuda_dlpack_capsule_and_streams():
    base = dlpack.live_exports()
    a = fsdp.DeviceArray(0xDEAD0000, (2, 3), "bfloat16", device="cuda", device_id=2, stream=7)
    cap = a.__dlpack__(stream=7)                     # same stream: no sync needed
    t = _managed(cap).dl_tensor
    assert (t.device.device_type, t.device.device_id, t.data) == (dlpack.kDLCUDA, 2, 0xDEAD0000)
    assert (t.dtype.code, t.dtype.bits) == (dlpack.kDLBfloat, 16)
    del t, cap
    a.__dlpack__(stream=-1)                          # -1: the consumer synchronizes itself
    with pytest.raises(BufferError, match="stream"):
        a.__dlpack__(stream=9)                       # another stream and no sync hook
    calls = []
    s = fsdp.DeviceArray(0xDEAD0000, (2,), "float32", device="cuda", stream=7, sync=lambda p, c: calls.append((p, c)))
    s.__dlpack__()                                   # None: the consumer's legacy default stream (1)
    s.__dlpack__(stream=9)
    assert calls == [(7, 1), (7, 9)]
    with pytest.raises(BufferError, match="device"):
        s.__dlpack__(dl_device=(dlpack.kDLCPU, 0))
    with pytest.raises(BufferError, match="copy"):
        s.__dlpack__(copy=True)
    gc.collect()
    assert dlpack.live_exports() == base


def test_versioned_capsule():
    buf = np.arange(6, dtype=np.float32)
    a = fsdp.DeviceArray(buf.ctypes.data, (6,), "float32", owner=buf, readonly=True)
    cap = a.__dlpack__(max_version=(1, 0))
    assert _api.PyCapsule_GetName(cap) == b"dltensor_versioned"
    mt = ctypes.cast(_api.PyCapsule_GetPointer(cap, b"dltensor_versioned"),
                     ctypes.POINTER(dlpack.DLManagedTensorVersioned)).contents
    assert (mt.version.major, mt.flags & dlpack.DLPACK_FLAG_BITMASK_READ_ONLY) == (1, 1)
    assert mt.dl_tensor.data == buf.ctypes.data and mt.dl_tensor.ndim == 1
    assert _api.PyCapsule_GetName(a.__dlpack__(max_version=(0, 8))) == b"dltensor"


def test_capsule_lifetime_no_leak():
    class Owner:
        pass

    buf = np.zeros(16, np.float32)
    owner = Owner()
    owner.buf = buf
    ref = weakref.ref(owner)
    a = fsdp.DeviceArray(buf.ctypes.data, (4, 4), "float32", owner=owner)
    del owner
    base = dlpack.live_exports()
    caps = [a.__dlpack__() for _ in range(4)] + [a.__dlpack__(max_version=(1, 0))]
    assert dlpack.live_exports() == base + 5
    del a
    gc.collect()
    assert ref() is not None                       # the capsules keep the owner alive
    arr = np.from_dlpack(caps_holder(caps.pop()))  # consumed: numpy renames it and owns the tensor
    assert arr.flags.writeable                     # (numpy imports legacy "dltensor" capsules read-only)
    del caps                                       # 4 unconsumed capsules dropped: their deleters run
    assert dlpack.live_exports() == base + 1 and ref() is not None
    arr[0, 0] = 5
    assert buf[0] == 5
    del arr                                        # the consumer calls the deleter
    gc.collect()
    assert dlpack.live_exports() == base and ref() is None

    a = fsdp.DeviceArray(buf.ctypes.data, (4, 4), "float32", owner=buf)
    for k in range(1000):
        if k % 2:
            x = np.from_dlpack(a)
            assert x.shape == (4, 4)
            del x
        else:
            a.__dlpack__(max_version=(1, 0) if k % 4 else None)
    gc.collect()
    assert dlpack.live_exports() == base


class caps_holder:
    """An object whose __dlpack__ hands out one pre-made capsule (numpy.from_dlpack takes objects, not capsules)."""

    def __init__(self, cap):
        self.cap = cap

    def __dlpack__(self, **kw):
        cap, self.cap = self.cap, None
        return cap

    def __dlpack_device__(self):
        return (dlpack.kDLCPU, 0)


def test_streams_refused_on_cpu():
    with _ctx() as ctx:
        u = ctx.register_unit("u", [("w", (2,))])
        with pytest.raises(fsdp.InvalidArgument, match="CUDA only"):
            u.forward_begin(stream=5)
        with pytest.raises(fsdp.InvalidArgument, match="CUDA only"):
            ctx.step(stream=5)
        with u.forward(stream=None):
            assert u.param_array(0).stream is None


def test_no_crash_at_interpreter_exit():
    """Live capsules, imported arrays and DeviceArrays at exit: exit code 0 and nothing on stderr."""
    code = """if True:
        import numpy as np, fsdp
        ctx = fsdp.Context(fsdp.Config())
        u = ctx.register_unit("u", [("w", (3, 3))])
        u.forward_begin()
        keep = [u.param_array(0), u.param_array(0).__dlpack__(), np.from_dlpack(u.param_array(0))]
        buf = np.ones(4, np.float32)
        keep += [fsdp.DeviceArray(buf.ctypes.data, (4,), "float32", owner=buf).__dlpack__(max_version=(1, 0))]
        keep += [np.from_dlpack(fsdp.DeviceArray(buf.ctypes.data, (4,), "float32", owner=buf))]
        u.forward_end()
        print("ok")
    """
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=os.environ)
    assert r.returncode == 0 and r.stdout.strip() == "ok" and r.stderr == "", r.stderr
