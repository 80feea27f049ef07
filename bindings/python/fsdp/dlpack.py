# dlpack.py - DeviceArray: library memory exported zero-copy through DLPack and __cuda_array_interface__.
"""DeviceArray wraps a pointer that libfsdp owns (a param or grad buffer) and exports it without a copy:

- ``__dlpack__`` / ``__dlpack_device__`` (DLPack ABI, legacy ``dltensor`` capsule and, when the consumer
  asks with ``max_version >= (1, 0)``, a ``dltensor_versioned`` capsule carrying the read-only flag):
  ``numpy.from_dlpack``, ``torch.from_dlpack``, ``cupy.from_dlpack``, ``jax.dlpack.from_dlpack`` (on CUDA:
  compiled, untested on a GPU; tests/test_cuda.py covers torch, CuPy and JAX and has not run on one).
- ``__cuda_array_interface__`` (version 3), only for CUDA memory and only for float32/float16: the CUDA
  Array Interface uses numpy typestrs and numpy has no bfloat16, so bfloat16 is exported only through
  DLPack (dtype code kDLBfloat). For CPU memory the attribute raises AttributeError so consumers fall
  back to another protocol.

The memory stays libfsdp's: a DeviceArray, and every array imported from it (numpy, torch, CuPy, JAX),
is valid only while the buffer is, i.e. inside the forward()/backward() block it came from. A capsule
keeps the DeviceArray's owner object alive until the consumer calls the deleter, but not the buffer:
``*_end`` gives the buffer back (on CUDA into a pool that keeps it mapped), the next gather reuses it, and
a tensor kept past the block (a param saved by autograd for backward, say) then reads another unit's
values with no fault and no error. Copy what must outlive the block (``tensor.clone()``). A debug
option, debug_poison=1 (or FSDP_DEBUG_POISON=1), fills freed gathered buffers with NaN, so
that such reads show as a NaN loss.

The read-only flag (DLPack 1.x, ``data[1]`` of the CUDA Array Interface) is advisory: numpy honours it,
torch has no read-only tensors and CuPy ignores it. Where libfsdp gathers nothing (world 1, NO_SHARD, a
shard group of one; not with offload=cpu) a param view is the library's own copy of the weights, the
fp32 master itself when param_dtype=fp32: a write through it changes the weights outside the optimizer.

Streams (CUDA): the producer's stream is the one the block began on. ``__dlpack__(stream=s)`` orders the
consumer's stream after it with an event when they differ (the ``sync`` hook; ``fsdp.cudart`` for the
units' arrays), except where CUDA orders them already: the same stream, or the legacy (1) and per-thread
(2) default streams, which synchronize with each other.
"""
import ctypes
import itertools
import threading

# ---- DLPack ABI (dlpack.h v0.8 DLManagedTensor, v1.x DLManagedTensorVersioned) ----

kDLCPU, kDLCUDA = 1, 2
kDLFloat, kDLBfloat = 2, 4
DLPACK_FLAG_BITMASK_READ_ONLY = 1 << 0


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class DLManagedTensor(ctypes.Structure):
    pass


DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)  # void (*)(DLManagedTensor*) / (DLManagedTensorVersioned*)
DLManagedTensor._fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", DELETER)]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("version", DLPackVersion), ("manager_ctx", ctypes.c_void_p), ("deleter", DELETER),
                ("flags", ctypes.c_uint64), ("dl_tensor", DLTensor)]


# name: (itemsize, DLPack type code, CUDA Array Interface typestr or None)
DTYPES = {"float32": (4, kDLFloat, "<f4"), "float16": (2, kDLFloat, "<f2"), "bfloat16": (2, kDLBfloat, None)}
_DTYPE_ALIASES = {"fp32": "float32", "f4": "float32", "<f4": "float32", "fp16": "float16", "f2": "float16",
                  "<f2": "float16", "half": "float16", "bf16": "bfloat16"}

# ---- the registry: what each live DLManagedTensor keeps alive, by manager_ctx id ----

_registry = {}          # id -> (managed struct, shape/strides array, DeviceArray (holds the owner))
_ids = itertools.count(1)
_lock = threading.Lock()


def live_exports():
    """How many exported DLManagedTensors have not been deleted yet (for tests and leak checks)."""
    return len(_registry)


def _make_deleter(struct):
    """The deleter of a `struct` (DLManagedTensor or DLManagedTensorVersioned): reads its manager_ctx id and
    drops what the registry kept alive for it. Runs on the consumer's thread (ctypes takes the GIL)."""
    offset = struct.manager_ctx.offset

    def deleter(addr):
        pending = _take_pending_error()
        try:
            if addr:
                key = ctypes.c_void_p.from_address(addr + offset).value
                with _lock:
                    _registry.pop(key, None)
        except Exception:  # never let an exception escape into C; at interpreter teardown globals may be gone
            pass
        _report(pending)
    return deleter


# A private handle on the Python C API: ctypes.pythonapi's function objects are shared by every module, and
# another one changing their argtypes must not change how our capsule destructor calls them.
_api = ctypes.PyDLL(ctypes.pythonapi._name, handle=ctypes.pythonapi._handle)
_api.PyCapsule_New.restype = ctypes.py_object
_api.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_api.PyCapsule_IsValid.restype = ctypes.c_int
_api.PyCapsule_IsValid.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_api.PyCapsule_GetPointer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_api.PyErr_Occurred.restype = ctypes.c_void_p
_api.PyErr_Occurred.argtypes = []


def _take_pending_error():
    """The exception a consumer had set when it called into a callback of ours, cleared, or None.

    A consumer that fails may drop the capsule (or call the deleter) with its exception still set. A ctypes
    callback cannot keep that exception set: CPython turns a Python call that returns with an exception
    set into SystemError and ctypes then prints and clears it. So the callback takes it first (ctypes
    raises the set exception after any pythonapi call) and reports it on stderr; the consumer's call then
    fails with SystemError ("returned NULL without setting an exception")."""
    try:
        _api.PyErr_Occurred()
    except BaseException as e:
        return e
    return None


def _report(pending):
    if pending is not None:
        try:
            import sys
            sys.stderr.write(f"fsdp.dlpack: the DLPack consumer failed: {type(pending).__name__}: {pending}\n")
        except Exception:
            pass

# PyCapsule_New stores the name pointer (no copy), so the names must outlive every capsule: they are
# ctypes buffers given an extra reference that is never dropped (also at interpreter exit).
_NAME_LEGACY = ctypes.create_string_buffer(b"dltensor")
_NAME_VERSIONED = ctypes.create_string_buffer(b"dltensor_versioned")

_CAPSULE_DESTRUCTOR = ctypes.CFUNCTYPE(None, ctypes.c_void_p)  # PyObject* as a plain pointer: no refcounting


def _capsule_destructor(cap):
    """Runs when a capsule is collected. A consumer renames the capsule it took ("used_dltensor...") and
    owns the tensor from then on; only a capsule still named "dltensor"/"dltensor_versioned" (never
    consumed) deletes its tensor here."""
    pending = _take_pending_error()
    try:
        for name in (_NAME_LEGACY, _NAME_VERSIONED):
            if _api.PyCapsule_IsValid(cap, name):
                p = _api.PyCapsule_GetPointer(cap, name)
                if p:
                    struct = DLManagedTensor if name is _NAME_LEGACY else DLManagedTensorVersioned
                    mt = ctypes.cast(p, ctypes.POINTER(struct)).contents
                    if mt.deleter:
                        mt.deleter(p)  # the tensor's own deleter
                break
    except Exception:
        pass
    _report(pending)


_DELETER_LEGACY = DELETER(_make_deleter(DLManagedTensor))
_DELETER_VERSIONED = DELETER(_make_deleter(DLManagedTensorVersioned))
_DESTRUCTOR_FN = _CAPSULE_DESTRUCTOR(_capsule_destructor)
# The callbacks and names must never be freed while a capsule or an imported tensor may still call them
# (a consumer can free its tensor during interpreter teardown, after this module's globals are cleared).
for _o in (_DELETER_LEGACY, _DELETER_VERSIONED, _DESTRUCTOR_FN, _NAME_LEGACY, _NAME_VERSIONED):
    _api.Py_IncRef.argtypes = [ctypes.py_object]
    _api.Py_IncRef(_o)
del _o

# ---- DeviceArray ----

_BF16_HINT = ("bfloat16 has no typestr in the CUDA Array Interface (its typestrs are numpy's, and numpy has no "
              "bfloat16): import it with from_dlpack instead: torch.from_dlpack(a), cupy.from_dlpack(a), "
              "jax.dlpack.from_dlpack(a)")


def stream_ordered(producer, consumer):
    """Whether work queued on stream `consumer` already runs after the work queued on stream `producer`, so
    that __dlpack__ needs no event (CUDA Array Interface stream values: None no stream, -1 the consumer
    synchronizes itself, 1 legacy default, 2 per-thread default, else a cudaStream_t). The legacy and the
    per-thread default stream synchronize with each other (CUDA's stream semantics); any other pair of
    distinct streams needs an event, as a non-blocking stream is ordered with nothing."""
    if producer is None or consumer == -1 or consumer == producer:
        return True
    return producer in (1, 2) and consumer in (1, 2)


def _dtype_name(dtype):
    s = getattr(dtype, "name", None) or getattr(dtype, "__name__", None) or str(dtype)
    s = _DTYPE_ALIASES.get(s, s)
    if s not in DTYPES:
        raise ValueError(f"DeviceArray: dtype {dtype!r} is not one of float32, float16, bfloat16")
    return s


class DeviceArray:
    """A row-major array at `ptr` that libfsdp owns, exported without a copy.

    DeviceArray(ptr, shape, dtype, device="cpu"|"cuda", device_id=0, stream=None, owner=None, readonly=False)

    dtype: "float32", "float16" or "bfloat16" (or numpy float32/float16). stream (CUDA only) is the
    stream the producer's work on the buffer was queued on, in __cuda_array_interface__ terms: None (no
    synchronization needed), 1 (legacy default stream), 2 (per-thread default stream) or a cudaStream_t
    as an int; 0 is refused (ambiguous, as in the spec). owner is kept alive by the array and by every
    capsule exported from it. sync(producer_stream, consumer_stream), optional, makes the consumer's
    stream wait for the producer's (an event record + wait, e.g. functools.partial(fsdp.cudart.stream_wait,
    device_id=N); Unit.param_array and grad_array give that one); without it, __dlpack__ on CUDA refuses a
    consumer stream that is not already ordered after the producer's (stream_ordered).
    """

    def __init__(self, ptr, shape, dtype, device="cpu", device_id=0, stream=None, owner=None, readonly=False,
                 sync=None):
        self.ptr = int(ptr or 0)
        self.shape = tuple(int(d) for d in shape)
        if any(d < 0 for d in self.shape):
            raise ValueError(f"DeviceArray: negative dimension in shape {self.shape}")
        self.dtype = _dtype_name(dtype)
        if device not in ("cpu", "cuda"):
            raise ValueError(f"DeviceArray: device must be 'cpu' or 'cuda', not {device!r}")
        self.device, self.device_id = device, int(device_id)
        if stream is not None:
            stream = int(stream)
            if stream == 0:
                raise ValueError("DeviceArray: stream 0 is ambiguous (CUDA Array Interface v3); use 1 for the "
                                 "legacy default stream, 2 for the per-thread default stream, or None")
            if device != "cuda":
                raise ValueError("DeviceArray: a stream is only meaningful for device='cuda'")
        self.stream, self.owner, self.readonly, self._sync = stream, owner, bool(readonly), sync

    @property
    def itemsize(self):
        return DTYPES[self.dtype][0]

    @property
    def ndim(self):
        return len(self.shape)

    @property
    def size(self):
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self):
        return self.size * self.itemsize

    def __repr__(self):
        dev = f"{self.device}:{self.device_id}" if self.device == "cuda" else "cpu"
        return (f"DeviceArray(shape={self.shape}, dtype={self.dtype}, device={dev}, ptr=0x{self.ptr:x}"
                f"{', readonly' if self.readonly else ''})")

    # ---- CUDA Array Interface v3 ----
    @property
    def __cuda_array_interface__(self):
        if self.device != "cuda":
            raise AttributeError("__cuda_array_interface__: this DeviceArray is in CPU memory; use __dlpack__ "
                                 "(numpy.from_dlpack)")
        typestr = DTYPES[self.dtype][2]
        if typestr is None:
            raise AttributeError(_BF16_HINT)
        return {"shape": self.shape, "typestr": typestr, "data": (self.ptr if self.size else 0, self.readonly),
                "version": 3, "strides": None, "stream": self.stream}

    # ---- numpy's conversion, which cupy.asarray falls back to without __cuda_array_interface__ ----
    def __array__(self, dtype=None, copy=None):
        """On the CPU, the zero-copy numpy view (np.from_dlpack), converted when dtype asks. GPU memory is
        refused with a TypeError that names from_dlpack: numpy cannot read it, and cupy.asarray would
        otherwise fail on bfloat16 with "Unsupported dtype object"."""
        if self.device == "cuda":
            raise TypeError(f"DeviceArray: this {self.dtype} array is GPU memory (cuda:{self.device_id}), which numpy "
                            f"cannot read; " + (_BF16_HINT if self.dtype == "bfloat16" else
                                                "import it with from_dlpack (torch.from_dlpack(a), "
                                                "cupy.from_dlpack(a), jax.dlpack.from_dlpack(a)) or cupy.asarray(a)"))
        if self.dtype == "bfloat16":
            raise TypeError("DeviceArray: numpy has no bfloat16; Unit.param(i)/grad(i) give the raw uint16 bits")
        import numpy as np
        a = np.from_dlpack(self)
        if dtype is not None and np.dtype(dtype) != a.dtype:
            if copy is False:
                raise ValueError(f"DeviceArray: a {a.dtype} array cannot become {np.dtype(dtype)} without a copy")
            return a.astype(dtype)
        return a.copy() if copy else a

    # ---- DLPack ----
    def __dlpack_device__(self):
        return (kDLCUDA if self.device == "cuda" else kDLCPU, self.device_id if self.device == "cuda" else 0)

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        """A PyCapsule for one consumer. max_version >= (1, 0) gives a "dltensor_versioned" capsule (read-only
        flag set for params), otherwise a legacy "dltensor" capsule (DLPack v0.8 ABI)."""
        if copy:
            raise BufferError("DeviceArray.__dlpack__: copy=True is not supported (this is a zero-copy export)")
        if dl_device is not None and tuple(dl_device) != self.__dlpack_device__():
            raise BufferError(f"DeviceArray.__dlpack__: cannot export to device {tuple(dl_device)}; the data is on "
                              f"{self.__dlpack_device__()}")
        if self.device == "cuda":
            self._sync_for(stream)
        versioned = max_version is not None and int(max_version[0]) >= 1
        return self._capsule(versioned)

    def _sync_for(self, stream):
        consumer = 1 if stream is None else int(stream)  # None: the consumer uses the legacy default stream
        if consumer == 0:
            raise ValueError("DeviceArray.__dlpack__: stream 0 is disallowed (use 1, 2 or a stream handle)")
        producer = self.stream
        if stream_ordered(producer, consumer):
            return
        if self._sync is None:
            raise BufferError(f"DeviceArray.__dlpack__: the data is ready on stream {producer} but the consumer "
                              f"uses stream {consumer}, and no cross-stream sync is available; consume on the same "
                              f"stream or pass stream=-1 after synchronizing yourself")
        self._sync(producer, consumer)

    def _capsule(self, versioned):
        n = self.ndim
        dims = (ctypes.c_int64 * max(2 * n, 1))()
        stride = 1
        for k in range(n - 1, -1, -1):  # compact row-major, strides in elements
            dims[k], dims[n + k] = self.shape[k], stride
            stride *= self.shape[k]
        mt = DLManagedTensorVersioned() if versioned else DLManagedTensor()
        t = mt.dl_tensor
        t.data = self.ptr or None
        t.device = DLDevice(*self.__dlpack_device__())
        t.ndim = n
        size, code, _ = DTYPES[self.dtype]
        t.dtype = DLDataType(code, 8 * size, 1)
        t.shape = ctypes.cast(dims, ctypes.POINTER(ctypes.c_int64))
        t.strides = ctypes.cast(ctypes.byref(dims, n * 8), ctypes.POINTER(ctypes.c_int64))
        t.byte_offset = 0
        key = next(_ids)
        mt.manager_ctx = key
        mt.deleter = _DELETER_VERSIONED if versioned else _DELETER_LEGACY
        if versioned:
            mt.version = DLPackVersion(1, 0)
            mt.flags = DLPACK_FLAG_BITMASK_READ_ONLY if self.readonly else 0
        addr = ctypes.addressof(mt)
        with _lock:
            _registry[key] = (mt, dims, self)
        name = _NAME_VERSIONED if versioned else _NAME_LEGACY
        try:
            return _api.PyCapsule_New(addr, name, ctypes.cast(_DESTRUCTOR_FN, ctypes.c_void_p))
        except BaseException:
            with _lock:
                _registry.pop(key, None)
            raise
