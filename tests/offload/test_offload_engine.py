"""The offload engine against the same array run whole (float64): outputs, gradients, buffers,
dropout streams and several optimizer steps with a schedule; the ledger of bytes on the compute
side against its budget; what the shard planner refuses, by name."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

import hfsweep as hs
from hfsweep.offload import (
    CpuTransfer,
    OffloadBudgetError,
    OffloadedArray,
    OffloadError,
    plan_shards,
)

B = 3


class Residual(nn.Module):
    """A stem, a residual block (no cut may go inside it: two values cross), a head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(6, 8)
        self.a = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.b = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.3)
        self.head = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.stem(x))
        h = h + self.b(torch.relu(self.bn(self.a(h))))
        return self.head(self.drop(h))


def _sequential() -> nn.Module:
    return nn.Sequential(
        nn.Linear(6, 8),
        nn.ReLU(),
        nn.BatchNorm1d(8),
        nn.Dropout(0.2),
        nn.Linear(8, 8),
        nn.Tanh(),
        nn.Linear(8, 3),
    )


def _pair(make: Callable[[], nn.Module]) -> tuple[hs.FusedArray, hs.FusedArray]:
    models = [make().double() for _ in range(B)]
    whole = hs.fuse(copy.deepcopy(models))
    host = hs.fuse(copy.deepcopy(models), share_frozen=False)
    for i in range(B):
        whole.manual_seed(i, 100 + i)
        host.manual_seed(i, 100 + i)
    return whole, host


def _optimizers(kind: str, whole: hs.FusedArray, host: hs.FusedArray) -> list[object]:
    out = []
    for array in (whole, host):
        if kind == "sgd":
            opt = hs.optim.SGD(
                array,
                lr=[0.1, 0.05, 0.02],
                momentum=[0.0, 0.5, 0.9],
                weight_decay=[0.0, 1e-3, 1e-2],
            )
        else:
            opt = hs.optim.AdamW(array, lr=[1e-2, 3e-3, 1e-3], weight_decay=[0.0, 0.01, 0.1])
        sched = hs.optim.lr_scheduler.StepLR(opt, step_size=[1, 2, 3], gamma=[0.5, 0.7, 0.9])
        out.append((opt, sched))
    return out


@pytest.mark.parametrize(
    ("make", "kind", "prefetch"),
    [
        (_sequential, "sgd", True),
        (Residual, "adamw", True),
        (_sequential, "adamw", False),
        (Residual, "sgd", False),
    ],
    ids=[
        "sequential-sgd",
        "residual-adamw",
        "sequential-adamw-no-prefetch",
        "residual-sgd-no-prefetch",
    ],
)
def test_offloaded_array_trains_exactly_as_the_whole_array(
    make: Callable[[], nn.Module], kind: str, prefetch: bool
) -> None:
    whole, host = _pair(make)
    engine = OffloadedArray(host, prefetch=prefetch)
    assert len(engine.shards) >= 3
    (opt_w, sched_w), (opt_h, sched_h) = _optimizers(kind, whole, host)
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        x = torch.randn(5, 6, generator=gen, dtype=torch.float64)
        target = torch.randn(B, 5, 3, generator=gen, dtype=torch.float64)
        out_w, out_h = whole(x), engine(x)
        torch.testing.assert_close(out_h, out_w, rtol=1e-7, atol=1e-12)
        ((out_w - target) ** 2).mean(dim=(1, 2)).sum().backward()
        ((out_h - target) ** 2).mean(dim=(1, 2)).sum().backward()
        for (name, pw), ph in zip(whole.named_parameters(), host.parameters(), strict=True):
            torch.testing.assert_close(ph.grad, pw.grad, rtol=1e-7, atol=1e-12, msg=name)
        for o, s in ((opt_w, sched_w), (opt_h, sched_h)):
            o.step()
            o.zero_grad(set_to_none=True)
            s.step()
        assert engine.ledger.resident == 0
    for (name, tw), th in zip(whole.state_dict().items(), host.state_dict().values(), strict=True):
        torch.testing.assert_close(th, tw, rtol=1e-7, atol=1e-12, msg=name)
    assert all(host.rng_state(i) == whole.rng_state(i) for i in range(B))
    host.eval()
    whole.eval()
    with torch.no_grad():
        x = torch.randn(4, 6, dtype=torch.float64)
        torch.testing.assert_close(engine(x), whole(x), rtol=1e-7, atol=1e-12)
    assert engine.ledger.resident == 0


def test_a_delayed_transfer_in_a_thread_gives_the_same_results() -> None:
    whole, host = _pair(_sequential)
    engine = OffloadedArray(host, transfer=CpuTransfer(delay=0.002))
    x = torch.randn(5, 6, dtype=torch.float64)
    whole(x).sum().backward()
    engine(x).sum().backward()
    for pw, ph in zip(whole.parameters(), host.parameters(), strict=True):
        torch.testing.assert_close(ph.grad, pw.grad, rtol=1e-7, atol=1e-12)
    engine.close()


def test_the_input_gradient_flows_through_the_shards() -> None:
    whole, host = _pair(_sequential)
    engine = OffloadedArray(host)
    x = torch.randn(5, 6, dtype=torch.float64)
    xw, xh = x.clone().requires_grad_(), x.clone().requires_grad_()
    whole(xw).pow(2).sum().backward()
    engine(xh).pow(2).sum().backward()
    torch.testing.assert_close(xh.grad, xw.grad, rtol=1e-7, atol=1e-12)


def test_the_ledger_stays_under_the_budget_in_forward_backward_and_step() -> None:
    """Bytes resident on the compute side (shard state, the prefetched shard, gradients,
    boundary activations) never exceed the budget: the ledger refuses any addition that would,
    so training without an error is the proof; its peaks say what was held."""
    models = [nn.Sequential(*[nn.Linear(32, 32) for _ in range(8)]).double() for _ in range(B)]
    host = hs.fuse(models, share_frozen=False)
    total = sum(t.numel() * t.element_size() for t in host.state_dict().values())
    budget = total // 2
    engine = OffloadedArray(host, budget_bytes=budget)
    assert len(engine.shards) >= 4 and max(s.nbytes for s in engine.shards) <= budget // 4
    opt = hs.optim.SGD(host, lr=[0.1] * B, momentum=[0.9] * B)
    x = torch.randn(4, 32, dtype=torch.float64)
    for _ in range(3):
        engine(x).pow(2).sum().backward()
        assert engine.ledger.resident == 0
        with engine.ledger.phase("step"):
            opt.step()
            opt.zero_grad()
    peaks = engine.ledger.peaks
    assert 0 < peaks["forward"] <= budget and 0 < peaks["backward"] <= budget
    assert peaks["step"] == 0  # the optimizer steps on the host
    assert engine.ledger.peak <= budget < total  # never the whole array at once
    # the prefetched shard was counted beside the computing one
    assert peaks["forward"] >= engine.shards[0].nbytes + engine.shards[1].nbytes


def test_boundary_activations_over_the_budget_are_refused() -> None:
    models = [nn.Sequential(*[nn.Linear(32, 32) for _ in range(8)]).double() for _ in range(B)]
    host = hs.fuse(models, share_frozen=False)
    total = sum(t.numel() * t.element_size() for t in host.state_dict().values())
    engine = OffloadedArray(host, budget_bytes=total // 2)
    x = torch.randn(512, 32, dtype=torch.float64)  # 393 KiB per boundary
    with pytest.raises(OffloadBudgetError, match=r"boundary activations .* over the budget"):
        engine(x).sum().backward()
    engine(x[:4]).sum().backward()  # a later step starts clean
    assert engine.ledger.resident == 0


def test_a_forward_without_backward_is_released_by_the_next() -> None:
    _, host = _pair(_sequential)
    engine = OffloadedArray(host)
    x = torch.randn(5, 6, dtype=torch.float64)
    engine(x)  # with autograd on: the last shard and boundaries are kept for a backward
    assert engine.ledger.resident > 0
    with torch.no_grad():
        engine(x)
    assert engine.ledger.resident == 0
    first = engine(x)
    engine(x)
    with pytest.raises(OffloadError, match="one forward for backward at a time"):
        first.sum().backward()


def test_tied_layers_stay_in_one_shard() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(4, 8)
            self.shared = nn.Linear(8, 8)
            self.mid = nn.Linear(8, 8)
            self.out = nn.Linear(8, 2)

        def forward(self, x: Tensor) -> Tensor:
            h = self.shared(torch.relu(self.inp(x)))
            h = self.shared(torch.relu(self.mid(h)))  # the same layer again
            return self.out(h)

    models = [Tied().double() for _ in range(B)]
    whole, host = hs.fuse(copy.deepcopy(models)), hs.fuse(models, share_frozen=False)
    engine = OffloadedArray(host)
    holding = [s for s in engine.shards if any("shared" in n for n in s.nodes)]
    assert len(holding) == 1 and sum("shared" in n for n in holding[0].nodes) == 2
    x = torch.randn(3, 4, dtype=torch.float64)
    whole(x).sum().backward()
    engine(x).sum().backward()
    for pw, ph in zip(whole.parameters(), host.parameters(), strict=True):
        torch.testing.assert_close(ph.grad, pw.grad, rtol=1e-7, atol=1e-12)


class Branching(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.a(x) if x.sum() > 0 else -self.a(x)


class Direct(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x: Tensor) -> Tensor:
        return self.a(x) * self.scale


class DrawsItself(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return nn.functional.dropout(self.a(x), 0.5, self.training)


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        return self.a(x) + y


@pytest.mark.parametrize(
    ("model", "match"),
    [
        (Branching, "needs its forward traceable by torch.fx.symbolic_trace; Branching is not"),
        (TwoInputs, r"forward takes one tensor; TwoInputs.forward takes \['x', 'y'\]"),
        (Direct, "Direct's forward reads 'scale' directly"),
        (DrawsItself, "DrawsItself's forward calls dropout"),
    ],
)
def test_models_offload_cannot_cut_are_refused_by_name(model: type, match: str) -> None:
    array = hs.fuse([model(), model()], share_frozen=False)
    with pytest.raises(OffloadError, match=match):
        OffloadedArray(array)


def test_small_budgets_are_refused() -> None:
    array = hs.fuse([_sequential() for _ in range(2)], share_frozen=False)
    with pytest.raises(OffloadError, match=r"holds \d+ bytes of stacked state, over the shard"):
        plan_shards(array, 16)
    with pytest.raises(OffloadBudgetError, match="budget must be >= 1 byte"):
        OffloadedArray(array, budget_bytes=0)
    with pytest.raises(ValueError, match="delay must be a number of seconds >= 0"):
        CpuTransfer(delay=-1)
