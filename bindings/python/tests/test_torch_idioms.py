# test_torch_idioms.py - the torch idioms a user types, through fsdp.torch, against the same loop in plain torch.
"""Each test writes what a torch user writes (a torch optimizer and lr scheduler, clip_grad_norm_,
model.state_dict / load_state_dict, save_pretrained / from_pretrained, p.shape, an init outside a forward)
and checks it either matches the unsharded run computed here, or raises at the line that would go wrong.
docs/bindings.md, "PyTorch", lists each idiom beside the test that shows it.

Tolerances (as test_torch_adapter.py): losses rtol 1e-5 (the ranks' grads are means over their rows,
equal to the whole batch's up to the order of the sums); params after the steps atol 2e-5 (2% of one AdamW
step's largest move, lr 1e-3); the clip's norm rtol 1e-5 (libfsdp adds the fp32 squares in double, torch
takes a norm of norms in fp32)."""
import copy

import numpy as np
import pytest

try:
    import torch
except ImportError as e:  # counted by tools/test_python.sh
    pytest.skip(f"torch is not installed in this venv ({e}); tools/test_python.sh installs it", allow_module_level=True)

import fsdp
import fsdp.torch as ft
from torch_models import BATCH, HYPER, Block, make_data, make_gpt2, make_net, mse

torch.set_num_threads(1)
STEPS = 6
LR = 1e-3


def groups_of(named):
    """Torch's usual weight-decay groups by name: none on biases and LayerNorms."""
    decay = [p for n, p in named if not (n.endswith(".bias") or ".ln" in n or n.startswith("ln"))]
    rest = [p for n, p in named if n.endswith(".bias") or ".ln" in n or n.startswith("ln")]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def plain_loop(model, x, y, make_opt, clip=None, steps=STEPS):
    """The unsharded loop a torch user writes: (losses, norms, final state_dict)."""
    opt = make_opt(list(model.named_parameters()))
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    losses, norms = [], []
    for _ in range(steps):
        loss = mse(model, x, y)
        loss.backward()
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms, {k: v.clone() for k, v in model.state_dict().items()}


def sharded_loop(init, world, make_opt, clip=None, steps=STEPS, **options):
    """The same loop with the model sharded and the torch optimizer over sharded.named_parameters()."""
    x, y = make_data()

    def rank_fn(rank, group):
        model = copy.deepcopy(init)
        with ft.shard(model, units=Block, group=group, rank=rank, optimizer="torch", **options) as sh:
            opt = make_opt(sh.named_parameters())
            sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
            rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
            losses, norms = [], []
            for _ in range(steps):
                loss = mse(model, x[rows], y[rows])
                loss.backward()
                if clip is not None:
                    norms.append(sh.clip_grad_norm_(clip).item())
                opt.step()
                sched.step()
                opt.zero_grad()
                losses.append(float(sh.ctx.metrics_reduce([loss.item()], "avg")[0]))
            return losses, norms, model.state_dict()

    return fsdp.run_ranks(world, rank_fn)[0]


def adamw(named):
    return torch.optim.AdamW(groups_of(named), lr=LR, betas=(0.9, 0.999), eps=1e-8, foreach=False)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_a_torch_adamw_with_groups_schedule_and_clip_on_the_shards_matches_plain_torch(world):
    init = make_net()
    x, y = make_data()
    ref = plain_loop(copy.deepcopy(init), x, y, adamw, clip=0.5)
    assert min(ref[1]) > 0.5, "the clip must bite in every step for the test to show it"
    losses, norms, sd = sharded_loop(init, world, adamw, clip=0.5)
    np.testing.assert_allclose(losses, ref[0], rtol=1e-5)
    np.testing.assert_allclose(norms, ref[1], rtol=1e-5)
    for k, v in ref[2].items():
        torch.testing.assert_close(sd[k], v, rtol=0, atol=2e-5, msg=lambda m: f"{k}: {m}")


def test_sgd_with_momentum_and_an_offloaded_shard_matches_plain_torch():
    def sgd(named):
        return torch.optim.SGD([p for _, p in named], lr=0.05, momentum=0.9, foreach=False)

    init = make_net()
    x, y = make_data()
    ref = plain_loop(copy.deepcopy(init), x, y, sgd)
    losses, _, sd = sharded_loop(init, 2, sgd, offload="cpu")
    np.testing.assert_allclose(losses, ref[0], rtol=1e-5)
    for k, v in ref[2].items():
        torch.testing.assert_close(sd[k], v, rtol=0, atol=2e-5, msg=lambda m: f"{k}: {m}")


def test_a_skipped_fp16_step_leaves_the_torch_optimizer_untouched():
    """fp16 with a dynamic loss scale of 2^40: the first step's grads overflow, libfsdp skips it, and the
    torch optimizer sees no grads (its state is not even made); the next steps train."""
    def rank_fn(rank, group):
        model = make_net()
        with ft.shard(model, units=Block, group=group, rank=rank, optimizer="torch", param_dtype="fp16",
                      loss_scale="dynamic", loss_scale_init=2.0 ** 40) as sh:
            opt = torch.optim.AdamW(sh.parameters(), lr=LR)
            x, y = make_data()
            before = {k: v.clone() for k, v in model.state_dict().items()}
            loss = mse(model, x.half(), y.half()) * sh.ctx.loss_scale
            loss.backward()
            opt.step()
            skipped = sh.ctx.skipped_steps
            after = model.state_dict()
            return skipped, len(opt.state), all(torch.equal(before[k], after[k]) for k in before)

    skipped, n_state, same = fsdp.run_ranks(1, rank_fn)[0]
    assert skipped == 1 and n_state == 0 and same


def test_a_torch_optimizer_over_model_parameters_raises_at_its_step():
    def rank_fn(rank, group):
        model = make_net()
        with ft.shard(model, units=Block, group=group, rank=rank):
            opt = torch.optim.AdamW(model.parameters(), lr=LR)
            mse(model, *make_data()).backward()
            with pytest.raises(fsdp.InvalidState, match=r"sharded\.parameters\(\)"):
                opt.step()
            return True

    assert fsdp.run_ranks(2, rank_fn) == [True, True]


def test_torch_clip_grad_norm_over_model_parameters_raises():
    def rank_fn(rank, group):
        model = make_net()
        with ft.shard(model, units=Block, group=group, rank=rank) as sh:
            mse(model, *make_data()).backward()
            with pytest.raises(RuntimeError):
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            with pytest.raises(fsdp.InvalidState, match="optimizer='torch'"):
                sh.parameters()
            sh.step()
            return True

    assert fsdp.run_ranks(2, rank_fn) == [True, True]


@pytest.mark.parametrize("world", [1, 2])
def test_sharded_clip_with_libfsdps_own_adamw_matches_plain_torch(world):
    """sharded.clip_grad_norm_ then sharded.step() (fsdp_clip_grad_norm: the norm now, the step clips) against
    torch.nn.utils.clip_grad_norm_ and torch.optim.AdamW on the unsharded model."""
    init = make_net()
    x, y = make_data()
    ref = copy.deepcopy(init)
    opt = torch.optim.AdamW(ref.parameters(), lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]),
                            eps=HYPER["eps"], weight_decay=HYPER["weight_decay"], foreach=False)
    ref_losses, ref_norms = [], []
    for _ in range(STEPS):
        loss = mse(ref, x, y)
        loss.backward()
        ref_norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5).item())
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())
    assert min(ref_norms) > 0.5, "the clip must bite in every step for the test to show it"

    def rank_fn(rank, group):
        model = copy.deepcopy(init)
        with ft.shard(model, units=Block, group=group, rank=rank, **HYPER) as sh:
            rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
            losses, norms = [], []
            for _ in range(STEPS):
                loss = mse(model, x[rows], y[rows])
                loss.backward()
                norms.append(sh.clip_grad_norm_(0.5).item())
                sh.step()
                losses.append(float(sh.ctx.metrics_reduce([loss.item()], "avg")[0]))
            return losses, norms, model.state_dict()

    losses, norms, sd = fsdp.run_ranks(world, rank_fn)[0]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    np.testing.assert_allclose(norms, ref_norms, rtol=1e-5)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(sd[k], v, rtol=0, atol=2e-5, msg=lambda m: f"{k}: {m}")


def test_params_outside_a_forward_have_the_models_shapes_and_nan_values():
    transformers = pytest.importorskip("transformers", reason="transformers is not installed in this venv")
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    plain = make_gpt2()
    want = {n: tuple(p.shape) for n, p in plain.named_parameters()}

    def rank_fn(rank, group):
        model = make_gpt2()
        with ft.shard(model, units=GPT2Block, group=group, rank=rank):
            got = {n: tuple(p.shape) for n, p in model.named_parameters()}
            values = [bool(p.isnan().all()) for p in model.parameters()]
            return got, model.num_parameters(), sum(p.numel() for p in model.parameters()), all(values)

    got, n_hf, n_sum, all_nan = fsdp.run_ranks(2, rank_fn)[0]
    assert got == want and n_hf == plain.num_parameters() and n_sum == sum(p.numel() for p in plain.parameters())
    assert all_nan, "a param read outside a forward must give NaN, not stale or zero values"
    assert isinstance(transformers.__version__, str)


def test_an_in_place_write_outside_a_forward_raises_naming_the_param():
    def rank_fn(rank, group):
        model = make_net()
        with ft.shard(model, units=Block, group=group, rank=rank) as sh:
            with torch.no_grad():
                with pytest.raises(RuntimeError):  # torch: one element stands for many
                    model.blocks[0].fc1.weight.normal_()
                model.blocks[2].fc2.bias.zero_()  # goes through: caught at the next forward
            with pytest.raises(fsdp.InvalidState, match=r"blocks\.2\.fc2\.bias.*written in place outside"):
                model(torch.randn(2, 6))
            with pytest.raises(fsdp.InvalidState, match=r"blocks\.2\.fc2\.bias"):
                sh.state_dict()
            return True

    assert fsdp.run_ranks(1, rank_fn) == [True]


@pytest.mark.parametrize("ranks", ["all", "rank0"])
def test_model_state_dict_is_the_full_model_and_torch_save_round_trips(tmp_path, ranks):
    init = make_net()
    x, y = make_data()
    ref = copy.deepcopy(init)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, foreach=False)
    mse(ref, x, y).backward()
    opt.step()

    def rank_fn(rank, group):
        model = copy.deepcopy(init)
        with ft.shard(model, units=Block, group=group, rank=rank, optimizer="torch", state_dict_ranks=ranks) as sh:
            o = torch.optim.AdamW(sh.parameters(), lr=LR, foreach=False)
            rows = slice(rank * BATCH // 2, (rank + 1) * BATCH // 2)
            mse(model, x[rows], y[rows]).backward()
            o.step()
            sd = model.state_dict()
            if rank == 0:
                torch.save(sd, tmp_path / "model.pt")
            return sd

    sds = fsdp.run_ranks(2, rank_fn)
    want = ref.state_dict()
    assert list(sds[0]) == list(want)
    if ranks == "rank0":
        assert not [k for k in sds[1] if k in dict(init.named_parameters())], "rank 1 holds params with rank0"
    loaded = make_net(seed=5)
    loaded.load_state_dict(torch.load(tmp_path / "model.pt"))
    for k, v in want.items():
        torch.testing.assert_close(loaded.state_dict()[k], v, rtol=0, atol=2e-5, msg=lambda m: f"{k}: {m}")


def test_model_load_state_dict_sets_the_sharded_values_and_refuses_what_torch_refuses():
    donor = make_net(seed=3)
    x, _ = make_data()
    with torch.no_grad():
        want = donor(x)

    def rank_fn(rank, group):
        model = make_net(seed=0)
        with ft.shard(model, units=Block, group=group, rank=rank):
            model.load_state_dict(donor.state_dict())
            with torch.no_grad():
                got = model(x)
            bad = dict(donor.state_dict())
            del bad["out.bias"]
            with pytest.raises(RuntimeError, match="out.bias"):
                model.load_state_dict(bad)
            return got

    for got in fsdp.run_ranks(2, rank_fn):
        assert torch.equal(got, want), "the loaded model's output differs from the donor's"


def test_gpt2_save_pretrained_of_the_sharded_model_loads_in_transformers(tmp_path):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed in this venv")
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    init = make_gpt2()
    ids = torch.randint(0, 128, (BATCH, 16), generator=torch.Generator().manual_seed(5))
    ref = copy.deepcopy(init)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, foreach=False)
    for _ in range(2):
        ref(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    def rank_fn(rank, group):
        model = copy.deepcopy(init)
        with ft.shard(model, units=GPT2Block, group=group, rank=rank, optimizer="torch") as sh:
            o = torch.optim.AdamW(sh.parameters(), lr=LR, foreach=False)
            rows = ids[rank * BATCH // 2:(rank + 1) * BATCH // 2]
            for _ in range(2):
                model(rows, labels=rows).loss.backward()
                o.step()
                o.zero_grad()
            # As in a plain script, on every rank (model.state_dict() inside is collective): rank 0 writes.
            model.save_pretrained(tmp_path)
            return model.should_save_on_this_rank(True)

    assert fsdp.run_ranks(2, rank_fn) == [True, False], "rank 0 alone writes the files"
    loaded = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path), dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, ref(ids).logits, rtol=0, atol=1e-4)


def _peft_gpt2():
    """A GPT-2 with PEFT's LoRA on c_attn and c_proj (nonzero B, so that the adapters change the logits)."""
    peft = pytest.importorskip("peft", reason="peft is not installed in this venv")
    pytest.importorskip("transformers", reason="transformers is not installed in this venv")
    base = make_gpt2()
    torch.manual_seed(1)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"], lora_dropout=0.0,
                          init_lora_weights=False, fan_in_fan_out=True)
    return peft.get_peft_model(base, cfg)


def _plain_peft(ref, ids, steps=3):
    """PEFT in plain torch: AdamW over the adapters, the whole batch. (the model, its losses)"""
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR, foreach=False)
    losses = []
    for _ in range(steps):
        loss = ref(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return ref, losses


@pytest.mark.parametrize("world", [1, 2, 4])
def test_peft_lora_trains_like_peft_in_plain_torch_and_its_adapter_loads(tmp_path, world):
    """get_peft_model, then shard(): the base is registered frozen (no grad or optimizer memory ever: the
    memory peak is what stays), the adapters train like PEFT's plain run, the base ends bitwise as it
    began, and PeftModel.save_pretrained writes the adapter that PeftModel.from_pretrained loads with the
    trained model's logits."""
    peft = pytest.importorskip("peft", reason="peft is not installed in this venv")
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    init = _peft_gpt2()
    ids = torch.randint(0, 128, (BATCH, 16), generator=torch.Generator().manual_seed(5))
    ref, ref_losses = _plain_peft(copy.deepcopy(init), ids)
    n_all = sum(p.numel() for p in init.parameters())
    n_lora = sum(p.numel() for p in init.parameters() if p.requires_grad)

    def rank_fn(rank, group):
        model = copy.deepcopy(init)
        with ft.shard(model, units=GPT2Block, group=group, rank=rank, optimizer="torch") as sh:
            mem = sh.ctx.memory_stats()
            o = torch.optim.AdamW(sh.parameters(), lr=LR, foreach=False)
            rows = ids[rank * BATCH // world:(rank + 1) * BATCH // world]
            losses = []
            for _ in range(3):
                loss = model(rows, labels=rows).loss
                loss.backward()
                o.step()
                o.zero_grad()
                losses.append(float(sh.ctx.metrics_reduce([loss.item()], "avg")[0]))
            model.save_pretrained(str(tmp_path), is_main_process=(rank == 0))  # collective: every rank
            return losses, mem, model.state_dict()

    losses, mem, sd = fsdp.run_ranks(world, rank_fn)[0]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert mem.total_peak_nbytes == mem.total_nbytes, "the base's grads were allocated, then freed"
    assert mem.sharded_grads_nbytes <= (n_lora // world + 64 * 4) * 4 < n_all * 4 // world
    want = ref.state_dict()
    for k, v in want.items():
        if "lora_" in k:
            torch.testing.assert_close(sd[k], v, rtol=0, atol=2e-5, msg=lambda m: f"{k}: {m}")
        else:
            assert torch.equal(sd[k], v), f"the frozen base param {k} changed"
    loaded = peft.PeftModel.from_pretrained(make_gpt2(), str(tmp_path))  # the same base (seed 0), no adapter
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, ref(ids).logits, rtol=0, atol=1e-4)


@pytest.mark.parametrize("world", [1, 2])
def test_get_peft_model_after_shard_trains_like_peft_in_plain_torch(world):
    """shard(), then get_peft_model on the sharded model: the next forward shards the model again (the adapters
    registered, PEFT's frozen base registered frozen) and LoRA trains like plain PEFT from the same values."""
    peft = pytest.importorskip("peft", reason="peft is not installed in this venv")
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    import threading
    lock = threading.Lock()
    cfg = dict(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"], lora_dropout=0.0, init_lora_weights=False,
               fan_in_fan_out=True)

    def peft_of(model):  # the same adapter init in every thread: torch's RNG is one per process
        with lock:
            torch.manual_seed(1)
            return peft.get_peft_model(model, peft.LoraConfig(**cfg))

    ids = torch.randint(0, 128, (BATCH, 16), generator=torch.Generator().manual_seed(5))
    base = make_gpt2()  # made once: threads drawing from torch's RNG at once would draw other inits
    ref, ref_losses = _plain_peft(peft_of(copy.deepcopy(base)), ids)

    def rank_fn(rank, group):
        model = copy.deepcopy(base)
        with ft.shard(model, units=GPT2Block, group=group, rank=rank, **HYPER) as sh:
            wrapped = peft_of(model)
            rows = ids[rank * BATCH // world:(rank + 1) * BATCH // world]
            losses = []
            for step in range(3):
                loss = wrapped(rows, labels=rows).loss
                if step == 0:
                    mem = sh.ctx.memory_stats()
                loss.backward()
                sh.step()
                losses.append(float(sh.ctx.metrics_reduce([loss.item()], "avg")[0]))
            return losses, mem, wrapped.state_dict()

    losses, mem, sd = fsdp.run_ranks(world, rank_fn)[0]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    n_lora = sum(p.numel() for p in ref.parameters() if p.requires_grad)
    assert mem.optimizer_state_nbytes <= 2 * (n_lora // world + 64 * 4) * 4, "the base has optimizer state"
    for k, v in ref.state_dict().items():
        if "lora_" in k:
            torch.testing.assert_close(sd[k], v, rtol=0, atol=2e-5, msg=lambda m: f"{k}: {m}")
        else:
            assert torch.equal(sd[k], v), f"the frozen base param {k} changed"
