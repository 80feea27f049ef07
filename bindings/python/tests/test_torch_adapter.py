# test_torch_adapter.py - fsdp.torch against plain torch: the same model, data and AdamW, unsharded, in the test.
"""Each case trains through fsdp.torch.shard at worlds 1, 2 and 4 (thread ranks; test_torch_mpirun below runs
processes) and compares with reference_train (torch_models.py: plain torch, whole batch, torch.optim.AdamW):
the first step's reduced grads through fsdp_gather_grad, every step's loss, and the params after the last
step. Tolerances:

- fp32, world 1: every rank-0 op is the reference's op on the same values, and the grads land in the
  unit's zeroed buffer by an exact add: grads bitwise equal.
- fp32, worlds 2 and 4: each rank's grad is the mean over its rows; their mean equals the full-batch mean
  up to the order of the sums: a few fp32 ulps (rtol 1e-5, atol 1e-6).
- params after 10 steps: libfsdp's AdamW evaluates torch's formula in another order (ulps per step);
  where a grad is near 0, m / sqrt(v) amplifies that, bounded by the step's size lr: atol 2e-5 is 2% of
  one step's largest move.
- bf16 (params and grads bf16, master fp32): the reduction is in bf16 at world 2 (reduce_dtype = param
  dtype): one bf16 rounding of the mean, 2^-8 relative.

torch and transformers come from PyPI (tools/test_python.sh installs them into a reused venv); without
them the module is skipped with the reason, and the runner counts the skip.

The cases with a `device` parameter also run with device=cuda (thread ranks sharing one GPU through the local
communicator) against the same plain-torch run on the GPU; they skip saying why where no GPU is usable
(gpu_env.py). On the GPU the world-1 grads get world 2's tolerance instead of bitwise equality: cuBLAS picks
its kernels by the operands' alignment, and libfsdp's gathered views are aligned otherwise than the
reference's tensors, so the same matmul may sum in another order (fp32 ulps)."""
import copy
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

try:
    import torch
except ImportError as e:  # counted by tools/test_python.sh, which says whether torch should be here
    pytest.skip(f"torch is not installed in this venv ({e}); tools/test_python.sh installs it", allow_module_level=True)

import fsdp
import fsdp.torch as ft
import gpu_env
from torch_models import BATCH, HYPER, Block, make_data, make_gpt2, make_net, mse, reference_train

torch.set_num_threads(1)  # thread ranks share torch's intra-op pool size; one thread each on 2 cores
STEPS = 10
DEVICES = ["cpu", "cuda"]


def on_device(device):
    """The torch device of a test's `device` case (skips the cuda cases where no GPU is usable)."""
    if device == "cuda":
        gpu_env.need_torch_gpu(torch)
        return torch.device("cuda", 0)
    return torch.device("cpu")


def bitwise_here(device):
    """Whether world-1 grads are compared bit for bit (see the module's docstring)."""
    return device == "cpu"


def sharded_train(init, world, steps, units=Block, loss_fn=None, x=None, y=None, micro=1, device="cpu", **options):
    """Thread ranks through fsdp.torch on `device` ("cpu" or "cuda": cuda:0 shared by the ranks); rank 0's
    (losses averaged over the ranks, first step's gathered grads, final state_dict)."""
    x, y = make_data() if x is None else (x, y)
    dev = on_device(device)
    x, y = x.to(dev), y.to(dev)
    loss_fn = loss_fn or mse

    def rank_fn(rank, group):
        model = copy.deepcopy(init).to(dev)
        with ft.shard(model, units=units, group=group, rank=rank, device=str(dev), **HYPER, **options) as sh:
            rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
            xs, ys = x[rows], y[rows]
            losses, grads0 = [], None
            for step in range(steps):
                total = 0.0
                for k, (xm, ym) in enumerate(zip(xs.chunk(micro), ys.chunk(micro))):
                    sync = k == micro - 1
                    with (sh.no_sync() if not sync else _nothing()):
                        loss = loss_fn(model, xm.to(sh.dtype), ym.to(sh.dtype)) / micro
                        loss.backward()
                    total += loss.item()
                if step == 0:
                    grads0 = sh.gather_grads()
                sh.step()
                losses.append(float(sh.ctx.metrics_reduce([total], "avg")[0]))
            return losses, grads0, sh.state_dict()

    return fsdp.run_ranks(world, rank_fn)[0]


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def close(a, b, rtol, atol, what):
    for name in b:
        torch.testing.assert_close(a[name].float(), b[name].float(), rtol=rtol, atol=atol,
                                   msg=lambda m: f"{what} {name}: {m}")


CASES = [(1, "FULL_SHARD", {}), (2, "FULL_SHARD", {}), (4, "FULL_SHARD", {}), (2, "SHARD_GRAD_OP", {}),
         (4, "SHARD_GRAD_OP", {}), (4, "HYBRID_SHARD", {"shard_group_size": 2}), (2, "FULL_SHARD", {"offload": "cpu"}),
         (2, "FULL_SHARD", {"debug_poison": 1})]


_NET_REFERENCE = {}


def net_reference(device):
    if device not in _NET_REFERENCE:
        init = make_net()
        x, y = make_data()
        _NET_REFERENCE[device] = init, reference_train(init, x, y, STEPS, device=on_device(device))
    return _NET_REFERENCE[device]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("world,sharding,extra", CASES, ids=[f"{w}-{s}-{'-'.join(e) or 'plain'}" for w, s, e in CASES])
def test_mlp_matches_plain_torch(world, sharding, extra, device):
    init, (ref_losses, ref_grads, ref_params) = net_reference(device)
    losses, grads, params = sharded_train(init, world, STEPS, sharding=sharding, device=device, **extra)
    assert set(grads) == set(ref_grads)
    if world == 1 and bitwise_here(device):
        for n in ref_grads:
            assert torch.equal(grads[n], ref_grads[n]), f"grad of {n} differs at world 1"
    else:
        close(grads, ref_grads, 1e-5, 1e-6, "grad")
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    close(params, ref_params, 0, 2e-5, "param")


@pytest.mark.parametrize("device", DEVICES)
def test_mlp_no_sync_accumulation_matches_the_whole_batch(device):
    init, _ = net_reference(device)
    x, y = make_data()
    ref_losses, ref_grads, ref_params = reference_train(init, x, y, 4, micro=2, device=on_device(device))
    losses, grads, params = sharded_train(init, 2, 4, micro=2, device=device)
    close(grads, ref_grads, 1e-5, 1e-6, "grad")
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    close(params, ref_params, 0, 2e-5, "param")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("world", [1, 2])
def test_mlp_bf16_matches_torch_in_bf16(world, device):
    init = make_net()
    x, y = make_data()
    ref_losses, ref_grads, _ = reference_train(init, x, y, 3, dtype=torch.bfloat16, device=on_device(device))
    losses, grads, _ = sharded_train(init, world, 3, param_dtype="bf16", device=device)
    if world == 1 and bitwise_here(device):  # the same bf16 ops; the grads reach the fp32 shard by exact conversions
        for n in ref_grads:
            assert torch.equal(grads[n], ref_grads[n]), f"bf16 grad of {n} differs at world 1"
    else:
        # Each rank's backward runs in bf16 over half the rows, so its sums round differently from the
        # whole batch's at every op, and the mean is rounded to bf16 once more: a few bf16 ulps (2^-8) of
        # the tensor's largest grad.
        for n in ref_grads:
            scale = ref_grads[n].abs().max().item()
            torch.testing.assert_close(grads[n], ref_grads[n], rtol=0, atol=4 * 2 ** -8 * scale,
                                       msg=lambda m: f"bf16 grad {n}: {m}")
    np.testing.assert_allclose(losses, ref_losses, rtol=2 ** -7)


def test_param_views_are_bf16_torch_tensors_only_inside_the_bracket():
    seen = {}

    def rank_fn(rank, group):
        model = make_net()
        with ft.shard(model, units=Block, group=group, rank=rank, param_dtype="bf16") as sh:
            blk = model.blocks[1]
            def look(m, args):
                seen[rank] = (m.fc1.weight.dtype, tuple(m.fc1.weight.shape))
            blk.register_forward_pre_hook(look)
            model(torch.randn(2, 6, dtype=torch.bfloat16)).float().sum().backward()
            sh.step()
            w = blk.fc1.weight
            return (tuple(w.shape), w.untyped_storage().nbytes(), bool(w.isnan().all()),
                    w.grad.untyped_storage().nbytes(), bool(w.grad.isnan().all()))

    outside = fsdp.run_ranks(2, rank_fn)
    assert seen[0] == (torch.bfloat16, (64, 16)) and seen[1] == seen[0]
    # Outside the bracket: the param's shape, one bf16 NaN of memory, and a grad that is NaN too.
    assert outside[0] == ((64, 16), 2, True, 2, True), "a param holds memory, or a grad, outside its unit's bracket"


@pytest.mark.parametrize("device", DEVICES)
def test_gpt2_matches_plain_torch_with_tied_embeddings(device):
    pytest.importorskip("transformers", reason="transformers is not installed in this venv")
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    dev = on_device(device)
    init = make_gpt2()
    ids = torch.randint(0, 128, (BATCH, 16), generator=torch.Generator().manual_seed(3)).to(dev)

    def lm_loss(model, x, y):
        return model(x.long(), labels=x.long()).loss

    ref = copy.deepcopy(init).to(dev)
    opt = torch.optim.AdamW(ref.parameters(), lr=HYPER["lr"], eps=HYPER["eps"], weight_decay=HYPER["weight_decay"],
                            foreach=False)
    ref_losses = []
    for step in range(STEPS):
        loss = lm_loss(ref, ids, ids)
        loss.backward()
        if step == 0:
            ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())
    for world in (1, 2, 4):
        losses, grads, sd = sharded_train(init, world, STEPS, units=GPT2Block, loss_fn=lm_loss, x=ids, y=ids,
                                          debug_poison=1, device=device)
        if world == 1 and bitwise_here(device):
            for n in ref_grads:
                assert torch.equal(grads[n], ref_grads[n]), f"grad of {n} differs at world 1"
        else:
            close(grads, ref_grads, 1e-5, 1e-6, f"world {world} grad")
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
        # The state_dict keeps the tie (one tensor under both names) and loads into transformers.
        assert sd["lm_head.weight"] is sd["transformer.wte.weight"]
        fresh = make_gpt2(seed=7).to(dev)
        fresh.load_state_dict(sd)
        with torch.no_grad():
            torch.testing.assert_close(fresh(ids).logits, ref(ids).logits, rtol=0, atol=2e-4)


@pytest.mark.parametrize("sharded_files", [False, True], ids=["one-file", "index"])
def test_gpt2_loads_hugging_face_weights_by_name_at_worlds_1_and_3(tmp_path, sharded_files):
    """transformers' save_pretrained (safetensors, one file or sharded with an index), loaded by name into a
    GPT-2 of another init sharded over 1 and 3 ranks: the same logits as the saved model's."""
    pytest.importorskip("transformers", reason="transformers is not installed in this venv")
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    saved = make_gpt2(seed=0)
    saved.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="100KB" if sharded_files else "1GB")
    assert (tmp_path / "model.safetensors.index.json").exists() == sharded_files
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = saved(ids).logits

    def rank_fn(rank, group):
        model = make_gpt2(seed=9)
        with ft.shard(model, units=GPT2Block, group=group, rank=rank) as sh:
            report = sh.load_pretrained(str(tmp_path))
            with torch.no_grad():
                return report, model(ids).logits, sh.ctx.step_count

    for world in (1, 3):
        for report, logits, step in fsdp.run_ranks(world, rank_fn):
            assert report == {"missing": [], "unexpected": []} and step == 0
            # The same fp32 params and the same ops: the same logits, to the bit.
            assert torch.equal(logits, want), f"world {world}: logits differ from the saved model's"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_gpt2_trained_at_world_2_exports_what_transformers_loads(tmp_path, dtype, device):
    """Three steps through fsdp.torch at world 2, then save_pretrained (fsdp_export, sharded past 100 KB for
    bf16): transformers' from_pretrained gives the logits of the trained model (fp32: bit for bit; bf16:
    those of its params rounded to bf16, which is what the file holds)."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed in this venv")
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    dev = on_device(device)
    init = make_gpt2(seed=0)
    ids = torch.randint(0, 128, (BATCH, 16), generator=torch.Generator().manual_seed(5)).to(dev)

    def rank_fn(rank, group):
        model = copy.deepcopy(init).to(dev)
        with ft.shard(model, units=GPT2Block, group=group, rank=rank, device=str(dev), **HYPER) as sh:
            rows = ids[rank * BATCH // 2:(rank + 1) * BATCH // 2]
            for _ in range(3):
                model(rows, labels=rows).loss.backward()
                sh.step()
            sh.save_pretrained(str(tmp_path), dtype=dtype, max_shard_bytes=100_000 if dtype == "bf16" else None)
            return sh.state_dict()

    trained = fsdp.run_ranks(2, rank_fn)[0]
    assert (tmp_path / "model.safetensors.index.json").exists() == (dtype == "bf16")
    loaded = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path), dtype=torch.float32).to(dev)
    want = make_gpt2(seed=7).to(dev)
    if dtype == "bf16":
        trained = {k: v.to(torch.bfloat16).to(torch.float32) for k, v in trained.items()}
    want.load_state_dict(trained)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, want(ids).logits)


class _NaiveGlue:
    """The obvious glue without saved-tensor hooks: each unit's params are the DLPack views themselves,
    made leaves for autograd, and kept by autograd past forward_end; their grads are added into the
    unit's buffers after loss.backward(). Under debug_poison its backward reads NaN."""

    def __init__(self, ctx, init):
        self.ctx, self.units, self.modules = ctx, [], []
        for k, blk in enumerate(init.blocks):
            names = [n for n, _ in blk.named_parameters()]
            u = ctx.register_unit(f"block{k}", [(n, tuple(p.shape)) for n, p in blk.named_parameters()])
            for n, p in blk.named_parameters():
                u.set_values(n, p.detach().numpy())
            self.units.append((u, names))
        self.head = copy.deepcopy(init)  # inp, ln_f and out stay plain torch (the test only reads the loss)

    def loss(self, x, y):
        h = self.head.inp(x)
        leaves = []
        for u, names in self.units:
            with u.forward():
                ps = {n: torch.from_dlpack(u.param_array(n)).requires_grad_() for n in names}
                h = torch.func.functional_call(self.head.blocks[0], ps, (h,))
            leaves.append(ps)
        loss = ((self.head.out(self.head.ln_f(h)) - y) ** 2).mean()
        # The test's ordering, not the glue's: debug_poison's fill is queued on the comm stream after the
        # slot's last reader, so a collective queued after it returns once every slot holds NaN (as in
        # DebugPoison.* of test_misuse). Without it the read below races the fill (a step read NaN or not).
        self.ctx.metrics_reduce([0.0])
        loss.backward()  # reads the views saved in forward: the units' gathered memory, given back
        for (u, names), ps in reversed(list(zip(self.units, leaves))):
            with u.backward():
                for n in names:
                    u.grad(n)[...] += ps[n].grad.numpy()
        return loss.item()


@pytest.mark.parametrize("poison", [0, 1])
def test_naive_glue_reads_freed_memory_and_poison_makes_it_nan(poison):
    init = make_net()
    x, y = make_data()

    def rank_fn(rank, group):
        with fsdp.Context(group=group, rank=rank, sharding="FULL_SHARD", debug_poison=poison, **HYPER) as ctx:
            glue = _NaiveGlue(ctx, init)
            rows = slice(rank * BATCH // 2, (rank + 1) * BATCH // 2)
            norms = []
            for _ in range(3):
                glue.loss(x[rows], y[rows])
                ctx.step()
                norms.append(ctx.last_grad_norm)
            return norms, ctx.skipped_steps

    norms, skipped = fsdp.run_ranks(2, rank_fn)[0]
    if poison:
        # Autograd's backward read the poisoned slots: NaN grads, which fsdp_step refuses (every step
        # skipped, the grad norm NaN) instead of training on whatever the next gather left there.
        assert np.isnan(norms).all() and skipped == 3, f"freed memory read without a NaN: norms {norms}"
    else:
        # Without the option the same glue trains on whatever the slots hold now, with no error: the
        # silent failure the option exists to expose.
        assert np.isfinite(norms).all() and skipped == 0
    # The adapter under the same poison trains to the reference (test_mlp_matches_plain_torch's
    # debug_poison case, test_gpt2_matches_plain_torch_with_tied_embeddings).


def test_in_place_write_to_a_param_raises_naming_it():
    def rank_fn(rank, group):
        model = make_net()
        with ft.shard(model, units=Block, group=group, rank=rank):
            def write(m, args):
                with torch.no_grad():
                    m.fc1.weight.mul_(2.0)
            model.blocks[1].register_forward_pre_hook(write)
            with pytest.raises(fsdp.InvalidState, match=r"blocks\.1\.fc1\.weight.*written in place"):
                model(torch.randn(2, 6))
            return True

    assert fsdp.run_ranks(1, rank_fn) == [True]


def test_changed_params_after_shard_are_refused_by_name():
    def rank_fn(rank, group):
        model = make_net()
        with ft.shard(model, units=Block, group=group, rank=rank):
            model.out = torch.nn.Linear(16, 3)
            with pytest.raises(fsdp.InvalidState, match=r"out\.weight.*shard the new model"):
                model(torch.randn(2, 6))
            return True

    assert fsdp.run_ranks(1, rank_fn) == [True]


def _freeze(model, step):
    """requires_grad=False on a whole Block (a frozen unit), on one param inside another Block and one of
    the root unit (units that mix frozen and trainable params); from step 4 blocks.0.fc1.weight trains again
    (its AdamW state starts then, with its own step count, as torch.optim.AdamW's per-param state does)."""
    if step == 0:
        for p in model.blocks[1].parameters():
            p.requires_grad_(False)
        model.blocks[0].fc1.weight.requires_grad_(False)
        model.inp.weight.requires_grad_(False)
    if step == 4:
        model.blocks[0].fc1.weight.requires_grad_(True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("world", [1, 2, 4])
def test_requires_grad_false_params_are_frozen_like_torch_freezes_them(world, device):
    """A PEFT-style frozen model: params with requires_grad=False get no grads, no optimizer state and no
    reduction in libfsdp, and training matches torch.optim.AdamW on the unsharded model with the same flags
    (tolerances as test_mlp_matches_plain_torch); the frozen params end bitwise as they started; grads and
    optimizer state shrink by the frozen params' share; flipping a flag between steps takes effect."""
    dev = on_device(device)
    init = make_net()
    x, y = make_data()
    ref_losses, ref_grads, ref_params = reference_train(init, x, y, STEPS, on_step=_freeze, device=dev)
    x, y = x.to(dev), y.to(dev)

    def rank_fn(rank, group):
        model = copy.deepcopy(init).to(dev)
        with ft.shard(model, units=Block, group=group, rank=rank, device=str(dev), **HYPER) as sh:
            before = sh.ctx.memory_stats()
            rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
            losses, grads0, mem = [], None, None
            for step in range(STEPS):
                _freeze(model, step)
                loss = mse(model, x[rows], y[rows])
                loss.backward()
                if step == 0:
                    grads0 = sh.gather_grads()
                    mem = sh.ctx.memory_stats()
                sh.step()
                losses.append(float(sh.ctx.metrics_reduce([loss.item()], "avg")[0]))
            frozen_flags = [u.trainable for u in sh.units]
            return losses, grads0, sh.state_dict(), before, mem, frozen_flags

    losses, grads, params, before, mem, flags = fsdp.run_ranks(world, rank_fn)[0]
    assert set(grads) == set(ref_grads), "gather_grads must list the trainable params alone"
    close(grads, ref_grads, 1e-5, 1e-6, "grad")
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    close(params, ref_params, 0, 2e-5, "param")
    for name in ("blocks.1.fc1.weight", "inp.weight"):
        assert torch.equal(params[name].cpu(), init.state_dict()[name]), f"{name} is frozen and changed"
    assert flags.count(False) == 1, "blocks.1 is frozen as a unit"
    frozen = sum(p.numel() for p in init.blocks[1].parameters()) + init.blocks[0].fc1.weight.numel() + \
        init.inp.weight.numel()
    total = sum(p.numel() for p in init.parameters())
    # Grads 4 bytes and AdamW 8 bytes per element of the shards: the frozen share is gone (padding aside).
    assert mem.sharded_grads_nbytes < before.sharded_grads_nbytes * (total - frozen) / total * 1.2 + 512
    assert mem.optimizer_state_nbytes == 2 * mem.sharded_grads_nbytes


def test_a_requires_grad_flag_that_differs_across_ranks_is_refused():
    def rank_fn(rank, group):
        model = make_net()
        with ft.shard(model, units=Block, group=group, rank=rank):
            model.blocks[0].fc1.bias.requires_grad_(rank == 0)
            with pytest.raises(fsdp.FsdpError, match="fsdp_param_set_trainable"):
                model(torch.randn(2, 6))
            return True

    assert fsdp.run_ranks(2, rank_fn) == [True, True]


def test_bad_units_are_refused():
    model = make_net()
    with pytest.raises(fsdp.InvalidArgument, match="not part of the model"):
        ft.shard(model, units=[torch.nn.Linear(2, 2)])
    with pytest.raises(fsdp.InvalidArgument, match="must be a torch.nn.Module"):
        ft.shard("not a model")


def test_units_by_predicate_and_list_group_the_same_params():
    model = make_net()
    by_class = ft._group(model, Block)
    by_list = ft._group(model, list(model.blocks))
    by_pred = ft._group(model, lambda name, m: name.startswith("blocks.") and name.count(".") == 1)
    names = [(g[0], [n for n, _ in g[2]]) for g in by_class]
    assert names == [(g[0], [n for n, _ in g[2]]) for g in by_list] == [(g[0], [n for n, _ in g[2]]) for g in by_pred]
    assert names[0] == ("root", ["inp.weight", "inp.bias", "ln_f.weight", "ln_f.bias", "out.weight", "out.bias"])
    assert [n for n, _ in names[1:]] == ["blocks.0", "blocks.1", "blocks.2"]


def _ckpt_run(world, steps, at=None, seed=0, first=None):
    """fsdp.torch on `world` thread ranks from make_net(seed), `steps` steps: first(sh) (its result returned)
    runs before them, at(sh, step) after each. (first's result on rank 0, rank 0's state_dict before the
    first step and after each)."""
    init = make_net(seed)
    x, y = make_data()

    def rank_fn(rank, group):
        model = copy.deepcopy(init)
        with ft.shard(model, units=Block, group=group, rank=rank, **HYPER) as sh:
            rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
            got = first(sh) if first is not None else None
            sds = [sh.state_dict()]
            for step in range(1, steps + 1):
                mse(model, x[rows], y[rows]).backward()
                sh.step()
                if at is not None:
                    at(sh, step)
                sds.append(sh.state_dict())
            return got, sds

    return fsdp.run_ranks(world, rank_fn)[0]


def _same(a, b, what):
    assert set(a) == set(b), what
    for k in b:
        assert torch.equal(a[k], b[k]), f"{what}: {k} differs"


def test_snapshot_restore_and_save_async_give_the_state_at_the_call(tmp_path):
    """sharded.snapshot and save_async at step 3 of 5 leave the run as the reference (the same run without
    them, computed here) and give step 3's state_dict back to a fresh sharded model of another init
    (restore; ctx.load of save_async's checkpoint), whose next steps are the reference's: the optimizer
    state and step came back too. With neither, restore changes nothing."""
    shm, ck = str(tmp_path / "shm"), str(tmp_path / "ck")
    _, ref = _ckpt_run(2, 5)
    assert not torch.equal(ref[3]["inp.weight"], ref[5]["inp.weight"])

    def at(sh, step):
        if step == 3:
            sh.snapshot(shm)
            sh.save_async(ck)
        elif step == 5:
            sh.save_wait()

    for k, sd in enumerate(_ckpt_run(2, 5, at)[1]):
        _same(sd, ref[k], f"the run with snapshot and save_async, step {k}")

    for path, checkpoint_dir, want in ((shm, ck, "snapshot"), (shm, None, "snapshot"), (None, ck, "checkpoint")):
        source, sds = _ckpt_run(2, 2, seed=7, first=lambda sh: sh.restore(path, checkpoint_dir))
        assert source == want, (path, checkpoint_dir)
        for k in range(3):
            _same(sds[k], ref[3 + k], f"{k} steps after restoring from the {want}")
    _, own = _ckpt_run(2, 0, seed=7)
    source, sds = _ckpt_run(2, 0, seed=7, first=lambda sh: sh.restore(None, str(tmp_path / "none")))
    assert source == "nothing"
    _same(sds[0], own[0], "nothing restored: the fresh model's own values")
    assert not torch.equal(own[0]["inp.weight"], ref[3]["inp.weight"])

    _, sds = _ckpt_run(2, 1, seed=7, first=lambda sh: sh.ctx.load(ck))
    _same(sds[0], ref[3], "save_async's checkpoint through ctx.load")
    _same(sds[1], ref[4], "a step after ctx.load")


JOB = """
import json, sys, copy, torch
sys.path.insert(0, sys.argv[2])
import fsdp, fsdp.torch as ft
from torch_models import BATCH, HYPER, Block, make_data, make_net, mse
torch.set_num_threads(1)
world, options = int(sys.argv[3]), json.loads(sys.argv[4])
def fn(rank, group):
    model = make_net()
    x, y = make_data()
    with ft.shard(model, units=Block, **HYPER, **options) as sh:
        rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
        losses = []
        for step in range(3):
            loss = mse(model, x[rows], y[rows])
            loss.backward()
            if step == 0:
                grads = {n: g.tolist() for n, g in sh.gather_grads().items()}
            sh.step()
            losses.append(float(sh.ctx.metrics_reduce([loss.item()], "avg")[0]))
        if rank == 0:
            with open(sys.argv[1], "w") as f:
                json.dump({"losses": losses, "grads": grads}, f)
fsdp.run_ranks(world, fn)
"""


MPI_CASES = [(2, {"sharding": "FULL_SHARD"}), (4, {"sharding": "HYBRID_SHARD", "shard_group_size": 2}),
             (4, {"sharding": "SHARD_GRAD_OP"})]


@pytest.mark.skipif(shutil.which("mpirun") is None or "mpi" not in fsdp.build_info().split("comms=")[-1],
                    reason="needs mpirun and a libfsdp built with MPI")
@pytest.mark.parametrize("world,options", MPI_CASES, ids=[f"{w}-{o['sharding']}" for w, o in MPI_CASES])
def test_torch_mpirun_processes_match_plain_torch(tmp_path, world, options):
    init = make_net()
    x, y = make_data()
    ref_losses, ref_grads, _ = reference_train(init, x, y, 3)
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1",
               FSDP_LIBRARY=fsdp.LIB_PATH, PYTHONPATH=os.path.dirname(os.path.dirname(fsdp.__file__)))
    out = tmp_path / "rank0.json"
    r = subprocess.run(["mpirun", "--oversubscribe", "-np", str(world), sys.executable, "-c", JOB, str(out),
                        os.path.dirname(os.path.abspath(__file__)), str(world), json.dumps(options)],
                       capture_output=True, text=True, timeout=180, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    got = json.loads(out.read_text())
    close({n: torch.tensor(v) for n, v in got["grads"].items()}, ref_grads, 1e-5, 1e-6, "mpirun grad")
    np.testing.assert_allclose(got["losses"], ref_losses, rtol=1e-5)
