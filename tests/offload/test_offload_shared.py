"""Offload of arrays whose frozen tensors are kept once for all members (``share_frozen``): a
frozen backbone in front of per-member heads, and peft LoRA adapters on a frozen base. Each
trains exactly as the same array without offload (float64, several optimizer steps); a frozen
tensor is copied to the compute side once for all members and counted once in the ledger; the
backward never fetches the frozen shards in front of the first trained one."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import pytest
import torch
from _offload_toy import Counting
from torch import Tensor, nn

import hfsweep as hs
from hfsweep.offload import OffloadedArray, OffloadError

B = 3


class Backbone(nn.Module):
    """A frozen "pretrained" backbone (the same weights in every member) and a trained head of
    the member's own seed."""

    def __init__(self, seed: int, width: int = 16, norm: nn.Module | None = None) -> None:
        super().__init__()
        torch.manual_seed(1234)
        self.backbone = nn.Sequential(
            nn.Linear(6, width),
            nn.Tanh(),
            norm if norm is not None else nn.LayerNorm(width),
            nn.Linear(width, width),
            nn.ReLU(),
            nn.Linear(width, 16),
            nn.Tanh(),
        )
        self.backbone.requires_grad_(False)
        torch.manual_seed(seed)
        self.head = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.2), nn.ReLU(), nn.Linear(16, 3))

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.backbone(x))


def _models(make: Callable[[int], nn.Module]) -> list[nn.Module]:
    return [make(i).double() for i in range(B)]


def _pair(
    make: Callable[[int], nn.Module], **engine: object
) -> tuple[hs.FusedArray, hs.FusedArray, OffloadedArray]:
    """The array run whole and the same array offloaded (both keep frozen tensors once)."""
    models = _models(make)
    whole, host = hs.fuse(copy.deepcopy(models)), hs.fuse(models)
    assert host.shared_frozen and host.shared_frozen == whole.shared_frozen
    for i in range(B):
        whole.manual_seed(i, 100 + i)
        host.manual_seed(i, 100 + i)
    return whole, host, OffloadedArray(host, **engine)  # type: ignore[arg-type]


def _train_side_by_side(
    whole: hs.FusedArray, host: hs.FusedArray, engine: OffloadedArray, steps: int = 4
) -> None:
    """AdamW with a step schedule on both, ``steps`` steps: outputs, gradients, state dicts and
    dropout streams equal (float64)."""
    pairs = []
    for array in (whole, host):
        opt = hs.optim.AdamW(array, lr=[1e-2, 3e-3, 1e-3], weight_decay=[0.0, 0.01, 0.1])
        pairs.append((opt, hs.optim.lr_scheduler.StepLR(opt, step_size=[1, 2, 3], gamma=0.5)))
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(5, 6, generator=gen, dtype=torch.float64)
        target = torch.randn(B, 5, 3, generator=gen, dtype=torch.float64)
        out_w, out_h = whole(x), engine(x)
        torch.testing.assert_close(out_h, out_w, rtol=1e-7, atol=1e-12)
        ((out_w - target) ** 2).mean(dim=(1, 2)).sum().backward()
        ((out_h - target) ** 2).mean(dim=(1, 2)).sum().backward()
        for (name, pw), ph in zip(whole.named_parameters(), host.parameters(), strict=True):
            torch.testing.assert_close(ph.grad, pw.grad, rtol=1e-7, atol=1e-12, msg=name)
        for opt, sched in pairs:
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
        assert engine.ledger.resident == 0
    for (name, tw), th in zip(whole.state_dict().items(), host.state_dict().values(), strict=True):
        torch.testing.assert_close(th, tw, rtol=1e-7, atol=1e-12, msg=name)
    assert all(host.rng_state(i) == whole.rng_state(i) for i in range(B))


def _same_steps(
    whole: hs.FusedArray,
    host: hs.FusedArray,
    engine: OffloadedArray,
    opts: Sequence[hs.optim.FusedOptimizer],
    x: Tensor,
    steps: int,
) -> None:
    """``steps`` steps of ``whole`` and of ``host`` run by ``engine`` on ``x`` (``opts``: the
    optimizers of both): the same outputs, then the same state (float64)."""
    for _ in range(steps):
        out_w, out_h = whole(x), engine(x)
        torch.testing.assert_close(out_h, out_w, rtol=1e-7, atol=1e-12)
        out_w.square().mean().backward()
        out_h.square().mean().backward()
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    for (name, tw), th in zip(whole.state_dict().items(), host.state_dict().values(), strict=True):
        torch.testing.assert_close(th, tw, rtol=1e-7, atol=1e-12, msg=name)


def test_a_frozen_backbone_with_member_heads_trains_as_the_whole_array() -> None:
    whole, host, engine = _pair(Backbone, shard_bytes=1)  # a shard per layer
    frozen = [s for s in engine.shards if s.shared_output]
    # the backbone's shards run once for all members, the heads' per member
    assert len(frozen) >= 3 and engine.shards[: len(frozen)] == frozen
    assert all(s.array.size == 1 for s in frozen) and not engine.shards[-1].shared_output
    assert not any(p.requires_grad for s in frozen for p in s.array.parameters())
    _train_side_by_side(whole, host, engine)
    assert all(host.member(i).backbone[0].weight.grad is None for i in range(B))


def test_a_frozen_tensor_is_copied_in_once_for_all_members_and_never_in_backward() -> None:
    """One forward copies each frozen tensor once (not B times); the backward fetches only
    the shards from the first trained one on: never the frozen backbone."""
    models = _models(Backbone)
    backbone = sum(t.numel() * t.element_size() for t in models[0].backbone.state_dict().values())
    fetched: dict[bool, tuple[int, int]] = {}
    for share in (True, False):
        transfer = Counting()
        array = hs.fuse(copy.deepcopy(models), share_frozen=share)
        engine = OffloadedArray(array, transfer=transfer, shard_bytes=1)
        out = engine(torch.randn(4, 6, dtype=torch.float64))
        forward = transfer.fetched
        out.sum().backward()
        fetched[share] = (forward, transfer.fetched - forward)
        heads = [s for s in engine.shards if any(n.startswith("head") for n in s.nodes)]
        # the backward: the heads only (the last shard stays on from the forward)
        assert engine.shards[-1] is heads[-1]
        assert fetched[share][1] == sum(s.nbytes for s in heads[:-1]) > 0
    assert fetched[False][0] - fetched[True][0] == (B - 1) * backbone
    assert fetched[True][1] == fetched[False][1]


def test_the_ledger_counts_a_shared_frozen_shard_once() -> None:
    """A backbone layer stacked for B members is over the shard limit (a quarter of the
    budget); kept once, it fits: the array trains within the budget, its peak counting the
    frozen layer once. Per-member copies of it cannot even be cut into shards that fit."""
    models = _models(lambda seed: Backbone(seed, width=64))
    big = models[0].backbone[3]  # Linear(64, 64): 33,280 bytes in float64
    layer = sum(t.numel() * t.element_size() for t in big.parameters())
    budget = 4 * (layer + 1024)  # shards of at most layer + 1 KiB
    with pytest.raises(OffloadError, match="over the shard limit"):
        OffloadedArray(hs.fuse(copy.deepcopy(models), share_frozen=False), budget_bytes=budget)
    whole = hs.fuse(copy.deepcopy(models))
    host = hs.fuse(models)
    for i in range(B):
        whole.manual_seed(i, i)
        host.manual_seed(i, i)
    engine = OffloadedArray(host, budget_bytes=budget)
    holding = [s for s in engine.shards if any(n == "backbone.3" for n in s.nodes)]
    assert len(holding) == 1 and layer <= holding[0].nbytes < 2 * layer
    opt_w = hs.optim.SGD(whole, lr=[0.1, 0.05, 0.02], momentum=[0.0, 0.5, 0.9])
    opt_h = hs.optim.SGD(host, lr=[0.1, 0.05, 0.02], momentum=[0.0, 0.5, 0.9])
    x = torch.randn(8, 6, dtype=torch.float64)
    for _ in range(3):
        whole(x).square().mean().backward()
        engine(x).square().mean().backward()
        for o in (opt_w, opt_h):
            o.step()
            o.zero_grad(set_to_none=True)
    for (name, tw), th in zip(whole.state_dict().items(), host.state_dict().values(), strict=True):
        torch.testing.assert_close(th, tw, rtol=1e-7, atol=1e-12, msg=name)
    peaks = engine.ledger.peaks
    assert holding[0].nbytes <= peaks["forward"] <= budget
    assert peaks["forward"] < B * layer  # less than the one layer's per-member copies
    assert peaks["backward"] < layer  # the backward holds the heads only


def test_buffers_kept_once_become_per_member_when_training_writes_them() -> None:
    """A BatchNorm in eval mode at fuse time has its statistics kept once; switched to
    training, the array keeps them per member again, and the engine cuts its shards anew."""

    def make(seed: int) -> nn.Module:
        model = Backbone(seed, norm=nn.BatchNorm1d(16))
        with torch.no_grad():
            model.backbone[2].running_var.fill_(2.0)
        return model.eval()

    whole, host, engine = _pair(make, shard_bytes=1)
    assert any("running_mean" in n for n in host.shared_frozen)
    before = [s.shared_output for s in engine.shards]
    whole.train()
    host.train()
    assert not any("running_mean" in n for n in host.shared_frozen)
    _train_side_by_side(whole, host, engine, steps=3)
    after = [s.shared_output for s in engine.shards]
    assert sum(after) < sum(before)  # from the BatchNorm on, the backbone runs per member


class TiedFrozen(nn.Module):
    """A frozen "embedding" used again at the end (tied), a trained layer per member between."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(1234)
        self.embed = nn.Linear(6, 6).requires_grad_(False)
        torch.manual_seed(seed)
        self.mid = nn.Linear(6, 6)
        self.out = nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.mid(torch.tanh(self.embed(x))))
        return self.out(torch.tanh(self.embed(h)))


def test_a_frozen_layer_used_twice_is_copied_in_by_each_shard_that_uses_it() -> None:
    """Kept once and written by no forward, a tied frozen layer does not hold the layers between
    its uses in one shard (as a trained or per-member one does): each shard using it copies it."""
    whole, host, engine = _pair(TiedFrozen, shard_bytes=1)
    using = [s for s in engine.shards if "embed" in s.nodes]
    assert len(using) == 2 and len(engine.shards) >= 4
    opts = [hs.optim.SGD(a, lr=[0.1, 0.05, 0.02], momentum=0.9) for a in (whole, host)]
    _same_steps(whole, host, engine, opts, torch.randn(5, 6, dtype=torch.float64), 3)
    # per member (share_frozen=False), the tied layer keeps everything between its uses together
    unshared = OffloadedArray(hs.fuse(_models(TiedFrozen), share_frozen=False), shard_bytes=1)
    assert len([s for s in unshared.shards if "embed" in s.nodes]) == 1


peft = pytest.importorskip("peft")


class Base(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.fc2 = nn.Linear(16, 16)
        self.fc3 = nn.Linear(16, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.fc2(torch.tanh(self.fc1(x))))
        return self.head(torch.relu(self.fc3(h)))


def lora_member(seed: int) -> nn.Module:
    torch.manual_seed(1234)  # the same "pretrained" base for every member
    base = Base()
    config = peft.LoraConfig(
        r=4,
        lora_alpha=[4, 8, 16][seed % 3],
        target_modules=["fc1", "fc2", "fc3"],
        lora_dropout=0.1,
        modules_to_save=["head"],
    )
    torch.manual_seed(seed)
    model = peft.get_peft_model(base, config)
    for name, p in model.named_parameters():  # LoRA's B starts at 0: give it weights to train
        if "lora_B" in name:
            nn.init.normal_(p, std=0.1)
    return model


def test_peft_lora_adapters_on_a_frozen_base_train_as_the_whole_array() -> None:
    """peft's LoRA layers cannot be traced by torch.fx (control flow in their forward): each is
    one layer call, so a shard holds a LoRA layer, its frozen base weight once and every
    member's adapter."""
    whole, host, engine = _pair(lora_member, shard_bytes=1)
    lora = [s for s in engine.shards if any(n.endswith(("fc1", "fc2", "fc3")) for n in s.nodes)]
    assert len(lora) == 3 and len(engine.shards) >= 4
    base = [s for s in host.shared_frozen if "base_layer" in s]
    assert len(base) == 6  # three base layers' weights and biases, kept once
    _train_side_by_side(whole, host, engine)


def test_a_random_call_inside_an_untraceable_layer_is_refused_when_it_runs() -> None:
    """A layer of a class fx cannot trace into may draw random numbers itself: the shard
    refuses the call (with one member too, where no vmap runs), never draws it from torch's
    global generator."""

    class Noisy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)

        def forward(self, x: Tensor) -> Tensor:
            if x.sum() > 1e9:  # untraceable: the layer is one call
                return x
            return nn.functional.dropout(self.a(x), 0.5, self.training)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.noisy = Noisy()
            self.out = nn.Linear(4, 2)

        def forward(self, x: Tensor) -> Tensor:
            return self.out(self.noisy(x))

    for size in (1, 2):
        engine = OffloadedArray(hs.fuse([Model() for _ in range(size)], trace=False))
        with pytest.raises(Exception, match="offload runs the model shard by shard"):
            engine(torch.randn(3, 4))


@pytest.mark.slow
def test_a_hugging_face_encoder_offloads_as_one_layer_and_trains_as_the_whole_array() -> None:
    """transformers' BertModel cannot be traced by torch.fx: the encoder is one layer call (one
    shard, kept once with every member's adapters), the classifier head another."""
    pytest.importorskip("transformers")
    from hfsweep.tasks import text_lora

    config = text_lora.resolve({"lora_dropout": 0.1})
    models = [text_lora.build_model({**config, "seed": i}).double() for i in range(2)]
    whole, host = hs.fuse(copy.deepcopy(models)), hs.fuse(models)
    for i in range(2):
        whole.manual_seed(i, i)
        host.manual_seed(i, i)
    engine = OffloadedArray(host)
    assert len(engine.shards) == 2 and "model.base_model.model.bert" in engine.shards[0].nodes
    opts = [hs.optim.AdamW(a, lr=[1e-2, 3e-3]) for a in (whole, host)]
    _same_steps(whole, host, engine, opts, torch.randint(3, 40, (4, 24)), 2)
