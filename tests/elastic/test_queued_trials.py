"""While the trials queued behind the formed arrays would form more arrays than the free
workers can start, the allocator maximises useful throughput: a worker starts a queued array
rather than grow a running one, and an array starts on its minimum, since the engine forms the
next array at once (fake clock, no Ray). Where the workers suffice for every queued array, the
queue does not change the plan.

Before, the allocator saw only the one array the engine had formed. At the start of a sweep it
gave the first array every free worker and shrank it for the next (a resize for nothing), and
while the sweep's 2,000 trials queued it grew many-member arrays instead of starting the next
one (``benchmarks/elastic_sim.py``: 46 resizes before the last trial started, the queue phase
24 s longer than one array per accelerator). Each test also runs the old decision
(``queued=0``, what the allocator was told before) and checks that it differs. ``queued``
counts arrays (``Packer.queued_arrays``'s estimate in ``hfsweep run``)."""

from __future__ import annotations

from pathlib import Path

from _elastic_fakes import FakeClock, evals, fake_policy

from hfsweep.elastic.allocator import Allocator, ArrayState, WaitingPool
from hfsweep.parallel import read_resize
from hfsweep.profiler import ScalingProfile

#: about the simulator's token_transformer (16 members) and cifar_resnet (1) arrays
TOKEN = ScalingProfile("token", {1: 100.0, 2: 190.0, 4: 350.0, 8: 560.0, 16: 700.0})
CIFAR = ScalingProfile("cifar", {1: 100.0, 2: 190.0, 4: 340.0, 8: 570.0})


def _token(workers: int = 1, since: float = 0.0) -> ArrayState:
    return ArrayState("a", "token", 16, 700.0, TOKEN, workers=workers, since=since)


def _formed() -> WaitingPool:
    return WaitingPool("cifar", 1, 1, 325.0, CIFAR, name="array 1", since=100.0)


def test_a_queued_sweep_starts_the_formed_array_rather_than_grow() -> None:
    """A 16-member array on 1 of 8 workers, a formed one-member array, and 40 queued arrays:
    the formed array starts on 1 worker, the running one keeps 1, and 6 workers are kept for
    the queued arrays (said in the plan's notes). Told nothing of the queue (before),
    the running array grew into the 6 workers (its 16 members' remaining time won), to be
    shrunk again as the engine formed the queued trials' arrays."""
    alloc = Allocator(resize_every_s=0, resize_cost_s=20.0)
    plan = alloc.decide([_token()], [_formed()], 8, now=100.0, event="array started", queued=40)
    assert plan.workers() == {"a": 1, "array 1": 1}
    assert [d.action for d in plan.decisions] == ["keep", "start"]
    assert plan.idle == 6
    assert any("6 worker(s) kept for the ~40 array(s) of queued trials" in n for n in plan.notes)

    before = Allocator(resize_every_s=0, resize_cost_s=20.0).decide(
        [_token()], [_formed()], 8, now=100.0, event="array started"
    )
    assert before.workers() == {"a": 7, "array 1": 1}


def test_the_first_array_starts_on_its_minimum_while_trials_queue() -> None:
    """Nothing runs, the first array is formed and 63 arrays queue behind it on 64 workers: it
    starts on 1 worker. Before, it started on as many as its profile gained from (8), to be
    shrunk when the next array formed."""
    alloc = Allocator(resize_every_s=60, resize_cost_s=20.0)
    plan = alloc.decide([], [_formed()], 64, now=0.0, event="array started", queued=63)
    assert plan.workers() == {"array 1": 1}
    (start,) = plan.decisions
    assert start.action == "start"
    before = Allocator(resize_every_s=60, resize_cost_s=20.0).decide(
        [], [_formed()], 64, now=0.0, event="array started"
    )
    assert before.workers() == {"array 1": 8}


def test_with_workers_to_spare_for_the_queue_the_old_objective_decides() -> None:
    """Nothing queued, or fewer queued arrays than the free workers: the running array grows
    into the free workers as before (the queued array's trial waits for the plan after the
    engine forms it). Queued arrays that take every free worker hold them all."""
    alloc = Allocator(resize_every_s=0, resize_cost_s=20.0)
    for queued in (0, 1, 6):
        plan = alloc.decide([_token()], [], 8, now=100.0, event="members stopped", queued=queued)
        assert plan.workers()["a"] == 8, queued
    plan = alloc.decide([_token()], [], 8, now=100.0, event="members stopped", queued=7)
    assert plan.workers()["a"] == 1 and plan.idle == 7


def test_min_workers_and_the_no_deadlock_rule_hold_while_trials_queue() -> None:
    """min_workers 2: the formed array starts on 2 and each queued array is kept 2; with no
    array running the formed array always starts; a running array never drops below its
    minimum, and the worker the queued arrays' minimums leave over goes to it."""
    alloc = Allocator(min_workers=2, resize_every_s=0)
    plan = alloc.decide([], [_formed()], 8, now=0.0, queued=100)
    assert plan.workers() == {"array 1": 2} and plan.idle == 6
    running = ArrayState("a", "token", 16, 700.0, TOKEN, workers=2, since=0.0)
    plan = alloc.decide([running], [], 7, now=10.0, queued=3)
    assert plan.workers() == {"a": 3} and plan.idle == 4  # 2 queued arrays of 2 each, 1 over


def test_a_cooling_array_on_several_workers_shrinks_for_queued_trials() -> None:
    """An array on 4 workers, resized 10 s ago (cooldown 60 s), and trials queue: the cooldown
    does not hold them back, so it shrinks to 1 and 3 workers are kept for them."""
    alloc = Allocator(resize_every_s=60, resize_cost_s=20.0)
    plan = alloc.decide([_token(workers=4, since=90.0)], [], 4, now=100.0, queued=5)
    assert plan.workers() == {"a": 1} and plan.idle == 3
    assert "cooldown lifted for the shrinks that start waiting trials" in plan.notes


def test_hfsweep_runs_policy_starts_a_queued_sweep_without_a_resize(tmp_path: Path) -> None:
    """``hfsweep run``'s policy on a fake clock, 4 workers, the engine's queued arrays counted
    down as it forms them: the four arrays start on 1 worker each and no array is asked to resize.
    Told nothing of the queue (before), the first array started on all 4 workers and was
    asked to shrink as each of the others formed."""
    folders = [str(tmp_path / str(i)) for i in range(4)]
    for folder in folders:
        Path(folder).mkdir()

    def start(queue_known: bool) -> list[int]:
        clock, shown = FakeClock(), []
        left = [3]
        policy = fake_policy(clock, shown, queued=(lambda held: left[0]) if queue_known else None)
        got = []
        for folder in folders:
            got.append(policy.started(folder, "k", 4, total=4))
            left[0] = max(0, left[0] - 1)
            clock.now += 0.5
            policy.reported(folder, evals(clock.now), live=4)
        return got

    assert start(queue_known=True) == [1, 1, 1, 1]
    assert all(read_resize(f) is None for f in folders)
    assert start(queue_known=False)[0] == 4
    assert read_resize(folders[0]) == 1


def test_no_more_queued_arrays_count_than_the_engine_may_form_at_once(tmp_path: Path) -> None:
    """With ``ray.max_concurrent: 1`` the engine forms no second array while one runs, so the
    queue holds no worker back: the array starts on both workers, as before the queue rule."""
    folder = tmp_path / "0"
    folder.mkdir()
    clock, shown = FakeClock(), []
    policy = fake_policy(clock, shown, queued=lambda held: 5)
    policy.max_arrays = 1
    assert policy.started(str(folder), "k", 4, total=2) == 2
    policy = fake_policy(clock, shown, queued=lambda held: 5)
    assert policy.started(str(folder), "k", 4, total=2) == 1


def test_the_engine_counts_the_arrays_it_will_still_start() -> None:
    """``hfsweep run``'s count for the policy (``_Backend._queued_arrays``): the arrays it has
    formed and not ended whose start the policy has not heard yet (it forms one for every free
    slot before their threads start them), each key's pooled trials in arrays of its size, and
    the trials the searcher may still be asked for (the sweep's trials less those asked) at the
    mix of keys asked so far; none of the latter once the searcher has no more or the time
    limit is reached."""
    import threading
    from types import SimpleNamespace

    from hfsweep.core._backend import _Backend
    from hfsweep.core._parts import _Array
    from hfsweep.core.packer import Packer

    asked = iter([("big", 0), ("big", 1), ("big", 2), ("one", 3)])
    packer: Packer[int] = Packer(
        ask=lambda array: [next(asked)],
        size=lambda key, item: {"big": 4, "one": 1}[key],
        may_ask=lambda: True,
        budget=100,
    )
    for _ in range(4):
        packer.ask("", size_now=True)
    # pooled: 3 "big" -> 1 array of 4, 1 "one" -> 1 array; asked so far: 3/4 + 1/1 arrays
    # per 4 trials = 0.4375 an unasked trial (the mean), 0.254 one standard error below it
    # (the default bound: sqrt((3 * 0.1875**2 + 0.5625**2 + 0.25) / 5 / 4) = 0.183)
    assert packer.queued_arrays(0) == 2
    assert packer.queued_arrays(16, bounded=False) == 2 + 7
    assert packer.queued_arrays(16) == 2 + 5
    arrays = [_Array(0, "big", 4, done=True), _Array(1, "big", 4), _Array(2, "one", 1)]
    engine = SimpleNamespace(
        packer=packer,
        sc=SimpleNamespace(budget=SimpleNamespace(time_limit_s=None)),
        drivers=SimpleNamespace(count=4),
        source=SimpleNamespace(exhausted=False),
        total=20,
        _elapsed=lambda: 5.0,
        arrays=arrays,
        dir=SimpleNamespace(array=lambda i: Path("run") / "arrays" / str(i)),
        _lock=threading.RLock(),
    )
    held = {str(Path("run") / "arrays" / "1")}  # array 2 formed, its start not heard yet

    def count() -> int:
        return _Backend._queued_arrays(engine, held)  # type: ignore[arg-type]

    assert count() == 1 + 2 + 5
    engine.source.exhausted = True
    assert count() == 1 + 2
    engine.source.exhausted, engine.sc.budget.time_limit_s = False, 5.0
    assert count() == 1 + 2
    engine.drivers = None
    assert count() == 1 + 2
    # before any trial was asked, each unasked trial counts as an array
    fresh: Packer[int] = Packer(
        ask=lambda a: None, size=lambda k, i: 1, may_ask=lambda: True, budget=5
    )
    assert fresh.queued_arrays(5) == 5
