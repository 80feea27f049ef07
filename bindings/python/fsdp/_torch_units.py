# _torch_units.py - fsdp.torch: which params make which unit (_group), and the adapter's per-unit pieces.
"""The parts of fsdp.torch (torch.py) that hold no hooks: the grouping of a module's params into units
(shard()'s `units` argument, ties and the root unit), the per-unit state the hooks keep, the record the
saved-tensor hooks keep instead of a tensor in gathered memory, and the identity autograd Function whose
backward ends a unit's backward."""
import weakref

import torch
import torch.nn as nn

from .core import InvalidArgument


def _tensors(obj, out):
    """Appends the tensors in a module's output (tensor, tuple/list, dict, ModelOutput) to `out`."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            _tensors(o, out)
    elif isinstance(obj, dict) or hasattr(obj, "values") and callable(obj.values):
        for o in obj.values():
            _tensors(o, out)
    return out


class _SavedParam:
    """What the pack hook saves instead of a tensor that lies in a unit's gathered memory."""
    __slots__ = ("unit", "key", "size", "stride", "offset", "dtype")

    def __init__(self, unit, key, t):
        self.unit, self.key = unit, key
        self.size, self.stride, self.offset, self.dtype = t.size(), t.stride(), t.storage_offset(), t.dtype


class _PostBackward(torch.autograd.Function):
    """Identity on a unit module's inputs: its backward runs once the inputs' grads are computed, that is
    after the module's whole backward (the adapter ends the unit's backward there)."""

    @staticmethod
    def forward(ctx, state, *tensors):
        ctx.state = state
        return tensors if len(tensors) != 1 else tensors[0]

    @staticmethod
    def backward(ctx, *grads):
        state = ctx.state
        state.owner()._post_backward(state)
        return (None,) + grads


class _UnitState:
    """The adapter's view of one unit: its params, its views now, and where it is in the step."""

    def __init__(self, owner, unit, module, params):
        self.owner = weakref.ref(owner)
        self.unit, self.module, self.params = unit, module, params  # params: [nn.Parameter] in unit order
        self.phase = None  # None (sharded), "forward", "backward"
        self.base = None  # the tensor(s) the current views slice: [flat] or one per param
        self.views = None  # [tensor] of the params, in unit order
        self.grads = None  # [tensor] of the grad buffers, in unit order (in backward)
        self.index = {p: i for i, p in enumerate(params)}
        self.versions = None
        self.cache = {}  # (grad, data pointer) -> (base tensors, views): gathered slots come back
        self.pending = 0  # forward calls whose _PostBackward has not run yet (this step)
        self.in_forward = 0  # nested calls of the unit module
        self.requires_grad = [True] * len(params)  # the flags libfsdp was last told (_sync_trainable)


def _group(model, units):
    """[(unit name, module, [(param name, param)])]: the root first (params outside every unit module,
    and params shared between units), then each unit module in module order."""
    if units is None:
        unit_modules = []
    elif isinstance(units, type) or (isinstance(units, tuple) and units and all(isinstance(u, type) for u in units)):
        unit_modules = [m for m in model.modules() if isinstance(m, units) and m is not model]
    elif callable(units) and not isinstance(units, nn.Module):
        unit_modules = [m for n, m in model.named_modules() if m is not model and units(n, m)]
    else:
        unit_modules = list(units)
        for m in unit_modules:
            if not isinstance(m, nn.Module):
                raise InvalidArgument(1, f"fsdp.torch.shard: units must be modules, module classes or a predicate "
                                         f"(name, module) -> bool; got {type(m).__name__}")
    names, rank_of = {}, {}
    for n, m in model.named_modules(remove_duplicate=False):
        names.setdefault(m, n)
        rank_of.setdefault(m, len(rank_of))
    for m in unit_modules:
        if m not in names:
            raise InvalidArgument(1, f"fsdp.torch.shard: unit module {type(m).__name__} is not part of the model")
    # A chosen module inside another chosen one stays in the outer one (no nesting).
    unit_modules = sorted(set(unit_modules), key=rank_of.get)
    chosen, covered = [], set()
    for m in unit_modules:
        if m not in covered:
            chosen.append(m)
            covered |= set(m.modules())
    # Where each param is used: in which unit modules, and whether by a module outside all of them.
    owners = {}
    for m in chosen:
        for p in m.parameters():
            owners.setdefault(p, set()).add(m)
    outside = {p for m in model.modules() if m not in covered for p in m.parameters(recurse=False)}
    in_units = {m: [] for m in chosen}
    root = []
    for n, p in model.named_parameters():
        o = owners.get(p, ())
        if len(o) == 1 and p not in outside:
            in_units[next(iter(o))].append((n, p))
        else:
            root.append((n, p))
    groups = []
    if root:
        groups.append(("root", model, root))
    for m in chosen:
        if in_units[m]:
            groups.append((names[m] or type(m).__name__, m, in_units[m]))
    return groups
