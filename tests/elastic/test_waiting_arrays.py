"""The allocator's ``start``/``wait`` decisions for waiting trials, carried out by ``hfsweep
run``'s elastic policy (hfsweep.elastic.policy.ElasticPolicy) on a fake clock with no Ray.

An array the engine has formed is a pool of waiting trials to the allocator until a plan gives
it workers: ``started`` answers 0 when its workers do more growing the running arrays (or none
is free), the engine forms no other array meanwhile (``admits``), and ``waiting`` answers the
workers once a later plan starts it: members stop, a node joins, an array ends (with nothing
running it always starts), or its wait reaches ``max_wait_s``. Scripted scenarios: the tail of
an ASHA sweep, a node lost, a node joining. Before these decisions were carried out, every
array started at once on at least ``min_workers_per_array`` workers."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from _elastic_fakes import FakeClock as _Clock
from _elastic_fakes import evals as _evals
from _elastic_fakes import fake_policy

from hfsweep.elastic.policy import ElasticPolicy
from hfsweep.parallel import read_resize


def _folders(tmp_path: Path, n: int) -> list[str]:
    folders = [str(tmp_path / str(i)) for i in range(n)]
    for folder in folders:
        Path(folder).mkdir()
    return folders


def _asha_tail(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, **settings: object
) -> tuple[ElasticPolicy, _Clock, list[str], str, str]:
    """Array 0 (4 trials) trains on both workers, 1 s per epoch, 2 of its 10 epochs done;
    then the sweep's last trial forms array 1 (1 trial): 1 x 10 epochs x 2 s started on one
    worker saves fewer member-seconds than 4 x 8 x 2 s on the second worker of array 0."""
    clock, shown = _Clock(), []
    policy = fake_policy(clock, shown, **settings)
    a, b = _folders(tmp_path, 2)
    with caplog.at_level(logging.INFO, logger="hfsweep.elastic"):
        assert policy.started(a, "k", 4, total=2) == 2
        for t in (1.0, 2.0):
            clock.now = t
            policy.reported(a, _evals(t), live=4)
        assert policy.started(b, "k", 1, total=2) == 0  # before: 1, array 0 shrunk to 1
    return policy, clock, shown, a, b


def test_tail_of_an_asha_sweep_the_last_trial_waits_until_members_stop(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    policy, clock, shown, a, b = _asha_tail(tmp_path, caplog)
    assert read_resize(a) is None  # array 0 keeps both workers
    assert "array 1: wait 0->0 (its 1 trial(s) x 20 s on one worker save fewer member-seconds" in (
        caplog.text
    )
    assert "running arrays (array 0 on 2)" in caplog.text
    assert "elastic: array 1 waits for workers before it trains" in caplog.text
    assert shown[-1] == "elastic: 1 arrays on 2/2 workers (1 waiting) [array started]"
    # the engine forms no other array while it waits
    assert policy.admits() == 2
    plans = len(policy.plans)
    clock.now = 2.5
    assert policy.waiting(b, total=2) == 0 and len(policy.plans) == plans  # nothing changed
    # ASHA stops 3 of array 0's 4 members at its rung: 1 x 7 x 2 s left there; array 1 starts
    clock.now = 3.0
    with caplog.at_level(logging.INFO, logger="hfsweep.elastic"):
        policy.reported(a, _evals(3.0), live=1)
        assert policy.plans[-1].event == "members stopped"
        assert policy.plans[-1].workers() == {"array 0": 1, "array 1": 1}
        assert read_resize(a) == 1  # array 0 shrinks at its next evaluation boundary
        assert policy.waiting(b, total=2) == 1
    assert "array 1: start 0->1 (new array of 1 waiting trials on 1 worker(s)" in caplog.text
    assert "elastic: array 1 starts on 1 worker(s) after waiting 1 s" in caplog.text
    assert policy.admits() is None
    # the started array is an array to the next plans: array 0 ending grows it
    clock.now = 4.0
    policy.ended(a, total=2)
    assert policy.plans[-1].workers() == {"array 1": 2} and read_resize(b) == 2


def test_a_waiting_array_starts_when_its_wait_reaches_max_wait_s(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """No array starves: nothing else changes, yet after ``max_wait_s`` the waiting array
    starts before any array keeps more than its minimum."""
    policy, clock, _, a, b = _asha_tail(tmp_path, caplog, max_wait_s=100.0)
    clock.now = 50.0
    assert policy.waiting(b, total=2) == 0
    clock.now = 102.0
    with caplog.at_level(logging.INFO, logger="hfsweep.elastic"):
        assert policy.waiting(b, total=2) == 1
    assert policy.plans[-1].event == "array 1 waited 100 s"
    assert "its trials waited 100 s (max_wait_s is 100): started before any array grows" in (
        caplog.text
    )
    assert read_resize(a) == 1


def test_with_no_array_running_a_waiting_array_starts(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """No deadlock: when the array it waited for ends, the waiting array starts, on every
    worker its profile gains from."""
    policy, clock, _, a, b = _asha_tail(tmp_path, caplog)
    clock.now = 5.0
    policy.ended(a, total=2)
    assert policy.plans[-1].workers() == {"array 1": 2}
    assert policy.waiting(b, total=2) == 2


def test_a_node_joining_starts_the_waiting_array(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    policy, clock, _, a, b = _asha_tail(tmp_path, caplog)
    clock.now = 3.0
    assert policy.waiting(b, total=4) == 1  # two workers joined
    plan = policy.plans[-1]
    assert plan.event == "node joined, array waiting"
    assert plan.workers() == {"array 0": 3, "array 1": 1}
    assert read_resize(a) == 3


def test_after_a_node_lost_new_and_resumed_arrays_wait_instead_of_oversubscribing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A node left: one worker for array 0. An array the engine formed before it knew waits
    (no free worker), and so does an array resumed from its checkpoint, which is served first
    when array 0 ends; the new one starts when nothing else runs."""
    clock, shown = _Clock(), []
    policy = fake_policy(clock, shown)
    a, b, c = _folders(tmp_path, 3)
    with caplog.at_level(logging.INFO, logger="hfsweep.elastic"):
        assert policy.started(a, "k", 4, total=2) == 2
        clock.now = 5.0
        assert policy.relaunch(a, 1, 1, total=1) == 1
        assert policy.started(b, "k", 4, total=1) == 0  # before: 1 worker it did not have
        assert "array 1: wait 0->0 (no free worker: the running arrays hold the 1 worker(s)" in (
            caplog.text
        )
        clock.now = 6.0
        assert policy.started(c, "k", 4, total=1, resume=True) == 0  # before: 1
        assert "array 2: keep 0->0" in caplog.text and "paused at position 1" in caplog.text
        assert policy.admits() == 3
        clock.now = 10.0
        policy.ended(a, total=1)
        assert policy.plans[-1].workers() == {"array 2": 1}  # the checkpointed array first
        assert policy.waiting(b, total=1) == 0
        assert policy.waiting(c, total=1) == 1
        assert "elastic: array 2 resumes on 1 worker(s) from its checkpoint" in caplog.text
        clock.now = 20.0
        policy.ended(c, total=1)
        assert policy.waiting(b, total=1) == 1
    assert policy.admits() is None
    assert "no array is running: waiting trials always start" in caplog.text


def test_a_new_array_still_starts_where_it_does_more_than_a_grow(tmp_path: Path) -> None:
    """The common case is unchanged: a new array of as many trials as the running one takes
    half the workers (tests/elastic/test_elastic_policy.py has more)."""
    clock = _Clock()
    policy = fake_policy(clock, [])
    a, b = _folders(tmp_path, 2)
    assert policy.started(a, "k", 4, total=4) == 4
    clock.now = 1.0
    assert policy.started(b, "k", 4, total=4) == 2
    assert policy.admits() is None


def test_a_cooldown_does_not_hold_waiting_trials_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``resize_every_s`` counts an array's start, but a second array formed just after the
    first started on both workers starts at once: the first shrinks despite its cooldown (the
    cooldown keeps running arrays from trading workers, not trials from starting). Measured on
    examples/digits_ray_elastic.yaml: holding the new array for the cooldown left it idle 10 s.
    Between running arrays the cooldown still holds: the next plan keeps both."""
    clock, shown = _Clock(), []
    policy = fake_policy(clock, shown, resize_every_s=10.0)
    a, b = _folders(tmp_path, 2)
    with caplog.at_level(logging.INFO, logger="hfsweep.elastic"):
        assert policy.started(a, "k", 8, total=2) == 2
        clock.now = 0.5
        assert policy.started(b, "k", 8, total=2) == 1
        assert "cooldown lifted for the shrinks that start waiting trials" in caplog.text
    assert read_resize(a) == 1
    assert policy.plans[-1].workers() == {"array 0": 1, "array 1": 1}
    clock.now = 1.0
    policy.reported(a, _evals(9.0, members=8), live=1)  # array 0 nearly done, 1 member left
    assert policy.plans[-1].workers() == {"array 0": 1, "array 1": 1}
    assert "cooldown 10 s" in policy.plans[-1].decisions[1].reason
