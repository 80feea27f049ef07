# _torch_optim.py - fsdp.torch: torch optimizers on libfsdp's shards, clipping, and the optimizers that would update nothing.
"""With ``shard(model, ..., optimizer="torch")`` the update is the host's (libfsdp's optimizer=host):
``sharded.parameters()`` gives one ``torch.nn.Parameter`` per trainable param, a 1-D view of this rank's
slice of its fp32 master (possibly empty), and any torch optimizer, lr scheduler and ``zero_grad`` work on
those. A step of such an optimizer is bracketed by torch's global optimizer hooks:

- before it, ``fsdp_step_begin``: every reduction done, the global grad norm, the loss scaler's verdict
  and ``max_grad_norm``; each shard param's ``.grad`` becomes its slice of the reduced fp32 grads, times
  the factor libfsdp gives (1 / loss scale, the clip); a skipped step (inf/nan) leaves every ``.grad``
  None, so that the optimizer changes nothing;
- after it, ``fsdp_step_end``: the param_dtype copies follow the master, the grads are zeroed, the step
  is counted.

Elementwise optimizers (AdamW, Adam, SGD, Lion...) compute what they compute on the whole params; one
that needs a param's shape (Shampoo, a factored Adafactor) sees 1-D slices. ``clip_grad_norm_`` opens
the host step early and scales the grads by torch's coefficient (with libfsdp's own optimizer it is
fsdp_clip_grad_norm). A torch optimizer over the model's own
params (``model.parameters()``, which hold no values outside a forward) raises at its first step,
naming ``sharded.parameters()``."""
import ctypes
import threading
import weakref

import numpy as np
import torch
import torch.nn as nn
import torch.optim.optimizer as _torch_optimizer

from ._lib import LIB, check
from .core import InvalidState, Unsupported

_live = weakref.WeakSet()  # ShardedModules: the global optimizer hooks look at each
_live_lock = threading.Lock()  # thread ranks shard, close and step at once
_hooks = []


def _track(sharded, on):
    with _live_lock:
        (_live.add if on else _live.discard)(sharded)


def _tracked():
    with _live_lock:
        return list(_live)


def _install_global_hooks():
    if _hooks:
        return
    _hooks.append(_torch_optimizer.register_optimizer_step_pre_hook(_pre_step))
    _hooks.append(_torch_optimizer.register_optimizer_step_post_hook(_post_step))


def _pre_step(opt, args, kwargs):
    for sh in _tracked():
        sh._optim.before(opt)


def _post_step(opt, args, kwargs):
    for sh in _tracked():
        sh._optim.after(opt)


class _Slice:
    """A trainable param's slice of this rank's shard: [lo, hi) of the shard's trainable block."""
    __slots__ = ("state", "index", "lo", "hi", "param")

    def __init__(self, state, index, lo, hi, param):
        self.state, self.index, self.lo, self.hi, self.param = state, index, lo, hi, param


class TorchOptimizer:
    """The shard params of one ShardedModule and its part in a torch optimizer's step."""

    def __init__(self, sharded):
        # A weak reference: the ShardedModule owns this, and a cycle would keep its views (DLPack imports of
        # libfsdp's memory) alive after close() until the garbage collector runs.
        self._sh = weakref.ref(sharded)
        self.slices = None  # [_Slice], made at the first parameters()
        self.buffers = {}  # unit -> (params address, grads address, numel): the views' memory
        self.kinds = weakref.WeakKeyDictionary()  # optimizer -> (params, "shards", "model" or None)
        self.kinds_lock = threading.Lock()  # thread ranks' optimizers step at once, and each looks here
        self.open = False  # fsdp_step_begin called, fsdp_step_end not yet
        self.update = True
        self.factor = 1.0  # what the grads were multiplied by (loss scale, clip)
        with _live_lock:
            _install_global_hooks()
        _track(sharded, True)

    @property
    def sh(self):
        sh = self._sh()
        if sh is None:
            raise InvalidState(2, "fsdp.torch: the sharded model is gone")
        return sh

    @property
    def host(self):
        return self.sh.ctx.optimizer == "host"

    # ---- the params ----
    def named_parameters(self):
        if not self.host:
            raise InvalidState(2, "fsdp.torch: sharded.parameters() are for a torch optimizer, which needs "
                                  "shard(model, ..., optimizer='torch'); with libfsdp's own optimizer call "
                                  "sharded.step() after backward instead")
        if self.sh.ctx.device_kind == "cuda" and self.sh.ctx._offload != "cpu":
            raise Unsupported(3, "fsdp.torch: a torch optimizer on the shards needs them in host memory "
                                 "(device=cpu, or offload=cpu on a GPU); on device=cuda use libfsdp's own "
                                 "optimizer (sharded.step())")
        if self.slices is None:
            self.slices = self._make_slices()
        else:
            self._repoint()
        return [(self.sh._param_names[s.state.params[s.index]], s.param) for s in self.slices]

    def _views(self, unit):
        """(params, grads) of the unit's trainable block on this rank, as float32 numpy views."""
        p, g, _ = unit.shard_tensors()
        return p, g

    def _offset(self, unit):
        ptr, off, n = ctypes.c_void_p(), ctypes.c_size_t(), ctypes.c_size_t()
        check(LIB.fsdp_shard_info(unit._handle(), ctypes.byref(ptr), ctypes.byref(off), ctypes.byref(n)),
              "fsdp_shard_info")
        return off.value

    def _make_slices(self):
        out = []
        for st in self.sh._states:
            unit = st.unit
            if not any(st.requires_grad) or not unit.trainable:
                continue
            pv, _ = self._views(unit)
            off, n = self._offset(unit), pv.size
            self.buffers[unit] = (pv.ctypes.data, n)
            for i, flag in enumerate(st.requires_grad):
                if not flag:
                    continue
                first, numel = unit.flat_range(i)
                lo, hi = max(first, off) - off, min(first + numel, off + n) - off
                lo, hi = (lo, hi) if hi > lo else (0, 0)
                param = nn.Parameter(torch.from_numpy(pv[lo:hi]), requires_grad=True)
                out.append(_Slice(st, i, lo, hi, param))
        return out

    def _repoint(self):
        """The views follow the unit's buffers (a load or a relayout may have moved them); a param whose
        slice changed size (a param frozen or unfrozen since) cannot keep its optimizer state."""
        seen = {}
        for s in self.slices:
            unit = s.state.unit
            if unit not in seen:
                pv, _ = self._views(unit)
                seen[unit] = pv
                if self.buffers.get(unit) != (pv.ctypes.data, pv.size):
                    fresh = {(x.state, x.index): x for x in self._make_slices()}
                    for old in self.slices:
                        new = fresh.get((old.state, old.index))
                        if new is None or new.hi - new.lo != old.hi - old.lo:
                            raise InvalidState(2, f"fsdp.torch: param {self.sh._param_names[old.state.params[old.index]]!r} "
                                                  f"was frozen, unfrozen or laid out anew since sharded.parameters() "
                                                  f"was built: build the torch optimizer again")
                        old.param.data, old.lo, old.hi = new.param.data, new.lo, new.hi
                    for u, _ in list(self.buffers.items()):
                        pvu, _ = self._views(u)
                        self.buffers[u] = (pvu.ctypes.data, pvu.size)
                    return

    # ---- the step ----
    def kind(self, opt):
        """'shards' if `opt` steps this model's shard params, 'model' if it holds the model's own params."""
        n = sum(len(g["params"]) for g in opt.param_groups)
        with self.kinds_lock:
            got = self.kinds.get(opt)
        if got is not None and got[0] == n:
            return got[1]
        ids = {id(p) for g in opt.param_groups for p in g["params"]}
        mine = self.slices is not None and any(id(s.param) in ids for s in self.slices)
        model = any(id(p) in ids for p in self.sh._state_of_param)
        kind = "model" if model else ("shards" if mine else None)
        with self.kinds_lock:
            self.kinds[opt] = (n, kind)
        return kind

    def before(self, opt):
        kind = self.kind(opt)
        if kind is None:
            return
        if kind == "model":
            raise InvalidState(2, f"fsdp.torch: {type(opt).__name__}.step() over the params of a sharded model "
                                  f"(model.parameters()) would update nothing: outside a forward they hold no "
                                  f"values. Build the optimizer over sharded.parameters() (with "
                                  f"shard(..., optimizer='torch')), or drop it and call sharded.step() after "
                                  f"backward (libfsdp's own AdamW)")
        self.sh._check_outside_writes()
        if not self.open:
            self.begin()
        self.attach_grads()

    def after(self, opt):
        if self.kind(opt) != "shards" or not self.open:
            return
        for s in self.slices:
            s.param.grad = None
        self.open = False
        self.sh.ctx.step_end(self.sh._stream())

    def begin(self):
        """fsdp_step_begin: reductions done, the norm, the verdict; the grads' factor."""
        self._repoint()
        self.update, self.factor = self.sh.ctx.step_begin(self.sh._stream())
        self.open = True

    def attach_grads(self, extra=1.0):
        """Each shard param's .grad: its slice of the reduced grads, scaled once by libfsdp's factor (and
        `extra`, a clip's coefficient); None for a skipped step."""
        grads = {}
        for s in self.slices:
            if not self.update:
                s.param.grad = None
                continue
            unit = s.state.unit
            if unit not in grads:
                _, gv = self._views(unit)
                grads[unit] = torch.from_numpy(gv)
                if self.factor * extra != 1.0:
                    grads[unit].mul_(self.factor * extra)
            s.param.grad = grads[unit][s.lo:s.hi]
        self.factor = 1.0  # applied: a second attach in the same step does not scale again

    def clip_grad_norm_(self, max_norm, norm_type=2.0, error_if_nonfinite=False):
        if float(norm_type) != 2.0:
            raise Unsupported(3, f"fsdp.torch: clip_grad_norm_ with norm_type={norm_type}: libfsdp's norm is the "
                                 f"global L2 norm (norm_type=2)")
        if not self.host:
            # libfsdp's own optimizer: the norm now, and the coming sharded.step() clips (fsdp_clip_grad_norm).
            self.sh._check_outside_writes()
            norm = self.sh.ctx.clip_grad_norm(max_norm, self.sh._stream())
            if error_if_nonfinite and not np.isfinite(norm):
                raise RuntimeError(f"The total norm of order 2.0 for gradients from `parameters` is non-finite, so "
                                   f"it cannot be clipped (fsdp.torch: libfsdp skips this step)")
            return torch.tensor(norm, dtype=torch.float32)
        if self.slices is None:
            self.named_parameters()
        if self.open:
            raise InvalidState(2, "fsdp.torch: clip_grad_norm_ was called twice before the optimizer's step")
        self.sh._check_outside_writes()
        self.begin()
        norm = self.sh.ctx.last_grad_norm
        total = torch.tensor(norm if self.update else float("nan"), dtype=torch.float32)
        if not np.isfinite(norm) or not self.update:
            if error_if_nonfinite:
                raise RuntimeError(f"The total norm of order 2.0 for gradients from `parameters` is non-finite, so "
                                   f"it cannot be clipped (fsdp.torch: libfsdp skips this step)")
            self.attach_grads()
            return total
        coef = float(max_norm) / (norm + 1e-6)
        self.attach_grads(min(coef, 1.0))
        return total
