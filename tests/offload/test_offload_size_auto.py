"""``fusion: {size: auto, offload: auto}``: the profiler measures array sizes beyond what the
device's memory budget holds offloaded, and chooses one where it trains more member-samples/s
than every size that fits; otherwise the on-device choice stands. Measurements are injected (the
tests prove which way each branch goes, never timings); the choice is cached; the executor's
trainer offloads the chosen size without measuring again, and its members end exactly as in one
array without offload."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from _offload_toy import SGD, toy_task
from _same_results import members

import hfsweep as hs
from hfsweep.executors.base import ArrayHooks
from hfsweep.executors.local import LocalExecutor
from hfsweep.offload import OffloadError
from hfsweep.settings import ArraySettings
from hfsweep.sizing.beyond import offload_beyond
from hfsweep.sizing.cache import ProfileCache
from hfsweep.sizing.model import Measurement, MemoryModel


def _m(size: int, rate: float, peak: int = 0) -> Measurement:
    return Measurement(size=size, samples_per_s=rate, peak_bytes=peak, step_s=size / rate)


class Offloaded:
    """``measure_offloaded``: member-samples/s by size (a size missing raises OffloadError)."""

    def __init__(self, rates: dict[int, float]) -> None:
        self.rates = rates
        self.calls: list[int] = []

    def __call__(self, size: int) -> Measurement:
        self.calls.append(size)
        if size not in self.rates:
            raise OffloadError(f"B={size} does not fit the shard limit")
        return _m(size, self.rates[size])


ON_DEVICE = [_m(1, 100.0, 1000), _m(2, 180.0, 2000)]  # 4 members would peak at 4000 bytes
LINE = MemoryModel(0.0, 1000.0)


def test_sizes_beyond_the_budget_are_measured_offloaded_and_the_fastest_wins() -> None:
    fake = Offloaded({4: 250.0, 8: 300.0, 16: 305.0})
    choice, measured = offload_beyond(fake, ON_DEVICE, LINE, 2500, max_size=64)
    assert fake.calls == [4, 8, 16]  # 16 gained less than 5% over 8: no more
    assert [m.size for m in measured] == [4, 8, 16]
    assert choice is not None  # 8: the smallest within 90% of the fastest (16)
    assert (choice.mode, choice.size, choice.fit_size) == ("host", 8, 2)
    assert (choice.offloaded_rate, choice.split_rate) == (300.0, 180.0)
    assert "B=8 offloaded" in choice.reason and "180.0 for B=2" in choice.reason


def test_the_on_device_choice_stands_where_offload_is_slower_or_cannot_run() -> None:
    slower = Offloaded({4: 150.0, 8: 160.0})
    choice, measured = offload_beyond(slower, ON_DEVICE, LINE, 2500, max_size=64)
    assert choice is None and [m.size for m in measured] == [4, 8]
    cannot = Offloaded({})
    assert offload_beyond(cannot, ON_DEVICE, LINE, 2500, max_size=64) == (None, [])
    assert cannot.calls == [4]  # larger arrays would not run either
    # every size up to max_size fits: nothing to measure
    fits = Offloaded({4: 1e9})
    assert offload_beyond(fits, ON_DEVICE, LINE, 1e9, max_size=2) == (None, [])
    assert offload_beyond(fits, ON_DEVICE, LINE, 1e9, max_size=64) == (None, [])
    assert fits.calls == []


def test_where_not_one_member_fits_the_device_the_offloaded_size_is_chosen() -> None:
    """The smallest offloaded size within the knee (90%) of the fastest is chosen."""
    fake = Offloaded({1: 50.0, 2: 90.0, 4: 99.0})
    choice, _ = offload_beyond(fake, [_m(1, 100.0, 5000)], LINE, 2500, max_size=64)
    assert choice is not None and (choice.size, choice.fit_size) == (2, 0)
    assert "no array that fits" in choice.reason and choice.split_rate is None


class FakeRates:
    """``measure_step``: a rate by whether the array is offloaded (offloaded arrays gain with
    size), a peak of ``per_member * size`` bytes on the device; counts its calls."""

    def __init__(self, per_member: int) -> None:
        self.per_member = per_member
        self.calls: list[tuple[int, bool]] = []

    def __call__(self, task: Any, config: Any, size: int, **kwargs: Any) -> Measurement:
        offload = bool(kwargs.get("offload", False))
        self.calls.append((size, offload))
        rate = 100.0 * min(size, 4) if offload else 50.0 * min(size, 2)
        peak = 0 if offload else self.per_member * size
        return _m(size, rate, peak)


#: 2 members' measured peaks fit, 4 do not; the real engine runs the toy model well within it
BUDGET = 400_000
PER_MEMBER = 150_000


def _profile(cache: ProfileCache, offload: str) -> hs.Profile:
    return hs.profile_task(
        toy_task(),
        SGD[0],
        dtype=torch.float64,
        max_size=4,
        cache=cache,
        offload=offload,
        device_memory=BUDGET,
    )


def test_profile_task_chooses_an_offloaded_size_and_caches_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeRates(PER_MEMBER)
    monkeypatch.setattr("hfsweep.sizing.timing.measure_step", fake)
    cache = ProfileCache(tmp_path / "profiles.json")
    profile = _profile(cache, "auto")
    assert sorted(fake.calls) == [(1, False), (2, False), (4, True)]  # max_size=4
    assert profile.chosen == 4 and profile.offload is not None
    assert (profile.offload.mode, profile.offload.fit_size) == ("host", 2)
    assert profile.reason == profile.offload.reason
    again = _profile(cache, "auto")
    assert len(fake.calls) == 3 and again.chosen == 4 and "(cached profile from " in again.reason
    # without offload: the most that fits, under a key of its own
    plain = _profile(cache, "none")
    assert plain.chosen == 2 and plain.offload is None and len(fake.calls) == 5


class NoneFits(FakeRates):
    """On the device even one member runs out of memory (a model larger than the device)."""

    def __call__(self, task: Any, config: Any, size: int, **kwargs: Any) -> Measurement:
        if not kwargs.get("offload", False):
            self.calls.append((size, False))
            raise torch.OutOfMemoryError("simulated: CUDA out of memory")
        return super().__call__(task, config, size, **kwargs)


def test_a_model_larger_than_the_device_gets_an_offloaded_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not even one member fits the device (out of memory at B=1): without offload the profiler
    has nothing to choose from and says so; with ``offload: auto`` it measures offloaded sizes
    and chooses one (B >= 1 trains)."""
    fake = NoneFits(PER_MEMBER)
    monkeypatch.setattr("hfsweep.sizing.timing.measure_step", fake)
    cache = ProfileCache(tmp_path / "profiles.json")
    with pytest.raises(torch.OutOfMemoryError):
        _profile(cache, "none")
    profile = _profile(cache, "auto")
    assert [c for c in fake.calls if c[1]] == [(1, True), (2, True), (4, True)]
    assert profile.chosen == 4 and profile.offload is not None
    assert profile.offload.fit_size == 0 and "no array that fits" in profile.reason
    assert [m.size for m in profile.measurements] == [1, 2, 4]  # offloaded: all it measured


@pytest.mark.slow
def test_the_executor_trains_the_offloaded_size_it_chose(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    configs = [*SGD, {**SGD[0], "seed": 7, "lr": 0.03}]
    reference = hs.ArrayTrainer(toy_task(), dtype=torch.float64).run(members(configs))
    fake = FakeRates(PER_MEMBER)
    monkeypatch.setattr("hfsweep.sizing.timing.measure_step", fake)
    monkeypatch.setenv("HFSWEEP_CACHE_DIR", str(tmp_path / "cache"))
    executor = LocalExecutor(
        toy_task(),
        arrays=ArraySettings(device="cpu", dtype="float64", offload="auto", device_memory=BUDGET),
    )
    size, reason = executor.array_size(SGD[0])
    assert size == 4 and "B=4 offloaded" in reason
    measured = len(fake.calls)
    results: list[hs.MemberResult] = []
    hooks = ArrayHooks(report=lambda evaluations: {}, refill=lambda: None, on_finish=results.append)
    with caplog.at_level(logging.INFO, logger="hfsweep.trainer"):
        executor.run_array(tmp_path / "array", members(configs), hooks, resume=False)
    assert len(fake.calls) == measured  # the trainer took the profiler's choice
    assert any(r.getMessage().startswith("offload: host") for r in caplog.records)
    by_id = {r.id: r for r in results}  # the executor keeps no weights in results: histories
    for expected in reference:
        got = by_id[expected.id]
        assert (got.status, got.steps) == (expected.status, expected.steps) == ("completed", 8)
        assert len(got.history) == len(expected.history) > 0
        for a, b in zip(got.history, expected.history, strict=True):
            assert a.keys() == b.keys()
            assert all(a[k] == pytest.approx(b[k], rel=1e-7, abs=1e-12) for k in a)


def _sweep(folder: Path, fusion: dict[str, Any]) -> hs.SweepResult:
    config = {
        "task": toy_task(),
        "search_space": {"lr": {"type": "float", "low": 1e-3, "high": 0.3, "log": True}},
        "searcher": {"name": "random"},
        "budget": {"trials": 4, "epochs": 1},
        "metric": "val_accuracy",
        "mode": "max",
        "fusion": {"device": "cpu", "dtype": "float64", **fusion},
        "output": str(folder),
        "seed": 0,
    }
    return hs.sweep(config, progress=False)


@pytest.mark.slow
def test_a_sweep_file_sizes_arrays_beyond_its_device_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``fusion: {size: auto, offload: auto, device_memory: ...}``: the sweep's arrays are of the
    offloaded size the profiler chose (4, where 2 fit), and its trials end as a sweep with arrays
    of 4 on the device."""
    plain = _sweep(tmp_path / "plain", {"size": 4})
    fake = FakeRates(PER_MEMBER)
    monkeypatch.setattr("hfsweep.sizing.timing.measure_step", fake)
    monkeypatch.setenv("HFSWEEP_CACHE_DIR", str(tmp_path / "cache"))
    auto = _sweep(tmp_path / "auto", {"size": "auto", "offload": "auto", "device_memory": BUDGET})
    assert (4, True) in fake.calls
    log = (auto.run_dir / "sweep.log").read_text()
    assert "B=4 offloaded (offload: auto)" in log
    a = {t.number: t for t in auto.study.get_trials()}
    b = {t.number: t for t in plain.study.get_trials()}
    assert sorted(a) == sorted(b) == [0, 1, 2, 3]
    for n, t in b.items():
        assert a[n].params == t.params and a[n].state == t.state
        assert a[n].value == pytest.approx(t.value, rel=1e-7)
