"""Measured scaling fed back to the allocator (hfsweep.elastic.policy.ElasticPolicy): the
intervals between an array's reports at the worker counts it trained on replace the scaling
profile's speed-ups, change the allocator's next decision, and are cached for the next sweep.
On a fake clock, no Ray."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from _elastic_fakes import FakeClock as _Clock
from _elastic_fakes import evals as _evals

from hfsweep.config.schema import ElasticConfig
from hfsweep.elastic.policy import ElasticPolicy
from hfsweep.elastic.scaling import SweepScaling
from hfsweep.sizing.allreduce import ScalingCache
from hfsweep.sizing.scaling import ScalingProfile

#: the model's profile: 2 workers 1.9x one, 3 workers 2.35x one
_GIVEN = ScalingProfile("k|float32|cpu|gloo", {1: 100.0, 2: 190.0, 3: 235.0})


def _policy(clock: _Clock, remembered: list[ScalingProfile]) -> tuple[ElasticPolicy, list[str]]:
    asked: list[str] = []

    def source(key: str, config: object, members: int) -> tuple[ScalingProfile, str]:
        asked.append(key)
        return _GIVEN, "given by the test"

    settings = ElasticConfig(enabled=True, resize_every_s=0.0, resize_cost_s=0.0)
    policy = ElasticPolicy(
        settings,
        budget=100,
        by="epochs",
        clock=clock,
        scaling=source,
        remember=remembered.append,
    )
    return policy, asked


def _report(policy: ElasticPolicy, clock: _Clock, folder: str, at: float, epoch: float) -> None:
    clock.now = at
    policy.reported(folder, _evals(epoch), live=4)


def test_measured_speedups_replace_the_profiles_and_change_the_next_decision(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock, remembered = _Clock(), []
    policy, asked = _policy(clock, remembered)
    a, c = str(tmp_path / "0"), str(tmp_path / "1")
    Path(a).mkdir()
    Path(c).mkdir()
    with caplog.at_level(logging.INFO, logger="hfsweep.elastic"):
        assert policy.started(a, "k", 4, total=2) == 2  # the model says 2 workers pay
        for at, epoch in ((1.0, 1.0), (2.0, 2.0), (3.0, 3.0)):  # 1 s per epoch on 2 workers
            _report(policy, clock, a, at, epoch)
        assert not policy.profiles["k"].measured  # one worker count: nothing to compare
        # a worker lost: the array goes on from its checkpoint on one worker; the first interval
        # holds the restart (4 s) and is not a measurement of one worker
        assert policy.relaunch(a, 1, 1, total=1) == 1
        _report(policy, clock, a, 7.0, 4.0)
        for at, epoch in ((7.8, 5.0), (8.6, 6.0)):  # 0.8 s per epoch on 1 worker
            _report(policy, clock, a, at, epoch)
    learnt = policy.profiles["k"]
    assert learnt.measured == frozenset({1, 2})
    assert learnt.speedup(2) == pytest.approx(0.8)  # 1 s on two workers vs 0.8 s on one
    # 3 workers were not measured: the model's error at 2 (0.8 / 1.9) carries over
    assert learnt.speedup(3) == pytest.approx(2.35 * 0.8 / 1.9)
    assert "2 workers 0.80x one (the profile said 1.90x)" in caplog.text
    assert remembered == []  # cached when an array ends, not at every report

    policy.ended(a, total=3)
    assert remembered == [learnt] and remembered[0].key == _GIVEN.key
    # a new array of the same key, alone on 3 workers: the model would give it all three
    assert policy.started(c, "k", 4, total=3) == 1
    assert asked == ["k"]  # the source was asked once; the measurement is the policy's own


def test_a_point_measured_only_above_one_worker_is_anchored_at_the_profile(tmp_path: Path) -> None:
    """Measured at 2 and 3 workers, never at 1: the speed-up at 2 stays the profile's, the one at
    3 is the profile's at 2 times the measured ratio of 3 to 2."""
    clock, remembered = _Clock(), []
    policy, _ = _policy(clock, remembered)
    a = str(tmp_path / "0")
    Path(a).mkdir()
    assert policy.started(a, "k", 4, total=3) == 3
    for at, epoch in ((1.0, 1.0), (2.0, 2.0), (3.0, 3.0)):  # 1 s per epoch on 3 workers
        _report(policy, clock, a, at, epoch)
    assert policy.relaunch(a, 2, 1, total=2) == 2
    for at, epoch in ((10.0, 4.0), (11.2, 5.0), (12.4, 6.0)):  # 1.2 s per epoch on 2 workers
        _report(policy, clock, a, at, epoch)
    learnt = policy.profiles["k"]
    assert learnt.measured == frozenset({3})
    assert learnt.speedup(2) == pytest.approx(1.9)
    assert learnt.speedup(3) == pytest.approx(1.9 * 1.2)


def test_without_a_scaling_source_nothing_is_learnt(tmp_path: Path) -> None:
    """``scaling: perfect`` (no source): the policy keeps assuming perfect scaling."""
    clock = _Clock()
    settings = ElasticConfig(enabled=True, resize_every_s=0.0)
    policy = ElasticPolicy(settings, budget=100, by="epochs", clock=clock)
    a = str(tmp_path / "0")
    Path(a).mkdir()
    policy.started(a, "k", 4, total=2)
    for at, epoch in ((1.0, 1.0), (2.0, 2.0)):
        _report(policy, clock, a, at, epoch)
    policy.relaunch(a, 1, 1, total=1)
    for at, epoch in ((5.0, 3.0), (5.5, 4.0), (6.0, 5.0)):
        _report(policy, clock, a, at, epoch)
    assert "k" not in policy.profiles
    assert policy._profile("k", 2).speedup(2) == 2.0


def test_the_measured_profile_is_cached_for_the_next_sweep(tmp_path: Path) -> None:
    cache = ScalingCache(tmp_path / "scaling.json")
    scaling = SweepScaling(
        task=None,  # type: ignore[arg-type]  # nothing is modelled: the profile is cached
        device="cpu",
        dtype=torch.float32,
        backend="gloo",
        max_workers=3,
        cache=cache,
    )
    key = scaling.cache_key("k")
    learnt = ScalingProfile(key, {1: 100.0, 2: 80.0, 3: 98.9}, frozenset({1, 2}))
    scaling.remember(learnt)
    profile, how = scaling("k", None, 4)
    assert profile == learnt
    assert "nothing measured now; the points marked (m) were measured by earlier arrays" in how
