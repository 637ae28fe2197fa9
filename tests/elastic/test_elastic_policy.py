"""The allocator as ``hfsweep run`` uses it (hfsweep.elastic.policy.ElasticPolicy), on a fake
clock with no Ray: arrays starting and ending, members stopping, workers lost and the cluster
shrinking; each change of a running array's workers is a resize request in its folder."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from _elastic_fakes import FakeClock as _Clock
from _elastic_fakes import evals as _evals
from _elastic_fakes import fake_policy as _policy

from hfsweep.parallel import read_resize


def test_arrays_share_the_workers_and_running_ones_are_asked_to_resize(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock, shown = _Clock(), []
    policy = _policy(clock, shown)
    a, b = str(tmp_path / "0"), str(tmp_path / "1")
    for folder in (a, b):
        Path(folder).mkdir()
    with caplog.at_level(logging.INFO, logger="hfsweep.elastic"):
        assert policy.started(a, "k", 4, total=4) == 4  # alone: every worker
        assert read_resize(a) is None
        clock.now = 10.0
        assert policy.started(b, "k", 4, total=4) == 2  # the first shrinks to make room
    assert read_resize(a) == 2
    assert policy.relaunch(a, 2, 0, total=4) == 2
    assert "elastic [array started]: array 1: start 0->2 (a new array of 4 trials" in caplog.text
    assert "array 0: shrink 4->2" in caplog.text
    assert shown[-1] == "elastic: 2 arrays on 4/4 workers (-1 shrunk, 1 new) [array started]"
    # array 1 ends: array 0 gets its workers back
    clock.now = 20.0
    policy.ended(b, total=4)
    assert read_resize(a) == 4 and shown[-1].endswith("(+1 grown) [array ended]")


def test_members_stopping_and_measured_progress_move_workers(tmp_path: Path) -> None:
    clock, shown = _Clock(), []
    policy = _policy(clock, shown)
    a, b = str(tmp_path / "0"), str(tmp_path / "1")
    for folder in (a, b):
        Path(folder).mkdir()
    policy.started(a, "k", 4, total=4)
    policy.started(b, "k", 4, total=4)
    assert [policy._arrays[f].workers for f in (a, b)] == [2, 2]
    # array 1 is nearly done, and three of its members stop: array 0 is worth more workers
    for t, epoch in ((1.0, 1.0), (2.0, 9.0)):
        clock.now = t
        policy.reported(a, _evals(epoch / 9.0), live=4)
        policy.reported(b, _evals(epoch), live=4 if t < 2 else 1)
    plan = policy.plans[-1]
    assert plan.event == "members stopped"
    assert plan.workers() == {"array 0": 3, "array 1": 1}
    assert read_resize(a) == 3 and read_resize(b) == 1


def test_lost_workers_and_a_smaller_cluster_are_named_in_the_decision(tmp_path: Path) -> None:
    clock, shown = _Clock(), []
    policy = _policy(clock, shown, max_workers_per_array=2)
    a, b = str(tmp_path / "0"), str(tmp_path / "1")
    for folder in (a, b):
        Path(folder).mkdir()
    assert policy.started(a, "k", 4, total=4) == 2  # at most 2 per array
    assert policy.started(b, "k", 4, total=4) == 2
    clock.now = 5.0
    # a node with two workers left while array 0 trained on it: one worker each
    assert policy.relaunch(a, 1, 1, total=2) == 1
    assert policy.plans[-1].event == "node left, 1 worker(s) lost"
    assert read_resize(b) == 1


# ---------------------------------------------------------------------- scaling profiles
def _scaled(speedups: dict[str, float], asked: list[str]):
    """A scaling source: key -> a profile whose speed-up at 2 workers is ``speedups[key]``
    (3 workers: 1.5 times that gain); ``asked`` records each key asked for."""
    from hfsweep.sizing.scaling import ScalingProfile

    def source(key: str, config: object, members: int) -> tuple[ScalingProfile, str]:
        asked.append(key)
        s2 = speedups[key]
        points = {1: 100.0, 2: 100.0 * s2, 3: 100.0 * (1 + 1.5 * (s2 - 1))}
        return ScalingProfile(key, points), "given by the test"

    return source


@pytest.mark.parametrize(("speedup", "grown"), [(0.8, False), (1.9, True)])
def test_an_array_grows_only_where_its_profile_says_more_workers_help(
    tmp_path: Path, speedup: float, grown: bool
) -> None:
    """Alone on 3 workers: an array whose profile says 2 workers are slower than one keeps one
    worker (the others idle); one that scales well gets all three."""
    asked: list[str] = []
    policy = _policy(_Clock(), [], scaling=_scaled({"k": speedup}, asked))
    a = str(tmp_path / "0")
    Path(a).mkdir()
    assert policy.started(a, "k", 4, total=3) == (3 if grown else 1)
    assert asked == ["k"]


def test_the_worker_goes_to_the_array_that_scales_better(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two arrays with the same members and work left on 3 workers: the third worker goes to
    the array whose profile gains more from a second worker, whichever started first; each key's
    profile is asked for once and logged."""
    for poor, good in (("a", "b"), ("b", "a")):
        asked: list[str] = []
        policy = _policy(_Clock(), [], scaling=_scaled({poor: 1.1, good: 1.9}, asked))
        first, second = str(tmp_path / f"{poor}0"), str(tmp_path / f"{poor}1")
        for folder in (first, second):
            Path(folder).mkdir(exist_ok=True)
        with caplog.at_level(logging.INFO, logger="hfsweep.elastic"):
            policy.started(first, "a", 4, total=3)
            policy.started(second, "b", 4, total=3)
            policy.started(str(tmp_path / "x"), "a", 4, total=3)  # a known key: not asked again
            policy.ended(str(tmp_path / "x"), total=3)
        workers = {k: policy._arrays[f].workers for k, f in (("a", first), ("b", second))}
        assert workers == {poor: 1, good: 2}
        assert asked == ["a", "b"]
        assert "2 workers 1.10x one" in caplog.text and "2 workers 1.90x one" in caplog.text


def test_a_failing_scaling_source_leaves_perfect_scaling_assumed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(key: str, config: object, members: int) -> tuple[None, str]:
        raise RuntimeError("no all-reduce here")

    policy = _policy(_Clock(), [], scaling=broken)
    Path(tmp_path / "0").mkdir()
    with caplog.at_level(logging.INFO, logger="hfsweep.elastic"):
        assert policy.started(str(tmp_path / "0"), "k", 4, total=2) == 2
    assert "assumed perfect: modelling it failed (RuntimeError: no all-reduce here)" in caplog.text
