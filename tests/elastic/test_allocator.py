"""The elastic allocator on a fake clock: scripted scenarios (the tail of an ASHA sweep, a node
lost, a node joining), the cooldown, min/max bounds, no starvation, and the dynamic program
against brute force. Every test is deterministic: the clock is a number the test passes."""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence

import pytest

from hfsweep.elastic.allocator import Allocator, ArrayState, Plan, WaitingPool, _best
from hfsweep.profiler import AllReduceCost, ScalingProfile, model_scaling

#: a profile that scales well: 1.9x at 2, 3.4x at 4, 5.6x at 8, 8x at 16
GOOD = ScalingProfile("good", {1: 100.0, 2: 190.0, 4: 340.0, 8: 560.0, 16: 800.0})
#: one that does not scale at all past 2 workers
POOR = ScalingProfile("poor", {1: 100.0, 2: 120.0, 4: 120.0})


def arr(name: str, workers: int, remaining: float = 1000.0, members: int = 1, **kw) -> ArrayState:
    kw.setdefault("profile", GOOD)
    return ArrayState(name, kw.pop("key", "k"), members, remaining, workers=workers, **kw)


def test_tail_of_an_asha_sweep_grows_the_survivors() -> None:
    """Three one-member arrays left on 16 workers, nothing waiting: they grow, and the one with
    the most left to train gets the most."""
    arrays = [arr("a", 1, 3000.0), arr("b", 1, 1000.0), arr("c", 1, 1000.0)]
    plan = Allocator(resize_every_s=0).decide(arrays, [], 16, now=100.0, event="array ended")
    w = plan.workers()
    assert sum(w.values()) <= 16 and all(k >= 1 for k in w.values())
    assert w["a"] > w["b"] >= 1 and w["b"] == w["c"]
    assert {d.action for d in plan.decisions} == {"grow"}
    assert all("workers were free" in d.reason for d in plan.decisions)
    assert plan.status().startswith("elastic: 3 arrays on ") and "[array ended]" in plan.status()


def test_a_poorly_scaling_array_is_not_given_workers_it_cannot_use() -> None:
    arrays = [arr("p", 1, 1000.0, profile=POOR)]
    plan = Allocator(resize_every_s=0).decide(arrays, [], 16, now=0.0)
    assert plan.workers() == {"p": 2} and plan.idle == 14


def test_a_node_lost_shrinks_without_starving_anyone() -> None:
    """Four arrays on 4 workers each, 16 -> 8 workers: each shrinks, none goes to 0, and the
    cooldown does not hold a shrink the cluster forces."""
    arrays = [arr(n, 4, since=95.0) for n in "abcd"]
    plan = Allocator(resize_every_s=60).decide(arrays, [], 8, now=100.0, event="node left")
    w = plan.workers()
    assert sum(w.values()) <= 8 and min(w.values()) >= 1
    assert {d.action for d in plan.decisions} == {"shrink"}
    assert all("workers left" in d.reason for d in plan.decisions)


def test_fewer_workers_than_arrays_pauses_the_latest_started_and_bounds_its_wait() -> None:
    arrays = [arr("a", 1, since=0.0), arr("b", 1, since=5.0), arr("c", 1, since=10.0)]
    plan = Allocator(max_wait_s=300).decide(arrays, [], 2, now=20.0, event="node left")
    assert plan.workers() == {"a": 1, "b": 1, "c": 0}
    (paused,) = [d for d in plan.decisions if d.after == 0]
    assert paused.action == "pause" and "waits at most 300 s" in paused.reason


def test_no_array_starves_when_workers_are_short() -> None:
    """3 arrays at min 1 on 2 workers for an hour of decisions every 60 s: every array is
    served again within max_wait_s (+ one decision interval) of being paused."""
    alloc = Allocator(resize_every_s=60, max_wait_s=300)
    arrays = [arr(n, 1, since=0.0) for n in "abc"]
    longest_wait = {n: 0.0 for n in "abc"}
    paused_at: dict[str, float] = {}
    for step in range(60):
        now = 60.0 * step
        plan = alloc.decide(arrays, [], 2, now=now)
        assert sum(plan.workers().values()) <= 2
        arrays = plan.apply(arrays)
        for a in arrays:
            if a.workers == 0:
                paused_at.setdefault(a.name, now)
                longest_wait[a.name] = max(longest_wait[a.name], now - paused_at[a.name])
            else:
                paused_at.pop(a.name, None)
    assert max(longest_wait.values()) <= 300 + 60
    # the array that started first keeps its worker; the other two take turns
    assert [longest_wait[n] > 0 for n in "abc"] == [False, True, True]


def test_a_node_joining_starts_waiting_trials_first() -> None:
    """4 arrays on 4 workers, 4 more join and 2 arrays' worth of trials wait: they start
    (a new array of 8 trials outweighs growing a one-member array)."""
    arrays = [arr(n, 1, 500.0, since=0.0) for n in "abcd"]
    pool = WaitingPool("k", arrays=2, members=8, remaining_s=1000.0, profile=GOOD)
    plan = Allocator(resize_every_s=0).decide(arrays, [pool], 8, now=100.0, event="node joined")
    started = [d for d in plan.decisions if d.action == "start"]
    assert len(started) == 2 and all(d.array.startswith("new:k#") for d in started)
    assert sum(plan.workers().values()) <= 8


def test_a_node_joining_with_nothing_waiting_grows_the_arrays() -> None:
    arrays = [arr(n, 1, since=0.0) for n in "ab"]
    plan = Allocator(resize_every_s=0).decide(arrays, [], 6, now=100.0, event="node joined")
    assert plan.workers() == {"a": 3, "b": 3} or sorted(plan.workers().values()) == [2, 4]
    assert all(d.action == "grow" for d in plan.decisions)


def test_cooldown() -> None:
    alloc = Allocator(resize_every_s=60)
    arrays = [arr("a", 1, since=50.0)]
    early = alloc.decide(arrays, [], 8, now=100.0)
    assert early.workers() == {"a": 1}
    (keep,) = early.decisions
    assert keep.action == "keep" and "cooldown 60 s" in keep.reason
    later = alloc.decide(arrays, [], 8, now=110.0)
    assert later.workers()["a"] > 1


def test_a_grow_must_save_more_than_the_resize_costs() -> None:
    arrays = [arr("a", 1, remaining=10.0)]  # 10 s left: growing saves < 10 s
    plan = Allocator(resize_every_s=0, resize_cost_s=30.0).decide(arrays, [], 8, now=0.0)
    assert plan.workers() == {"a": 1}


def test_min_and_max_bounds() -> None:
    arrays = [arr(n, 0) for n in "abc"]
    plan = Allocator(min_workers=2, max_workers=4).decide(arrays, [], 16, now=0.0)
    assert all(2 <= k <= 4 for k in plan.workers().values())
    assert plan.idle == 16 - sum(plan.workers().values())
    # 5 workers for 3 arrays of min 2: one waits
    plan = Allocator(min_workers=2).decide(arrays, [], 5, now=0.0)
    assert sorted(plan.workers().values()) == [0, 2, 3]
    with pytest.raises(ValueError, match="max_workers"):
        Allocator(min_workers=4, max_workers=2)


def test_new_arrays_wait_while_an_array_is_paused() -> None:
    arrays = [arr("a", 1), arr("b", 0, since=0.0)]
    pool = WaitingPool("k", 1, 8, 1000.0, GOOD)
    plan = Allocator().decide(arrays, [pool], 1, now=10.0)
    (wait,) = [d for d in plan.decisions if d.action == "wait"]
    assert "paused" in wait.reason


def test_decisions_are_deterministic_and_explained() -> None:
    arrays = [arr(n, 1, remaining=100.0 * (i + 1), since=0.0) for i, n in enumerate("abcde")]
    pool = WaitingPool("k2", 3, 4, 800.0, POOR)
    plans = [Allocator().decide(arrays, [pool], 12, now=120.0) for _ in range(2)]
    assert plans[0] == plans[1]
    assert all(d.reason for d in plans[0].decisions)
    assert isinstance(plans[0], Plan) and str(plans[0].decisions[0]).startswith("a: ")


def _value(weights: list[float], profiles: list[ScalingProfile], ks: Sequence[int]) -> float:
    """The allocator's objective, written out: w * (2 - 1 / speedup(k)), 0 for k = 0."""
    return sum(
        w * (2 - 1 / p.speedup(k)) for w, p, k in zip(weights, profiles, ks, strict=True) if k
    )


def test_the_dp_matches_brute_force() -> None:
    rng = random.Random(0)
    profiles = [GOOD, POOR, ScalingProfile("x", {1: 1.0, 2: 1.5, 4: 2.6, 8: 3.0})]
    for _ in range(40):
        n = rng.randint(1, 4)
        total = rng.randint(n, 12)
        profs = [rng.choice(profiles) for _ in range(n)]
        weights = [rng.uniform(1, 100) for _ in range(n)]
        options = [[0, *range(1, min(p.max_workers, total) + 1)] for p in profs]
        got = _best(options, weights, profs, total)
        assert got is not None and sum(got) <= total

        brute = max(
            _value(weights, profs, ks) for ks in itertools.product(*options) if sum(ks) <= total
        )
        assert _value(weights, profs, got) == pytest.approx(brute)


def test_with_a_modelled_profile() -> None:
    """The profile the sizing code models, as the allocator gets it."""
    cost = AllReduceCost(latency_s=1e-4, bandwidth_bytes_per_s=1e9)
    prof = model_scaling(
        "m", step_s=0.05, members=2, batch_size=128, gradient_bytes=4e6, allreduce=cost
    )
    arrays = [ArrayState("x", "m", 2, 600.0, prof, workers=1)]
    plan = Allocator(resize_every_s=0).decide(arrays, [], 8, now=0.0)
    assert plan.workers()["x"] > 1


def test_a_pool_waits_while_its_workers_do_more_growing_a_running_array() -> None:
    """One 8-member array with most of its training ahead on 2 workers, one trial waiting: the
    second worker saves more member-seconds there; the wait is named, explained and counted."""
    arrays = [arr("a", 2, remaining=900.0, members=8, since=0.0)]
    pool = WaitingPool("k", 1, 1, 1000.0, GOOD, name="array 1", since=10.0)
    plan = Allocator(resize_every_s=0, max_wait_s=300).decide(arrays, [pool], 2, now=20.0)
    assert plan.workers() == {"a": 2}
    (wait,) = [d for d in plan.decisions if d.action == "wait"]
    assert wait.array == "array 1"
    assert "save fewer member-seconds than the workers do in the running arrays (a on 2)" in (
        wait.reason
    )
    assert "at the latest once it has waited 300 s" in wait.reason
    assert plan.status() == "elastic: 1 arrays on 2/2 workers (1 waiting) [timer]"


def test_a_pool_that_waited_max_wait_s_starts_before_any_array_grows() -> None:
    arrays = [arr("a", 2, remaining=900.0, members=8, since=0.0)]
    pool = WaitingPool("k", 1, 1, 1000.0, GOOD, name="array 1", since=10.0)
    plan = Allocator(resize_every_s=0, max_wait_s=300).decide(arrays, [pool], 2, now=310.0)
    assert plan.workers() == {"a": 1, "array 1": 1}
    (start,) = [d for d in plan.decisions if d.action == "start"]
    assert start.array == "array 1" and "waited 300 s (max_wait_s is 300)" in start.reason
    # not when the running arrays hold every worker at their minimum: it waits for one to end
    plan = Allocator(max_wait_s=300).decide([*arrays[:1], arr("b", 1)], [pool], 2, now=310.0)
    assert "array 1" not in plan.workers()
    (wait,) = [d for d in plan.decisions if d.action == "wait"]
    assert "no free worker" in wait.reason and "at the next of those" in wait.reason


def test_with_no_array_running_waiting_trials_always_start() -> None:
    """Even a pool with nothing left to gain by the objective (no training time left) starts
    when no array runs: no plan leaves every worker idle while trials wait."""
    pool = WaitingPool("k", 2, 4, 0.0, POOR, name="array 0")
    plan = Allocator().decide([], [pool], 4, now=0.0)
    started = [d for d in plan.decisions if d.action == "start"]
    assert started and started[0].array == "array 0#0"
    assert started[0].reason == "no array is running: waiting trials always start"
    # and with no worker at all nothing starts
    assert Allocator().decide([], [pool], 0, now=0.0).workers() == {}


def test_a_cooldown_holds_running_arrays_but_not_waiting_trials() -> None:
    """An array started on every worker a moment ago shrinks for a new array of as many
    trials (its cooldown does not hold them back), but not to grow another running array."""
    fresh = arr("a", 2, remaining=1000.0, members=8, since=99.0)
    pool = WaitingPool("k", 1, 8, 1000.0, GOOD, name="array 1", since=99.5)
    plan = Allocator(resize_every_s=60).decide([fresh], [pool], 2, now=100.0)
    assert plan.workers() == {"a": 1, "array 1": 1}
    assert "cooldown lifted for the shrinks that start waiting trials" in plan.notes
    other = arr("b", 1, remaining=5000.0, members=8, since=0.0)
    plan = Allocator(resize_every_s=60).decide([fresh, other], [], 3, now=100.0)
    assert plan.workers() == {"a": 2, "b": 1}
    # without the cooldown the worker would move to b, which has more left to train
    plan = Allocator(resize_every_s=0).decide([fresh, other], [], 3, now=100.0)
    assert plan.workers() == {"a": 1, "b": 2}
