"""A ``pause`` of the allocator carried out by ``hfsweep run``'s elastic policy
(hfsweep.elastic.policy.ElasticPolicy), on a fake clock with no Ray: after a node left, the
array the plan pauses is asked to stop at its next evaluation boundary (a resize to 0 workers),
its relaunch waits, and it goes on when a later plan gives it workers: after ``max_wait_s`` in
the place of the array that last (re)started, or when the cluster grows again."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from _elastic_fakes import FakeClock as _Clock
from _elastic_fakes import fake_policy

from hfsweep.elastic.policy import ElasticPolicy
from hfsweep.parallel import read_resize


def _policy(clock: _Clock, shown: list[str]) -> ElasticPolicy:
    return fake_policy(clock, shown, max_workers_per_array=2, max_wait_s=100.0)


def test_a_paused_array_gives_its_workers_back_and_goes_on_after_max_wait_or_a_node_joining(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock, shown = _Clock(), []
    policy = _policy(clock, shown)
    a, b = str(tmp_path / "0"), str(tmp_path / "1")
    for folder in (a, b):
        Path(folder).mkdir()
    with caplog.at_level(logging.INFO, logger="hfsweep.elastic"):
        assert policy.started(a, "k", 4, total=3) == 2
        assert policy.started(b, "k", 4, total=3) == 1
        # a node with two workers left while array 0 trained on one of them: one worker is
        # left for two arrays, and array 0, the one that (re)started last, is paused
        clock.now = 10.0
        assert policy.relaunch(a, 1, 1, total=1) == 0
        assert "elastic: array 0 paused at its checkpoint" in caplog.text
        assert "array 0: pause 1->0" in caplog.text and "1 paused" in shown[-1]
        assert read_resize(b) is None  # array 1 keeps its worker
        # while it waits nothing changes, and nothing is re-planned
        plans = len(policy.plans)
        clock.now = 60.0
        assert policy.waiting(a, total=1) == 0 and len(policy.plans) == plans
        # after max_wait_s it is served first, in the place of array 1, which is asked to
        # stop at its next evaluation boundary (a resize to 0 workers)
        clock.now = 111.0
        assert policy.waiting(a, total=1) == 1
        assert policy.plans[-1].event == "array 0 waited 100 s"
        assert read_resize(b) == 0
        assert "elastic: array 0 resumes on 1 worker(s) from its checkpoint" in caplog.text
        # array 1 reaches that boundary: its relaunch waits for workers
        assert policy.relaunch(b, 0, 0, total=1) == 0
        clock.now = 120.0
        assert policy.waiting(b, total=1) == 0
        # a node joins: array 1 goes on, array 0 keeps its worker
        clock.now = 130.0
        assert policy.waiting(b, total=2) == 1
        assert policy.plans[-1].event.startswith("node joined")
        assert policy.plans[-1].workers() == {"array 0": 1, "array 1": 1}


def test_a_pause_withdrawn_before_the_boundary_asks_for_the_workers_it_has(
    tmp_path: Path,
) -> None:
    """An array asked to pause, then given workers again before it reached its evaluation
    boundary, is asked for the workers it trains on instead (a resize to its own size, which
    the trainer drops without a restart), not left to stop."""
    clock, shown = _Clock(), []
    policy = _policy(clock, shown)
    a, b = str(tmp_path / "0"), str(tmp_path / "1")
    for folder in (a, b):
        Path(folder).mkdir()
    policy.started(a, "k", 4, total=3)
    policy.started(b, "k", 4, total=3)
    clock.now = 10.0
    assert policy.relaunch(a, 1, 1, total=1) == 0
    clock.now = 111.0
    assert policy.waiting(a, total=1) == 1
    assert read_resize(b) == 0  # asked to pause at its next boundary
    clock.now = 115.0
    policy.ended(a, total=1)  # array 0 ends before array 1 reached it
    assert read_resize(b) == 1
    assert policy.relaunch(b, 1, 0, total=1) == 1  # had it stopped, it goes on at once
