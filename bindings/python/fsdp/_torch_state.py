# _torch_state.py - fsdp.torch: the params outside the brackets, and model.state_dict / load_state_dict on the full model.
"""Outside a unit's forward or backward a sharded param holds no values. It still has its shape: its
``.data`` is one NaN of the param_dtype, expanded to the param's shape (no memory), so ``p.shape``,
``p.numel()``, ``model.num_parameters()`` and the like give the unsharded model's numbers, a read of the
values gives NaN, an in-place write either fails in torch (one element stands for many) or is caught at
the next forward, step or state_dict (the placeholder's version counter moved), naming the param.

``model.state_dict()`` and ``model.load_state_dict()`` give and take the full model: a state_dict hook
replaces each param's entry by its gathered fp32 values (collective: every rank calls it; tied params
stay one tensor under both names), and a load hook gives each param a real fp32 tensor for torch to copy
into, then hands the values to libfsdp (collective too: with sync_module_states, rank 0's win). So
``torch.save(model.state_dict())``, ``model.save_pretrained(dir)`` (transformers, whose state_dict call
this is) and ``from_pretrained`` round trips work as on the unsharded model."""
import functools

import torch


class Placeholders:
    """One NaN per param, expanded to its shape, and the param's version when it was set."""

    def __init__(self, dtype, device):
        self.dtype, self.device = dtype, device
        self.of = {}  # param -> (placeholder tensor, its version when set)

    def put(self, p):
        """Makes `p`'s data its placeholder (made once; its version is noted now)."""
        got = self.of.get(p)
        t = got[0] if got is not None else torch.full((), float("nan"), dtype=self.dtype,
                                                      device=self.device).expand(p.shape)
        p.data = t
        self.of[p] = (t, p._version)  # the param's own counter: `p.data = t` does not share t's

    def holds(self, p):
        got = self.of.get(p)
        return got is not None and p.data_ptr() == got[0].data_ptr()

    def written(self):
        """The params whose placeholder was written in place since it was set."""
        return [p for p, (t, v) in self.of.items() if self.holds(p) and p._version != v]


def written_message(names):
    return (f"fsdp.torch: param{'s' if len(names) > 1 else ''} {', '.join(repr(n) for n in names)} "
            f"{'were' if len(names) > 1 else 'was'} written in place outside a forward (an init like p.normal_() "
            f"or p.zero_(), an edit under torch.no_grad()): a sharded param holds no values there, so the write "
            f"is lost. Set values with model.load_state_dict(...), sharded.load_pretrained(...) or before shard()")


class StateDictHooks:
    """The hooks that make model.state_dict() / load_state_dict() work on the full model."""

    def __init__(self, sharded, ranks="all"):
        if ranks not in ("all", "rank0"):
            raise ValueError(f"fsdp.torch: state_dict_ranks must be 'all' or 'rank0', not {ranks!r}")
        self.sh, self.ranks = sharded, ranks
        model = sharded.model
        self.names = list(model.named_parameters(remove_duplicate=False))
        self.loading = None
        # (torch marks its hooks with an attribute, which a bound method cannot take: partials)
        self.handles = [model.register_state_dict_post_hook(functools.partial(StateDictHooks.saved, self)),
                        model.register_load_state_dict_pre_hook(functools.partial(StateDictHooks.before_load, self)),
                        model.register_load_state_dict_post_hook(functools.partial(StateDictHooks.after_load, self))]

    def remove(self):
        for h in self.handles:
            h.remove()
        self.handles = []

    def saved(self, module, state_dict, prefix, local_metadata):
        sh = self.sh
        sh._check_outside_writes()
        keep = self.ranks == "all" or sh.ctx.rank == 0
        full = {}
        for st in sh._states:  # unit by unit: each gather is collective, in the same order on every rank
            for i, p in enumerate(st.params):
                full[p] = torch.from_numpy(st.unit.gather(i))
        for name, p in self.names:
            key = prefix + name
            if key in state_dict:
                if keep:
                    state_dict[key] = full[p]
                else:
                    del state_dict[key]
        return None

    def before_load(self, module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        if local_metadata.get("assign_to_params_buffers"):
            raise RuntimeError("fsdp.torch: load_state_dict(..., assign=True) would replace the sharded params; "
                               "call it without assign")
        sh = self.sh
        sh._check_outside_writes()
        if any(st.phase is not None for st in sh._states):
            raise RuntimeError("fsdp.torch: load_state_dict inside a forward or backward; call it between steps")
        # torch copies each entry into its param: give each a real fp32 tensor to copy into.
        self.loading = {}
        for name, p in self.names:
            if p in self.loading:
                continue
            self.loading[p] = prefix + name in state_dict
            p.data = torch.zeros(p.shape, dtype=torch.float32)
        return None

    def after_load(self, module, incompatible):
        sh, loading, self.loading = self.sh, self.loading, None
        if loading is None:
            return
        try:
            for st in sh._states:  # collective with sync_module_states: every rank, in the same order
                for i, p in enumerate(st.params):
                    if loading.get(p):
                        st.unit.set_values(i, p.data.numpy())
        finally:
            for p in loading:
                sh._placeholders.put(p)
