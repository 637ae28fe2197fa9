"""Per-member LR schedulers against torch.optim.lr_scheduler run on each member alone."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.optim import lr_scheduler as L

import hfsweep as hs
import hfsweep.optim.lr_scheduler as H
from hfsweep.testing import MLP
from hfsweep.testing._op_counts import OpCounter

# The torch references are sometimes stepped without an optimizer step, on purpose.
pytestmark = pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)`")

B = 3
LRS = [0.1, 0.2, 0.05]
T = [10, 20, 7]


def pick(values: list[Any], i: int) -> Any:
    return values[i]


# name -> (fused factory, torch factory for member i, optimizer, steps, metric(t, i) or None)
CASES: dict[str, tuple[Callable, Callable, str, int, Callable | None]] = {
    "StepLR": (
        lambda o: H.StepLR(o, [3, 5, 2], [0.5, 0.9, 0.1]),
        lambda o, i: L.StepLR(o, [3, 5, 2][i], [0.5, 0.9, 0.1][i]),
        "SGD",
        40,
        None,
    ),
    "MultiStepLR": (
        lambda o: H.MultiStepLR(o, [[3, 7], [5], [2, 2, 9]], 0.5),
        lambda o, i: L.MultiStepLR(o, [[3, 7], [5], [2, 2, 9]][i], 0.5),
        "SGD",
        40,
        None,
    ),
    "ExponentialLR": (
        lambda o: H.ExponentialLR(o, [0.9, 0.99, 0.5]),
        lambda o, i: L.ExponentialLR(o, [0.9, 0.99, 0.5][i]),
        "Adam",
        40,
        None,
    ),
    "CosineAnnealingLR": (
        lambda o: H.CosineAnnealingLR(o, T, [0.0, 1e-3, 1e-2]),
        lambda o, i: L.CosineAnnealingLR(o, T[i], [0.0, 1e-3, 1e-2][i]),
        "SGD",
        45,
        None,
    ),
    "CosineAnnealingWarmRestarts": (
        lambda o: H.CosineAnnealingWarmRestarts(o, [3, 5, 2], [1, 2, 3], 1e-3),
        lambda o, i: L.CosineAnnealingWarmRestarts(o, [3, 5, 2][i], [1, 2, 3][i], 1e-3),
        "SGD",
        40,
        None,
    ),
    "LinearLR": (
        lambda o: H.LinearLR(o, [0.1, 0.5, 1.0], [1.0, 0.2, 0.5], [5, 10, 3]),
        lambda o, i: L.LinearLR(o, [0.1, 0.5, 1.0][i], [1.0, 0.2, 0.5][i], [5, 10, 3][i]),
        "SGD",
        20,
        None,
    ),
    "ConstantLR": (
        lambda o: H.ConstantLR(o, [0.1, 0.5, 1.0], [5, 10, 3]),
        lambda o, i: L.ConstantLR(o, [0.1, 0.5, 1.0][i], [5, 10, 3][i]),
        "SGD",
        20,
        None,
    ),
    "OneCycleLR": (
        lambda o: H.OneCycleLR(o, [1.0, 0.5, 2.0], total_steps=40, pct_start=[0.3, 0.1, 0.5]),
        lambda o, i: L.OneCycleLR(
            o, [1.0, 0.5, 2.0][i], total_steps=40, pct_start=[0.3, 0.1, 0.5][i]
        ),
        "SGD",
        39,
        None,
    ),
    "OneCycleLR-three-phase-linear-Adam": (
        lambda o: H.OneCycleLR(
            o, [1.0, 0.5, 2.0], total_steps=30, three_phase=True, anneal_strategy="linear"
        ),
        lambda o, i: L.OneCycleLR(
            o, [1.0, 0.5, 2.0][i], total_steps=30, three_phase=True, anneal_strategy="linear"
        ),
        "Adam",
        29,
        None,
    ),
    "SequentialLR-warmup-cosine": (
        lambda o: H.SequentialLR(
            o,
            [H.LinearLR(o, 0.1, total_iters=[3, 5, 2]), H.CosineAnnealingLR(o, T)],
            [[3], [5], [2]],
        ),
        lambda o, i: L.SequentialLR(
            o,
            [L.LinearLR(o, 0.1, total_iters=[3, 5, 2][i]), L.CosineAnnealingLR(o, T[i])],
            [[3, 5, 2][i]],
        ),
        "SGD",
        30,
        None,
    ),
    "ReduceLROnPlateau": (
        lambda o: H.ReduceLROnPlateau(
            o, patience=[2, 0, 5], factor=[0.5, 0.1, 0.9], cooldown=[0, 1, 2]
        ),
        lambda o, i: L.ReduceLROnPlateau(
            o, patience=[2, 0, 5][i], factor=[0.5, 0.1, 0.9][i], cooldown=[0, 1, 2][i]
        ),
        "SGD",
        40,
        lambda t, i: [1.0 / (t + 1), 1.0, float(t % 4)][i],
    ),
}


def optimizers(kind: str):
    p = torch.nn.Parameter(torch.zeros(B, 2, dtype=torch.float64))
    p.grad = torch.zeros_like(p)
    fused = hs.optim.SGD([p], lr=LRS, momentum=0.9) if kind == "SGD" else hs.optim.Adam([p], lr=LRS)
    alone = []
    for i in range(B):
        q = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
        q.grad = torch.zeros_like(q)
        alone.append(
            torch.optim.SGD([q], lr=LRS[i], momentum=0.9)
            if kind == "SGD"
            else torch.optim.Adam([q], lr=LRS[i])
        )
    return fused, alone


def advance(sched, metric, t: int) -> None:
    if metric is None:
        sched.step()
    else:
        sched.step([metric(t, i) for i in range(B)])


def advance_one(sched, metric, t: int, i: int) -> None:
    sched.step() if metric is None else sched.step(metric(t, i))


def assert_same_lrs(fused, alone, members=range(B)) -> None:
    for i in members:
        expected = alone[i].param_groups[0]
        got = fused.param_groups[0]
        assert float(got["lr"][i]) == pytest.approx(expected["lr"], rel=1e-12, abs=1e-15)
        if "momentum" in fused.numeric and "momentum" in expected:
            assert float(got["momentum"][i]) == pytest.approx(expected["momentum"], rel=1e-12)
        if "beta1" in fused.numeric:
            assert float(got["beta1"][i]) == pytest.approx(expected["betas"][0], rel=1e-12)


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_torch_per_member(name: str) -> None:
    make, make_torch, kind, steps, metric = CASES[name]
    fused, alone = optimizers(kind)
    sched = make(fused)
    torch_scheds = [make_torch(o, i) for i, o in enumerate(alone)]
    assert_same_lrs(fused, alone)
    for t in range(steps):
        fused.step()
        advance(sched, metric, t)
        for i, (o, s) in enumerate(zip(alone, torch_scheds, strict=True)):
            o.step()
            advance_one(s, metric, t, i)
        assert_same_lrs(fused, alone)


@pytest.mark.parametrize("name", ["StepLR", "CosineAnnealingLR", "OneCycleLR", "ReduceLROnPlateau"])
def test_inactive_member_schedule_does_not_advance(name: str) -> None:
    make, make_torch, kind, steps, metric = CASES[name]
    fused, alone = optimizers(kind)
    sched = make(fused)
    torch_scheds = [make_torch(o, i) for i, o in enumerate(alone)]
    fused.set_active(1, False)
    for t in range(steps // 2):
        advance(sched, metric, t)
        for i in (0, 2):
            advance_one(torch_scheds[i], metric, t, i)
    assert sched.last_epoch[1] == 0
    assert_same_lrs(fused, alone)  # member 1 still at its epoch-0 value, the others advanced


@pytest.mark.parametrize(
    "name",
    [
        "StepLR",
        "CosineAnnealingWarmRestarts",
        "LinearLR",
        "SequentialLR-warmup-cosine",
        "ReduceLROnPlateau",
    ],
)
def test_optimizer_reset_restarts_the_members_schedule(name: str) -> None:
    make, make_torch, kind, steps, metric = CASES[name]
    fused, alone = optimizers(kind)
    sched = make(fused)
    torch_scheds = [make_torch(o, i) for i, o in enumerate(alone)]
    for t in range(7):
        advance(sched, metric, t)
        for i, s in enumerate(torch_scheds):
            advance_one(s, metric, t, i)
    fused.reset_member(2, lr=0.3)  # a new trial in slot 2
    q = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    alone[2] = (
        torch.optim.SGD([q], lr=0.3, momentum=0.9)
        if kind == "SGD"
        else torch.optim.Adam([q], lr=0.3)
    )
    torch_scheds[2] = make_torch(alone[2], 2)
    assert sched.last_epoch[2] == 0
    assert_same_lrs(fused, alone)
    for t in range(7, 7 + steps // 2):
        if metric is None:
            sched.step()
        else:  # member 2 restarted: its metric sequence restarts too
            sched.step([metric(t if i != 2 else t - 7, i) for i in range(B)])
        for i, s in enumerate(torch_scheds):
            advance_one(s, metric, t if i != 2 else t - 7, i)
        assert_same_lrs(fused, alone)


@pytest.mark.parametrize(
    "name",
    [
        "StepLR",
        "CosineAnnealingLR",
        "CosineAnnealingWarmRestarts",
        "OneCycleLR",
        "ReduceLROnPlateau",
        "LinearLR",
        "SequentialLR-warmup-cosine",
    ],
)
def test_member_state_dict_loads_into_torch_and_continues_identically(name: str) -> None:
    make, make_torch, kind, steps, metric = CASES[name]
    fused, _ = optimizers(kind)
    sched = make(fused)
    for t in range(steps // 2):
        advance(sched, metric, t)
    i = 1
    exported = sched.member_state_dict(i)
    q = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    opt = (
        torch.optim.SGD([q], lr=LRS[i], momentum=0.9)
        if kind == "SGD"
        else torch.optim.Adam([q], lr=LRS[i])
    )
    resumed = make_torch(opt, i)
    resumed.load_state_dict(exported)
    for group, lr in zip(opt.param_groups, exported["_last_lr"], strict=True):
        group["lr"] = lr  # torch restores the optimizer's lr from the optimizer's own checkpoint
    for t in range(steps // 2, steps):
        advance(sched, metric, t)
        advance_one(resumed, metric, t, i)
        assert float(fused.param_groups[0]["lr"][i]) == pytest.approx(
            opt.param_groups[0]["lr"], rel=1e-12
        )


@pytest.mark.parametrize("name", ["StepLR", "CosineAnnealingLR", "ReduceLROnPlateau"])
def test_load_member_state_dict_from_torch(name: str) -> None:
    make, make_torch, kind, _, metric = CASES[name]
    fused, alone = optimizers(kind)
    sched = make(fused)
    torch_sched = make_torch(alone[0], 0)
    for t in range(9):
        alone[0].step()
        advance_one(torch_sched, metric, t, 0)
    sched.load_member_state_dict(0, torch_sched.state_dict())
    assert_same_lrs(fused, alone, members=[0])
    for t in range(9, 20):
        advance(sched, metric, t)
        advance_one(torch_sched, metric, t, 0)
        assert_same_lrs(fused, alone, members=[0])


def test_training_with_adamw_and_cosine_matches_torch_per_member() -> None:
    torch.manual_seed(0)
    models = [MLP(d_in=6, hidden=8, d_out=3).double() for _ in range(B)]
    refs = [copy.deepcopy(m) for m in models]
    array = hs.fuse(models)
    opt = hs.optim.AdamW(array, lr=[1e-2, 3e-3, 1e-3], weight_decay=[0.0, 0.01, 0.1])
    warm = H.LinearLR(opt, 0.1, total_iters=[2, 4, 3])
    sched = H.SequentialLR(opt, [warm, H.CosineAnnealingLR(opt, [20, 10, 5])], [[2], [4], [3]])
    ref_opts, ref_scheds = [], []
    for i, r in enumerate(refs):
        o = torch.optim.AdamW(
            r.parameters(),
            lr=[1e-2, 3e-3, 1e-3][i],
            weight_decay=[0.0, 0.01, 0.1][i],
            foreach=False,
        )
        s = L.SequentialLR(
            o,
            [L.LinearLR(o, 0.1, total_iters=[2, 4, 3][i]), L.CosineAnnealingLR(o, [20, 10, 5][i])],
            [[2, 4, 3][i]],
        )
        ref_opts.append(o)
        ref_scheds.append(s)
    gen = torch.Generator().manual_seed(1)
    for _ in range(25):
        x = torch.randn(5, 6, generator=gen, dtype=torch.float64)
        y = torch.randint(0, 3, (5,), generator=gen)
        opt.zero_grad()
        hs.member_losses(array(x), y).sum().backward()
        opt.step()
        sched.step()
        for r, o, s in zip(refs, ref_opts, ref_scheds, strict=True):
            o.zero_grad()
            F.cross_entropy(r(x), y).backward()
            o.step()
            s.step()
    for i, r in enumerate(refs):
        for p, q in zip(r.parameters(), array.member(i).parameters(), strict=True):
            torch.testing.assert_close(q, p, rtol=1e-7, atol=1e-10)


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda o: H.StepLR(o, [1, 2]), ValueError, "step_size has 2 values for 3 members"),
        (lambda o: H.StepLR(o, [1, 0, 2]), ValueError, r"step_size\[1\] = 0"),
        (lambda o: H.CosineAnnealingLR(o, [5, -1, 2]), ValueError, r"T_max\[1\] = -1"),
        (lambda o: H.OneCycleLR(o, 1.0), ValueError, "total_steps, or epochs and steps_per_epoch"),
        (lambda o: H.ReduceLROnPlateau(o, mode="up"), ValueError, "mode must be 'min' or 'max'"),
        (
            lambda o: H.SequentialLR(o, [H.StepLR(o, 2), H.StepLR(o, 3)], [1, 2]),
            ValueError,
            "one fewer milestone",
        ),
        (
            lambda o: H.StepLR(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))]), 2),
            TypeError,
            "needs an hs.optim optimizer",
        ),
    ],
)
def test_bad_arguments(make, error, match) -> None:
    fused, _ = optimizers("SGD")
    with pytest.raises(error, match=match):
        make(fused)


def test_one_cycle_refuses_to_step_past_its_end() -> None:
    fused, _ = optimizers("SGD")
    sched = H.OneCycleLR(fused, 1.0, total_steps=3)
    for _ in range(3):
        sched.step()
    with pytest.raises(ValueError, match="tried to step 4 times; total_steps is 3"):
        sched.step()


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_schedule_step_reads_nothing_back_from_the_device(name: str) -> None:
    """On an accelerator each read of a tensor's values stalls the host until the device is
    done: the schedulers step from their host copies and write each ``[B]`` tensor at once,
    also right after a refill and after a member went non-finite (the values themselves are
    checked against torch by the tests above)."""
    make, _, kind, steps, metric = CASES[name]
    fused, _ = optimizers(kind)
    sched = make(fused)
    grad = fused.param_groups[0]["params"][0].grad
    frozen = None
    reads: list[str] = []
    for t in range(steps // 2):
        if t == 3:  # a refill from the host
            fused.reset_member(2, lr=0.07)
        grad[0, 0] = float("nan") if t == 5 else 0.0  # member 0 is deactivated at step 5
        fused.step()
        if t == 5:
            frozen = float(fused.param_groups[0]["lr"][0])
        # every read of a value into Python: .item(), .tolist(), bool(), a copy to the CPU...
        with OpCounter() as counter:
            advance(sched, metric, t)
        reads += counter.host_reads
    assert reads == []
    assert fused.nonfinite_members == [0]
    assert sched.last_epoch[0] == 5  # steps 0-4; none once deactivated
    assert float(fused.param_groups[0]["lr"][0]) == frozen
