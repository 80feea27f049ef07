# unit.py - Unit: a registered unit of a Context (its brackets, params and grads as arrays or views).
import contextlib
import ctypes
import functools

import numpy as np

from . import _lib
from ._lib import LIB, check, Unsupported
from . import cudart
from ._sources import grad_source
from .dlpack import DeviceArray
from ._base import _ARRAY_DTYPES, bf16_to_f32, f32_to_bf16


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
