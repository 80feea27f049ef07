# test_streams.py - the binding's stream logic without a GPU: which stream objects a call takes, which
# consumer streams a DLPack export orders with an event and which CUDA orders already, the calls that
# make the event (against a stand-in CUDA runtime), and how a missing runtime is reported.
import gc
import os
import subprocess
import sys

import numpy as np
import pytest

import fsdp
from fsdp import cudart, dlpack
from fsdp.core import stream_handle


# ---- stand-ins for the stream objects of the CUDA stream protocol, torch and CuPy ----

class ProtocolStream:
    def __init__(self, handle, version=0):
        self.handle, self.version = handle, version

    def __cuda_stream__(self):
        return (self.version, self.handle)


class PropertyProtocolStream:  # an early draft of the protocol made it an attribute
    __cuda_stream__ = (0, 0x7A00)


class TorchStream:  # torch.cuda.Stream: .cuda_stream, 0 for the default stream
    def __init__(self, handle):
        self.cuda_stream = handle


class _BaseStream:  # cupy.cuda.Stream and ExternalStream derive from one base with .ptr
    def __init__(self, ptr):
        self.ptr = ptr


class Stream(_BaseStream):
    pass


class ExternalStream(_BaseStream):
    pass


class MemoryPointer:  # cupy's device pointer also has .ptr, and is not a stream
    ptr = 0x9000


def test_stream_handle_takes_ints_the_stream_protocol_and_torch_and_cupy_streams():
    assert stream_handle(None) is None
    assert stream_handle(0) == 0 and stream_handle(1) == 1 and stream_handle(0x7F0012345600) == 0x7F0012345600
    assert stream_handle(np.int64(0x5000)) == 0x5000
    assert stream_handle(ProtocolStream(0xBEEF00)) == 0xBEEF00
    assert stream_handle(PropertyProtocolStream()) == 0x7A00
    assert stream_handle(TorchStream(0x1200)) == 0x1200
    assert stream_handle(TorchStream(0)) == 0  # torch's default stream: NULL, the legacy default stream
    assert stream_handle(Stream(0x3400)) == 0x3400
    assert stream_handle(ExternalStream(2)) == 2


@pytest.mark.parametrize("bad,match", [
    ("5", "expected a cudaStream_t as an int, an object with __cuda_stream__, a torch.cuda.Stream or a cupy"),
    (1.5, "expected a cudaStream_t"),
    (True, "a bool is not a stream"),
    (MemoryPointer(), "expected a cudaStream_t"),
    (ProtocolStream(0x10, version=1), "__cuda_stream__ version 1"),
    (ProtocolStream("x"), "expected a cudaStream_t"),
])
def test_stream_handle_refuses_other_objects_with_a_type_error(bad, match):
    with pytest.raises(TypeError, match=match):
        stream_handle(bad)


def test_stream_handle_refuses_a_protocol_answer_that_is_not_a_pair():
    class Odd:
        def __cuda_stream__(self):
            return 0x10

    with pytest.raises(TypeError, match="not \\(version, handle\\)"):
        stream_handle(Odd())
    with pytest.raises(fsdp.InvalidArgument, match="not negative"):
        stream_handle(-3)


# ---- a CPU context dressed as a CUDA one: the calls' stream arguments and the arrays' streams ----

def _ctx():
    return fsdp.Context(fsdp.Config(optimizer="sgd", lr=1.0, loss_scale="off", timeout_s=20))


def test_stream_objects_reach_the_c_calls_as_handles(monkeypatch):
    seen = []
    for name in ("fsdp_forward_begin", "fsdp_forward_end", "fsdp_backward_begin", "fsdp_backward_end"):
        real = getattr(fsdp._lib.LIB, name)

        def fake(unit, stream, _real=real, _name=name):  # the library is CPU: record, then pass NULL on
            seen.append((_name, stream))
            return _real(unit, None)
        monkeypatch.setattr(fsdp._lib.LIB, name, fake)
    with _ctx() as ctx:
        u = ctx.register_unit("u", [("w", (2, 3))])
        with pytest.raises(fsdp.InvalidArgument, match="CUDA only"):
            u.forward_begin(stream=TorchStream(0x1200))  # on the CPU a stream object is refused too
        monkeypatch.setattr(ctx, "device_kind", "cuda")
        with pytest.raises(TypeError, match="Unit.forward_begin: stream='s': expected a cudaStream_t"):
            u.forward_begin(stream="s")
        with u.forward(stream=TorchStream(0x1200)):
            assert u.param_array(0).stream == 0x1200  # the producer's stream of the arrays
        with u.backward(stream=Stream(0x3400)):
            assert u.grad_array(0).stream == 0x3400
        with u.forward(stream=ProtocolStream(0)):
            assert u.param_array(0).stream == 1  # NULL is the legacy default stream
    assert seen == [("fsdp_forward_begin", 0x1200), ("fsdp_forward_end", 0x1200),
                    ("fsdp_backward_begin", 0x3400), ("fsdp_backward_end", 0x3400),
                    ("fsdp_forward_begin", 0), ("fsdp_forward_end", 0)]


# ---- which exports need an event ----

@pytest.mark.parametrize("producer,consumer,ordered", [
    (None, 0x5000, True),   # no producer stream (CPU, or nothing queued)
    (1, -1, True),          # the consumer synchronizes itself
    (1, 1, True), (0x5000, 0x5000, True),
    (1, 2, True), (2, 1, True),  # the legacy and per-thread default streams synchronize with each other
    (1, 0x5000, False), (0x5000, 1, False), (2, 0x5000, False), (0x5000, 2, False), (0x5000, 0x6000, False),
])
def test_which_consumer_streams_need_an_event(producer, consumer, ordered):
    assert dlpack.stream_ordered(producer, consumer) is ordered
    calls = []
    a = fsdp.DeviceArray(0xDEAD0000, (2,), "float32", device="cuda", stream=producer,
                         sync=lambda p, c: calls.append((p, c)))
    a.__dlpack__(stream=consumer)
    assert calls == ([] if ordered else [(producer, consumer)])


def test_a_consumer_without_a_stream_is_on_the_legacy_default_stream():
    calls = []
    a = fsdp.DeviceArray(0xDEAD0000, (2,), "float32", device="cuda", stream=2, sync=lambda p, c: calls.append((p, c)))
    a.__dlpack__()  # None: stream 1, ordered with 2
    b = fsdp.DeviceArray(0xDEAD0000, (2,), "float32", device="cuda", stream=0x5000, sync=lambda p, c: calls.append((p, c)))
    b.__dlpack__()
    assert calls == [(0x5000, 1)]
    gc.collect()


# ---- the event, against a stand-in CUDA runtime ----

class FakeCudart:
    """The runtime's functions as Python callables over ctypes arguments: records each call."""

    def __init__(self, device=0, fail=None):
        self.device, self.fail, self.calls, self.next_event = device, fail, [], 0xE0

    def _ret(self, name):
        return 700 if name == self.fail else 0  # 700: cudaErrorIllegalAddress

    def cudaGetDevice(self, p):
        p._obj.value = self.device
        self.calls.append(("cudaGetDevice",))
        return self._ret("cudaGetDevice")

    def cudaSetDevice(self, d):
        self.calls.append(("cudaSetDevice", d))
        if self._ret("cudaSetDevice") == 0:
            self.device = d
        return self._ret("cudaSetDevice")

    def cudaEventCreateWithFlags(self, p, flags):
        self.next_event += 1
        p._obj.value = self.next_event
        self.calls.append(("cudaEventCreateWithFlags", flags))
        return self._ret("cudaEventCreateWithFlags")

    def cudaEventRecord(self, ev, stream):
        self.calls.append(("cudaEventRecord", ev.value, stream.value, self.device))
        return self._ret("cudaEventRecord")

    def cudaStreamWaitEvent(self, stream, ev, flags):
        self.calls.append(("cudaStreamWaitEvent", stream.value, ev.value, flags))
        return self._ret("cudaStreamWaitEvent")

    def cudaEventDestroy(self, ev):
        self.calls.append(("cudaEventDestroy", ev.value))
        return 0

    def cudaStreamSynchronize(self, stream):
        self.calls.append(("cudaStreamSynchronize", stream.value, self.device))
        return self._ret("cudaStreamSynchronize")

    def cudaGetErrorName(self, status):
        return b"cudaErrorIllegalAddress" if status == 700 else b"cudaErrorUnknown"


def test_stream_synchronize_waits_on_the_streams_device_and_switches_back():
    fake = FakeCudart(device=0)
    cudart.CudaRuntime(fake).stream_synchronize(0x7000, device_id=1)
    assert fake.calls == [("cudaGetDevice",), ("cudaSetDevice", 1), ("cudaStreamSynchronize", 0x7000, 1),
                          ("cudaSetDevice", 0)]
    fake = FakeCudart(device=0, fail="cudaStreamSynchronize")
    with pytest.raises(cudart.CudaRuntimeError, match="cudaStreamSynchronize failed .cudaErrorIllegalAddress."):
        cudart.CudaRuntime(fake).stream_synchronize(0, device_id=0)


def test_stream_wait_records_on_the_producer_and_makes_the_consumer_wait():
    fake = FakeCudart(device=0)
    cudart.CudaRuntime(fake).stream_wait(1, 0x5000, device_id=1)
    assert fake.calls == [("cudaGetDevice",), ("cudaSetDevice", 1),
                          ("cudaEventCreateWithFlags", cudart.CUDA_EVENT_DISABLE_TIMING),
                          ("cudaEventRecord", 0xE1, 1, 1),  # on the producer's stream, on its device
                          ("cudaStreamWaitEvent", 0x5000, 0xE1, 0),
                          ("cudaEventDestroy", 0xE1),
                          ("cudaSetDevice", 0)]  # the thread's device restored
    fake = FakeCudart(device=1)
    cudart.CudaRuntime(fake).stream_wait(0x6000, 2, device_id=1)
    assert [c[0] for c in fake.calls] == ["cudaGetDevice", "cudaEventCreateWithFlags", "cudaEventRecord",
                                          "cudaStreamWaitEvent", "cudaEventDestroy"]  # no device switch


@pytest.mark.parametrize("failing", ["cudaEventRecord", "cudaStreamWaitEvent", "cudaEventCreateWithFlags"])
def test_a_failed_runtime_call_is_named_and_leaves_nothing_behind(failing):
    fake = FakeCudart(device=0, fail=failing)
    with pytest.raises(cudart.CudaRuntimeError, match=f"{failing} failed \\(cudaErrorIllegalAddress\\) while making "
                                                     f"stream 0x5000 wait for stream 0x1 on cuda:1"):
        cudart.CudaRuntime(fake).stream_wait(1, 0x5000, device_id=1)
    names = [c[0] for c in fake.calls]
    assert names.count("cudaEventDestroy") == (0 if failing == "cudaEventCreateWithFlags" else 1)
    assert fake.calls[-1] == ("cudaSetDevice", 0) and fake.device == 0
    assert isinstance(cudart.CudaRuntimeError("x"), BufferError)  # what DLPack consumers expect an export to raise


def test_unit_arrays_order_a_consumer_on_another_stream_with_an_event(monkeypatch):
    """Unit.param_array/grad_array give DeviceArrays whose export makes the consumer's stream wait (P1 of the
    GPU review: JAX, torch on a side stream and CuPy on its stream were refused with BufferError)."""
    fake = FakeCudart(device=0)
    monkeypatch.setattr(cudart, "_runtime", cudart.CudaRuntime(fake))
    base = dlpack.live_exports()
    with _ctx() as ctx:
        u = ctx.register_unit("u", [("w", (2, 3))])
        with u.forward():
            monkeypatch.setattr(ctx, "device_kind", "cuda")  # arrays as a CUDA context makes them
            monkeypatch.setattr(ctx, "device_id", 3)
            pa = u.param_array(0)
            assert (pa.device, pa.device_id, pa.stream) == ("cuda", 3, 1)
            for consumer in (1, 2, -1, None):  # ordered already: no runtime call at all
                pa.__dlpack__(stream=consumer)
            assert fake.calls == []
            cap = pa.__dlpack__(stream=0x5000, max_version=(1, 0))  # what jax.dlpack.from_dlpack does
            assert ("cudaEventRecord", 0xE1, 1, 3) in fake.calls
            assert ("cudaStreamWaitEvent", 0x5000, 0xE1, 0) in fake.calls
            assert fake.device == 0
            del cap
            monkeypatch.setattr(ctx, "device_kind", "cpu")
    gc.collect()
    assert dlpack.live_exports() == base


# ---- finding the runtime ----

def test_a_runtime_that_is_not_there_is_reported_with_what_was_tried(tmp_path):
    missing = str(tmp_path / "libcudart.so.13")
    with pytest.raises(cudart.CudaRuntimeError, match="the CUDA runtime \\(libcudart\\) was not found") as e:
        cudart.find({"FSDP_CUDART_LIBRARY": missing})
    assert missing in str(e.value) and "FSDP_CUDART_LIBRARY must name a libcudart.so.13" in str(e.value)
    assert "stream=-1" in str(e.value)
    with pytest.raises(cudart.CudaRuntimeError, match="is not the CUDA runtime: it has no cudaGetDevice"):
        cudart.find({"FSDP_CUDART_LIBRARY": fsdp.LIB_PATH})  # loads, but is libfsdp


def test_where_the_runtime_is_looked_for(tmp_path, monkeypatch):
    wheel = tmp_path / "site" / "nvidia" / "cu13" / "lib"
    wheel.mkdir(parents=True)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    paths = [p for p, _ in cudart.candidates({"CUDA_HOME": "/opt/cuda-x"})]
    assert paths[0] == "libcudart.so.13"  # first by name: finds the one torch, CuPy or JAX loaded
    assert paths.index(str(wheel / "libcudart.so.13")) < paths.index("/opt/cuda-x/lib64/libcudart.so.13")
    assert paths.index("/opt/cuda-x/lib64/libcudart.so.13") < paths.index("/usr/local/cuda/lib64/libcudart.so.13")
    assert paths[-1] == "libcudart.so"
    assert cudart.candidates({"FSDP_CUDART_LIBRARY": "/x/libcudart.so"}) == [("/x/libcudart.so", True)]


def _gpu_usable():
    try:
        fsdp.Context(fsdp.Config(device="cuda:0")).close()
        return True
    except fsdp.FsdpError:
        return False


def test_the_real_runtime_without_a_gpu_fails_with_a_named_cuda_error():
    try:
        rt = cudart.find({k: v for k, v in os.environ.items() if k != "FSDP_CUDART_LIBRARY"})
    except cudart.CudaRuntimeError as e:
        pytest.skip(f"no CUDA runtime on this machine ({str(e)[:200]}...)")
    if _gpu_usable():
        pytest.skip("a GPU is usable here: test_cuda.py covers the runtime with a GPU")
    with pytest.raises(cudart.CudaRuntimeError, match=r"cudaGetDevice failed \(cuda\w+\)"):
        rt.stream_wait(1, 0x5000, device_id=0)


# ---- a bf16 view on CUDA points at from_dlpack ----

def test_gpu_arrays_that_numpy_cannot_read_point_at_from_dlpack():
    bf16 = fsdp.DeviceArray(0xDEAD0000, (3,), "bfloat16", device="cuda")
    with pytest.raises(AttributeError, match="bfloat16 .*import it with from_dlpack"):
        bf16.__cuda_array_interface__
    # cupy.asarray falls back to numpy's conversion when __cuda_array_interface__ is missing
    with pytest.raises(TypeError, match="GPU memory .*bfloat16 .*from_dlpack"):
        np.asarray(bf16)
    with pytest.raises(TypeError, match="from_dlpack"):
        np.asarray(fsdp.DeviceArray(0xDEAD0000, (3,), "float32", device="cuda"))


def test_numpy_conversion_of_a_cpu_array_is_the_zero_copy_view():
    buf = np.arange(6, dtype=np.float32)
    a = fsdp.DeviceArray(buf.ctypes.data, (2, 3), "float32", owner=buf)
    v = np.asarray(a)
    assert v.shape == (2, 3) and np.shares_memory(v, buf)
    assert np.asarray(a, dtype=np.float64).dtype == np.float64
    with pytest.raises(TypeError, match="numpy has no bfloat16"):
        np.asarray(fsdp.DeviceArray(buf.ctypes.data, (3,), "bfloat16", owner=buf))
    del v
    gc.collect()


def test_cudart_is_never_loaded_for_the_cpu(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("the CUDA runtime was loaded for a CPU context")
    monkeypatch.setattr(cudart, "find", boom)
    monkeypatch.setattr(cudart, "_runtime", None)
    with _ctx() as ctx:
        u = ctx.register_unit("u", [("w", (4,))])
        with u.backward():
            g = np.from_dlpack(u.grad_array(0))
            g += 1
            del g
        ctx.step()


# ---- test_cuda.py's rule: skip where no GPU is there, fail where one is listed but unusable ----

def _run_test_cuda(tmp_path, nvidia_smi_output, **env):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\nprintf '%s' '{nvidia_smi_output}'\n")
    smi.chmod(0o755)
    e = {k: v for k, v in os.environ.items() if k not in ("FSDP_REQUIRE_GPU", "CUDA_VISIBLE_DEVICES")}
    e.update(PATH=f"{bin_dir}:{os.environ.get('PATH', '')}", FSDP_LIBRARY=fsdp.LIB_PATH,
             PYTHONPATH=os.path.dirname(os.path.dirname(fsdp.__file__)), **env)
    here = os.path.dirname(os.path.abspath(__file__))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                        "-k", "bf16_points_at_dlpack", os.path.join(here, "test_cuda.py")],
                       capture_output=True, text=True, timeout=300, env=e, cwd=str(tmp_path))
    return r.returncode, r.stdout + r.stderr


def test_the_gpu_tests_fail_where_nvidia_smi_lists_a_gpu_cuda_cannot_use(tmp_path):
    if _gpu_usable():
        pytest.skip("a GPU is usable here: the GPU tests run for real")
    rc, out = _run_test_cuda(tmp_path, "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)\\n")
    assert rc != 0 and "nvidia-smi -L lists 1 GPU(s), but no CUDA device can be used here" in out, out
    rc, out = _run_test_cuda(tmp_path, "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)\\n", CUDA_VISIBLE_DEVICES="")
    assert rc == 0 and "1 skipped" in out and "GPU test not run" in out, out  # hidden on purpose
    rc, out = _run_test_cuda(tmp_path, "")
    assert rc == 0 and "1 skipped" in out, out  # no GPU here: skips, saying why
    rc, out = _run_test_cuda(tmp_path, "", FSDP_REQUIRE_GPU="1")
    assert rc != 0 and "GPU test could not run" in out, out
