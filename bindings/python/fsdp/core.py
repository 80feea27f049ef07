# core.py - Config, LocalGroup, Context and Unit: thin Python objects over the libfsdp C handles.
import contextlib
import ctypes
import dataclasses
import functools
import operator
import os

import numpy as np

from . import _lib
from ._lib import LIB, check, InvalidState, InvalidArgument, Unsupported
from . import cudart
from ._sources import grad_source
from .dlpack import DeviceArray

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


def launcher_world():
    """(rank, size) from an mpirun launcher's environment, or None when not started by one."""
    size = os.environ.get("OMPI_COMM_WORLD_SIZE") or os.environ.get("PMI_SIZE")
    if not size:
        return None
    rank = os.environ.get("OMPI_COMM_WORLD_RANK") or os.environ.get("PMI_RANK") or "0"
    return int(rank), int(size)


class _Handle:
    """An owned library handle: close() frees it once (idempotent), also from `with` and __del__. A
    subclass sets self._h and self._destroy (kept on the object so that __del__ works during
    interpreter teardown, after the module's globals are gone)."""

    _h = None

    def _handle(self):
        if not self._h:
            raise _closed(type(self).__name__)
        return self._h

    def close(self):
        """Local: frees the handle. Idempotent."""
        h, self._h = self._h, None
        if h:
            self._destroy(h)

    @property
    def closed(self):
        return not self._h

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class Config(_Handle):
    """Key/value options (docs/configuration.md). Config(sharding="FULL_SHARD", lr=1e-3, ...)."""

    def __init__(self, _from_env=False, **options):
        h = ctypes.c_void_p()
        check(LIB.fsdp_config_create(ctypes.byref(h)), "fsdp_config_create")
        self._h = h.value
        self._destroy = LIB.fsdp_config_destroy  # kept so __del__ works during interpreter teardown
        if _from_env:
            self.from_env()
        for k, v in options.items():
            self.set(k, v)

    def set(self, key, value):
        check(LIB.fsdp_config_set(self._handle(), str(key).encode(), _value_str(value).encode()), "fsdp_config_set")
        return self

    def get(self, key):
        n = ctypes.c_size_t()
        buf = ctypes.create_string_buffer(256)
        st = LIB.fsdp_config_get(self._handle(), str(key).encode(), buf, 256, ctypes.byref(n))
        if st == 1 and n.value >= 256:
            buf = ctypes.create_string_buffer(n.value + 1)
            st = LIB.fsdp_config_get(self._handle(), str(key).encode(), buf, n.value + 1, ctypes.byref(n))
        check(st, "fsdp_config_get")
        return buf.value.decode()

    def from_env(self):
        check(LIB.fsdp_config_from_env(self._handle()), "fsdp_config_from_env")
        return self

class LocalGroup(_Handle):
    """fsdp_local_group_t: `world_size` ranks that are threads of this process."""

    def __init__(self, world_size):
        h = ctypes.c_void_p()
        check(LIB.fsdp_local_group_create(int(world_size), ctypes.byref(h)), "fsdp_local_group_create")
        self._h = h.value
        self.world_size = int(world_size)
        self._destroy = LIB.fsdp_local_group_destroy

    # close() is safe while contexts still use the group: its memory lives until the last one is destroyed.

    def abort(self, reason=None):
        """Local, callable from any thread: every collective of every context on the group, in progress
        or to come, fails at once with CommError carrying `reason`, and no new Context can join. For
        when one thread-rank fails and the others must not wait out timeout_s; run_ranks does it."""
        check(LIB.fsdp_local_group_abort(self._handle(), None if reason is None else str(reason).encode()),
              "fsdp_local_group_abort")


def local_group(n):
    """A LocalGroup of n thread-ranks, usable as a context manager."""
    return LocalGroup(n)


@dataclasses.dataclass
class MemoryStats:
    """fsdp_memory_stats_t: bytes this rank holds, by category and by pool."""
    sharded_params_nbytes: int
    sharded_grads_nbytes: int
    optimizer_state_nbytes: int
    gathered_params_nbytes: int
    gathered_params_peak_nbytes: int
    unsharded_grads_nbytes: int
    unsharded_grads_peak_nbytes: int
    total_nbytes: int
    total_peak_nbytes: int
    device_nbytes: int
    device_peak_nbytes: int
    host_nbytes: int
    host_peak_nbytes: int
    free_slots_nbytes: int
    secondary_params_nbytes: int  # secondary_shard's kept slices
    secondary_params_peak_nbytes: int


@dataclasses.dataclass
class CommStats:
    """fsdp_comm_stats_t: what this rank's collectives moved (calls, and bytes of each collective's data),
    and host_waits: the times a call of this context blocked the calling thread on queued work (0 for a
    steady-state step)."""
    all_gather_calls: int
    all_gather_nbytes: int
    reduce_scatter_calls: int
    reduce_scatter_nbytes: int
    all_reduce_calls: int
    all_reduce_nbytes: int
    broadcast_calls: int
    broadcast_nbytes: int
    control_calls: int
    host_waits: int
    all_to_all_calls: int  # the quantized grad reduction (reduce_dtype=int8 or fp8_e4m3)
    all_to_all_nbytes: int
    world_group_nbytes: int  # the bytes above by the group they ran over
    shard_group_nbytes: int
    replica_group_nbytes: int
    secondary_group_nbytes: int


class Context(_Handle):
    """One rank's view of the job. Context(config, group=None, rank=None).

    rank None: the group's rank must then be given explicitly; without a group it is 0, or -1 (the
    launcher's rank) when the process was started by mpirun."""

    def __init__(self, config=None, group=None, rank=None, **options):
        own = None
        if config is None or isinstance(config, dict):
            config = own = Config(**dict(config or {}, **options))
        elif options:
            for k, v in options.items():
                config.set(k, v)
        if rank is None:
            if group is not None:
                raise InvalidArgument(1, "Context: a group was given without its rank; pass rank=0..world_size-1")
            rank = -1 if launcher_world() is not None else 0
        h = ctypes.c_void_p()
        try:
            self.device = config.get("device")
            self._host_state = int(config.get("host_state"))  # optimizer=host: Unit.shard_tensors's buffers
            self._offload = config.get("offload")
            self.optimizer = config.get("optimizer")  # "host": the shards are updated by the host (fsdp.torch)
            check(LIB.fsdp_ctx_create(config._handle(), group._handle() if group is not None else None, int(rank),
                                      ctypes.byref(h)), "fsdp_ctx_create")
        finally:
            if own is not None:
                own.close()
        self._h = h.value
        self._destroy = LIB.fsdp_ctx_destroy
        self._group = group  # keep the Python object alive as long as the context
        self.units = []
        v = ctypes.c_int()
        check(LIB.fsdp_ctx_rank(self._h, ctypes.byref(v)))
        self.rank = v.value
        check(LIB.fsdp_ctx_world_size(self._h, ctypes.byref(v)))
        self.world_size = v.value
        check(LIB.fsdp_ctx_param_dtype(self._h, ctypes.byref(v)))
        self.param_dtype, self.np_dtype, self._ctype = _DTYPES[v.value]
        kind, _, idx = self.device.partition(":")
        self.device_kind = "cuda" if kind == "cuda" else "cpu"
        self.device_id = int(idx) if idx.isdigit() else 0

    # ---- units ----
    def register_unit(self, name, params, trainable=None):
        """Collective. params: {name: shape} or [(name, shape), ...]; returns the Unit. trainable: a bool per
        param (None: all True); a False param is frozen from the start, with no grad or optimizer memory ever
        (fsdp_unit_register_trainable)."""
        items = list(params.items()) if isinstance(params, dict) else [tuple(p) for p in params]
        names = [str(n) for n, _ in items]
        shapes = [tuple(int(d) for d in (s if hasattr(s, "__len__") else (s,))) for _, s in items]
        n = len(items)
        c_names = (ctypes.c_char_p * max(n, 1))(*[s.encode() for s in names])
        c_ndims = (ctypes.c_int32 * max(n, 1))(*[len(s) for s in shapes])
        flat = [d for s in shapes for d in s]
        c_dims = (ctypes.c_int64 * max(len(flat), 1))(*flat)
        h = ctypes.c_void_p()
        if trainable is None:
            check(LIB.fsdp_unit_register(self._handle(), str(name).encode(), n, c_names, c_ndims, c_dims,
                                         ctypes.byref(h)), "fsdp_unit_register")
        else:
            flags = [1 if t else 0 for t in trainable]
            if len(flags) != n:
                raise InvalidArgument(1, f"Context.register_unit: {len(flags)} trainable flags for {n} params")
            c_flags = (ctypes.c_int32 * max(n, 1))(*flags)
            check(LIB.fsdp_unit_register_trainable(self._handle(), str(name).encode(), n, c_names, c_ndims, c_dims,
                                                   c_flags, ctypes.byref(h)), "fsdp_unit_register_trainable")
        unit = Unit(self, h.value, str(name), names, shapes)
        self.units.append(unit)
        return unit

    # ---- the step ----
    def _stream(self, stream, what):
        """The void* stream argument, as an int or None (NULL): None on CPU; on CUDA what stream_handle() makes
        of an int, a __cuda_stream__ object, a torch.cuda.Stream or a cupy.cuda.Stream."""
        if stream is None:
            return None
        if self.device_kind != "cuda":
            raise InvalidArgument(1, f"{what}: stream={stream!r} given on a {self.device} context; streams are "
                                     f"CUDA only (pass None)")
        try:
            return stream_handle(stream)
        except TypeError as e:
            raise TypeError(f"{what}: {e}") from None

    def step(self, stream=None):
        """Collective: reduce waits, unscale, clip, optimizer on this rank's shards."""
        check(LIB.fsdp_step(self._handle(), self._stream(stream, "Context.step")), "fsdp_step")

    def clip_grad_norm(self, max_norm, stream=None):
        """Collective, after the step's last backward, before step(): the grads' global L2 norm (returned; a
        host wait), and the coming step alone clips the grads to max_norm with torch's rule
        (fsdp_clip_grad_norm; the max_grad_norm option does it inside the step, without the wait)."""
        v = ctypes.c_double()
        check(LIB.fsdp_clip_grad_norm(self._handle(), self._stream(stream, "Context.clip_grad_norm"), float(max_norm),
                                      ctypes.byref(v)), "fsdp_clip_grad_norm")
        return v.value

    def step_begin(self, stream=None):
        """optimizer=host: every reduction done, the norm, the loss scaler's verdict and clipping. Returns
        (update, grad_scale): update False for a skipped step (inf/nan: change nothing), else multiply every grad
        by grad_scale in the update (Unit.shard_tensors), then call step_end."""
        update, scale = ctypes.c_int(0), ctypes.c_float(0)
        check(LIB.fsdp_step_begin(self._handle(), self._stream(stream, "Context.step_begin"), ctypes.byref(update),
                                  ctypes.byref(scale)), "fsdp_step_begin")
        return update.value == 1, scale.value

    def step_end(self, stream=None):
        """optimizer=host: after the host's update; the next gathers read it."""
        check(LIB.fsdp_step_end(self._handle(), self._stream(stream, "Context.step_end")), "fsdp_step_end")

    def set_lr(self, lr):
        check(LIB.fsdp_set_lr(self._handle(), float(lr)), "fsdp_set_lr")

    def set_param_group(self, pattern, lr_scale=None, weight_decay=None, beta1=None, beta2=None):
        """A param group (fsdp_set_param_group): every registered param whose name matches the glob `pattern`
        takes the options given (lr_scale multiplies set_lr's lr). Collective, between steps. Returns how many
        params it set."""
        items = [f"{k}={float(v)!r}" for k, v in (("lr_scale", lr_scale), ("weight_decay", weight_decay),
                                                   ("beta1", beta1), ("beta2", beta2)) if v is not None]
        matched = ctypes.c_size_t(0)
        check(LIB.fsdp_set_param_group(self._handle(), str(pattern).encode(), ";".join(items).encode(),
                                       ctypes.byref(matched)), "fsdp_set_param_group")
        return matched.value

    def set_grad_sync(self, enabled):
        check(LIB.fsdp_set_grad_sync(self._handle(), 1 if enabled else 0), "fsdp_set_grad_sync")

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside accumulate grads locally; sync is switched back on at exit."""
        self.set_grad_sync(False)
        try:
            yield self
        finally:
            if self._h:
                self.set_grad_sync(True)

    @property
    def last_grad_norm(self):
        v = ctypes.c_double()
        check(LIB.fsdp_last_grad_norm(self._handle(), ctypes.byref(v)), "fsdp_last_grad_norm")
        return v.value

    @property
    def step_count(self):
        """The optimizer's step count: steps that updated the params (skipped ones not counted), restored by
        load()."""
        v = ctypes.c_uint64()
        check(LIB.fsdp_ctx_step(self._handle(), ctypes.byref(v)), "fsdp_ctx_step")
        return v.value

    def _loss_scale(self):
        s, k = ctypes.c_double(), ctypes.c_uint64()
        check(LIB.fsdp_loss_scale(self._handle(), ctypes.byref(s), ctypes.byref(k)), "fsdp_loss_scale")
        return s.value, k.value

    @property
    def loss_scale(self):
        return self._loss_scale()[0]

    @property
    def skipped_steps(self):
        return self._loss_scale()[1]

    def loss_scale_address(self):
        """The address of the loss scale where the steps keep it (one float64; fsdp_loss_scale_device): GPU
        memory on a CUDA context, for a loss kernel to read in stream order after the last step with no host
        wait (loss_scale waits for the step), as a step captured in a CUDA graph must."""
        p = ctypes.POINTER(ctypes.c_double)()
        check(LIB.fsdp_loss_scale_device(self._handle(), ctypes.byref(p)), "fsdp_loss_scale_device")
        return ctypes.cast(p, ctypes.c_void_p).value

    def metrics_reduce(self, values, op="sum"):
        """Collective: every rank passes the same number of values and gets back, as a new float64 array of
        the same shape, their sum, mean ("avg"), maximum or minimum over the ranks, the same bits on every
        rank. For metrics (the step's mean loss, each rank's memory figures in its own slot of a
        world-sized vector summed for rank 0 to print), not tensors: at most 2^20 values."""
        code = _REDUCE_OPS.get(op) if isinstance(op, str) else None
        if code is None:
            raise InvalidArgument(1, f"metrics_reduce: op must be one of {', '.join(_REDUCE_OPS)}, not {op!r}")
        a = np.array(values, dtype=np.float64, order="C")  # a copy: the caller's array is left as it was
        check(LIB.fsdp_metrics_reduce(self._handle(), a.ctypes.data_as(ctypes.POINTER(ctypes.c_double)), a.size,
                                      code), "fsdp_metrics_reduce")
        return a

    def check_async_error(self):
        """Raises the failure a collective reported after its call returned, if any."""
        check(LIB.fsdp_ctx_async_error(self._handle()), "fsdp_ctx_async_error")

    # ---- observe ----
    def memory_stats(self):
        s = _lib.MemoryStatsC()
        s.struct_size = ctypes.sizeof(_lib.MemoryStatsC)
        check(LIB.fsdp_memory_stats(self._handle(), ctypes.byref(s)), "fsdp_memory_stats")
        return MemoryStats(**{f.name: getattr(s, f.name) for f in dataclasses.fields(MemoryStats)})

    def reset_peak_memory(self):
        check(LIB.fsdp_memory_stats_reset_peak(self._handle()), "fsdp_memory_stats_reset_peak")

    def comm_stats(self):
        s = _lib.CommStatsC()
        s.struct_size = ctypes.sizeof(_lib.CommStatsC)
        check(LIB.fsdp_comm_stats(self._handle(), ctypes.byref(s)), "fsdp_comm_stats")
        return CommStats(**{f.name: getattr(s, f.name) for f in dataclasses.fields(CommStats)})

    def reset_comm_stats(self):
        check(LIB.fsdp_comm_stats_reset(self._handle()), "fsdp_comm_stats_reset")

    def trace_begin(self):
        check(LIB.fsdp_trace_begin(self._handle()), "fsdp_trace_begin")

    def trace_write(self, path):
        check(LIB.fsdp_trace_write(self._handle(), os.fsencode(path)), "fsdp_trace_write")

    # ---- checkpoints ----
    def save(self, dir, kind="sharded"):
        """Collective. kind "sharded" (one file per rank) or "full" (model.safetensors by rank 0)."""
        check(LIB.fsdp_save(self._handle(), os.fsencode(dir), str(kind).encode()), "fsdp_save")

    def load(self, dir, strict=True):
        """Collective. Loads a checkpoint of either kind, saved at any world size and in any grouping of the
        same params into units (matched by name); all or nothing. strict=False (fsdp_load_partial): the
        params the checkpoint lacks keep their values and state, its params that are not registered are
        ignored. Returns load_report(): {"missing": [...], "unexpected": [...]}."""
        if strict:
            check(LIB.fsdp_load(self._handle(), os.fsencode(dir)), "fsdp_load")
        else:
            check(LIB.fsdp_load_partial(self._handle(), os.fsencode(dir)), "fsdp_load_partial")
        return self.load_report()

    def save_async(self, dir):
        """Collective (fsdp_save_async): save(dir, "sharded") without waiting for the file system. The state
        at the call (every step queued before it) is copied into host memory and a background thread writes
        and commits the checkpoint, as crash-safe as save(): `dir` holds the old one or the new one. Training
        may go on meanwhile. The next save_async, save, load or restore first waits for this one and, if it
        failed unreported, raises its error instead of doing anything else; save_wait() waits now."""
        check(LIB.fsdp_save_async(self._handle(), os.fsencode(dir)), "fsdp_save_async")

    def save_wait(self):
        """Local (fsdp_save_wait): waits for the last save_async to be written and committed; raises its
        error (once: a later wait returns quietly). Returns at once when none is pending. close() waits too."""
        check(LIB.fsdp_save_wait(self._handle()), "fsdp_save_wait")

    def snapshot(self, path):
        """Collective (fsdp_snapshot): copies the rank's state (what save() writes) into a snapshot under
        `path`, a directory every process of the job on this node sees, best a memory file system
        (/dev/shm/<job>): path/rank<R>/ holds two slots and a marker, and the previous snapshot stays
        restorable until the new one is whole. Not crash-safe across a reboot. restore() reads it back."""
        check(LIB.fsdp_snapshot(self._handle(), os.fsencode(path)), "fsdp_snapshot")

    def restore(self, path=None, checkpoint_dir=None):
        """Collective (fsdp_restore), for a restarted job of the same world size: restores the newest step
        that every rank's snapshot under `path` holds whole (params, optimizer state, step, lr, loss scale),
        else loads the checkpoint at `checkpoint_dir`, else changes nothing. None (or "") skips either.
        Returns what was restored: "snapshot", "checkpoint" or "nothing". A checkpoint that exists but does
        not load raises (load()'s error)."""
        source = ctypes.c_int(0)
        check(LIB.fsdp_restore(self._handle(), None if path is None else os.fsencode(path),
                               None if checkpoint_dir is None else os.fsencode(checkpoint_dir),
                               ctypes.byref(source)), "fsdp_restore")
        return _RESTORE_SOURCES.get(source.value, f"unknown ({source.value})")

    @staticmethod
    def _name_options(strip_prefix, add_prefix, rename, transpose, **more):
        """fsdp_load_pretrained's / fsdp_export's options text."""
        items = []
        if strip_prefix:
            items.append(f"strip_prefix={strip_prefix}")
        if add_prefix:
            items.append(f"add_prefix={add_prefix}")
        for src, dst in (rename or {}).items():
            items.append(f"rename={src}:{dst}")
        items += [f"transpose={g}" for g in ([transpose] if isinstance(transpose, str) else transpose)]
        items += [f"{k}={v}" for k, v in more.items() if v is not None]
        for item in items:
            if ";" in item or "\n" in item:
                raise InvalidArgument(1, f"{item!r} holds ';' or a newline, which separate options")
        return ";".join(items).encode()

    def load_pretrained(self, path, strip_prefix=None, add_prefix=None, rename=None, transpose=(), strict=True):
        """Collective (fsdp_load_pretrained). Sets the params from safetensors weights written by anything (a
        file, or a Hugging Face directory with model.safetensors or its index), by name: a file's tensor name
        loses strip_prefix, gains add_prefix, then goes through the first matching rename rule
        ({"h.{i}.attn.c_attn.weight": "blocks.{i}.qkv.weight"}, in order); `transpose` globs name the 2-D
        params stored transposed. F32/BF16/F16 become fp32 exactly; optimizer state restarts. Returns
        load_report()."""
        text = self._name_options(strip_prefix, add_prefix, rename, transpose, strict=1 if strict else 0)
        check(LIB.fsdp_load_pretrained(self._handle(), os.fsencode(path), text), "fsdp_load_pretrained")
        return self.load_report()

    def export(self, dir, strip_prefix=None, add_prefix=None, rename=None, transpose=(), dtype="fp32",
               max_shard_bytes=None):
        """Collective (fsdp_export). The params, consolidated, as safetensors files another program loads
        (transformers' from_pretrained): model.safetensors, or several files and their index past
        max_shard_bytes; dtype "fp32" or "bf16"; the naming options as load_pretrained's, applied in reverse.
        `dir` must be new or empty."""
        text = self._name_options(strip_prefix, add_prefix, rename, transpose, dtype=dtype,
                                  max_shard_bytes=max_shard_bytes)
        check(LIB.fsdp_export(self._handle(), os.fsencode(dir), text), "fsdp_export")

    def load_report(self):
        """What the last successful load left out: {"missing": registered params the checkpoint lacked,
        "unexpected": its params that are not registered}."""
        n = ctypes.c_size_t()
        LIB.fsdp_load_report(self._handle(), None, 0, ctypes.byref(n))  # the length (a NULL buffer is refused)
        buf = ctypes.create_string_buffer(n.value + 1)
        check(LIB.fsdp_load_report(self._handle(), buf, n.value + 1, ctypes.byref(n)), "fsdp_load_report")
        out = {"missing": [], "unexpected": []}
        for line in buf.value.decode().splitlines():
            kind, _, name = line.partition(": ")
            out[kind].append(name)
        return out

    # ---- lifetime ----
    def finalize(self):
        """Collective. Afterwards every call but close() raises InvalidState."""
        check(LIB.fsdp_ctx_finalize(self._handle()), "fsdp_ctx_finalize")

    # close() (from _Handle) is local: it frees the context and its units.


class Unit:
    """A registered unit: a group of params gathered and freed together. Owned by its Context."""

    def __init__(self, ctx, handle, name, names, shapes):
        self.ctx, self._h, self.name = ctx, handle, name
        self.names, self.shapes = list(names), list(shapes)
        self._index = {n: i for i, n in enumerate(self.names)}
        self._last_stream = None  # the stream of the last forward_begin/backward_begin (CUDA)
        self._flat = None  # [(offset, numel)] of each param in the flat buffer, once asked (flat_array)

    def __repr__(self):
        return f"Unit({self.name!r}, {dict(zip(self.names, self.shapes))})"

    def _handle(self):
        self.ctx._handle()  # raises if the context was closed (the unit died with it)
        return self._h

    def index(self, i_or_name):
        if isinstance(i_or_name, str):
            if i_or_name not in self._index:
                raise KeyError(f"unit {self.name!r} has no param {i_or_name!r}; it has {self.names}")
            return self._index[i_or_name]
        return int(i_or_name)

    def numel(self, i):
        i = self.index(i)
        return int(np.prod(self.shapes[i], dtype=np.int64)) if 0 <= i < len(self.shapes) else 0

    def set_values(self, i, values):
        """Sets a param from a full fp32 array (converted); this rank keeps its slice.
        values None: only with sync_module_states=1 on ranks other than 0."""
        i = self.index(i)
        if values is None:
            check(LIB.fsdp_param_set_values(self._handle(), i, None, self.numel(i)),
                  "fsdp_param_set_values")
            return
        a = np.ascontiguousarray(values, dtype=np.float32)
        check(LIB.fsdp_param_set_values(self._handle(), i, a.ctypes.data, a.size), "fsdp_param_set_values")

    def set_weight_decay(self, i, wd):
        check(LIB.fsdp_param_set_weight_decay(self._handle(), self.index(i), float(wd)),
              "fsdp_param_set_weight_decay")

    @property
    def trainable(self):
        """False once frozen (set_trainable(False)): no grads, no optimizer state, no reduction."""
        out = ctypes.c_int(1)
        check(LIB.fsdp_unit_trainable(self._handle(), ctypes.byref(out)), "fsdp_unit_trainable")
        return out.value == 1

    def set_trainable(self, trainable):
        """Freezes (False) or unfreezes (True) the unit: collective, between steps (fsdp_unit_set_trainable).
        Unfreezing gives zero grads and fresh optimizer state."""
        check(LIB.fsdp_unit_set_trainable(self.ctx._handle(), self._handle(), 1 if trainable else 0),
              "fsdp_unit_set_trainable")

    def param_trainable(self, i):
        """False once param i is frozen inside the unit (set_param_trainable(i, False))."""
        out = ctypes.c_int(1)
        check(LIB.fsdp_param_trainable(self._handle(), i, ctypes.byref(out)), "fsdp_param_trainable")
        return out.value == 1

    def set_param_trainable(self, i, trainable):
        """Freezes (False) or unfreezes (True) param i alone: collective, between steps
        (fsdp_param_set_trainable). The unit lays its frozen params out in a block of their own, with no grads,
        no optimizer state and no bytes in the reduction; params keep their values, the params that stay
        trainable keep their state, an unfrozen one starts fresh."""
        check(LIB.fsdp_param_set_trainable(self.ctx._handle(), self._handle(), i, 1 if trainable else 0),
              "fsdp_param_set_trainable")
        self._flat = None  # the unit was laid out again

    # ---- the pass ----
    # stream (CUDA only): the stream the host computes on: a cudaStream_t as an int, an object with
    # __cuda_stream__, a torch.cuda.Stream or a cupy.cuda.Stream (stream_handle); None passes NULL, the
    # legacy default stream. The stream of the last *_begin is the producer's stream of the DeviceArrays
    # (NULL is reported as 1).
    def forward_begin(self, stream=None):
        s = self.ctx._stream(stream, "Unit.forward_begin")
        check(LIB.fsdp_forward_begin(self._handle(), s), "fsdp_forward_begin")
        self._last_stream = s

    def forward_end(self, stream=None):
        check(LIB.fsdp_forward_end(self._handle(), self.ctx._stream(stream, "Unit.forward_end")), "fsdp_forward_end")

    def backward_begin(self, stream=None):
        s = self.ctx._stream(stream, "Unit.backward_begin")
        check(LIB.fsdp_backward_begin(self._handle(), s), "fsdp_backward_begin")
        self._last_stream = s

    def backward_end(self, stream=None):
        check(LIB.fsdp_backward_end(self._handle(), self.ctx._stream(stream, "Unit.backward_end")),
              "fsdp_backward_end")

    @contextlib.contextmanager
    def forward(self, stream=None):
        """forward_begin; the block; forward_end only if the block did not raise (the other ranks
        would wait in a collective for a rank that failed anyway; the error propagates unchanged)."""
        self.forward_begin(stream)
        yield self
        self.forward_end(stream)

    @contextlib.contextmanager
    def backward(self, stream=None):
        """backward_begin; the block (add grads into grad(i)); backward_end only if the block did not raise."""
        self.backward_begin(stream)
        yield self
        self.backward_end(stream)

    def _ptr(self, fn, i, what):
        i = self.index(i)
        p = ctypes.c_void_p()
        check(fn(self._handle(), i, ctypes.byref(p)), "fsdp_" + what + "_ptr")
        return i, p.value or 0

    def _array(self, fn, i, what, readonly):
        i, p = self._ptr(fn, i, what)
        ctx = self.ctx
        cuda = ctx.device_kind == "cuda"
        stream = (self._last_stream or 1) if cuda else None  # NULL stream = the legacy default stream (1)
        sync = functools.partial(cudart.stream_wait, device_id=ctx.device_id) if cuda else None
        return DeviceArray(p, self.shapes[i], _ARRAY_DTYPES[ctx.param_dtype], device=ctx.device_kind,
                           device_id=ctx.device_id, stream=stream, owner=self, readonly=readonly, sync=sync)

    def flat_array(self, grad=False):
        """(DeviceArray, offsets): the unit's params (grad=True: its grads) as ONE array over the flat buffer
        from the first param's start to the last param's end, and each param's element offset in it; param
        i is array[offsets[i]:offsets[i] + numel(i)] reshaped to shapes[i]. One DLPack import per unit
        instead of one per param. Valid as param_array()/grad_array() are; the params' part read only.
        None for a unit without elements or if the pointers do not lie at their flat_range offsets. With
        grad=True a param frozen in the unit (set_param_trainable) has no grads: its offset is None."""
        if self._flat is None:
            self._flat = [self.flat_range(i) for i in range(len(self.names))]
        flat = self._flat
        if grad:
            if not self.trainable:
                return None
            flat = [r if self.param_trainable(i) else None for i, r in enumerate(flat)]
        # The param that starts lowest (frozen params lie after the trainable ones, whatever their index).
        live = [k for k, r in enumerate(flat) if r is not None and r[1]]
        if not live:
            return None
        first = min(live, key=lambda k: flat[k][0])
        fn, what = (LIB.fsdp_grad_ptr, "grad") if grad else (LIB.fsdp_param_ptr, "param")
        ctx = self.ctx
        esz = 4 if ctx.param_dtype == "fp32" else 2
        start = flat[first][0]
        _, base = self._ptr(fn, first, what)
        for i, r in enumerate(flat):
            if r is not None and r[1] and self._ptr(fn, i, what)[1] != base + (r[0] - start) * esz:
                return None
        last = max(off + n for off, n in (r for r in flat if r is not None))
        cuda = ctx.device_kind == "cuda"
        arr = DeviceArray(base, (last - start,), _ARRAY_DTYPES[ctx.param_dtype], device=ctx.device_kind,
                          device_id=ctx.device_id, stream=(self._last_stream or 1) if cuda else None, owner=self,
                          readonly=not grad,
                          sync=functools.partial(cudart.stream_wait, device_id=ctx.device_id) if cuda else None)
        return arr, [None if r is None else r[0] - start for r in flat]

    def param_array(self, i):
        """param(i) as a DeviceArray (any device): DLPack (numpy/torch/cupy/jax .from_dlpack) and, on CUDA,
        __cuda_array_interface__ (fp32, fp16; bf16 through DLPack only, as kDLBfloat). On CUDA a consumer
        reading on another stream than the block's is ordered after it with an event (fsdp.cudart).

        Valid only inside forward()/backward() of this unit, and so is every tensor imported from it: after
        *_end the memory is reused by the next gather, and a tensor kept longer (saved by autograd for
        backward, say) reads other values with no error; clone what must outlive the block. Read only by
        the DLPack 1.x flag, which only numpy enforces (torch and CuPy ignore it); where nothing is gathered
        (world 1, NO_SHARD; not with offload=cpu) the view is the library's own weights, with fp32 params
        the master itself, so a write through it bypasses the optimizer."""
        return self._array(LIB.fsdp_param_ptr, i, "param", True)

    def grad_array(self, i):
        """grad(i) as a writable DeviceArray (any device): add grads into it. Valid only inside backward() of
        this unit, and so is every tensor imported from it (see param_array)."""
        return self._array(LIB.fsdp_grad_ptr, i, "grad", False)

    def _view(self, fn, i, what):
        i, p = self._ptr(fn, i, what)
        n = self.numel(i)
        if n == 0:
            return np.zeros(self.shapes[i], dtype=self.ctx.np_dtype)
        if not p:
            raise _lib.Internal(10, f"fsdp_{what}_ptr returned NULL for a param of {n} elements")
        buf = (self.ctx._ctype * n).from_address(p)
        return np.frombuffer(buf, dtype=self.ctx.np_dtype).reshape(self.shapes[i])

    def param(self, i):
        """Zero-copy read-only view of the full param (param dtype; bf16 as raw uint16 bits).
        Valid only inside forward()/backward() of this unit. On a CUDA context: param_array(i)."""
        if self.ctx.device_kind == "cuda":
            return self.param_array(i)
        a = self._view(LIB.fsdp_param_ptr, i, "param")
        a.flags.writeable = False
        return a

    def grad(self, i):
        """Zero-copy writable view of the full grad buffer: ADD grads into it (g += ...).
        Valid only inside backward() of this unit. On a CUDA context: grad_array(i)."""
        if self.ctx.device_kind == "cuda":
            return self.grad_array(i)
        return self._view(LIB.fsdp_grad_ptr, i, "grad")

    def _numpy_only(self, what):
        if self.ctx.device_kind != "cpu":
            raise Unsupported(3, f"Unit.{what} computes with numpy and needs device=cpu; on {self.ctx.device} use "
                                 f"param_array()/grad_array() with a GPU array library")

    def param_f32(self, i):
        """A float32 copy of param(i) (converts bf16 bits / fp16); a view when the dtype is fp32."""
        self._numpy_only("param_f32")
        a = self.param(i)
        return bf16_to_f32(a) if a.dtype == np.uint16 else a.astype(np.float32, copy=False)

    def add_grad(self, i, g):
        """grad(i) += g: the sum is taken in float32 and rounded once to the param dtype (bf16 and fp16
        to nearest even)."""
        self._numpy_only("add_grad")
        view = self.grad(i)
        g = np.asarray(g, np.float32)
        if view.dtype == np.uint16:
            view[...] = f32_to_bf16(bf16_to_f32(view) + g)
        elif view.dtype == np.float16:
            view[...] = (view.astype(np.float32) + g).astype(np.float16)
        else:
            view += g

    def grad_accumulate(self, i, src, dtype=None, stream=None):
        """grad(i) += src on the unit's device (fsdp_grad_accumulate): each element added in float32 and rounded
        once to the param dtype, as add_grad does, from an array of the host's framework in any of float32,
        bfloat16, float16, without writing into libfsdp's buffer (for arrays that cannot be added into in
        place, JAX's, or memory of another allocator). src: a torch tensor, a JAX array, a numpy array (CPU),
        an array with __cuda_array_interface__ (CuPy, Numba), or an int address with dtype=; dense row-major
        with numel(i) elements, on the context's device. Queued on `stream` (default: the one this unit's
        block began on) after its work so far: on a GPU keep src alive until that stream is synchronized; on
        the CPU the add is done when this returns. Inside backward(); several calls add up."""
        i = self.index(i)
        ptr, code, n = grad_source(src, dtype, f"Unit.grad_accumulate({self.names[i]!r})")
        s = self._last_stream if stream is None else self.ctx._stream(stream, "Unit.grad_accumulate")
        check(LIB.fsdp_grad_accumulate(self._handle(), i, ptr, code, self.numel(i) if n is None else n, s),
              "fsdp_grad_accumulate")

    def params(self):
        return {n: self.param(k) for k, n in enumerate(self.names)}

    def grads(self):
        return {n: self.grad(k) for k, n in enumerate(self.names)}

    def gather(self, i):
        """Collective. A new float32 array with the param's full fp32 master values."""
        return self._gather_full(LIB.fsdp_gather_param, i, "fsdp_gather_param")

    def gather_grad(self, i):
        """Collective, for tests and debugging. A new float32 array with the param's reduced grad: what the
        grad shards hold after backward (averaged over the ranks by default), before step() unscales and
        clips it. Outside the unit's blocks, with no grads waiting unreduced under no_sync."""
        return self._gather_full(LIB.fsdp_gather_grad, i, "fsdp_gather_grad")

    def _gather_full(self, fn, i, what):
        i = self.index(i)
        out = np.empty(self.shapes[i], dtype=np.float32)
        check(fn(self._handle(), i, out.ctypes.data, out.size), what)
        return out

    def shard_info(self):
        """(copy of this rank's flat fp32 master shard, its offset in the unit's flat buffer). device=cpu only:
        on a CUDA context the shard is GPU memory (use gather())."""
        self._numpy_only("shard_info")
        p, off, n = ctypes.c_void_p(), ctypes.c_size_t(), ctypes.c_size_t()
        check(LIB.fsdp_shard_info(self._handle(), ctypes.byref(p), ctypes.byref(off), ctypes.byref(n)),
              "fsdp_shard_info")
        if n.value == 0 or not p.value:
            return np.zeros(0, np.float32), off.value
        return np.frombuffer((ctypes.c_float * n.value).from_address(p.value), np.float32).copy(), off.value

    def shard_tensors(self):
        """optimizer=host, between Context.step_begin and step_end: (params, grads, [state buffers]) of this rank's
        shard as writable float32 numpy views (the flat fp32 master, the reduced grads, the host_state buffers).
        Shards in host memory only (device=cpu, or offload=cpu)."""
        n_states = self.ctx._host_state
        if self.ctx.device_kind == "cuda" and self.ctx._offload != "cpu":
            raise Unsupported(3, "Unit.shard_tensors gives numpy views: the shards are GPU memory here "
                                 "(device=cuda without offload=cpu)")
        p, g, n = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_size_t()
        states = (ctypes.c_void_p * max(n_states, 1))()
        check(LIB.fsdp_shard_tensors(self.ctx._handle(), self._handle(), ctypes.byref(p), ctypes.byref(g), states,
                                     n_states, ctypes.byref(n)), "fsdp_shard_tensors")

        def view(addr):
            if n.value == 0 or not addr:
                return np.zeros(0, np.float32)
            return np.frombuffer((ctypes.c_float * n.value).from_address(addr), np.float32)
        return view(p.value), view(g.value), [view(states[i]) for i in range(n_states)]

    def flat_range(self, i):
        off, n = ctypes.c_size_t(), ctypes.c_size_t()
        check(LIB.fsdp_param_flat_range(self._handle(), self.index(i), ctypes.byref(off), ctypes.byref(n)),
              "fsdp_param_flat_range")
        return off.value, n.value
