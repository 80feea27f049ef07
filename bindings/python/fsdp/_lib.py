# _lib.py - loads libfsdp with ctypes, declares its C prototypes and maps status codes to exceptions.
import ctypes
import ctypes.util
import os

c_int, c_size_t, c_double, c_char_p, c_void_p = ctypes.c_int, ctypes.c_size_t, ctypes.c_double, ctypes.c_char_p, ctypes.c_void_p
P = ctypes.POINTER

LOG_FN = ctypes.CFUNCTYPE(None, c_int, c_int, c_char_p, c_void_p)


class MemoryStatsC(ctypes.Structure):
    _fields_ = [(n, c_size_t) for n in (
        "struct_size", "sharded_params_nbytes", "sharded_grads_nbytes", "optimizer_state_nbytes",
        "gathered_params_nbytes", "gathered_params_peak_nbytes", "unsharded_grads_nbytes",
        "unsharded_grads_peak_nbytes", "total_nbytes", "total_peak_nbytes", "device_nbytes",
        "device_peak_nbytes", "host_nbytes", "host_peak_nbytes", "free_slots_nbytes",
        "secondary_params_nbytes", "secondary_params_peak_nbytes")]


class CommStatsC(ctypes.Structure):
    _fields_ = [("struct_size", c_size_t)] + [(n, ctypes.c_uint64) for n in (
        "all_gather_calls", "all_gather_nbytes", "reduce_scatter_calls", "reduce_scatter_nbytes",
        "all_reduce_calls", "all_reduce_nbytes", "broadcast_calls", "broadcast_nbytes", "control_calls", "host_waits",
        "all_to_all_calls", "all_to_all_nbytes", "world_group_nbytes", "shard_group_nbytes",
        "replica_group_nbytes", "secondary_group_nbytes")]


# name: (restype, argtypes); restype None means fsdp_status_t (c_int).
_PROTOTYPES = {
    "fsdp_status_name": (c_char_p, [c_int]),
    "fsdp_last_error": (c_char_p, []),
    "fsdp_log_set_level": (None, [c_int]),
    "fsdp_log_set_callback": (None, [LOG_FN, c_void_p]),
    "fsdp_version": (c_int, []),
    "fsdp_build_info": (c_char_p, []),
    "fsdp_launcher": (None, [P(c_int), P(c_int), P(c_int), P(c_int)]),
    "fsdp_comm_id_create": (None, [c_char_p, c_size_t]),
    "fsdp_config_create": (None, [P(c_void_p)]),
    "fsdp_config_destroy": (type(None), [c_void_p]),
    "fsdp_config_set": (None, [c_void_p, c_char_p, c_char_p]),
    "fsdp_config_get": (None, [c_void_p, c_char_p, c_char_p, c_size_t, P(c_size_t)]),
    "fsdp_config_from_env": (None, [c_void_p]),
    "fsdp_local_group_create": (None, [c_int, P(c_void_p)]),
    "fsdp_local_group_destroy": (type(None), [c_void_p]),
    "fsdp_local_group_abort": (None, [c_void_p, c_char_p]),
    "fsdp_ctx_create": (None, [c_void_p, c_void_p, c_int, P(c_void_p)]),
    "fsdp_ctx_finalize": (None, [c_void_p]),
    "fsdp_ctx_destroy": (type(None), [c_void_p]),
    "fsdp_ctx_rank": (None, [c_void_p, P(c_int)]),
    "fsdp_ctx_world_size": (None, [c_void_p, P(c_int)]),
    "fsdp_ctx_param_dtype": (None, [c_void_p, P(c_int)]),
    "fsdp_ctx_async_error": (None, [c_void_p]),
    "fsdp_unit_register": (None, [c_void_p, c_char_p, c_size_t, P(c_char_p), P(ctypes.c_int32),
                                  P(ctypes.c_int64), P(c_void_p)]),
    "fsdp_clip_grad_norm": (None, [c_void_p, c_void_p, c_double, P(c_double)]),
    "fsdp_unit_register_trainable": (None, [c_void_p, c_char_p, c_size_t, P(c_char_p), P(ctypes.c_int32),
                                            P(ctypes.c_int64), P(ctypes.c_int32), P(c_void_p)]),
    "fsdp_param_set_values": (None, [c_void_p, c_size_t, c_void_p, c_size_t]),
    "fsdp_param_set_weight_decay": (None, [c_void_p, c_size_t, c_double]),
    "fsdp_unit_set_trainable": (None, [c_void_p, c_void_p, c_int]),
    "fsdp_unit_trainable": (None, [c_void_p, P(c_int)]),
    "fsdp_param_set_trainable": (None, [c_void_p, c_void_p, c_size_t, c_int]),
    "fsdp_param_trainable": (None, [c_void_p, c_size_t, P(c_int)]),
    "fsdp_set_param_group": (None, [c_void_p, c_char_p, c_char_p, P(c_size_t)]),
    "fsdp_step_begin": (None, [c_void_p, c_void_p, P(c_int), P(ctypes.c_float)]),
    "fsdp_step_end": (None, [c_void_p, c_void_p]),
    "fsdp_shard_tensors": (None, [c_void_p, c_void_p, P(c_void_p), P(c_void_p), P(c_void_p), c_size_t,
                                  P(c_size_t)]),
    "fsdp_forward_begin": (None, [c_void_p, c_void_p]),
    "fsdp_forward_end": (None, [c_void_p, c_void_p]),
    "fsdp_backward_begin": (None, [c_void_p, c_void_p]),
    "fsdp_backward_end": (None, [c_void_p, c_void_p]),
    "fsdp_param_ptr": (None, [c_void_p, c_size_t, P(c_void_p)]),
    "fsdp_grad_ptr": (None, [c_void_p, c_size_t, P(c_void_p)]),
    "fsdp_grad_accumulate": (None, [c_void_p, c_size_t, c_void_p, ctypes.c_int, c_size_t, c_void_p]),
    "fsdp_step": (None, [c_void_p, c_void_p]),
    "fsdp_set_grad_sync": (None, [c_void_p, c_int]),
    "fsdp_set_lr": (None, [c_void_p, c_double]),
    "fsdp_loss_scale": (None, [c_void_p, P(c_double), P(ctypes.c_uint64)]),
    "fsdp_loss_scale_device": (None, [c_void_p, P(P(c_double))]),
    "fsdp_last_grad_norm": (None, [c_void_p, P(c_double)]),
    "fsdp_ctx_step": (None, [c_void_p, P(ctypes.c_uint64)]),
    "fsdp_metrics_reduce": (None, [c_void_p, P(c_double), c_size_t, c_int]),
    "fsdp_gather_param": (None, [c_void_p, c_size_t, c_void_p, c_size_t]),
    "fsdp_gather_grad": (None, [c_void_p, c_size_t, c_void_p, c_size_t]),
    "fsdp_shard_info": (None, [c_void_p, P(c_void_p), P(c_size_t), P(c_size_t)]),
    "fsdp_param_flat_range": (None, [c_void_p, c_size_t, P(c_size_t), P(c_size_t)]),
    "fsdp_save": (None, [c_void_p, c_char_p, c_char_p]),
    "fsdp_load": (None, [c_void_p, c_char_p]),
    "fsdp_load_partial": (None, [c_void_p, c_char_p]),
    "fsdp_load_pretrained": (None, [c_void_p, c_char_p, c_char_p]),
    "fsdp_export": (None, [c_void_p, c_char_p, c_char_p]),
    "fsdp_save_async": (None, [c_void_p, c_char_p]),
    "fsdp_save_wait": (None, [c_void_p]),
    "fsdp_snapshot": (None, [c_void_p, c_char_p]),
    "fsdp_restore": (None, [c_void_p, c_char_p, c_char_p, P(c_int)]),
    "fsdp_load_report": (None, [c_void_p, c_char_p, c_size_t, P(c_size_t)]),
    "fsdp_memory_stats": (None, [c_void_p, P(MemoryStatsC)]),
    "fsdp_memory_stats_reset_peak": (None, [c_void_p]),
    "fsdp_comm_stats": (None, [c_void_p, P(CommStatsC)]),
    "fsdp_comm_stats_reset": (None, [c_void_p]),
    "fsdp_trace_begin": (None, [c_void_p]),
    "fsdp_trace_write": (None, [c_void_p, c_char_p]),
}


def _candidates():
    """(path, explicit) pairs in the order they are tried."""
    env = os.environ.get("FSDP_LIBRARY")
    if env:
        return [(env, True)]
    here = os.path.dirname(os.path.abspath(__file__))
    out = [(os.path.join(here, n), False) for n in ("libfsdp.so", "libfsdp.so.0", "libfsdp.dylib")]
    found = ctypes.util.find_library("fsdp")
    if found:
        out.append((found, False))
    out.append(("libfsdp.so.0", False))
    return out


def load():
    tried = []
    for path, explicit in _candidates():
        if os.sep in path and not os.path.exists(path) and not explicit:
            tried.append(f"{path} (no such file)")
            continue
        try:
            lib = ctypes.CDLL(path)
        except OSError as e:
            tried.append(f"{path} ({e})")
            if explicit:
                break
            continue
        if not hasattr(lib, "fsdp_version"):
            tried.append(f"{path} (loaded, but it is not libfsdp: no fsdp_version)")
            if explicit:
                break
            continue
        for name, (res, args) in _PROTOTYPES.items():
            if not hasattr(lib, name):  # an older libfsdp (FSDP_LIBRARY): fail when the call is used
                setattr(lib, name, _missing(name, path))
                continue
            f = getattr(lib, name)
            f.restype = c_int if res is None else (None if res is type(None) else res)
            f.argtypes = args
        return lib, path
    raise ImportError("fsdp: could not load libfsdp; tried: " + "; ".join(tried) +
                      ". `pip install ./bindings/python` (in a libfsdp checkout) builds it into the package; "
                      "FSDP_LIBRARY=/path/to/libfsdp.so uses one built elsewhere.")


def _missing(name, path):
    def call(*args):
        raise Unsupported(3, f"{name} is not in the libfsdp loaded from {path}: that library is older than this "
                             f"binding; rebuild it, or unset FSDP_LIBRARY to use the one inside the package")
    return call


LIB, LIB_PATH = load()

# ---- errors ---------------------------------------------------------------


class FsdpError(Exception):
    """A libfsdp call failed: .status (int), .status_name and .message (fsdp_last_error())."""
    status = None

    def __init__(self, status, message, call=""):
        self.status = status
        self.message = message
        self.call = call
        self.status_name = _status_name(status)
        super().__init__(f"{self.status_name}: {message}" if message else self.status_name)


class InvalidArgument(FsdpError, ValueError): pass
class InvalidState(FsdpError): pass
class Unsupported(FsdpError): pass
class OutOfMemory(FsdpError, MemoryError): pass
class Timeout(FsdpError, TimeoutError): pass
class Mismatch(FsdpError): pass
class CommError(FsdpError): pass
class Corrupt(FsdpError): pass
class FsdpIOError(FsdpError): pass
class Internal(FsdpError): pass


_CLASSES = {1: InvalidArgument, 2: InvalidState, 3: Unsupported, 4: OutOfMemory, 5: Timeout, 6: Mismatch,
            7: CommError, 8: Corrupt, 9: FsdpIOError, 10: Internal}


def _status_name(status):
    try:
        return LIB.fsdp_status_name(status).decode()
    except Exception:  # interpreter teardown
        return f"status {status}"


def check(status, call=""):
    """Raises the FsdpError subclass for a failed status, with this thread's fsdp_last_error()."""
    if status != 0:
        msg = LIB.fsdp_last_error().decode(errors="replace")
        raise _CLASSES.get(status, FsdpError)(status, msg, call)
