# torch.py - fsdp.torch: shard a torch.nn.Module over libfsdp units; module and autograd hooks drive the brackets.
"""PyTorch adapter: ``shard(model, units=...)`` puts each group of the model's params into a libfsdp unit
and drives ``forward_begin/end`` and ``backward_begin/end`` from module and autograd hooks, so that the
training loop stays torch's::

    sharded = fsdp.torch.shard(model, units=GPT2Block, group=group, rank=rank, lr=3e-4, weight_decay=0.1)
    for batch in data:
        loss = model(**batch).loss
        loss.backward()
        sharded.step()

How it works (docs/bindings.md, "PyTorch"):

- Each unit module (and the model itself, for the params outside every unit module: the root unit) gets a
  forward pre-hook (``forward_begin``; the module's ``nn.Parameter`` objects get the gathered memory as
  their ``.data``) and a forward hook (``forward_end``; each param's ``.data`` becomes a NaN expanded to
  its shape: _torch_state.py). The ``nn.Parameter`` objects stay the same objects all along: hooks,
  ``named_parameters()`` and tied params keep working, and they hold no memory between the brackets.
- model.state_dict() / load_state_dict() give and take the full model (_torch_state.py); a torch optimizer
  steps the shards through sharded.parameters() (_torch_optim.py).
- Which params make which unit, and the per-unit pieces the hooks keep: _torch_units.py.
- Autograd saves tensors in forward that it reads in backward: a matmul's weight, a LayerNorm's gamma,
  views of them. Those point into gathered memory that ``forward_end`` gave back. A
  ``torch.autograd.graph.saved_tensors_hooks`` pair, active during the model's forward, replaces every
  saved tensor that lies in a unit's gathered memory by (unit, offset, sizes, strides) and re-makes it in
  backward from the views ``backward_begin`` hands out, gathering the unit first if it is not yet.
- Backward begins for a unit when the first grad reaches one of its outputs (a tensor hook) or when
  autograd first unpacks one of its saved params, whichever comes first; each param's ``.grad`` is then the
  unit's grad buffer itself, and autograd accumulates into it in place. Backward ends when the grads of
  the unit's inputs are computed (an identity autograd Function on the inputs, as FSDP2 does), and at the
  end of the backward pass for the units whose inputs need no grad (the root, the embeddings).
- A param shared by modules in different units (tied embeddings) belongs to the root unit, gathered for
  the whole forward and backward.
- Params are read only: an in-place write to a param inside a bracket (under ``torch.no_grad()``; with
  grad enabled torch refuses it itself) raises at the bracket's end, naming the param. Torch ignores
  DLPack's read-only flag, so the adapter checks the params' version counters instead. A write through
  ``p.data`` is not seen: don't.

Thread ranks (``fsdp.run_ranks``) share torch's process-wide state: its RNG (ranks building a model at once
get different random inits: ``sync_module_states`` is on by default here, so rank 0's values win), its
intra-op thread pool size (``torch.set_num_threads``; give each rank cores / ranks), its default dtype.
"""
import functools

try:
    import torch
    import torch.nn as nn
except ImportError as e:  # fsdp itself needs numpy only; this module is the one that needs torch
    raise ImportError(f"fsdp.torch needs PyTorch (pip install torch): {e}") from e

from ._torch_optim import TorchOptimizer, _track
from ._torch_state import Placeholders, StateDictHooks, written_message
from ._torch_units import _PostBackward, _SavedParam, _UnitState, _group, _tensors
from .core import Context, InvalidArgument, InvalidState, Unsupported

_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_PEFT_ORDER = (" (PEFT: call get_peft_model before fsdp.torch.shard, so that the adapters are registered and "
               "the base is frozen from the start)")


class ShardedModule:
    """The result of shard(): .ctx, .units (libfsdp Units, registration order), .step(), .no_sync(),
    .state_dict(), .close(). The model itself is used as before: model(x), loss.backward()."""

    def __init__(self, model, ctx, groups, check_writes, pack_saved, state_dict_ranks="all"):
        self.model, self.ctx = model, ctx
        self._state_dict_ranks = state_dict_ranks
        self._pdtype = _TORCH_DTYPES[ctx.param_dtype]
        self._device = torch.device("cuda", ctx.device_id) if ctx.device_kind == "cuda" else torch.device("cpu")
        self._check_writes, self._pack_saved = check_writes, pack_saved
        self._states, self._state_of_param, self._hooks = [], {}, []
        self._grad_hooks, self._installed = {}, False
        self._storages = {}  # data pointer of a live view's storage -> (state, key)
        self._saved_hooks = None
        self._in_backward = False
        self._empty = torch.empty(0, dtype=self._pdtype, device=self._device)
        self._placeholders = Placeholders(self._pdtype, self._device)  # the params' data outside the brackets
        self._grad_placeholders = {}  # param -> a NaN expanded to its shape: its .grad after backward
        self._sd_hooks = None
        self.units = []
        for name, module, params in groups:
            # Frozen params (requires_grad False: a PEFT base) are registered frozen: their grads and
            # optimizer state are never allocated, not even for a moment.
            unit = ctx.register_unit(name, [(n, tuple(p.shape)) for n, p in params],
                                     trainable=[bool(p.requires_grad) for _, p in params])
            st = _UnitState(self, unit, module, [p for _, p in params])
            st.requires_grad = [bool(p.requires_grad) for _, p in params]  # as registered
            self._states.append(st)
            self.units.append(unit)
            for p in st.params:
                self._state_of_param[p] = st
        self._param_names = {p: n for _, _, params in groups for n, p in params}
        self._root = next((st for st in self._states if st.module is model), None)
        self._optim = TorchOptimizer(self)  # sharded.parameters(), clip_grad_norm_, the optimizers' hooks

    @property
    def dtype(self):
        """The torch dtype of the params inside the brackets (the context's param_dtype)."""
        return self._pdtype

    # ---- setup ----
    def _set_values(self, sync):
        for st in self._states:
            for i, p in enumerate(st.params):
                if sync and self.ctx.rank != 0:
                    st.unit.set_values(i, None)
                else:
                    st.unit.set_values(i, p.detach().to(torch.float32).cpu().numpy())
                self._placeholders.put(p)  # the model's own copy goes: the unit holds the values now

    def _sync_trainable(self):
        """requires_grad=False params are frozen in libfsdp: a unit whose params are all frozen as a whole
        (fsdp_unit_set_trainable), else param by param inside it (fsdp_param_set_trainable: no grads, no
        optimizer state, no bytes in the reduction). Collective; at shard() and before each forward of the
        root, when a flag changed since (between steps, as torch's own optimizers see it)."""
        for st in self._states:
            flags = [bool(p.requires_grad) for p in st.params]
            if flags == st.requires_grad:
                continue
            unit_on = any(flags) or not flags
            if not unit_on:
                if st.unit.trainable:
                    st.unit.set_trainable(False)
            else:
                for i, f in enumerate(flags):  # inside a frozen unit this moves no optimizer state
                    if st.unit.param_trainable(i) != f:
                        st.unit.set_param_trainable(i, f)
                if not st.unit.trainable:
                    st.unit.set_trainable(True)
            st.requires_grad = flags
            st.cache.clear()  # the unit was laid out again: the views' offsets moved
        self._hook_grads()

    def _hook_grads(self):
        """A param that needs grad gets the hook that keeps its grad in the unit's buffer (torch refuses
        hooks on params that do not: frozen ones, e.g. a PEFT base, get theirs when unfrozen)."""
        if not self._installed:
            return
        for p, st in self._state_of_param.items():
            if p.requires_grad and p not in self._grad_hooks:
                self._grad_hooks[p] = p.register_post_accumulate_grad_hook(functools.partial(self._grad_arrived, st))

    def _install(self):
        model = self.model
        for st in self._states:
            if st.module is model:
                continue
            self._hooks.append(st.module.register_forward_pre_hook(
                functools.partial(self._unit_pre_forward, st), with_kwargs=True))
            self._hooks.append(st.module.register_forward_hook(
                functools.partial(self._unit_post_forward, st), always_call=True))
        self._hooks.append(model.register_forward_pre_hook(self._root_pre_forward, with_kwargs=True))
        self._hooks.append(model.register_forward_hook(self._root_post_forward, always_call=True))
        self._installed = True
        self._hook_grads()
        self._sd_hooks = StateDictHooks(self, self._state_dict_ranks)
        # transformers' save_pretrained asks the model whether this rank writes: rank 0 alone, so that
        # model.save_pretrained(dir) can be called on every rank (its state_dict is collective).
        orig = getattr(model, "should_save_on_this_rank", None)
        if callable(orig) and "should_save_on_this_rank" not in vars(model):
            rank = self.ctx.rank

            def should_save_on_this_rank(is_main_process, _orig=orig):
                return bool(_orig(is_main_process)) and rank == 0
            model.should_save_on_this_rank = should_save_on_this_rank
        self._expected = list(model.named_parameters())

    # ---- views ----
    def _make_views(self, st, grad):
        """The unit's params (or grads) as torch tensors over libfsdp's memory, one DLPack import per unit
        (per param where the params do not lie in one span), cached by the memory's address."""
        unit = st.unit
        # Grads exist for the params libfsdp trains: none in a frozen unit, none for a frozen param.
        unit_on = any(st.requires_grad)
        has = [not grad or (unit_on and f) for f in st.requires_grad]
        if not any(has):
            return [], [None] * len(st.params)
        got = unit.flat_array(grad=grad)
        if got is not None:
            arr, offs = got
            key = (grad, arr.ptr)
            hit = st.cache.get(key)
            if hit is not None:
                return hit
            flat = torch.from_dlpack(arr)
            base = [flat]
            views = [flat[o:o + unit.numel(i)].view(unit.shapes[i]) if o is not None else None
                     for i, o in enumerate(offs)]
        else:
            base = [(torch.from_dlpack(unit.grad_array(i) if grad else unit.param_array(i)) if unit.numel(i)
                     else torch.empty(unit.shapes[i], dtype=self._pdtype, device=self._device)) if has[i] else None
                    for i in range(len(unit.names))]
            views = base
            key = (grad, tuple(t.data_ptr() if t is not None else 0 for t in base))
            base = [t for t in base if t is not None]
        if len(st.cache) >= 8:  # a few slots per unit come back; forget the oldest
            st.cache.pop(next(iter(st.cache)))
        st.cache[key] = (base, views)
        return base, views

    def _attach(self, st, phase):
        """After *_begin: the params' .data are the gathered views (and their .grad the grad buffers)."""
        base, views = self._make_views(st, grad=False)
        for p, v in zip(st.params, views):
            if not self._placeholders.holds(p) and p.data_ptr() != v.data_ptr():
                raise InvalidState(2, f"fsdp.torch: param {self._param_names[p]!r} of unit {st.unit.name!r} was "
                                      f"given new data after shard(); set values through the unit "
                                      f"(unit.set_values) instead")
            p.data = v
        st.base, st.views, st.phase = base, views, phase
        for k, b in enumerate(base):
            if b.numel():
                self._storages[b.untyped_storage().data_ptr()] = (st, k)
        if phase == "backward":
            _, st.grads = self._make_views(st, grad=True)
            for p, g in zip(st.params, st.grads):
                if g is not None:  # a frozen param (requires_grad=False) has none
                    p.grad = g
        if self._check_writes:
            st.versions = [p._version for p in st.params]

    def _detach(self, st):
        """Before *_end: checks that nothing wrote the params, then empties .data and .grad."""
        if self._check_writes and st.versions is not None:
            for p, v in zip(st.params, st.versions):
                if p._version != v:
                    raise InvalidState(2, f"fsdp.torch: param {self._param_names[p]!r} of unit {st.unit.name!r} "
                                          f"was written in place during its {st.phase}; params are read-only "
                                          f"views of gathered memory (the write would be lost, or change the "
                                          f"weights outside the optimizer)")
        for b in st.base or ():
            if b.numel():
                self._storages.pop(b.untyped_storage().data_ptr(), None)
        for p in st.params:
            self._placeholders.put(p)
            p.grad = None
        st.base = st.views = st.grads = st.versions = None
        st.phase = None

    def _stream(self):
        return torch.cuda.current_stream(self._device) if self._device.type == "cuda" else None

    # ---- forward ----
    def _begin_forward(self, st):
        if st.in_forward:
            st.in_forward += 1
            return
        if st.phase == "backward":  # recomputation (activation checkpointing) inside the unit's backward
            st.in_forward += 1
            return
        st.unit.forward_begin(self._stream())
        st.in_forward = 1
        self._attach(st, "forward")

    def _end_forward(self, st):
        st.in_forward -= 1
        if st.in_forward or st.phase != "forward":
            return
        self._detach(st)
        st.unit.forward_end(self._stream())

    def _unit_pre_forward(self, st, module, args, kwargs):
        self._begin_forward(st)
        if not torch.is_grad_enabled():
            return None
        # Wrap the inputs that need grad: their grads come last in the module's backward.
        flat = [(i, a) for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
        kflat = [(k, a) for k, a in kwargs.items() if isinstance(a, torch.Tensor) and a.requires_grad]
        if not flat and not kflat:
            return None
        st.pending += 1
        out = _PostBackward.apply(st, *[a for _, a in flat], *[a for _, a in kflat])
        out = out if isinstance(out, tuple) else (out,)
        args = list(args)
        for (i, _), t in zip(flat, out):
            args[i] = t
        kwargs = dict(kwargs)
        for (k, _), t in zip(kflat, out[len(flat):]):
            kwargs[k] = t
        return tuple(args), kwargs

    def _unit_post_forward(self, st, module, args, output):
        self._end_forward(st)
        self._hook_outputs(st, output)
        return None

    def _hook_outputs(self, st, output):
        if not torch.is_grad_enabled():
            return
        for t in _tensors(output, []):
            if t.requires_grad:
                t.register_hook(functools.partial(self._pre_backward, st))

    def _root_pre_forward(self, module, args, kwargs):
        if self._saved_hooks is not None:
            raise InvalidState(2, "fsdp.torch: the model's forward was entered again before it returned")
        self._check_params()
        self._check_outside_writes()
        for p, g in self._grad_placeholders.items():  # last backward's: the grads live in the units
            if p.grad is g:
                p.grad = None
        self._sync_trainable()
        if self._pack_saved:
            self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._saved_hooks.__enter__()
        if self._root is not None:
            self._begin_forward(self._root)
        return None

    def _root_post_forward(self, module, args, output):
        hooks, self._saved_hooks = self._saved_hooks, None
        try:
            if self._root is not None:
                self._end_forward(self._root)
                self._hook_outputs(self._root, output)
        finally:
            if hooks is not None:
                hooks.__exit__(None, None, None)
        return None

    def _reshard(self):
        """The model sharded again as it is now (collective: every rank's next forward reaches it): the values
        libfsdp holds are gathered back into their params, the context closes, and shard() runs again with
        its first arguments, so that the adapters are registered and the base, which PEFT froze, is
        registered frozen. Thread ranks draw different adapter inits from torch's shared RNG: with
        sync_module_states (the default) rank 0's win, as at shard()."""
        if any(st.phase is not None for st in self._states) or self._optim.open:
            raise InvalidState(2, "fsdp.torch: PEFT's adapters appeared while a step is in progress")
        full = {p: torch.from_numpy(st.unit.gather(i)) for st in self._states for i, p in enumerate(st.params)}
        args = self._args
        self.close()
        for p, v in full.items():
            p.data = v
            p.grad = None
        _, group, rank, config, options = args[:5]
        _setup(self, Context(config, group, rank, **options), args)

    def _check_params(self):
        """The model's params are those shard() registered; where PEFT's get_peft_model added its adapters
        since (a peft_config, params added, none of the registered ones gone: PEFT only renames them), the
        model is sharded again."""
        now = list(self.model.named_parameters())
        if len(now) != len(self._expected) or any(a is not b or n != m for (n, a), (m, b) in zip(now, self._expected)):
            known = {id(p) for _, p in self._expected}
            new = [n for n, p in now if id(p) not in known]
            gone = sorted(set(n for n, _ in self._expected) - set(n for n, _ in now))
            kept = {id(p) for _, p in now} >= known  # PEFT renames the base params it wraps, not replaces them
            if new and kept and getattr(self.model, "peft_config", None) is not None:
                self._reshard()
                return
            raise InvalidState(2, f"fsdp.torch: the model's params changed after shard(): "
                                  f"{'new or replaced: ' + ', '.join(new) if new else ''}"
                                  f"{'; ' if new and gone else ''}{'gone: ' + ', '.join(gone) if gone else ''}"
                                  f"{'reordered' if not new and not gone else ''}; shard the new model instead"
                                  f"{_PEFT_ORDER if any('lora_' in n for n in new) else ''}")

    # ---- saved tensors ----
    def _pack(self, t):
        try:
            hit = self._storages.get(t.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):  # tensors without storage (meta, some subclasses)
            return t
        if hit is None:
            return t
        return _SavedParam(hit[0], hit[1], t)

    def _unpack(self, saved):
        if not isinstance(saved, _SavedParam):
            return saved
        st = saved.unit
        if st.phase != "backward":
            self._begin_backward(st)
        base = st.base[saved.key]
        if base.dtype != saved.dtype:
            base = base.view(saved.dtype)
        return base.as_strided(saved.size, saved.stride, saved.offset)

    # ---- backward ----
    def _begin_backward(self, st):
        if st.phase == "forward":
            raise InvalidState(2, f"fsdp.torch: backward reached unit {st.unit.name!r} while its forward is still "
                                  f"running (backward inside the module's forward is not supported)")
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        st.unit.backward_begin(self._stream())
        self._attach(st, "backward")

    def _pre_backward(self, st, grad):
        if st.phase != "backward":
            self._begin_backward(st)
        return None

    def _post_backward(self, st):
        st.pending -= 1
        if st.pending <= 0 and st.phase == "backward":
            self._end_backward(st)

    def _end_backward(self, st):
        self._detach(st)
        st.unit.backward_end(self._stream())

    def _grad_arrived(self, st, p):
        """After autograd accumulated p's grad: it must be in the unit's grad buffer."""
        if st.phase != "backward":
            # The grad arrived outside the unit's backward (after it ended): autograd took its own tensor.
            # Take the unit into backward again (libfsdp adds this use's grads to the reduced ones) and
            # add the grad there.
            g, p.grad = p.grad, None
            self._begin_backward(st)
            p.grad.add_(g)
            return
        view = st.grads[st.index[p]]
        if p.grad is not view:  # autograd replaced the buffer (create_graph=True): keep the sum in it
            view.copy_(p.grad)
            p.grad = view

    def _finish_backward(self):
        self._in_backward = False
        for st in reversed(self._states):
            st.pending = 0
            if st.phase == "backward":
                self._end_backward(st)
        # The grads are in the units' shards now: each trainable param's .grad is a NaN of its shape (no
        # memory), so that torch code that reads it (torch.nn.utils.clip_grad_norm_ over model.parameters())
        # gets NaN or fails, instead of finding no grad and doing nothing.
        for p in self._state_of_param:
            if p.requires_grad:
                g = self._grad_placeholders.get(p)
                if g is None:
                    g = self._grad_placeholders[p] = torch.full((), float("nan"), dtype=self._pdtype,
                                                                device=self._device).expand(p.shape)
                p.grad = g

    def _check_outside_writes(self):
        written = self._placeholders.written()
        if written:
            raise InvalidState(2, written_message([self._param_names[p] for p in written]))

    # ---- the step and the rest ----
    def step(self):
        """Collective: the optimizer step on every rank's shards (fsdp_step)."""
        if self.ctx.optimizer == "host":
            raise InvalidState(2, "fsdp.torch: with optimizer='torch' the step is the torch optimizer's: "
                                  "opt.step() over sharded.parameters(), not sharded.step()")
        self._check_outside_writes()
        self.ctx.step(self._stream())

    def parameters(self):
        """The params a torch optimizer steps (shard(..., optimizer='torch')): one torch.nn.Parameter per
        trainable param, a 1-D view of this rank's slice of its fp32 master (possibly empty), whose .grad is
        its slice of the reduced grads during the optimizer's step. Param groups by name: named_parameters()."""
        return [p for _, p in self._optim.named_parameters()]

    def named_parameters(self):
        """[(the model's param name, its shard param)] of parameters(), in registration order."""
        return self._optim.named_parameters()

    def clip_grad_norm_(self, max_norm, norm_type=2.0, error_if_nonfinite=False):
        """torch.nn.utils.clip_grad_norm_ for the sharded model (collective): the global L2 norm of the grads
        over every rank, returned as a tensor; the grads are scaled by max_norm / (norm + 1e-6) where that
        is below 1. After backward, before the step: the torch optimizer's (optimizer='torch'), or
        sharded.step() (fsdp_clip_grad_norm: a host wait for the norm; the max_grad_norm option clips inside
        the step without it)."""
        return self._optim.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)

    def set_lr(self, lr):
        self.ctx.set_lr(lr)

    def no_sync(self):
        """Context manager: backward passes inside accumulate grads locally, without communication."""
        return self.ctx.no_sync()

    def gather_grads(self):
        """Collective: {param name: reduced fp32 grad as a torch tensor} (fsdp_gather_grad), after backward
        and before step(); for tests of an integration."""
        return {self._param_names[p]: torch.from_numpy(st.unit.gather_grad(i))
                for st in self._states for i, p in enumerate(st.params) if st.requires_grad[i]}

    def load_pretrained(self, path, **kwargs):
        """Collective: the params from a Hugging Face checkpoint directory (save_pretrained's safetensors, one
        file or sharded with an index) or a .safetensors file, by the model's own param names
        (Context.load_pretrained: strip_prefix, add_prefix, rename, transpose, strict). Tied params are stored
        once; the optimizer state restarts. Returns the load report."""
        return self.ctx.load_pretrained(path, **kwargs)

    def save_pretrained(self, dir, dtype="fp32", max_shard_bytes=None, **kwargs):
        """Collective: the params as a Hugging Face checkpoint directory (fsdp_export: safetensors under the
        model's own param names, tied params once), and rank 0 writes the model's config beside them when
        it has one (transformers' config.save_pretrained), so that from_pretrained(dir) loads it."""
        self.ctx.export(dir, dtype=dtype, max_shard_bytes=max_shard_bytes, **kwargs)
        config = getattr(self.model, "config", None)
        if self.ctx.rank == 0 and config is not None and hasattr(config, "save_pretrained"):
            config.save_pretrained(dir)

    # Checkpoints that do not stall the step (Context.save_async/save_wait/snapshot/restore, docs/checkpoints.md).
    # They hold libfsdp's state: the fp32 params and libfsdp's own optimizer state, step, lr and loss scale;
    # with optimizer='torch' the torch optimizer's state is not in them (save it with torch).
    def save_async(self, dir):
        """Collective: a sharded checkpoint of the state now, written in the background (fsdp_save_async);
        training goes on meanwhile. sharded.ctx.load(dir) (or restore(checkpoint_dir=dir)) reads it."""
        self._check_outside_writes()
        self.ctx.save_async(dir)

    def save_wait(self):
        """Local: waits for the last save_async to be committed; raises its error (fsdp_save_wait)."""
        self.ctx.save_wait()

    def snapshot(self, path):
        """Collective: copies the state into a per-rank snapshot under `path` (/dev/shm/<job>; fsdp_snapshot)."""
        self._check_outside_writes()
        self.ctx.snapshot(path)

    def restore(self, path=None, checkpoint_dir=None):
        """Collective, between steps: the newest snapshot every rank holds under `path`, else the checkpoint
        at `checkpoint_dir`, else nothing (fsdp_restore); returns "snapshot", "checkpoint" or "nothing"."""
        return self.ctx.restore(path, checkpoint_dir)

    def state_dict(self):
        """Collective: model.state_dict(), every param gathered in fp32 (tied params under each of their
        names, one tensor), buffers as the model holds them; what model.load_state_dict and transformers'
        save_pretrained take. With state_dict_ranks='rank0' the params are only in rank 0's."""
        return self.model.state_dict()

    def close(self):
        """Removes the hooks and closes the context (local)."""
        for h in self._hooks:
            h.remove()
        for h in self._grad_hooks.values():
            h.remove()
        self._hooks, self._grad_hooks = [], {}
        if self._sd_hooks is not None:
            self._sd_hooks.remove()
            self._sd_hooks = None
        vars(self.model).pop("should_save_on_this_rank", None)
        _track(self, False)
        for st in self._states:  # the views hold DLPack imports of the context's memory
            st.cache.clear()
            st.base = st.views = st.grads = None
        self.ctx.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def shard(model, units=None, *, group=None, rank=None, config=None, sync_module_states=True, check_writes=True,
          state_dict_ranks="all", **options):
    """Shards `model`'s params over libfsdp units and installs the hooks that drive them. Collective.

    units: a list of submodules, a module class (or tuple of classes: every module of that class, like
      FSDP's ModuleWrapPolicy), or a predicate (name, module) -> bool; each chosen module is a unit (a
      chosen module inside another stays in the outer one). Params outside every unit module, and params
      shared by modules of different units, form the root unit. None: the whole model is one unit.
    group, rank: as Context (thread ranks: fsdp.run_ranks gives both; under mpirun leave them None).
    config: a fsdp.Config, or options as keywords (lr=..., sharding=..., param_dtype="bf16", ...).
      optimizer="torch": the update is a torch optimizer's over sharded.parameters() (libfsdp's
      optimizer=host); else libfsdp's own (adamw by default), run by sharded.step().
    sync_module_states: rank 0's param values go to every rank (on by default: thread ranks share torch's
      RNG, so their inits differ).
    check_writes: raise at a bracket's end if a param was written in place inside it.
    state_dict_ranks: "all" (every rank's model.state_dict() holds the full params) or "rank0" (only rank
      0's; the others' have no param entries). Either way every rank must call it: the gathers are
      collective.

    Params whose requires_grad is False when shard() is called (a frozen base, a PEFT model's) are frozen
    in libfsdp: no grads, no optimizer state. Outside a unit's bracket a param holds no memory (its .data
    is a NaN expanded to its shape: p.shape and p.numel() are the model's, its values NaN), and after
    backward its .grad is such a NaN too: the grads live in the units (docs/bindings.md, "PyTorch")."""
    if not isinstance(model, nn.Module):
        raise InvalidArgument(1, f"fsdp.torch.shard: model must be a torch.nn.Module, not {type(model).__name__}")
    pack_saved = options.pop("_pack_saved", True)  # tests only: the naive glue, without saved-tensor hooks
    if options.get("optimizer") == "torch":
        options["optimizer"] = "host"
        options.setdefault("host_state", 0)  # the torch optimizer keeps its own state
    if state_dict_ranks not in ("all", "rank0"):
        raise InvalidArgument(1, f"fsdp.torch.shard: state_dict_ranks must be 'all' or 'rank0', not "
                                 f"{state_dict_ranks!r}")
    if config is None:
        options.setdefault("sync_module_states", 1 if sync_module_states else 0)
    sync = config.get("sync_module_states") if config is not None else options["sync_module_states"]
    sync = str(sync) not in ("0", "false", "False")
    ctx = Context(config, group, rank, **options)
    sharded = ShardedModule.__new__(ShardedModule)
    sharded.model = model
    # shard()'s arguments: what _reshard needs to shard the model again (PEFT's get_peft_model after shard()).
    _setup(sharded, ctx, (units, group, rank, config, dict(options), sync, check_writes, pack_saved, state_dict_ranks))
    return sharded


def _setup(sharded, ctx, args):
    """(Re)makes `sharded` over its model with the context `ctx` and shard()'s arguments; closes ctx on failure."""
    units, sync, check_writes, pack_saved, state_dict_ranks = args[0], *args[5:]
    try:
        sharded.__init__(sharded.model, ctx, _group(sharded.model, units), check_writes, pack_saved, state_dict_ranks)
        sharded._args = args
        sharded._set_values(sync)
        sharded._sync_trainable()
        sharded._install()
    except BaseException:
        ctx.close()
        raise
