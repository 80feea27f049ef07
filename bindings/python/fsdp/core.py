# core.py - Config, LocalGroup and Context: thin Python objects over the libfsdp C handles (Unit: unit.py;
# the dtype helpers and stream_handle: _base.py, re-exported here).
import contextlib
import ctypes
import dataclasses
import os

import numpy as np

from . import _lib
from ._lib import LIB, check, InvalidState, InvalidArgument, Unsupported

# bf16_to_f32, f32_to_bf16, InvalidState and Unsupported: re-exported (fsdp/__init__.py and the adapters
# import them from here).
from ._base import _DTYPES, _REDUCE_OPS, _RESTORE_SOURCES, bf16_to_f32, f32_to_bf16, _closed, _value_str, stream_handle
from .unit import Unit


def launcher_world():
    """(rank, size) that a launcher gave this process (mpirun, MPICH, Slurm's srun: fsdp_launcher), or None
    when not started by one."""
    rank, size = ctypes.c_int(-1), ctypes.c_int(-1)
    check(LIB.fsdp_launcher(ctypes.byref(rank), ctypes.byref(size), None, None), "fsdp_launcher")
    if size.value < 1:
        return None
    return rank.value, size.value


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
