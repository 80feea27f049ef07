# fsdp - Python binding of libfsdp (ctypes + numpy): ZeRO-3/FSDP training of numpy models.
"""Drive libfsdp from Python. See bindings/python/README.md."""
import ctypes as _ctypes

from ._lib import (LIB_PATH, FsdpError, InvalidArgument, InvalidState, Unsupported, OutOfMemory, Timeout,
                   Mismatch, CommError, Corrupt, FsdpIOError, Internal)
from ._lib import LIB as _LIB, LOG_FN as _LOG_FN, check as _check
from .core import Config, Context, Unit, LocalGroup, MemoryStats, CommStats, local_group, launcher_world, bf16_to_f32, f32_to_bf16
from .ranks import run_ranks
from .dlpack import DeviceArray
from . import cudart  # the CUDA runtime through ctypes: DLPack's cross-stream sync
from .wrap import wrap, Wrapped, group_params

__version__ = "0.1.0"

LOG_ERROR, LOG_WARN, LOG_INFO, LOG_DEBUG = 0, 1, 2, 3


def version():
    """FSDP_VERSION_NUMBER of the loaded library (MAJOR*10000 + MINOR*100 + PATCH)."""
    return _LIB.fsdp_version()


def build_info():
    return _LIB.fsdp_build_info().decode()


def comm_id_create():
    """A new id for comm=nccl processes that the host starts itself: call on one process, pass the text to
    every process, and give each Config(comm="nccl", comm_id=<text>, world_size=N) and its rank
    (docs/launching.md). Unsupported in a build without NCCL."""
    buf = _ctypes.create_string_buffer(257)
    _check(_LIB.fsdp_comm_id_create(buf, 257), "fsdp_comm_id_create")
    return buf.value.decode()


def set_log_level(level):
    _check(_LIB.fsdp_log_set_level(int(level)), "fsdp_log_set_level")


_log_cb = None  # keeps the ctypes callback alive


def set_log_callback(fn):
    """fn(level, rank, message) receives every enabled message (from any thread); None restores stderr."""
    global _log_cb
    if fn is None:
        _check(_LIB.fsdp_log_set_callback(_LOG_FN(), None), "fsdp_log_set_callback")
        _log_cb = None
        return
    cb = _LOG_FN(lambda level, rank, msg, user: fn(level, rank, msg.decode(errors="replace")))
    _check(_LIB.fsdp_log_set_callback(cb, None), "fsdp_log_set_callback")
    _log_cb = cb
