"""Offloaded arrays stepped together, their shards alternating (``hfsweep.offload.
AlternatingArrays``): each array trains exactly as the same array without offload (float64:
forward, gradients, many steps of different optimizers and schedules, BatchNorm, dropout
streams), the arrays' shards are fetched in turn through the one transfer, and the
shared ledger holds the arrays' shards together within the one budget. No timing: the
overlap is measured by ``benchmarks/offload_alternate.py``."""

from __future__ import annotations

import copy
import threading
import time
from typing import Any

import pytest
import torch
from torch import nn

import hfsweep as hs
from hfsweep.offload import (
    SCHEDULES,
    AlternatingArrays,
    CpuTransfer,
    OffloadedArray,
    OffloadError,
)
from hfsweep.offload._alternate import Schedule, _pick
from hfsweep.offload._transfer import _Link

B = 3


def _models(seed: int, width: int, depth: int) -> list[nn.Module]:
    torch.manual_seed(seed)
    out = []
    for _ in range(B):
        layers: list[nn.Module] = [nn.Linear(6, width), nn.BatchNorm1d(width), nn.Tanh()]
        for _ in range(depth):
            layers += [nn.Dropout(0.2), nn.Linear(width, width), nn.ReLU()]
        layers.append(nn.Linear(width, 3))
        out.append(nn.Sequential(*layers).double())
    return out


def _arrays() -> tuple[list[hs.FusedArray], list[hs.FusedArray]]:
    """Three arrays of different architectures and depths, and their twins not offloaded."""
    made = [_models(0, 8, 1), _models(1, 12, 3), _models(2, 6, 2)]
    whole = [hs.fuse(copy.deepcopy(m)) for m in made]
    host = [hs.fuse(m, share_frozen=False) for m in made]
    for a in [*whole, *host]:
        for i in range(B):
            a.manual_seed(i, 100 + i)
    return whole, host


def _optimizers(k: int, array: hs.FusedArray) -> tuple[object, object]:
    if k == 0:
        opt = hs.optim.SGD(array, lr=[0.1, 0.05, 0.02], momentum=[0.0, 0.5, 0.9])
        sched = hs.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=[4, 6, 8])
    elif k == 1:
        opt = hs.optim.AdamW(array, lr=[1e-2, 3e-3, 1e-3], weight_decay=[0.0, 0.01, 0.1])
        sched = hs.optim.lr_scheduler.StepLR(opt, step_size=[1, 2, 3], gamma=[0.5, 0.7, 0.9])
    else:
        opt = hs.optim.RMSprop(array, lr=[1e-3, 3e-3, 1e-2])
        sched = hs.optim.lr_scheduler.StepLR(opt, step_size=[2, 2, 2], gamma=[0.5, 0.6, 0.7])
    return opt, sched


def _record(arrays: AlternatingArrays) -> list[int]:
    """A list that each engine's fetches append its index to, in the order they start."""
    order: list[int] = []
    for k, engine in enumerate(arrays.engines):
        fetch = engine._fetch

        def recorded(*args: Any, _k: int = k, _fetch: Any = fetch) -> Any:
            order.append(_k)
            return _fetch(*args)

        engine._fetch = recorded  # type: ignore[method-assign]
    return order


def test_alternated_arrays_train_exactly_as_each_alone() -> None:
    whole, host = _arrays()
    arrays = AlternatingArrays(host, transfer=CpuTransfer(delay=0.001))
    assert len({len(e.shards) for e in arrays.engines}) > 1  # one ends before the others
    optimizers = [_optimizers(k, a) for k in range(3) for a in (whole[k], host[k])]
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        xs = [torch.randn(5, 6, generator=gen, dtype=torch.float64) for _ in range(3)]
        targets = [torch.randn(B, 5, 3, generator=gen, dtype=torch.float64) for _ in range(3)]
        outs = arrays.forward(xs)
        losses = [((o - t) ** 2).mean(dim=(1, 2)).sum() for o, t in zip(outs, targets, strict=True)]
        arrays.backward(losses)
        for w, x, out, t in zip(whole, xs, outs, targets, strict=True):
            out_w = w(x)
            torch.testing.assert_close(out, out_w, rtol=1e-7, atol=1e-12)
            ((out_w - t) ** 2).mean(dim=(1, 2)).sum().backward()
        for w, h in zip(whole, host, strict=True):
            for (name, pw), ph in zip(w.named_parameters(), h.parameters(), strict=True):
                torch.testing.assert_close(ph.grad, pw.grad, rtol=1e-7, atol=1e-12, msg=name)
        for opt, sched in optimizers:
            opt.step()  # type: ignore[attr-defined]
            opt.zero_grad(set_to_none=True)  # type: ignore[attr-defined]
            sched.step()  # type: ignore[attr-defined]
        assert arrays.ledger.resident == 0
    for w, h in zip(whole, host, strict=True):
        for (name, tw), th in zip(w.state_dict().items(), h.state_dict().values(), strict=True):
            torch.testing.assert_close(th, tw, rtol=1e-7, atol=1e-12, msg=name)
        assert all(h.rng_state(i) == w.rng_state(i) for i in range(B))
    # an evaluation forward, alternated too, keeps nothing
    for a in [*whole, *host]:
        a.eval()
    x = torch.randn(4, 6, dtype=torch.float64)
    with torch.no_grad():
        for out, w in zip(arrays.forward([x, x, x]), whole, strict=True):
            torch.testing.assert_close(out, w(x), rtol=1e-7, atol=1e-12)
    assert arrays.ledger.resident == 0
    arrays.close()


def _turns(counts: list[int]) -> list[int]:
    """Which array fetches, in order, where array i fetches ``counts[i]`` shards in turns."""
    return [i for r in range(max(counts)) for i, c in enumerate(counts) if r < c]


def test_the_fetches_alternate_between_the_arrays() -> None:
    """One step: every array's first shard is fetched, then the arrays take turns (each shard
    computing while the next array's is copied in), in the forward and in the backward; an
    array with fewer shards drops out of the turns when it is done."""
    _, host = _arrays()
    arrays = AlternatingArrays(host, transfer=CpuTransfer(delay=0.001))
    order = _record(arrays)
    x = torch.randn(5, 6, dtype=torch.float64)
    outs = arrays.forward([x, x, x])
    n = [len(e.shards) for e in arrays.engines]
    assert order == _turns(n)  # shard k of each, in turn
    order.clear()
    arrays.backward([o.square().sum() for o in outs])
    # the last shard of each stayed from the forward; the others fetched in turn
    assert order == _turns([k - 1 for k in n])
    arrays.close()


def test_the_arrays_share_one_budget() -> None:
    """Within one budget the shards of each array hold at most a quarter of it over the number
    of arrays; the shared ledger counts every array's shards, held together, under it."""
    _, host = _arrays()
    state = max(sum(t.numel() * t.element_size() for t in a._state()) for a in host)
    budget = 3 * state
    arrays = AlternatingArrays(host, budget_bytes=budget, transfer=CpuTransfer(0.001))
    for engine in arrays.engines:
        assert engine.ledger is arrays.ledger
        assert max(s.nbytes for s in engine.shards) <= budget // (4 * 3)
    x = torch.randn(5, 6, dtype=torch.float64)
    for _ in range(2):
        outs = arrays.forward([x, x, x])
        arrays.backward([o.square().sum() for o in outs])
    peaks = arrays.ledger.peaks
    assert 0 < peaks["forward"] <= budget and 0 < peaks["backward"] <= budget
    # more than any one array's two largest shards: several arrays' shards were held at once
    largest = max(sum(sorted(s.nbytes for s in e.shards)[-2:]) for e in arrays.engines)
    assert peaks["forward"] > largest
    assert arrays.ledger.resident == 0
    arrays.close()


def test_refusals() -> None:
    _, host = _arrays()
    with pytest.raises(OffloadError, match="the same array twice"):
        AlternatingArrays([host[0], host[0]])
    arrays = AlternatingArrays(host[:2])
    x = torch.randn(5, 6, dtype=torch.float64)
    with pytest.raises(OffloadError, match="one input per array"):
        arrays.forward([x])
    with pytest.raises(OffloadError, match="an input requires one"):
        arrays.forward([x, x.clone().requires_grad_()])
    outs = arrays.forward([x, x])
    arrays.backward([o.sum() for o in outs])
    with pytest.raises(OffloadError, match="ran already"):
        arrays.backward([o.sum() for o in outs])


def _loss(target: torch.Tensor) -> Any:
    """The tests' loss of an output against ``target``, as a function for ``step``."""
    return lambda out: ((out - target) ** 2).mean(dim=(1, 2)).sum()


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_step_trains_exactly_as_each_alone(schedule: Schedule) -> None:
    """``step`` under either schedule (the shifted one starting each array's step once the one
    before it is in its backward): every array's losses, gradients, state dicts and dropout
    streams as the same array without offload, over five steps of three optimizers."""
    whole, host = _arrays()
    arrays = AlternatingArrays(host, transfer=CpuTransfer(delay=0.001), schedule=schedule)
    assert arrays.schedule == schedule
    optimizers = [_optimizers(k, a) for k in range(3) for a in (whole[k], host[k])]
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        xs = [torch.randn(5, 6, generator=gen, dtype=torch.float64) for _ in range(3)]
        targets = [torch.randn(B, 5, 3, generator=gen, dtype=torch.float64) for _ in range(3)]
        losses = arrays.step(xs, [_loss(t) for t in targets])
        assert arrays.ledger.resident == 0
        for w, x, t, loss in zip(whole, xs, targets, losses, strict=True):
            loss_w = _loss(t)(w(x))
            torch.testing.assert_close(loss, loss_w.detach(), rtol=1e-7, atol=1e-12)
            loss_w.backward()
        for w, h in zip(whole, host, strict=True):
            for (name, pw), ph in zip(w.named_parameters(), h.parameters(), strict=True):
                torch.testing.assert_close(ph.grad, pw.grad, rtol=1e-7, atol=1e-12, msg=name)
        for opt, sched in optimizers:
            opt.step()  # type: ignore[attr-defined]
            opt.zero_grad(set_to_none=True)  # type: ignore[attr-defined]
            sched.step()  # type: ignore[attr-defined]
    for w, h in zip(whole, host, strict=True):
        for (name, tw), th in zip(w.state_dict().items(), h.state_dict().values(), strict=True):
            torch.testing.assert_close(th, tw, rtol=1e-7, atol=1e-12, msg=name)
        assert all(h.rng_state(i) == w.rng_state(i) for i in range(B))
    arrays.close()


def test_the_shifted_step_starts_each_array_in_the_backward_of_the_one_before() -> None:
    """Shifted: the first array's forward fetches alone; the second's forward starts once the
    first is in its backward (its fetches then alternate with the first's backward ones), the
    third's once the second is; the lockstep's ``step`` fetches as forward and backward do."""
    _, host = _arrays()
    n = [len(e.shards) for e in AlternatingArrays(host).engines]
    x = torch.randn(5, 6, dtype=torch.float64)
    orders = {}
    for schedule in SCHEDULES:
        _, host = _arrays()
        arrays = AlternatingArrays(host, transfer=CpuTransfer(0.001), schedule=schedule)
        orders[schedule] = _record(arrays)
        arrays.step([x, x, x], [lambda o: o.square().sum()] * 3)
        arrays.close()
    assert orders["lockstep"] == _turns(n) + _turns([k - 1 for k in n])
    shifted = orders["shifted"]
    assert shifted[: n[0]] == [0] * n[0]  # the first array's forward, alone
    for i in (1, 2):
        # array i's first fetch comes after array i - 1's forward ones and its first backward
        # one (its shard n - 2, fetched while its shard n - 1, kept from the forward,
        # computes: in the round array i joins, array i - 1 has its turn first)
        first = shifted.index(i)
        assert shifted[:first].count(i - 1) == n[i - 1] + 1
        assert i + 1 not in shifted[:first]
    assert sorted(shifted) == sorted(orders["lockstep"])  # the same fetches, reordered


def _budgeted(schedule: Schedule) -> tuple[AlternatingArrays, int]:
    _, host = _arrays()
    state = max(sum(t.numel() * t.element_size() for t in a._state()) for a in host)
    budget = 3 * state
    arrays = AlternatingArrays(
        host, budget_bytes=budget, transfer=CpuTransfer(0.001), schedule=schedule
    )
    return arrays, budget


def test_the_shifted_step_stays_within_the_budget_and_under_the_lockstep_peak() -> None:
    """Within one budget the shifted step's shared ledger peaks under it, and never above the
    lockstep's: an array's shards and boundary activations are held while the one before it
    runs its backward, but by then that one has let go of some of its own."""
    peaks = {}
    x = torch.randn(5, 6, dtype=torch.float64)
    for schedule in SCHEDULES:
        arrays, budget = _budgeted(schedule)
        for engine in arrays.engines:
            assert max(s.nbytes for s in engine.shards) <= budget // (4 * 3)
        for _ in range(2):
            arrays.step([x, x, x], [lambda o: o.square().sum()] * 3)
        assert 0 < arrays.ledger.peak <= budget
        assert arrays.ledger.resident == 0
        peaks[schedule] = arrays.ledger.peak
        arrays.close()
    assert peaks["shifted"] <= peaks["lockstep"]


class _Failed(RuntimeError):
    pass


def _fail_then_step_again(arrays: AlternatingArrays, where: str) -> None:
    """The second of ``arrays``' three arrays fails in its loss or at its third shard
    (``where``): the error comes through, nothing stays held on the compute side, and the next
    step trains all three as before; then ``arrays`` is closed."""
    x = torch.randn(5, 6, dtype=torch.float64)
    ok = [lambda o: o.square().sum()] * 3

    def failing(out: torch.Tensor) -> torch.Tensor:
        raise _Failed("the loss")

    losses = list(ok)
    if where == "loss":
        losses[1] = failing
    else:
        engine = arrays.engines[1]
        run = engine._run
        calls = iter(range(100))

        def fails_at_the_third_shard(*args: Any) -> Any:
            if next(calls) == 2:
                raise _Failed("a shard")
            return run(*args)

        engine._run = fails_at_the_third_shard  # type: ignore[method-assign]
    with pytest.raises(_Failed):
        arrays.step([x, x, x], losses)
    assert arrays.ledger.resident == 0
    assert arrays.ledger.by_kind == dict.fromkeys(arrays.ledger.by_kind, 0)
    if where == "forward":
        arrays.engines[1]._run = run  # type: ignore[method-assign]
    assert len(arrays.step([x, x, x], ok)) == 3
    assert arrays.ledger.resident == 0
    arrays.close()


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("where", ["loss", "forward"])
def test_a_failure_in_one_array_closes_the_others(schedule: Schedule, where: str) -> None:
    """The second array's loss or one of its shards fails: the error comes through, nothing
    stays held on the compute side (the arrays under way are closed, what the finished ones
    kept is released), and the next step trains as before."""
    _, host = _arrays()
    arrays = AlternatingArrays(host, transfer=CpuTransfer(0.001), schedule=schedule)
    _fail_then_step_again(arrays, where)


def test_step_refusals() -> None:
    _, host = _arrays()
    with pytest.raises(
        OffloadError, match=r"schedule must be one of \('lockstep', 'shifted', 'ready'\)"
    ):
        AlternatingArrays(host[:2], schedule="staggered")  # type: ignore[arg-type]
    arrays = AlternatingArrays(host[:2], schedule="shifted")
    x = torch.randn(5, 6, dtype=torch.float64)
    loss = [lambda o: o.sum()] * 2
    with pytest.raises(OffloadError, match="one input and one loss per array"):
        arrays.step([x], loss)
    with pytest.raises(OffloadError, match="an input requires one"):
        arrays.step([x, x.clone().requires_grad_()], loss)
    with torch.no_grad(), pytest.raises(OffloadError, match="needs autograd on"):
        arrays.step([x, x], loss)
    # a step's backward is its own: backward() after it has no forward to go through
    arrays.step([x, x], loss)
    with pytest.raises(OffloadError, match="after a forward"):
        arrays.backward([torch.zeros(()), torch.zeros(())])
    arrays.close()


def _train_as_alone(arrays: AlternatingArrays, whole: list[hs.FusedArray], steps: int) -> None:
    """``steps`` training steps of ``arrays`` (its host arrays' twins ``whole`` beside them):
    every loss, gradient, state dict and dropout stream as the twin's."""
    host = [e.array for e in arrays.engines]
    optimizers = [_optimizers(k, a) for k in range(3) for a in (whole[k], host[k])]
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        xs = [torch.randn(5, 6, generator=gen, dtype=torch.float64) for _ in range(3)]
        targets = [torch.randn(B, 5, 3, generator=gen, dtype=torch.float64) for _ in range(3)]
        losses = arrays.step(xs, [_loss(t) for t in targets])
        assert arrays.ledger.resident == 0
        for w, x, t, loss in zip(whole, xs, targets, losses, strict=True):
            loss_w = _loss(t)(w(x))
            torch.testing.assert_close(loss, loss_w.detach(), rtol=1e-7, atol=1e-12)
            loss_w.backward()
        for w, h in zip(whole, host, strict=True):
            for (name, pw), ph in zip(w.named_parameters(), h.parameters(), strict=True):
                torch.testing.assert_close(ph.grad, pw.grad, rtol=1e-7, atol=1e-12, msg=name)
        for opt, sched in optimizers:
            opt.step()  # type: ignore[attr-defined]
            opt.zero_grad(set_to_none=True)  # type: ignore[attr-defined]
            sched.step()  # type: ignore[attr-defined]
    for w, h in zip(whole, host, strict=True):
        for (name, tw), th in zip(w.state_dict().items(), h.state_dict().values(), strict=True):
            torch.testing.assert_close(th, tw, rtol=1e-7, atol=1e-12, msg=name)
        assert all(h.rng_state(i) == w.rng_state(i) for i in range(B))


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("depth", [3, (4, 1, 2)])
def test_a_deeper_prefetch_trains_exactly_as_each_alone(
    schedule: Schedule, depth: int | tuple[int, ...]
) -> None:
    """Several shards fetched ahead (the same depth for all, or one per array), under every
    schedule: each array still trains as its twin without offload, over five steps."""
    whole, host = _arrays()
    arrays = AlternatingArrays(
        host, transfer=CpuTransfer(delay=0.001), schedule=schedule, prefetch_depth=depth
    )
    expected = [depth] * 3 if isinstance(depth, int) else list(depth)
    assert [e.prefetch_depth for e in arrays.engines] == expected
    _train_as_alone(arrays, whole, 5)
    arrays.close()


@pytest.mark.parametrize("depth", [1, 2, 4])
def test_one_array_alone_with_a_deeper_prefetch_is_exact_and_holds_its_depth(depth: int) -> None:
    """An offloaded array alone: at a turn it has ``depth`` shards fetched or on their way
    (the first ``depth`` before its first shard computes), and it computes what the array
    computes, gradients included."""
    whole, host = _arrays()
    engine = OffloadedArray(host[1], transfer=CpuTransfer(0.001), prefetch_depth=depth)
    n = len(engine.shards)
    assert n > 4
    x = torch.randn(5, 6, dtype=torch.float64)
    steps = engine._forward_steps(x, False)
    next(steps)
    held = sum(s.nbytes for s in engine.shards[:depth])
    assert engine.ledger.by_kind["shard state"] == held
    assert engine._waiting is not None and engine._waiting.nbytes == engine.shards[0].nbytes
    steps.close()
    assert engine.ledger.resident == 0
    out, out_w = engine(x), whole[1](x)
    torch.testing.assert_close(out, out_w, rtol=1e-7, atol=1e-12)
    out.square().sum().backward()
    out_w.square().sum().backward()
    for (name, pw), ph in zip(whole[1].named_parameters(), host[1].parameters(), strict=True):
        torch.testing.assert_close(ph.grad, pw.grad, rtol=1e-7, atol=1e-12, msg=name)
    assert engine.ledger.resident == 0
    engine.close()


@pytest.mark.parametrize("depth", [1, 3])
def test_one_array_alone_with_a_deeper_prefetch_stays_within_its_budget(depth: int) -> None:
    """Alone within a budget, the shard limit is the budget over ``depth + 3`` (a quarter at
    depth 1): the shards ahead, the one computing and its gradients leave a part for the
    boundary activations, and the ledger's peak stays under the budget."""
    _, host = _arrays()
    state = sum(t.numel() * t.element_size() for t in host[1]._state())
    budget = 3 * state
    engine = OffloadedArray(
        host[1], budget_bytes=budget, transfer=CpuTransfer(0.001), prefetch_depth=depth
    )
    assert max(s.nbytes for s in engine.shards) <= budget // (depth + 3)
    x = torch.randn(5, 6, dtype=torch.float64)
    for _ in range(2):
        engine(x).square().sum().backward()
    assert 0 < engine.ledger.peak <= budget and engine.ledger.resident == 0
    engine.close()


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_deeper_prefetch_stays_within_the_budget(schedule: Schedule) -> None:
    """Within one budget, with depths (3, 1, 2): each array's shards hold at most the budget
    over 2 (sum of depths + 2), so the arrays' shards ahead, the one computing and its
    gradients take half of it; the shared ledger's peak stays under the budget."""
    _, host = _arrays()
    state = max(sum(t.numel() * t.element_size() for t in a._state()) for a in host)
    budget = 6 * state  # a layer of the widest array within the budget over 16
    arrays = AlternatingArrays(
        host,
        budget_bytes=budget,
        transfer=CpuTransfer(0.001),
        schedule=schedule,
        prefetch_depth=(3, 1, 2),
    )
    for engine in arrays.engines:
        assert max(s.nbytes for s in engine.shards) <= budget // (2 * (6 + 2))
    x = torch.randn(5, 6, dtype=torch.float64)
    for _ in range(2):
        arrays.step([x, x, x], [lambda o: o.square().sum()] * 3)
    assert 0 < arrays.ledger.peak <= budget
    assert arrays.ledger.by_kind["shard state"] == 0 == arrays.ledger.resident
    arrays.close()


@pytest.mark.parametrize("where", ["loss", "forward"])
def test_a_failure_with_a_deeper_prefetch_releases_everything(where: str) -> None:
    """The shards fetched ahead are released too where one array fails under ``ready``."""
    _, host = _arrays()
    arrays = AlternatingArrays(
        host, transfer=CpuTransfer(0.001), schedule="ready", prefetch_depth=3
    )
    _fail_then_step_again(arrays, where)


class _Waiting:
    """A stand-in for a fetch a suspended array waits on (``order``: when it started)."""

    def __init__(
        self, order: int, ready: bool, urgent: bool = False, started: bool = False
    ) -> None:
        self.order = order
        self._ready = ready
        self.urgent = urgent
        self._started = started

    def ready(self) -> bool:
        return self._ready

    def started(self) -> bool:
        return self._started or self._ready


class _Engine:
    def __init__(self, waiting: _Waiting | None) -> None:
        self._waiting = waiting


def test_the_ready_turn_goes_to_an_array_whose_shard_is_in() -> None:
    """``ready``'s rule: the first array after the last one taken whose next shard is in;
    else the one whose fetch started first; else (none waits on a fetch) the next in turn."""
    engines: Any = [_Engine(_Waiting(5, False)), _Engine(_Waiting(3, True)), _Engine(None)]
    assert _pick([0, 1, 2], engines, -1) == 1
    assert _pick([0, 1, 2], engines, 1) == 1  # the only one in takes turns in a row
    engines[0]._waiting._ready = True
    assert _pick([0, 1, 2], engines, 0) == 1  # in turn after the last one taken
    assert _pick([0, 1, 2], engines, 1) == 0
    engines = [_Engine(_Waiting(5, False)), _Engine(_Waiting(3, False)), _Engine(None)]
    assert _pick([0, 1, 2], engines, 1) == 1  # none in: the fetch started first
    engines = [_Engine(None), _Engine(None), _Engine(None)]
    assert _pick([0, 2], engines, 0) == 2


@pytest.mark.parametrize("depth", [0, -1, True, 1.5, "2", (1, 2), (1, 0, 2)])
def test_bad_prefetch_depths_are_refused_naming_the_value(depth: Any) -> None:
    _, host = _arrays()
    with pytest.raises(OffloadError, match="prefetch_depth must be an int >= 1") as refused:
        AlternatingArrays(host, prefetch_depth=depth)
    message = str(refused.value)
    assert repr(depth) in message and "one such int per array (3)" in message
    if isinstance(depth, int):
        with pytest.raises(
            OffloadError, match=f"prefetch_depth must be an int >= 1, got {depth!r}"
        ):
            OffloadedArray(host[0], prefetch_depth=depth)


def test_the_ready_turn_follows_the_link_s_order_where_none_is_in() -> None:
    """None in: the copy under way first, then an urgent fetch not started (it passes the
    others on the link), then the others in the order started."""
    engines: Any = [_Engine(_Waiting(3, False)), _Engine(_Waiting(5, False, urgent=True))]
    assert _pick([0, 1], engines, -1) == 1  # urgent, asked for later: in first
    engines[0]._waiting._started = True
    assert _pick([0, 1], engines, -1) == 0  # a copy under way is not interrupted


def test_the_link_takes_urgent_jobs_before_the_others_queued() -> None:
    """The transfer's thread: a job under way runs to its end; of those queued the urgent
    ones go first, each class in the order submitted; closing runs what is queued."""
    link, ran, hold = _Link(), [], threading.Event()

    def job(name: str) -> Any:
        def run() -> list[torch.Tensor]:
            if name == "first":
                hold.wait(10)
            ran.append(name)
            return []

        return run

    futures = [link.submit(job("first"), False)]
    while not futures[0].running():  # the first under way before the others are queued
        time.sleep(0.001)
    for name, urgent in [("a1", False), ("b1", True), ("a2", False), ("b2", True)]:
        futures.append(link.submit(job(name), urgent))
    hold.set()
    link.shutdown()
    assert ran == ["first", "b1", "b2", "a1", "a2"]
    assert all(f.done() for f in futures)


def test_a_failing_copy_reaches_whoever_waits_on_it() -> None:
    link = _Link()

    def fails() -> list[torch.Tensor]:
        raise RuntimeError("copy failed")

    with pytest.raises(RuntimeError, match="copy failed"):
        link.submit(fails, True).result(10)
    link.shutdown()


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("urgent", [(1,), (0, 2)])
def test_urgent_fetches_train_exactly_as_each_alone(
    schedule: Schedule, urgent: tuple[int, ...]
) -> None:
    """Some arrays' fetches ahead of the others' on the link, with a deeper prefetch: the
    shards come in in another order, and each array still trains as its twin."""
    whole, host = _arrays()
    arrays = AlternatingArrays(
        host,
        transfer=CpuTransfer(delay=0.001),
        schedule=schedule,
        prefetch_depth=(3, 1, 2),
        urgent=urgent,
    )
    assert [e._urgent for e in arrays.engines] == [i in urgent for i in range(3)]
    _train_as_alone(arrays, whole, 5)
    arrays.close()


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_urgent_fetches_stay_within_the_budget(schedule: Schedule) -> None:
    """The priority changes when shards are in, not how many are held: the shared ledger's
    peak stays under the budget, as without it."""
    _, host = _arrays()
    state = max(sum(t.numel() * t.element_size() for t in a._state()) for a in host)
    budget = 6 * state
    arrays = AlternatingArrays(
        host,
        budget_bytes=budget,
        transfer=CpuTransfer(0.001),
        schedule=schedule,
        prefetch_depth=(3, 1, 2),
        urgent=[1],
    )
    x = torch.randn(5, 6, dtype=torch.float64)
    for _ in range(2):
        arrays.step([x, x, x], [lambda o: o.square().sum()] * 3)
    assert 0 < arrays.ledger.peak <= budget
    assert arrays.ledger.by_kind["shard state"] == 0 == arrays.ledger.resident
    arrays.close()


def test_urgent_is_not_marked_where_the_link_copies_in_the_order_issued() -> None:
    """A transfer that does not reorder (as one CUDA stream): marking the urgent arrays'
    fetches would make the ready schedule wait on the array whose copy is not first on the
    link, so none is marked, and the order of the turns is the link's own."""

    class _InOrder(CpuTransfer):
        reorders = False

    _, host = _arrays()
    arrays = AlternatingArrays(host, transfer=_InOrder(), schedule="ready", urgent=(1,))
    assert not any(e._urgent for e in arrays.engines)
    arrays.close()


@pytest.mark.parametrize("urgent", [1, (3,), (-1,), (0, 0), (True,), (0.0,), "0", None])
def test_bad_urgent_values_are_refused_naming_the_value(urgent: Any) -> None:
    _, host = _arrays()
    with pytest.raises(OffloadError, match="urgent must be a list or tuple") as refused:
        AlternatingArrays(host, urgent=urgent)
    message = str(refused.value)
    assert repr(urgent) in message and "distinct array indices in 0..2" in message
