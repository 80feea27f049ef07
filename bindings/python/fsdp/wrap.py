# wrap.py - wrap(): groups a dict of named numpy params into units and sets them up on a Context.
import numpy as np

from .core import Config, Context, InvalidArgument


def group_params(params, auto_wrap=None, block=None, min_num_params=None):
    """Returns [(unit_name, [param_name, ...]), ...] in order of first appearance.

    auto_wrap "block" (the default when `block` is given): "BLOCK.I.rest" goes into unit "BLOCK.I";
      any other param into the unit named by its first dotted component ("head.w" -> "head").
    auto_wrap "size" (default when min_num_params is given): consecutive params fill a unit until it
      holds >= min_num_params elements; units are "unit0", "unit1", ...
    auto_wrap "none" (default otherwise): one unit "root" with every param."""
    if auto_wrap is None:
        auto_wrap = "block" if block else ("size" if min_num_params else "none")
    names = list(params)
    if auto_wrap == "none":
        return [("root", names)] if names else []
    if auto_wrap == "size":
        if not min_num_params or int(min_num_params) < 1:
            raise ValueError("wrap: auto_wrap='size' needs min_num_params >= 1")
        units, cur, count = [], [], 0
        for n in names:
            cur.append(n)
            count += int(np.size(params[n]))
            if count >= int(min_num_params):
                units.append((f"unit{len(units)}", cur))
                cur, count = [], 0
        if cur:
            units.append((f"unit{len(units)}", cur))
        return units
    if auto_wrap == "block":
        if not block:
            raise ValueError("wrap: auto_wrap='block' needs block='PREFIX' (e.g. block='layers')")
        groups = {}
        prefix = block.rstrip(".") + "."
        for n in names:
            if n.startswith(prefix) and "." in n[len(prefix):]:
                key = prefix + n[len(prefix):].split(".", 1)[0]
            else:
                key = n.split(".", 1)[0]
            groups.setdefault(key, []).append(n)
        return list(groups.items())
    raise ValueError(f"wrap: auto_wrap must be 'block', 'size' or 'none', not {auto_wrap!r}")


class Wrapped:
    """The result of wrap(): .ctx, .units (forward order), .unit_of(param), .params(unit), .step()..."""

    def __init__(self, ctx, units, sharding):
        self.ctx, self.units = ctx, units
        self.sharding = sharding  # the library's name of the strategy in effect (FULL_SHARD, ...)
        self._unit_of = {n: u for u in units for n in u.names}

    def __repr__(self):
        where = f"rank {self.ctx.rank} of {self.ctx.world_size}" if not self.ctx.closed else "closed"
        return (f"Wrapped({self.sharding}, param_dtype={self.ctx.param_dtype}, {where}, "
                f"units={[u.name for u in self.units]})")

    def unit_of(self, param_name):
        return self._unit_of[param_name]

    def unit(self, name):
        for u in self.units:
            if u.name == name:
                return u
        raise KeyError(f"no unit {name!r}; units are {[u.name for u in self.units]}")

    def _u(self, unit):
        return self.unit(unit) if isinstance(unit, str) else unit

    def params(self, unit):
        """{param name: zero-copy view} of a unit; inside its forward() or backward() block."""
        return self._u(unit).params()

    def grads(self, unit):
        """{param name: zero-copy grad view} of a unit; inside its backward() block."""
        return self._u(unit).grads()

    def gather(self):
        """Collective. {param name: full fp32 values} of every param."""
        return {n: u.gather(n) for u in self.units for n in u.names}

    def step(self):
        self.ctx.step()

    def set_lr(self, lr):
        self.ctx.set_lr(lr)

    def no_sync(self):
        return self.ctx.no_sync()

    def memory_stats(self):
        return self.ctx.memory_stats()

    def save(self, dir, kind="sharded"):
        self.ctx.save(dir, kind)

    def load(self, dir, strict=True):
        return self.ctx.load(dir, strict)

    def finalize(self):
        self.ctx.finalize()

    def close(self):
        self.ctx.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def wrap(params, auto_wrap=None, mp="fp32", shard_strat="FULL_SHARD", block=None, min_num_params=None,
         group=None, rank=None, **config):
    """numpy only. Creates a Context (param_dtype=mp, sharding=shard_strat, plus any other option as a keyword),
    registers the units of group_params(...) and sets every param's values from `params`
    ({name: array}, in forward order). mp: fp32|bf16|fp16; shard_strat: FULL_SHARD (the default, as
    the library's; Zeta's fsdp() defaults to NO_SHARD), SHARD_GRAD_OP (alias SHARD_GRAD), NO_SHARD,
    HYBRID_SHARD (and the library's other names)."""
    for n, v in params.items():
        if type(v).__module__.split(".")[0] in ("torch", "jax", "jaxlib"):
            raise InvalidArgument(1, f"wrap: param {n!r} is a {type(v).__module__}.{type(v).__name__}; wrap() takes "
                                     f"numpy arrays (a name -> array dict in forward order) and its units are name "
                                     f"groups, not modules: for a torch.nn.Module use fsdp.torch.shard(model, units=...)"
                                     f" (tied params stay tied, units follow the modules), for a JAX pytree "
                                     f"fsdp.jax.shard(params, ...)")
    groups = group_params(params, auto_wrap, block, min_num_params)
    options = dict(param_dtype=mp, sharding=shard_strat)
    options.update(config)  # an explicit sharding=/param_dtype= keyword wins over shard_strat/mp
    with Config(**options) as cfg:
        sharding = cfg.get("sharding")
        ctx = Context(cfg, group, rank)
    try:
        units = []
        for uname, names in groups:
            unit = ctx.register_unit(uname, [(n, np.shape(params[n])) for n in names])
            for n in names:
                unit.set_values(n, params[n])
            units.append(unit)
    except BaseException:
        ctx.close()
        raise
    return Wrapped(ctx, units, sharding)
