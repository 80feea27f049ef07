# jax.py - fsdp.jax: a JAX params pytree sharded into libfsdp units, trained whole-function or layer by layer.
"""The JAX adapter: a params pytree (nested dicts, lists, tuples, dataclasses; Flax-style
``{"layers": [{"w": .., "b": ..}, ...], "head": {...}}``) becomes libfsdp units, and JAX computes on
the gathered params through one DLPack import per unit.

    sharded = fsdp.jax.shard(params, units=2, group=group, rank=rank, lr=1e-3, weight_decay=0.01)
    train = sharded.value_and_grad(loss_fn)          # whole-function mode: loss_fn(params, *batch)
    # or: train = sharded.layerwise({"layers.0": f0, ..., "head": g}, loss_fn)  # one unit gathered at a time
    for batch in data:
        loss = train(*batch)                         # forward and backward: grads go into libfsdp's buffers
        sharded.step()                               # AdamW (or the configured optimizer) on this rank's shards
    params = sharded.gather()                        # the full fp32 params, as numpy arrays in the same pytree

JAX is imported when a function here first needs it: ``import fsdp`` and ``import fsdp.jax`` work without it.
``device=cpu`` and ``device=cuda`` contexts alike: JAX arrays are immutable, so the grads are never written
into libfsdp's buffers; ``Unit.grad_accumulate`` (``fsdp_grad_accumulate``) adds each JAX grad from JAX's own
memory on the unit's device, in the params' dtype. On a GPU the params reach JAX through DLPack on the GPU
(JAX's stream is ordered after the gather with an event, ``fsdp.cudart``), and the adds are queued on the
block's stream (the legacy default stream), which the adapter synchronizes before it drops JAX's grads.

Rules the adapter keeps, which glue of one's own must keep too (docs/bindings.md, "JAX"):

- JAX dispatches asynchronously: every result computed from a unit's params is blocked on
  (``jax.block_until_ready``) before that unit's ``*_end``, which frees or reuses the memory.
- An array imported from a unit's memory never outlives the unit's block: the adapter drops its imports
  before ``*_end``; losses and aux outputs come back as numpy copies; an activation that still aliases a
  unit's memory (a layer that returned a param unchanged) is copied before ``forward_end``.
- Leaf order is JAX's (``jax.tree_util.tree_flatten``: dict keys sorted, lists by index): param ``i`` of a
  unit is its ``i``-th leaf in that order, and a param's name is its key path joined with dots
  (``layers.10.w``), never re-sorted as text.
"""
from __future__ import annotations

import threading

import numpy as np

from . import cudart
from ._lib import InvalidArgument, InvalidState, Unsupported
from .core import Config, Context
from .dlpack import DeviceArray
from .wrap import Wrapped
from ._jax_fns import _jax, _cached, _whole_fn, _layer_fwd, _layer_bwd, _loss_grad_fn

__all__ = ["shard", "ShardedParams", "path_name"]

_ARRAY_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # DeviceArray dtype names
ROOT = "root"  # the unit of the leaves outside every chosen subtree


def _key_str(k):
    """One key of a JAX key path as text: DictKey.key, SequenceKey.idx, GetAttrKey.name, FlattenedIndexKey.key."""
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def path_name(path):
    """A JAX key path as the dotted name fsdp.jax gives params and units: (DictKey('layers'), SequenceKey(0),
    DictKey('w')) -> 'layers.0.w'."""
    return ".".join(_key_str(k) for k in path)


def _shape(leaf):
    shape = getattr(leaf, "shape", None)  # arrays, and jax.ShapeDtypeStruct in check()
    return np.shape(leaf) if shape is None else shape


# ---- choosing the units ----

def _unit_prefixes(paths, units):
    """For each leaf (its key path), the length of the path prefix of the unit it belongs to (0: the root
    unit), and the unit order: 'first leaf' or the list of names given."""
    if isinstance(units, bool):
        raise TypeError(f"shard: units={units!r}: pass a depth (int), a predicate on dotted paths or a list of "
                        f"subtree names")
    if isinstance(units, int):
        if units < 0:
            raise ValueError(f"shard: units={units}: a depth is 0 (one unit) or more")
        # A leaf belongs to the subtree at depth `units` above it, or to its parent when it is shallower:
        # a leaf never makes a unit by itself, so {"head": {"w", "b"}} at depth 2 is one unit "head".
        return [min(units, len(p) - 1) if p else 0 for p in paths], None
    if callable(units):
        memo = {}

        def chosen(prefix):
            name = path_name(prefix)
            if name not in memo:
                memo[name] = bool(units(name))
            return memo[name]
        # Top-down: the shortest prefix (1 key or more) the predicate takes claims the whole subtree.
        return [next((k for k in range(1, len(p) + 1) if chosen(p[:k])), 0) for p in paths], None
    if isinstance(units, (list, tuple)) and all(isinstance(u, str) for u in units):
        wanted = list(units)
        if len(set(wanted)) != len(wanted):
            dup = next(u for u in wanted if wanted.count(u) > 1)
            raise ValueError(f"shard: units lists {dup!r} twice")
        names = set(wanted)
        out = [next((k for k in range(1, len(p) + 1) if path_name(p[:k]) in names), 0) for p in paths]
        found = {path_name(p[:k]) for p, k in zip(paths, out) if k}
        missing = [u for u in wanted if u not in found]
        if missing:
            subtrees = sorted({path_name(p[:k]) for p in paths for k in range(1, len(p) + 1)})
            raise ValueError(f"shard: units names {missing[0]!r}, which is no subtree of params (or lies inside "
                             f"another listed one); its subtrees are {subtrees[:20]}"
                             f"{' ...' if len(subtrees) > 20 else ''}")
        return out, wanted
    raise TypeError(f"shard: units={units!r}: pass a depth (int), a predicate on dotted paths (callable) or a "
                    f"list of subtree names (str)")


def _child(jtu, node, key):
    """The child of a pytree node under one key of a key path."""
    kids, _ = jtu.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
    for p, c in kids:
        if len(p) == 1 and p[0] == key:
            return c
    raise KeyError(key)


# ---- the sharded params ----

class ShardedParams(Wrapped):
    """The result of shard(): a params pytree's leaves held by libfsdp units on this rank.

    .ctx (the Context), .units (fsdp.Unit, in unit order), .unit_names, .treedef (the pytree's structure),
    .names and .shapes (every leaf in JAX's order), .unit_of(name), .sharding (the strategy in effect; None
    with a ctx= of one's own). Whole-function mode: value_and_grad(loss_fn), step_fn(loss_fn). Layer-wise
    mode: layerwise(fns, loss_fn). Then step(), set_lr(), no_sync(), gather(), gather_grads(), set(params),
    memory_stats(), save(), load(), finalize(), close() (fsdp.Wrapped's, with gather() and close() below)."""

    def __init__(self, ctx, own_ctx, sharding, treedef, names, shapes, groups, unit_trees):
        super().__init__(ctx, [], sharding)  # units are added by shard() as they are registered
        self._own_ctx = own_ctx
        self.treedef, self.names, self.shapes = treedef, list(names), [tuple(s) for s in shapes]
        self._groups = groups            # per unit: (unit name, [leaf index, ...])
        self._unit_trees = unit_trees    # per unit: (treedef, positions) that _place takes
        self._leaf_src = [None] * len(names)  # leaf index -> (unit index, param index)
        for u, (_, leaves) in enumerate(groups):
            for i, k in enumerate(leaves):
                self._leaf_src[k] = (u, i)
        self._dtype = _ARRAY_DTYPES[ctx.param_dtype]
        self._busy = threading.Lock()    # one pass at a time on this rank

    def _add_unit(self, unit):
        self.units.append(unit)
        self._unit_of.update((n, unit) for n in unit.names)

    def __repr__(self):
        where = f"rank {self.ctx.rank} of {self.ctx.world_size}" if not self.ctx.closed else "closed"
        return (f"ShardedParams({self.sharding}, param_dtype={self.ctx.param_dtype}, {where}, "
                f"units={self.unit_names})")

    @property
    def unit_names(self):
        return [name for name, _ in self._groups]

    # ---- checks ----
    def check(self, params, what="ShardedParams.check"):
        """Raises ValueError naming the first difference between `params` and the pytree shard() saw: a leaf
        missing, added or renamed, a shape, or the structure (list for tuple, another container type)."""
        jtu = _jax().tree_util
        flat, treedef = jtu.tree_flatten_with_path(params)
        names = [path_name(p) for p, _ in flat]
        head = f"{what}: the params pytree differs from the one shard() saw"
        for k in range(max(len(names), len(self.names))):
            want = self.names[k] if k < len(self.names) else None
            got = names[k] if k < len(names) else None
            if want != got:
                if got is None or (want is not None and want not in names):
                    msg = f"leaf {want!r} is missing" + (f" (leaf {k} is {got!r})" if got is not None else "")
                else:
                    msg = f"leaf {got!r} is new" + (f" (where shard() saw {want!r})" if want is not None else "")
                raise ValueError(f"{head}: {msg}")
            shape = tuple(int(d) for d in _shape(flat[k][1]))
            if shape != self.shapes[k]:
                raise ValueError(f"{head}: leaf {want!r} has shape {shape}; shard() saw {self.shapes[k]}")
        if treedef != self.treedef:
            raise ValueError(f"{head}: same leaves and shapes, but the structure is {treedef}; shard() saw "
                             f"{self.treedef}")
        return flat

    def set(self, params):
        """Collective (with sync_module_states=1, rank 0's values win). Sets every param from a pytree of
        the same structure and shapes as shard()'s (ValueError naming the first difference otherwise).
        The optimizer state is kept."""
        flat = self.check(params, "ShardedParams.set")
        self._set_leaves([leaf for _, leaf in flat])

    def _set_leaves(self, leaves):
        for k, (u, i) in enumerate(self._leaf_src):
            self.units[u].set_values(i, np.asarray(leaves[k], np.float32))

    # ---- reading back ----
    def gather(self):
        """Collective. The full fp32 params as a pytree of new numpy arrays, structured as shard()'s."""
        return self.treedef.unflatten([self.units[u].gather(i) for u, i in self._leaf_src])

    def gather_grads(self):
        """Collective, for tests and debugging. The reduced fp32 grads (the ranks' mean by default) as a
        pytree of new numpy arrays: after a pass's backward, before step() (Unit.gather_grad); not inside
        no_sync() while grads wait unreduced."""
        return self.treedef.unflatten([self.units[u].gather_grad(i) for u, i in self._leaf_src])

    # ---- one DLPack import per unit ----
    def _import(self, u):
        """Inside unit u's block: its params as JAX arrays, one DLPack import of the whole flat span
        (Unit.flat_array: the params lie at their flat_range offsets from param 0's pointer, as they do today),
        else one import per param. Returns (arrays, layout for _unit_leaves, the imported (lo, hi) bytes)."""
        jax = _jax()
        unit = self.units[u]
        numels = [unit.numel(i) for i in range(len(unit.names))]
        flat = unit.flat_array()
        if flat is not None:
            arr, offsets = flat
            layout = tuple((0, offsets[i], n, unit.shapes[i]) for i, n in enumerate(numels))
            return (jax.dlpack.from_dlpack(arr),), layout, (arr.ptr, arr.ptr + arr.nbytes)
        live = [i for i, n in enumerate(numels) if n]
        if not live:  # every param has zero elements: nothing to import
            return (), tuple((0, 0, 0, unit.shapes[i]) for i in range(len(numels))), (0, 0)
        views = {i: DeviceArray(unit.param_array(i).ptr, (numels[i],), self._dtype, owner=unit, readonly=True)
                 for i in live}
        slot = {i: k for k, i in enumerate(live)}
        layout = tuple((slot.get(i, 0), 0, n, unit.shapes[i]) for i, n in enumerate(numels))
        span = (min(v.ptr for v in views.values()), max(v.ptr + v.nbytes for v in views.values()))
        return tuple(jax.dlpack.from_dlpack(views[i]) for i in live), layout, span

    def _add_grads(self, u, grads):
        """Adds a unit's JAX grads (blocked on) into its grad buffers from JAX's memory (Unit.grad_accumulate:
        in fp32, rounded once to param_dtype). On a GPU the adds are queued on the block's stream: it is
        synchronized before the grads may go back to JAX's allocator."""
        unit = self.units[u]
        for i, g in enumerate(grads):
            if unit.numel(i):
                unit.grad_accumulate(i, g if hasattr(g, "unsafe_buffer_pointer") else np.ascontiguousarray(g))
        if self.ctx.device_kind == "cuda":
            cudart.load().stream_synchronize(unit._last_stream or 0, self.ctx.device_id)

    def _scale(self):
        return np.float32(self.ctx.loss_scale)

    # ---- whole-function mode ----
    def value_and_grad(self, loss_fn, has_aux=False):
        """Whole-function mode. Returns train(*args, **kwargs) -> loss (a float; (loss, aux) with has_aux,
        aux as numpy copies) that runs jax.value_and_grad(loss_fn) (jitted; one compile per loss_fn and
        input shapes, shared by the ranks) on the full params and ADDS the grads into libfsdp's buffers:
        backward_begin on every unit in order (each gathers its params), one DLPack import per unit, the
        jitted call blocked on, the grads added, backward_end on every unit in reverse order (the grads
        reduce). Call step() after it (several calls before a step accumulate: scale the loss yourself).

        loss_fn(params, *args, **kwargs): params is the pytree shard() saw, its leaves in the context's
        param_dtype; args/kwargs are traced (arrays or pytrees of arrays; close over static values). Keeps
        every unit gathered during the call (the whole model's params, as JAX needs them at once); use
        layerwise() to hold fewer. Under fp16's dynamic loss scaling the grads are of loss * ctx.loss_scale,
        and the loss returned is the unscaled one."""
        self._check_device("value_and_grad")

        def train(*args, **kwargs):
            with self._pass("value_and_grad"):
                return self._whole(loss_fn, has_aux, args, kwargs)
        return train

    def step_fn(self, loss_fn, has_aux=False):
        """value_and_grad(loss_fn) followed by step(): train(*args, **kwargs) -> loss."""
        vg = self.value_and_grad(loss_fn, has_aux)

        def train(*args, **kwargs):
            out = vg(*args, **kwargs)
            self.step()
            return out
        return train

    def _whole(self, loss_fn, has_aux, args, kwargs):
        jax = _jax()
        n = len(self.units)
        for unit in self.units:
            unit.backward_begin()
        imported = [self._import(u) for u in range(n)]
        layouts = tuple(lay for _, lay, _ in imported)
        fn = _cached(("whole", loss_fn, bool(has_aux), self.treedef, tuple(self._leaf_src), layouts, self._dtype),
                     lambda: _whole_fn(loss_fn, bool(has_aux), self.treedef, self._leaf_src, layouts, self._dtype))
        out = fn(tuple(arrs for arrs, _, _ in imported), self._scale(), args, kwargs)
        del imported
        jax.block_until_ready(out)  # everything computed from the views, before any *_end
        loss, aux, grads = out
        del out
        loss = float(np.asarray(loss))
        if has_aux:
            aux = jax.tree_util.tree_map(lambda a: np.array(a, copy=True), aux)
        for u in range(n):
            self._add_grads(u, [grads[k] for k in self._groups[u][1]])
        del grads
        for unit in reversed(self.units):
            unit.backward_end()
        return (loss, aux) if has_aux else loss

    # ---- layer-wise mode ----
    def layerwise(self, layer_fns, loss_fn):
        """Layer-wise mode: one unit gathered at a time (plus what prefetch adds). Returns train(x,
        *loss_args) -> loss (a float) that runs the units as a chain, x -> f(params, x) per unit, then
        loss_fn(y, *loss_args), and ADDS the param grads into libfsdp's buffers; call step() after it.

        layer_fns: the chain in execution order, every unit once: a dict or list of (unit name, f) pairs, or
        a list of functions, one per unit in `units` order. f(params, x) -> y: params is the unit's subtree
        of the pytree (for the root unit: the whole pytree with the other units' leaves None), x and y arrays
        or pytrees of arrays; jitted once per function and shapes, shared by the ranks.

        Forward: forward_begin, f (jitted), blocked on, forward_end, unit by unit; each unit's input is kept
        (on the host's side, not libfsdp's). Backward, in reverse: backward_begin, jax.vjp of f at the kept
        input (f runs again: activation checkpointing per unit, as the gathered params may not be kept across
        forward_end), blocked on, grads added, backward_end. Gathered at once under FULL_SHARD and
        HYBRID_SHARD: the unit computing, plus one prefetched (forward_prefetch=1 in forward,
        backward_prefetch=pre or post in backward) while limit_all_gathers (default 2) allows; so at most
        max(1, min(2, limit_all_gathers)) units. SHARD_GRAD_OP keeps every unit gathered from its forward to
        its backward by design."""
        self._check_device("layerwise")
        chain = self._chain(layer_fns)

        def train(x, *loss_args):
            with self._pass("layerwise"):
                return self._layerwise(chain, loss_fn, x, loss_args)
        return train

    def _chain(self, layer_fns):
        names = self.unit_names
        if isinstance(layer_fns, dict):
            pairs = list(layer_fns.items())
        else:
            pairs = list(layer_fns)
            if pairs and all(callable(p) for p in pairs):
                if len(pairs) != len(names):
                    raise ValueError(f"layerwise: {len(pairs)} layer functions for {len(names)} units {names}; "
                                     f"give one per unit, or (unit name, f) pairs")
                pairs = list(zip(names, pairs))
        chain, seen = [], set()
        for item in pairs:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) and callable(item[1])):
                raise TypeError(f"layerwise: {item!r} is not a (unit name, function) pair")
            name, f = item
            if name not in names:
                raise ValueError(f"layerwise: no unit {name!r}; units are {names}")
            if name in seen:
                raise ValueError(f"layerwise: unit {name!r} appears twice; each unit runs once per pass")
            seen.add(name)
            chain.append((names.index(name), f))
        missing = [n for n in names if n not in seen]
        if missing:
            raise ValueError(f"layerwise: no function for unit(s) {missing}; every unit must run once per pass")
        return chain

    def _layerwise(self, chain, loss_fn, x, loss_args):
        jax = _jax()
        inputs = []
        for u, f in chain:
            unit = self.units[u]
            unit.forward_begin()
            arrays, layout, span = self._import(u)
            treedef, positions = self._unit_trees[u]
            fwd = _cached(("fwd", f, treedef, positions, layout, self._dtype),
                          lambda: _layer_fwd(f, treedef, positions, layout, self._dtype))
            inputs.append(x)
            y = jax.block_until_ready(fwd(arrays, x))
            del arrays
            x = _unalias(jax, y, span)
            del y
            unit.forward_end()
        lg = _cached(("loss", loss_fn), lambda: _loss_grad_fn(loss_fn))
        loss, ct = jax.block_until_ready(lg(x, self._scale(), tuple(loss_args)))
        loss = float(np.asarray(loss))
        del x
        for pos in range(len(chain) - 1, -1, -1):
            u, f = chain[pos]
            unit = self.units[u]
            unit.backward_begin()
            arrays, layout, span = self._import(u)
            treedef, positions = self._unit_trees[u]
            want_dx = pos > 0
            bwd = _cached(("bwd", f, treedef, positions, layout, self._dtype, want_dx),
                          lambda: _layer_bwd(f, treedef, positions, layout, self._dtype, want_dx))
            grads, dx = jax.block_until_ready(bwd(arrays, inputs[pos], ct))
            del arrays
            inputs[pos] = None
            self._add_grads(u, grads)
            del grads
            ct = _unalias(jax, dx, span)
            del dx
            unit.backward_end()
        return loss

    # ---- pass guards ----
    def _check_device(self, what):
        if self.ctx.device_kind not in ("cpu", "cuda"):
            raise Unsupported(3, f"ShardedParams.{what}: fsdp.jax runs on device=cpu and device=cuda contexts; "
                                 f"this one is {self.ctx.device}")

    def _pass(self, what):
        if not self._busy.acquire(blocking=False):
            raise InvalidState(2, f"ShardedParams.{what}: a pass is already running on this rank's params "
                                  f"(one thread per rank)")
        return _Release(self._busy)

    def close(self):
        """Closes the context shard() created (not one passed in with ctx=). Idempotent."""
        if self._own_ctx:
            self.ctx.close()


class _Release:
    def __init__(self, lock):
        self._lock = lock

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._lock.release()


def _unalias(jax, tree, span):
    """`tree` with every JAX array that lies in the byte range `span` (a unit's imported memory) replaced by a
    copy, blocked on: an output that aliases a param (returned unchanged, forwarded by jit) must not outlive
    the unit's block. Outputs of a jitted call are fresh buffers otherwise, so this copies nothing."""
    lo, hi = span
    if hi <= lo:
        return tree

    def fix(a):
        ptr = getattr(a, "unsafe_buffer_pointer", None)
        if ptr is not None and lo <= ptr() < hi:
            return jax.block_until_ready(jax.numpy.array(a, copy=True))
        return a
    return jax.tree_util.tree_map(fix, tree)


def shard(params, units=1, ctx=None, group=None, rank=None, **config):
    """Puts a JAX params pytree into libfsdp units and returns a ShardedParams.

    units chooses the subtrees that become units (every leaf outside them goes into one unit "root"):
      - an int d: the subtrees d keys deep (units=1: each top-level entry; units=2 on
        {"layers": [...], "head": {...}}: "head", "layers.0", "layers.1", ...); a leaf shallower than d
        joins its parent's subtree, never a unit by itself; 0: one unit for everything;
      - a predicate on dotted paths, tried top-down: the first subtree (or leaf) it is true for is a unit,
        e.g. lambda p: re.fullmatch(r"layers\\.\\d+|embed|head", p);
      - a list of dotted subtree names: those units, in that order.
    Units are ordered by their first leaf in JAX's order (dict keys sorted), a list's in its order; the
    root unit, if any, comes last with a list. Unit names are the subtrees' dotted paths, param names the
    leaves' (unique across units, as full checkpoints need).

    ctx: register into an existing Context (then no config keywords); else a Context is made from
    **config (docs/configuration.md) on `group`/`rank` (None, None: one rank, or the launcher's under
    mpirun). sync_module_states defaults to 1 here: every rank passes its pytree (for the structure) and
    rank 0's values win, so thread ranks that initialised differently still start equal; pass
    sync_module_states=0 to keep each rank's own values. Collective."""
    jax = _jax()
    jtu = jax.tree_util
    flat, treedef = jtu.tree_flatten_with_path(params)
    if not flat:
        raise ValueError("shard: params has no leaves")
    paths = [tuple(p) for p, _ in flat]
    names = [path_name(p) or "param" for p in paths]
    seen = {}
    for k, name in enumerate(names):
        if name in seen:
            raise ValueError(f"shard: leaves {seen[name]} and {k} are both named {name!r} (a key holds a '.'); "
                             f"param names must be unique")
        seen[name] = k
    shapes = []
    for (p, leaf), name in zip(flat, names):
        dt = getattr(leaf, "dtype", None)
        if dt is None:
            dt = np.asarray(leaf).dtype
        if not np.issubdtype(np.dtype(dt), np.floating) and str(dt) != "bfloat16":
            raise ValueError(f"shard: leaf {name!r} has dtype {dt}; only floating-point leaves are params "
                             f"(keep integer state out of the pytree)")
        shapes.append(tuple(int(d) for d in _shape(leaf)))

    cut, order = _unit_prefixes(paths, units)
    groups = {}  # unit name -> (prefix length, [leaf index, ...]); '' is the root
    for k, (p, c) in enumerate(zip(paths, cut)):
        key = path_name(p[:c]) if c else ""
        groups.setdefault(key, (c, []))[1].append(k)
    if order is not None:
        keys = list(order) + ([""] if "" in groups else [])
    else:
        keys = list(groups)  # insertion order: by first leaf
    root_name = ROOT
    while root_name in groups:
        root_name = "_" + root_name
    unit_list, unit_trees = [], []
    for key in keys:
        c, leaves = groups[key]
        unit_list.append((key if key else root_name, leaves))
        if key:
            node = params
            for kk in paths[leaves[0]][:c]:
                node = _child(jtu, node, kk)
            unit_trees.append((jtu.tree_structure(node), None))
        else:
            unit_trees.append((treedef, tuple(leaves)))

    own = ctx is None
    if own:
        options = dict(config)
        options.setdefault("sync_module_states", 1)
        with Config(**options) as cfg:
            sharding = cfg.get("sharding")
            ctx = Context(cfg, group, rank)
    else:
        if config or group is not None or rank is not None:
            raise InvalidArgument(1, "shard: ctx= was given, so config keywords, group and rank belong to that "
                                     "Context; pass them when creating it")
        sharding = None
    try:
        sp = ShardedParams(ctx, own, sharding, treedef, names, shapes, unit_list, unit_trees)
        sp._check_device("shard")
        for uname, leaves in unit_list:
            sp._add_unit(ctx.register_unit(uname, [(names[k], shapes[k]) for k in leaves]))
        sp._set_leaves([leaf for _, leaf in flat])
    except BaseException:
        if own:
            ctx.close()
        raise
    return sp
