"""A resize must pay for itself (fake clock): it pauses the array for ``resize_cost_s``, so the
allocator charges it ``members * resize_cost_s`` member-seconds (a shrink too), and a grow must
save more than that before the array's next rung, where ASHA may stop its members. Each
scenario is one the allocator decided the other way before (a pause spent for nothing in
``benchmarks/elastic_sim.py``'s accounting)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from _elastic_fakes import FakeClock, evals, fake_policy

from hfsweep.elastic.allocator import Allocator, ArrayState, WaitingPool
from hfsweep.elastic.policy import ElasticPolicy
from hfsweep.parallel import read_resize
from hfsweep.profiler import ScalingProfile

#: about a cifar_resnet trial's modelled scaling in the simulator: 1.9x at 2, 5.7x at 8
CIFAR = ScalingProfile("cifar", {1: 100.0, 2: 190.0, 4: 340.0, 8: 570.0})


def _young(horizon_s: float | None) -> ArrayState:
    """A one-member array that just started (27 epochs of 12 s ahead on one worker) and is one
    epoch from ASHA's first rung, in the tail of a sweep (nothing waits)."""
    return ArrayState("a", "cifar", 1, 27 * 12.0, CIFAR, workers=1, since=0.0, horizon_s=horizon_s)


def test_no_grow_just_before_a_rung() -> None:
    """One epoch (12 s on one worker) before its rung, 7 free workers save at most 12 - 12/5.7
    = 9.9 s there, less than the 20 s a resize pauses it: it keeps its worker, and says why.
    Without the rung's horizon (the old rule: the whole 324 s) it grows to 8."""
    alloc = Allocator(resize_every_s=0, resize_cost_s=20.0)
    plan = alloc.decide([_young(horizon_s=12.0)], [], 8, now=100.0, event="array ended")
    assert plan.workers() == {"a": 1}
    (keep,) = plan.decisions
    assert keep.action == "keep"
    assert keep.reason == (
        "a grow would not repay its 20 s resize before its next rung, ~12 s away on one worker"
    )
    assert alloc.decide([_young(horizon_s=None)], [], 8, now=100.0).workers() == {"a": 8}


def test_a_grow_that_pays_before_the_rung_is_made() -> None:
    """Six epochs (72 s on one worker) to its next rung: 8 workers save 72 - 72/5.7 = 59 s
    there, more than the 20 s pause: it grows."""
    plan = Allocator(resize_every_s=0, resize_cost_s=20.0).decide(
        [_young(horizon_s=72.0)], [], 8, now=100.0
    )
    assert plan.workers() == {"a": 8}
    (grow,) = plan.decisions
    assert grow.action == "grow"


def test_no_shrink_that_gains_less_than_its_pause() -> None:
    """Array a (1 member, 100 s left on one worker) on both workers, and one waiting trial of
    60 s: shrinking a to start it gains 100 + 60 - 100 * (2 - 1/1.9) = 12.6 member-seconds by
    the objective but pauses a's member 20 s: a keeps both workers and the trial waits. The old
    allocator, charging nothing for a shrink, shrank a."""
    a = ArrayState("a", "cifar", 1, 100.0, CIFAR, workers=2, since=0.0)
    pool = WaitingPool("cifar", 1, 1, 60.0, CIFAR, name="array 1", since=10.0)
    plan = Allocator(resize_every_s=0, resize_cost_s=20.0).decide([a], [pool], 2, now=10.0)
    assert plan.workers() == {"a": 2}
    assert [d.action for d in plan.decisions] == ["keep", "wait"]
    # free resizes (resize_cost_s 0, the default) shrink as before
    plan = Allocator(resize_every_s=0).decide([a], [pool], 2, now=10.0)
    assert plan.workers() == {"a": 1, "array 1": 1}


def test_a_shrink_that_gains_more_than_its_pause_is_made() -> None:
    """The same, with a waiting trial of 150 s: shrinking gains 102.6 member-seconds, more than
    the 20 s pause."""
    a = ArrayState("a", "cifar", 1, 100.0, CIFAR, workers=2, since=0.0)
    pool = WaitingPool("cifar", 1, 1, 150.0, CIFAR, name="array 1", since=10.0)
    plan = Allocator(resize_every_s=0, resize_cost_s=20.0).decide([a], [pool], 2, now=10.0)
    assert plan.workers() == {"a": 1, "array 1": 1}


def _tail(tmp_path: Path, rungs: tuple[float, ...]) -> tuple[ElasticPolicy, FakeClock, str]:
    """``hfsweep run``'s policy on a fake clock, a 10-epoch budget, resizes costing 3 s: arrays
    b and a (one member each) share 2 workers; a trains 1 s an epoch on one worker (two
    reports), then b ends and 6 workers join: 7 free workers for a, at epoch 2."""
    clock, shown = FakeClock(), []
    policy = fake_policy(
        clock,
        shown,
        scaling=lambda key, config, members: (PROFILE, "given"),
        rungs=rungs,
        resize_cost_s=3.0,
    )
    b, a = (str(tmp_path / n) for n in ("0", "1"))
    for folder in (b, a):
        Path(folder).mkdir()
    assert policy.started(b, "k", 1, total=2) == 2
    assert policy.started(a, "k", 1, total=2) == 1  # b shrinks for it
    for epoch in (1.0, 2.0):
        clock.now = epoch
        policy.reported(a, evals(epoch, members=1), live=1)
    policy.ended(b, total=8)
    return policy, clock, a


#: a profile like CIFAR's, in member-epochs/s
PROFILE = ScalingProfile("k", {1: 1.0, 2: 1.9, 4: 3.4, 8: 5.7})


def test_the_policy_gives_the_schedulers_next_rung_as_the_horizon(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """With ASHA's rungs at 1, 3 and 9 epochs, array a at epoch 2 is 1 s (one epoch) from the
    rung at 3: 7 more workers save 0.8 s there, less than the 3 s resize, so it keeps its
    worker (logged with the reason) and is not asked to resize. At epoch 3 it is 6 s from the
    rung at 9, and the next plan (an array starts) grows it."""
    with caplog.at_level(logging.INFO, logger="hfsweep.elastic"):
        policy, clock, a = _tail(tmp_path, rungs=(1.0, 3.0, 9.0))
    assert policy.plans[-1].workers() == {"array 1": 1}
    assert (
        "array 1: keep 1->1 (a grow would not repay its 3 s resize before its next rung, ~1 s away"
        in caplog.text
    )
    assert read_resize(a) is None
    clock.now = 3.0
    policy.reported(a, evals(3.0, members=1), live=1)
    c = tmp_path / "2"
    c.mkdir()
    policy.started(str(c), "k", 1, total=8)
    grown = policy.plans[-1].workers()["array 1"]
    assert grown > 1 and read_resize(a) == grown


def test_without_rungs_the_policy_grows_at_once(tmp_path: Path) -> None:
    """The same without rungs (FIFO): the whole 8 s left count, and 7 more workers save 6.6 s,
    more than the resize: a grows to 8 when b ends (as every array did before)."""
    policy, _, a = _tail(tmp_path, rungs=())
    assert policy.plans[-1].workers() == {"array 1": 8}
    assert read_resize(a) == 8
