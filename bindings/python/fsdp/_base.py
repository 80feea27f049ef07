# _base.py - what core.py and unit.py share: dtype tables, bf16 conversions, the stream argument
# (stream_handle) and small helpers. Re-exported by core.py, where callers found them before.
import ctypes
import operator

import numpy as np

from ._lib import InvalidArgument, InvalidState

_DTYPES = {0: ("fp32", np.float32, ctypes.c_float), 1: ("bf16", np.uint16, ctypes.c_uint16),
           2: ("fp16", np.float16, ctypes.c_uint16)}
_ARRAY_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # DeviceArray dtype names
_REDUCE_OPS = {"sum": 0, "avg": 1, "max": 2, "min": 3}  # fsdp_reduce_op_t
_RESTORE_SOURCES = {0: "nothing", 1: "snapshot", 2: "checkpoint"}  # fsdp_restore_source_t


def bf16_to_f32(bits):
    """float32 values of bf16 raw bits (a uint16 array)."""
    return (np.asarray(bits, np.uint16).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(values):
    """bf16 raw bits (uint16) of float32 values, rounded to nearest even (nan stays nan)."""
    u = np.ascontiguousarray(values, np.float32).view(np.uint32)
    r = ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    return np.where(np.isnan(np.asarray(values, np.float32)), np.uint16(0x7FC0), r)


def _closed(what):
    return InvalidState(2, f"{what} is closed (close() was called); create a new one")


def _value_str(v):
    if isinstance(v, bool):
        return "1" if v else "0"
    return str(v)


def stream_handle(stream):
    """The cudaStream_t (an int, 0 for NULL) that `stream` stands for, or None for None. Takes an int
    (1 and 2 are the legacy and per-thread default streams), an object with __cuda_stream__ (the CUDA
    stream protocol: returns (0, handle)), a torch.cuda.Stream (.cuda_stream) or a cupy.cuda.Stream (.ptr);
    anything else raises TypeError."""
    if stream is None:
        return None
    if isinstance(stream, bool):
        raise TypeError(f"stream={stream!r}: a bool is not a stream")
    protocol = getattr(type(stream), "__cuda_stream__", None)
    if protocol is not None:
        got = stream.__cuda_stream__() if callable(protocol) else stream.__cuda_stream__
        if not (isinstance(got, tuple) and len(got) == 2):
            raise TypeError(f"stream={stream!r}: __cuda_stream__ returned {got!r}, not (version, handle)")
        if got[0] != 0:
            raise TypeError(f"stream={stream!r}: __cuda_stream__ version {got[0]!r} is not one this binding knows (0)")
        handle = got[1]
    elif hasattr(stream, "cuda_stream"):  # torch.cuda.Stream, torch.cuda.ExternalStream
        handle = stream.cuda_stream
    elif hasattr(stream, "ptr") and any(c.__name__.endswith("Stream") for c in type(stream).__mro__):
        handle = stream.ptr  # cupy.cuda.Stream, cupy.cuda.ExternalStream (not any object with a .ptr)
    else:
        handle = stream
    try:
        value = operator.index(handle)
    except TypeError:
        raise TypeError(f"stream={stream!r}: expected a cudaStream_t as an int, an object with __cuda_stream__, a "
                        f"torch.cuda.Stream or a cupy.cuda.Stream, or None (the legacy default stream)") from None
    if value < 0:
        raise InvalidArgument(1, f"stream={stream!r}: a cudaStream_t is not negative")
    return value
