# cudart.py - the CUDA runtime through ctypes, for two jobs: ordering a DLPack consumer's stream after libfsdp's,
# and waiting for a stream before a framework's memory that it reads may go (fsdp.jax's grads).
"""A DLPack consumer (torch on a side stream, JAX on XLA's stream, CuPy on its current stream) names the
stream it will read on; the data was made ready on another one, the stream given to ``*_begin``. DLPack
leaves the ordering to the producer: record an event on the producer's stream and make the consumer's
stream wait for it, without blocking the host. libfsdp's C ABI has no call for that, and this module needs
none: it loads the CUDA runtime itself (libfsdp links its own statically and exports none of it), and
streams and events are driver objects that every runtime in the process shares.

Which runtime: ``$FSDP_CUDART_LIBRARY`` when set (and only that), else ``libcudart.so.13`` by name (the one
torch, CuPy or JAX already loaded, or one on the loader's path), else the ``nvidia-cuda-runtime`` wheel
(``nvidia/cu13/lib``, or ``nvidia/cuda_runtime/lib`` in the older layout), else the toolkit
(``$CUDA_HOME``, ``$CUDA_PATH``, ``/usr/local/cuda``), else ``libcudart.so``. It is loaded on the first
export that needs an event, never on the CPU or when the streams are already ordered.
"""
import contextlib
import ctypes
import importlib.util
import os
import sys
import threading

CUDA_EVENT_DISABLE_TIMING = 0x02  # cudaEventDisableTiming
SONAME = "libcudart.so.13"

_FUNCTIONS = {  # name: argtypes; each returns a cudaError_t
    "cudaGetDevice": [ctypes.POINTER(ctypes.c_int)],
    "cudaSetDevice": [ctypes.c_int],
    "cudaEventCreateWithFlags": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint],
    "cudaEventRecord": [ctypes.c_void_p, ctypes.c_void_p],
    "cudaStreamWaitEvent": [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint],
    "cudaEventDestroy": [ctypes.c_void_p],
    "cudaStreamSynchronize": [ctypes.c_void_p],
}


class CudaRuntimeError(BufferError):
    """The CUDA runtime is missing, or one of its calls failed, while ordering a consumer's stream. A
    BufferError, which is what the DLPack protocol says an export that cannot be made raises."""


def _declare(fn, argtypes, restype):
    try:
        fn.argtypes, fn.restype = argtypes, restype
    except AttributeError:  # a stand-in's bound method takes no attributes
        pass


class CudaRuntime:
    """The runtime calls the ordering needs, over a loaded library: a ctypes.CDLL, or (the tests) any
    object with functions of the same names."""

    def __init__(self, lib, path="libcudart"):
        missing = [n for n in _FUNCTIONS if not hasattr(lib, n)]
        if missing:
            raise CudaRuntimeError(f"{path} is not the CUDA runtime: it has no {', '.join(missing)}")
        for name, argtypes in _FUNCTIONS.items():
            _declare(getattr(lib, name), argtypes, ctypes.c_int)
        self._error_name = getattr(lib, "cudaGetErrorName", None)
        if self._error_name is not None:
            _declare(self._error_name, [ctypes.c_int], ctypes.c_char_p)
        self._lib, self.path = lib, path

    def _check(self, status, call, doing):
        if status != 0:
            name = f"error {status}"
            if self._error_name is not None:
                got = self._error_name(status)
                name = got.decode() if isinstance(got, bytes) else str(got)
            raise CudaRuntimeError(f"fsdp.cudart: {call} failed ({name}) while {doing} (runtime {self.path})")

    @contextlib.contextmanager
    def _on_device(self, device_id, doing):
        """The block with cuda:`device_id` current; the thread's current device is the same afterwards."""
        lib = self._lib
        prev = ctypes.c_int(-1)
        self._check(lib.cudaGetDevice(ctypes.byref(prev)), "cudaGetDevice", doing)
        switch = prev.value != device_id
        if switch:
            self._check(lib.cudaSetDevice(device_id), f"cudaSetDevice({device_id})", doing)
        try:
            yield
        finally:
            if switch:
                lib.cudaSetDevice(prev.value)

    def stream_wait(self, producer, consumer, device_id):
        """Makes stream `consumer` wait, on the GPU, for the work queued so far on stream `producer` (each a
        cudaStream_t as an int; 1 is cudaStreamLegacy, 2 cudaStreamPerThread) through an event made on
        cuda:`device_id`, the producer's device. The host does not block; the thread's current device is
        the same afterwards."""
        lib = self._lib
        doing = f"making stream {consumer:#x} wait for stream {producer:#x} on cuda:{device_id}"
        with self._on_device(device_id, doing):
            ev = ctypes.c_void_p()
            self._check(lib.cudaEventCreateWithFlags(ctypes.byref(ev), CUDA_EVENT_DISABLE_TIMING),
                        "cudaEventCreateWithFlags", doing)
            try:
                self._check(lib.cudaEventRecord(ev, ctypes.c_void_p(producer)), "cudaEventRecord", doing)
                self._check(lib.cudaStreamWaitEvent(ctypes.c_void_p(consumer), ev, 0), "cudaStreamWaitEvent", doing)
            finally:
                # The wait took the event's state when it was queued, so the event may go now: CUDA frees it
                # once the GPU is past it.
                lib.cudaEventDestroy(ev)

    def stream_synchronize(self, stream, device_id):
        """Blocks the host until the work queued so far on `stream` (a cudaStream_t as an int; 0 is the legacy
        default stream) on cuda:`device_id` is done: until a framework's memory that the work reads may go."""
        doing = f"waiting for stream {stream:#x} on cuda:{device_id}"
        with self._on_device(device_id, doing):
            self._check(self._lib.cudaStreamSynchronize(ctypes.c_void_p(stream)), "cudaStreamSynchronize", doing)


def _wheel_dirs():
    """The nvidia/ folders that NVIDIA's wheels install into (a namespace package, maybe on several paths)."""
    dirs = []
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        dirs += [d for d in spec.submodule_search_locations]
    for p in sys.path:
        d = os.path.join(p or ".", "nvidia")
        if d not in dirs and os.path.isdir(d):
            dirs.append(d)
    return dirs


def candidates(environ=None):
    """The libraries to try, in order, as (what to dlopen, explicit). A bare name goes to the loader, which
    also finds a runtime torch, CuPy or JAX already loaded; a path is tried only where it exists."""
    env = os.environ if environ is None else environ
    explicit = env.get("FSDP_CUDART_LIBRARY")
    if explicit:
        return [(explicit, True)]
    out = [SONAME]
    for d in _wheel_dirs():
        out += [os.path.join(d, "cu13", "lib", SONAME), os.path.join(d, "cuda_runtime", "lib", SONAME)]
    for root in (env.get("CUDA_HOME"), env.get("CUDA_PATH"), "/usr/local/cuda"):
        if root:
            out += [os.path.join(root, "lib64", SONAME), os.path.join(root, "targets", "x86_64-linux", "lib", SONAME)]
    out.append("libcudart.so")
    return [(p, False) for p in dict.fromkeys(out)]


def find(environ=None):
    """A new CudaRuntime from the first candidate that loads as one; CudaRuntimeError naming every library
    tried, and why each failed, when none does."""
    env = os.environ if environ is None else environ
    tried = []
    for path, explicit in candidates(env):
        if os.sep in path and not explicit and not os.path.exists(path):
            tried.append(f"{path} (not there)")
            continue
        try:
            lib = ctypes.CDLL(path)
        except OSError as e:
            tried.append(f"{path} ({e})")
            continue
        try:
            return CudaRuntime(lib, path)
        except CudaRuntimeError as e:
            tried.append(str(e))
    how = ("FSDP_CUDART_LIBRARY must name a libcudart.so.13" if env.get("FSDP_CUDART_LIBRARY") else
           "install the CUDA toolkit or the nvidia-cuda-runtime wheel, or set FSDP_CUDART_LIBRARY to a "
           "libcudart.so.13")
    raise CudaRuntimeError("fsdp.cudart: the CUDA runtime (libcudart) was not found; it is needed to make a DLPack "
                           "consumer's stream wait for libfsdp's. Tried: " + "; ".join(tried) + ". Fix: " + how +
                           "; or synchronize the producer's stream yourself and import with stream=-1")


_runtime = None
_lock = threading.Lock()


def load():
    """The process's CudaRuntime, found once (find())."""
    global _runtime
    with _lock:
        if _runtime is None:
            _runtime = find()
        return _runtime


def stream_wait(producer, consumer, device_id=0):
    """Makes stream `consumer` wait on the GPU for what is queued on stream `producer` (CudaRuntime.stream_wait)
    with the runtime load() finds. A DeviceArray sync hook: sync=functools.partial(stream_wait, device_id=N)."""
    load().stream_wait(producer, consumer, device_id)
