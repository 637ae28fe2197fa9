"""Shared frozen state: tensors every member holds identically and no member trains are kept once.

A frozen "pretrained" backbone (``requires_grad=False``, eval-mode BatchNorm) with a trainable head
per member: the array holds the backbone once and the heads stacked, and each member trains
exactly as the same model alone with ``torch.optim`` (float64, rtol 1e-7; forward, gradients,
optimizer state, many steps). A frozen tensor that differs between members stays per member and
is still exact; ``member(i)``, state dicts, checkpoints and refills give each member its full
model.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _side_by_side import ATOL, RTOL, SideBySide, trained
from torch import Tensor, nn

import hfsweep as hs

B = 4


class Backbone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 12), nn.Tanh()
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


def pretrained_backbone(seed: int = 0) -> Backbone:
    """A backbone whose weights and BatchNorm statistics come from ``seed`` alone (the stand-in
    for loading a pretrained checkpoint), frozen and in eval mode."""
    gen = torch.Generator().manual_seed(seed)
    backbone = Backbone()
    with torch.no_grad():
        for t in [*backbone.parameters(), *backbone.buffers()]:
            if t.is_floating_point():
                t.copy_(torch.rand(t.shape, generator=gen) + 0.5)
    backbone.net[1].num_batches_tracked.fill_(7)
    return backbone.requires_grad_(False).eval()


class Classifier(nn.Module):
    """A frozen backbone and a trainable head (initialised from torch's global generator, so
    each member gets its own). ``train()`` keeps the backbone in eval mode, as fine-tuning code
    does."""

    def __init__(self, backbone_seed: int = 0) -> None:
        super().__init__()
        self.backbone = pretrained_backbone(backbone_seed)
        self.head = nn.Linear(12, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.backbone(x))

    def train(self, mode: bool = True) -> Classifier:
        super().train(mode)
        self.backbone.eval()
        return self


def members(seeds: list[int] | None = None) -> list[Classifier]:
    torch.manual_seed(0)
    out = [Classifier(s) for s in (seeds or [0] * B)]
    return [m.double() for m in out]


def nbytes(tensors: Any) -> int:
    """Bytes of distinct tensors (by storage)."""
    seen: dict[int, int] = {}
    for t in tensors:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


BACKBONE_NAMES = [f"backbone.{n}" for n, _ in pretrained_backbone().state_dict().items()]


def test_the_backbone_is_kept_once_and_the_heads_per_member() -> None:
    models = members()
    array = hs.fuse(models)
    assert array.shared_frozen == BACKBONE_NAMES
    # parameters() yields the trained heads only, stacked; the backbone is a buffer, once
    assert [(n, tuple(p.shape)) for n, p in array.named_parameters()] == [
        ("module.head.weight", (B, 3, 12)),
        ("module.head.bias", (B, 3)),
    ]
    backbone = pretrained_backbone().double()
    head = nn.Linear(12, 3).double()
    one_backbone = nbytes([*backbone.parameters(), *backbone.buffers()])
    one_head = nbytes(head.parameters())
    # hfsweep's own per-member state beside the model's: the random stream's seed and call
    # count (two int64 per member)
    settings = [t for n, t in array.named_buffers() if not n.startswith("module.")]
    assert nbytes(settings) == B * 2 * 8
    measured = nbytes([*array.parameters(), *array.buffers()])
    assert measured == one_backbone + B * (one_head + 2 * 8)
    # without sharing: B backbones
    stacked = hs.fuse(members(), share_frozen=False)
    assert stacked.shared_frozen == []
    measured = nbytes([*stacked.parameters(), *stacked.buffers()])
    assert measured == B * (one_backbone + one_head + 2 * 8)


def test_the_fused_optimizers_never_see_the_shared_tensors() -> None:
    array = hs.fuse(members())
    for params in (array, array.parameters()):
        opt = hs.optim.AdamW(params, lr=[1e-3] * B)
        assert [p for g in opt.param_groups for p in g["params"]] == list(array.parameters())


CASES: dict[str, tuple[type, type, list[dict[str, Any]]]] = {
    "SGD": (
        hs.optim.SGD,
        torch.optim.SGD,
        [{"lr": 0.1 * (i + 1), "momentum": 0.2 * i, "weight_decay": 1e-3 * i} for i in range(B)],
    ),
    "AdamW": (
        hs.optim.AdamW,
        torch.optim.AdamW,
        [{"lr": 1e-3 * (i + 1), "weight_decay": 0.05 * i} for i in range(B)],
    ),
}


def _fused_kwargs(per_member: list[dict[str, Any]]) -> dict[str, list[float]]:
    return {k: [h[k] for h in per_member] for k in per_member[0]}


def _train_and_compare(
    models: list[Classifier], case: str, steps: int, shared_names: list[str]
) -> None:
    fused_cls, torch_cls, per_member = CASES[case]
    refs = [copy.deepcopy(m) for m in models]
    array = hs.fuse(models)
    assert array.shared_frozen == shared_names
    array.train()
    run = SideBySide(
        array,
        fused_cls(array, **_fused_kwargs(per_member)),
        refs,
        [torch_cls(trained(r), **h, foreach=False) for r, h in zip(refs, per_member, strict=True)],
    )
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        x = torch.randn(8, 6, generator=gen, dtype=torch.float64)
        y = torch.randint(0, 3, (8,), generator=gen)
        run.step(
            x,
            loss=lambda out, y=y: hs.member_losses(out, y),
            ref_loss=lambda out, y=y: F.cross_entropy(out, y),
            grads=step in (0, steps - 1),
        )
    run.assert_states()
    # the frozen backbone did not move, in either
    for i, (m, r) in enumerate(zip(models, refs, strict=True)):
        mine, theirs, before = array.member_state_dict(i), r.state_dict(), m.state_dict()
        for k in before:
            if k.startswith("backbone."):
                assert torch.equal(mine[k], before[k]) and torch.equal(theirs[k], before[k])


@pytest.mark.parametrize("case", list(CASES))
def test_members_with_a_shared_backbone_train_as_alone(case: str) -> None:
    _train_and_compare(members(), case, steps=60, shared_names=BACKBONE_NAMES)


def test_a_frozen_tensor_that_differs_between_members_stays_per_member() -> None:
    models = members()
    with torch.no_grad():  # member 2's first frozen layer differs (fine-tuned elsewhere, say)
        models[2].backbone.net[0].weight.mul_(1.5)
        models[1].backbone.net[1].running_var.add_(0.25)
    per_member = ["backbone.net.0.weight", "backbone.net.1.running_var"]
    shared = [n for n in BACKBONE_NAMES if n not in per_member]
    _train_and_compare(models, "AdamW", steps=40, shared_names=shared)
    stacked = hs.fuse(models)
    assert stacked.module.backbone.net[0].weight.shape == (B, 16, 6)
    assert not stacked.module.backbone.net[0].weight.requires_grad
    assert "backbone.net.0.weight" not in [n for n, _ in stacked.module.named_buffers()]


def test_member_gives_the_full_model_with_the_backbone() -> None:
    models = members()
    array = hs.fuse(models)
    x = torch.randn(5, 6, dtype=torch.float64)
    out = array(x)
    for i, m in enumerate(models):
        member = array.member(i)
        assert type(member) is Classifier
        assert not member.backbone.net[0].weight.requires_grad
        assert member.head.weight.requires_grad
        assert member.state_dict().keys() == m.state_dict().keys()
        fresh = Classifier().double()
        fresh.load_state_dict(array.member_state_dict(i))
        fresh.eval()
        torch.testing.assert_close(fresh(x), out[i], rtol=RTOL, atol=ATOL)
        # copies: changing the member leaves the array alone
        with torch.no_grad():
            member.backbone.net[0].weight.zero_()
    assert array.member(0).backbone.net[0].weight.abs().sum() > 0


def test_state_dict_round_trip_across_sharing_layouts() -> None:
    trained = hs.fuse(members())
    with torch.no_grad():
        trained.module.head.weight.add_(torch.randn_like(trained.module.head.weight))
    saved = trained.state_dict()
    assert saved["module.backbone.net.0.weight"].shape == (16, 6)  # once
    x = torch.randn(5, 6, dtype=torch.float64)
    expected = trained(x)
    torch.manual_seed(5)  # other heads
    for share in (True, False):
        fresh = hs.fuse([Classifier().double() for _ in range(B)], share_frozen=share)
        fresh.load_state_dict(saved)
        torch.testing.assert_close(fresh(x), expected, rtol=0, atol=0)
    # a state dict of an array that stacked everything loads into one that shares
    stacked_state = hs.fuse(members(), share_frozen=False)
    stacked_state.load_state_dict(saved)
    sharing = hs.fuse([Classifier().double() for _ in range(B)])
    sharing.load_state_dict(stacked_state.state_dict())
    assert sharing.shared_frozen == BACKBONE_NAMES
    torch.testing.assert_close(sharing(x), expected, rtol=0, atol=0)
    # ... and whose frozen rows differ: that tensor becomes per member
    differing = stacked_state.state_dict()
    differing["module.backbone.net.3.bias"][1] += 1.0
    sharing.load_state_dict(differing)
    assert "backbone.net.3.bias" not in sharing.shared_frozen
    assert sharing.module.backbone.net[3].bias.shape == (B, 12)
    out = sharing(x)
    torch.testing.assert_close(out[0], expected[0], rtol=0, atol=0)
    assert not torch.allclose(out[1], expected[1])


def test_member_state_dict_round_trip_and_a_differing_refill() -> None:
    models = members()
    array = hs.fuse(models)
    x = torch.randn(5, 6, dtype=torch.float64)
    before = array(x).detach()
    # a member's own state loads back without copying the shared backbone
    array.load_member_state_dict(2, array.member_state_dict(2))
    assert array.shared_frozen == BACKBONE_NAMES
    # a refill whose backbone differs in one tensor: that tensor becomes per member
    newcomer = Classifier().double()
    with torch.no_grad():
        newcomer.backbone.net[3].weight.add_(0.1)
    newcomer.eval()
    array.load_member(1, newcomer)
    assert "backbone.net.3.weight" not in array.shared_frozen
    assert len(array.shared_frozen) == len(BACKBONE_NAMES) - 1
    after = array(x)
    torch.testing.assert_close(after[1], newcomer(x), rtol=RTOL, atol=ATOL)
    for i in (0, 2, 3):
        assert torch.equal(after[i], before[i])
    # the same through a state dict
    other = members()[0]
    with torch.no_grad():
        other.backbone.net[0].bias.add_(0.1)
    other.eval()
    array.load_member_state_dict(3, other.state_dict())
    assert "backbone.net.0.bias" not in array.shared_frozen
    torch.testing.assert_close(array(x)[3], other(x), rtol=RTOL, atol=ATOL)


class PlainClassifier(Classifier):
    """No ``train()`` override: ``array.train()`` puts the backbone's BatchNorm in training."""

    def train(self, mode: bool = True) -> PlainClassifier:
        return nn.Module.train(self, mode)  # type: ignore[return-value]


def test_batchnorm_statistics_become_per_member_in_training_mode() -> None:
    torch.manual_seed(0)
    models = [PlainClassifier().double().eval() for _ in range(B)]
    refs = [copy.deepcopy(m) for m in models]
    array = hs.fuse(models)
    stats = ["backbone.net.1.running_mean", "backbone.net.1.running_var"]
    assert all(n in array.shared_frozen for n in stats)
    array.train()  # BatchNorm now updates its statistics from each member's batch
    assert not any(n in array.shared_frozen for n in [*stats, "backbone.net.1.num_batches_tracked"])
    assert "backbone.net.0.weight" in array.shared_frozen  # frozen parameters stay shared
    opt = hs.optim.SGD(array, lr=[0.1, 0.2, 0.3, 0.4])
    ref_opts = [
        torch.optim.SGD([p for p in r.parameters() if p.requires_grad], lr=0.1 * (i + 1))
        for i, r in enumerate(refs)
    ]
    gen = torch.Generator().manual_seed(3)
    for r in refs:
        r.train()
    for _ in range(20):
        xs = torch.randn(B, 8, 6, generator=gen, dtype=torch.float64)  # one batch per member
        y = torch.randint(0, 3, (B, 8), generator=gen)
        opt.zero_grad()
        out = array(xs, shared=False)
        sum(F.cross_entropy(out[i], y[i]) for i in range(B)).backward()  # type: ignore[union-attr]
        opt.step()
        for i, (r, o) in enumerate(zip(refs, ref_opts, strict=True)):
            o.zero_grad()
            expected = r(xs[i])
            torch.testing.assert_close(out[i], expected, rtol=RTOL, atol=ATOL)
            F.cross_entropy(expected, y[i]).backward()
            o.step()
    for i, r in enumerate(refs):
        mine = array.member_state_dict(i)
        for k, v in r.state_dict().items():
            torch.testing.assert_close(mine[k], v, rtol=RTOL, atol=ATOL, msg=f"member {i} {k}")


def test_a_submodule_switched_to_training_directly_is_caught_at_the_call() -> None:
    torch.manual_seed(0)
    models = [PlainClassifier().double().eval() for _ in range(2)]
    array = hs.fuse(models)
    array.module.backbone.net[1].train()  # not through array.train()
    xs = torch.randn(2, 8, 6, dtype=torch.float64)
    out = array(xs, shared=False)
    assert "backbone.net.1.running_mean" not in array.shared_frozen
    for i, m in enumerate(models):
        m.backbone.net[1].train()
        torch.testing.assert_close(out[i], m(xs[i]), rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(
            array.member(i).backbone.net[1].running_mean,
            m.backbone.net[1].running_mean,
            rtol=RTOL,
            atol=ATOL,
        )


def test_an_array_with_nothing_per_member_still_runs() -> None:
    """Every tensor frozen and identical: nothing is batched, the output still has B rows."""
    torch.manual_seed(0)
    models = [pretrained_backbone().double() for _ in range(3)]
    array = hs.fuse(models)
    assert list(array.parameters()) == []
    x = torch.randn(5, 6, dtype=torch.float64)
    out = array(x)
    assert out.shape == (3, 5, 12)
    for i in range(3):
        torch.testing.assert_close(out[i], models[0](x), rtol=RTOL, atol=ATOL)


def test_one_member_arrays_share_too() -> None:
    models = members()[:1]
    array = hs.fuse(models)
    assert array.shared_frozen == BACKBONE_NAMES
    x = torch.randn(5, 6, dtype=torch.float64)
    torch.testing.assert_close(array(x)[0], models[0](x), rtol=RTOL, atol=ATOL)


def test_bitfit_frozen_weights_shared_trained_biases_per_member() -> None:
    """Only the biases train (BitFit): every Linear has a shared weight and a stacked bias."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3)).double()
    models = []
    for i in range(B):
        m = copy.deepcopy(base)
        for layer in (m[0], m[2]):
            layer.weight.requires_grad_(False)
            with torch.no_grad():
                layer.bias.add_(0.1 * i)
        models.append(m)
    refs = [copy.deepcopy(m) for m in models]
    array = hs.fuse(models)
    assert array.shared_frozen == ["0.weight", "2.weight"]
    lrs = [0.05 * (i + 1) for i in range(B)]
    run = SideBySide(
        array,
        hs.optim.Adam(array, lr=lrs),
        refs,
        [
            torch.optim.Adam(trained(r), lr=lr, foreach=False)
            for r, lr in zip(refs, lrs, strict=True)
        ],
    )
    gen = torch.Generator().manual_seed(2)
    for step in range(30):
        x = torch.randn(7, 6, generator=gen, dtype=torch.float64)
        y = torch.randint(0, 3, (7,), generator=gen)
        run.step(
            x,
            loss=lambda out, y=y: hs.member_losses(out, y),
            ref_loss=lambda out, y=y: F.cross_entropy(out, y),
            grads=step == 0,
        )
    run.assert_states()


class RunningAverage(nn.Module):
    """A persistent buffer that forward updates from the data, and a non-persistent constant."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(3, 3)
        self.register_buffer("average", torch.zeros(3))
        self.register_buffer("scale", torch.full((3,), 0.5), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        y = self.layer(x) * self.scale
        if self.training:
            self.average.mul_(0.9).add_(0.1 * y.detach().mean(0))
        return y


def test_persistent_buffers_stay_per_member_constants_are_shared() -> None:
    """A persistent buffer may be a running average written from each member's data, so it is
    not shared even when equal at fuse time; a non-persistent one (a constant) is."""
    torch.manual_seed(0)
    models = [RunningAverage().double() for _ in range(3)]
    refs = [copy.deepcopy(m) for m in models]
    array = hs.fuse(models)
    assert array.shared_frozen == ["scale"]
    for _ in range(3):
        x = torch.randn(4, 3, dtype=torch.float64)
        out = array(x)
        for i, r in enumerate(refs):
            torch.testing.assert_close(out[i], r(x), rtol=RTOL, atol=ATOL)
    for i, r in enumerate(refs):
        torch.testing.assert_close(array.member(i).average, r.average, rtol=RTOL, atol=ATOL)


class WritesConstant(RunningAverage):
    def forward(self, x: Tensor) -> Tensor:
        y = self.layer(x)
        self.scale.copy_(y.detach().mean(0))  # a "constant" written per member
        return y


def test_a_shared_buffer_written_per_member_fails_with_the_way_out() -> None:
    models = [WritesConstant().double() for _ in range(2)]
    with pytest.raises(hs.FusionError, match=r"Buffers \['scale'\] .*share_frozen=False"):
        hs.fuse(models)(torch.randn(4, 3, dtype=torch.float64))
    array = hs.fuse(models, share_frozen=False)
    x = torch.randn(4, 3, dtype=torch.float64)
    out = array(x)
    for i, m in enumerate(models):
        torch.testing.assert_close(out[i], m(x), rtol=RTOL, atol=ATOL)
