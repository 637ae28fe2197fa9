"""``offload: auto`` by measured throughput: where some but not all of an array's members fit the
device memory budget, the array is measured offloaded at B and on the device at B', and the faster
wins. The measurements are injected (the tests prove which way each branch goes, never timings);
the choice is cached with the profile and read back on resume without measuring again; whichever
way an array trains, its members end exactly as in one array without offload."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from _offload_toy import SGD, toy_task
from _same_results import Crash, assert_same, crashing_report, members

import hfsweep as hs
from hfsweep.offload import OffloadChoice, choose_by_rate, state_bytes
from hfsweep.sizing.cache import Profile, ProfileCache
from hfsweep.sizing.model import Measurement
from hfsweep.sizing.offloading import profile_offload


def test_choose_by_rate_keeps_the_faster_way() -> None:
    host = choose_by_rate(8, 3, 1000, offloaded_rate=120.0, split_rate=100.0)
    assert (host.mode, host.arrays) == ("host", 1)
    assert "spills the array of 8 to the host" in host.reason
    assert "120.0 member-samples/s offloaded at B=8 against 100.0" in host.reason
    split = choose_by_rate(8, 3, 1000, offloaded_rate=90.0, split_rate=100.0)
    assert (split.mode, split.arrays) == ("split", 3)
    assert "splits the array of 8 into 3 arrays of at most 3" in split.reason
    assert choose_by_rate(8, 3, 1000, 100.0, 100.0).mode == "split"  # a tie: no transfers
    assert OffloadChoice.from_dict(split.to_dict()) == split
    with pytest.raises(ValueError, match="1 <= fit < size, got fit=8, size=8"):
        choose_by_rate(8, 8, 1000, 1.0, 1.0)
    with pytest.raises(ValueError, match="mode must be 'none', 'host' or 'split', got 'gpu'"):
        OffloadChoice(2, 1, 10, "gpu", "")


class FakeRates:
    """``measure_step`` standing in for the timing: member-samples/s by whether the array is
    offloaded, and a peak of ``base + per_member * size`` bytes (0 by default: a device that
    reports no peak); counts its calls."""

    def __init__(
        self, offloaded: float, on_device: float, per_member: int = 0, base: int = 0
    ) -> None:
        self.rates = {True: offloaded, False: on_device}
        self.per_member, self.base = per_member, base
        self.calls: list[tuple[int, bool]] = []

    def __call__(self, task: Any, config: Any, size: int, **kwargs: Any) -> Measurement:
        offload = bool(kwargs.get("offload", False))
        self.calls.append((size, offload))
        rate = self.rates[offload]
        peak = self.base + self.per_member * size if self.per_member else 0
        return Measurement(size=size, samples_per_s=rate, peak_bytes=peak, step_s=size * 24 / rate)


@pytest.fixture(scope="module")
def reference() -> list[hs.MemberResult]:
    """The members of ``SGD`` trained in one array without offload."""
    return hs.ArrayTrainer(toy_task(), dtype=torch.float64).run(members(SGD))


def _member_state() -> int:
    task = toy_task()
    return state_bytes(task.build_model(task.resolve(SGD[0])).double())


def test_profile_offload_measures_both_ways_and_caches(tmp_path: Path) -> None:
    task, member = toy_task(), _member_state()
    cache = ProfileCache(tmp_path / "profiles.json")
    budget = 2 * member + 5  # B' = 2 of B = 3
    fake = FakeRates(offloaded=300.0, on_device=200.0)
    kwargs: dict[str, Any] = {"dtype": torch.float64, "cache": cache, "measure": None}

    def measure(size: int, offloaded: bool) -> Measurement:
        return fake(task, SGD[0], size, offload=offloaded)

    kwargs["measure"] = measure
    choice = profile_offload(task, SGD[0], 3, device_memory=budget, **kwargs)
    assert (choice.mode, choice.fit_size, choice.offloaded_rate, choice.split_rate) == (
        "host", 2, 300.0, 200.0,
    )  # fmt: skip
    assert sorted(fake.calls) == [(1, False), (2, False), (3, True)]
    again = profile_offload(task, SGD[0], 3, device_memory=budget, **kwargs)
    assert len(fake.calls) == 3 and again.mode == "host" and again.reason.endswith("(cached)")
    # the key holds the budget: another budget is measured again (and here splits)
    fake.rates[True] = 100.0
    other = profile_offload(task, SGD[0], 3, device_memory=budget + 1, **kwargs)
    assert other.mode == "split" and len(fake.calls) == 6
    entries = cache._read()
    assert len(entries) == 2  # both choices, each under its budget's key
    stored = [Profile.from_dict(e) for e in entries.values()]
    assert sorted(p.offload.mode for p in stored if p.offload is not None) == ["host", "split"]
    assert all(f"* {p.offload.reason}" in p.table() for p in stored if p.offload is not None)
    # the estimate says the array fits: measured on the device only (1 and 2 members); not one
    # member's state fits: nothing to measure
    fits = profile_offload(task, SGD[0], 2, device_memory=budget, **kwargs)
    alone = profile_offload(task, SGD[0], 3, device_memory=member - 1, **kwargs)
    assert (fits.mode, alone.mode, alone.fit_size, len(fake.calls)) == ("none", "host", 0, 8)
    assert fake.calls[-2:] == [(1, False), (2, False)]


def _choose(fake: Any, size: int, budget: int) -> OffloadChoice:
    """``profile_offload`` of ``SGD[0]`` at ``size`` with ``budget`` bytes, measured by ``fake``."""
    task = toy_task()

    def measure(n: int, offloaded: bool) -> Measurement:
        return fake(task, SGD[0], n, offload=offloaded)

    return profile_offload(
        task, SGD[0], size, device_memory=budget, dtype=torch.float64, measure=measure
    )


def test_b_prime_comes_from_measured_peaks_activations_included() -> None:
    member = _member_state()
    budget = 3 * member  # the state estimate says B' = 3 of B = 4
    # activations double each member's peak: only 1 fits, where the estimate said 3
    heavy = FakeRates(offloaded=100.0, on_device=200.0, per_member=2 * member)
    choice = _choose(heavy, 4, budget)
    assert (choice.mode, choice.fit_size, choice.arrays) == ("split", 1, 4)
    assert sorted(heavy.calls) == [(1, False), (3, False), (4, True)]
    # a lighter optimizer state than the estimate's (SGD: no moments): the whole array fits
    light = FakeRates(offloaded=100.0, on_device=200.0, per_member=member // 2)
    fits = _choose(light, 4, budget)
    assert (fits.mode, fits.fit_size, fits.offloaded_rate) == ("none", 4, None)
    assert sorted(light.calls) == [
        (1, False),
        (3, False),
        (4, False),
    ]  # B=4 measured, not offloaded
    assert "measured peaks" in fits.reason and "activations included" in fits.reason
    # not even one member's measured peak fits: offload is the only way, nothing else is measured
    huge = FakeRates(offloaded=100.0, on_device=200.0, per_member=4 * member)
    alone = _choose(huge, 4, budget)
    assert (alone.mode, alone.fit_size, huge.calls) == ("host", 0, [(1, False)])
    assert f"exceeds the {budget} bytes" in alone.reason


class Superlinear(FakeRates):
    """Peaks of ``member / 2`` per member up to 3 members, then ``member`` per member: the line
    through the first measurements under-predicts the larger arrays."""

    def __call__(self, task: Any, config: Any, size: int, **kwargs: Any) -> Measurement:
        m = super().__call__(task, config, size, **kwargs)
        scale = 1 if size <= 3 else 2
        return Measurement(m.size, m.samples_per_s, scale * m.peak_bytes, m.step_s)


def test_b_prime_is_measured_again_where_the_line_under_predicts() -> None:
    member = _member_state()
    fake = Superlinear(offloaded=300.0, on_device=200.0, per_member=member // 2)
    choice = _choose(fake, 6, 3 * member + 1)  # the first line predicts all 6 fit
    assert (choice.mode, choice.fit_size) == ("host", 3)
    on_device = sorted(n for n, offloaded in fake.calls if not offloaded)
    assert on_device[0] == 1 and 6 in on_device and on_device[-1] == 6
    assert all(n <= 3 or n * member > 3 * member + 1 for n in on_device)  # each n > 3 was over


def test_a_device_without_peaks_keeps_the_estimate() -> None:
    member = _member_state()
    fake = FakeRates(offloaded=100.0, on_device=200.0)  # peaks of 0: nothing to fit
    choice = _choose(fake, 4, 3 * member)
    assert (choice.mode, choice.fit_size) == ("split", 3)
    assert sorted(fake.calls) == [(1, False), (3, False), (4, True)]


def test_b_prime_from_real_peaks_on_this_cpu() -> None:
    """The real step's peaks (live tensor bytes on the CPU, deterministic): B' is the largest
    size whose measured peak is within the budget."""
    from hfsweep.sizing.task import measure_step

    task = toy_task()
    resolved = task.resolve(SGD[0])
    train, _ = task.build_data(resolved)
    x, y = next(iter(train))
    batch = (x.double(), y)

    def peak(n: int) -> int:
        return measure_step(
            task, resolved, n, device=torch.device("cpu"), dtype=torch.float64, batch=batch,
            min_seconds=0.0, min_steps=1, warmup=1, share_frozen=False,
        ).peak_bytes  # fmt: skip

    peaks = {n: peak(n) for n in (1, 2, 3)}
    assert peaks[1] < peaks[2] < peaks[3]
    budget = (peaks[2] + peaks[3]) // 2
    if budget // _member_state() < 1:
        pytest.skip("the state estimate does not leave one member within the budget")
    choice = profile_offload(
        task, SGD[0], 3, device_memory=budget, dtype=torch.float64, min_seconds=0.0
    )
    assert choice.fit_size == 2 and choice.mode in ("host", "split")


def _train_auto(
    fake: FakeRates,
    budget: int,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> tuple[list[hs.MemberResult], list[str]]:
    """The members of ``SGD`` trained by an ``offload="auto"`` trainer with ``budget`` bytes of
    device memory, ``fake`` measuring; the results and the trainer's log messages."""
    monkeypatch.setattr("hfsweep.sizing.timing.measure_step", fake)
    with caplog.at_level(logging.INFO, logger="hfsweep.trainer"):
        results = hs.ArrayTrainer(
            toy_task(), dtype=torch.float64, offload="auto", device_memory=budget
        ).run(members(SGD))
    return results, [r.getMessage() for r in caplog.records]


@pytest.mark.slow
def test_the_trainer_splits_when_that_is_faster(
    reference: list[hs.MemberResult],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake = FakeRates(offloaded=100.0, on_device=150.0)
    split, messages = _train_auto(fake, 2 * _member_state(), monkeypatch, caplog)
    assert sorted(fake.calls) == [(1, False), (2, False), (3, True)]
    assert any("splits the array of 3 into 2 arrays of at most 2" in m for m in messages)
    assert any("100.0 member-samples/s offloaded at B=3 against 150.0" in m for m in messages)
    assert "offload: auto trains the 3 members as arrays of 2, 1, one after another" in messages
    assert not any(m.startswith("offload: host") for m in messages)
    for a, b in zip(split, reference, strict=True):
        assert_same(a, b, rng=True)


@pytest.mark.slow
def test_the_trainer_splits_an_array_whose_state_fits_but_whose_step_does_not(
    reference: list[hs.MemberResult],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    member = _member_state()
    # the estimate says all 3 fit 3 members' state; the measured peaks (activations twice the
    # state) say 1 does
    fake = FakeRates(offloaded=100.0, on_device=150.0, per_member=2 * member)
    split, messages = _train_auto(fake, 3 * member, monkeypatch, caplog)
    assert sorted(fake.calls) == [(1, False), (3, False), (3, True)]  # once: the parts fit
    assert "offload: auto trains the 3 members as arrays of 1, 1, 1, one after another" in messages
    for a, b in zip(split, reference, strict=True):
        assert_same(a, b, rng=True)


@pytest.mark.slow
def test_the_trainer_offloads_when_that_is_faster_and_resumes_without_measuring(
    reference: list[hs.MemberResult],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    task = toy_task()
    trials = members(SGD[:2])  # an array of 2 members trains them as one of 3 would
    fake = FakeRates(offloaded=150.0, on_device=100.0)
    monkeypatch.setattr("hfsweep.sizing.timing.measure_step", fake)

    def trainer() -> hs.ArrayTrainer:
        return hs.ArrayTrainer(
            task,
            dtype=torch.float64,
            offload="auto",
            device_memory=2 * _member_state() - 1,  # B' = 1 of B = 2
            checkpoint_dir=tmp_path / "ckpt",
        )

    with caplog.at_level(logging.INFO, logger="hfsweep.trainer"), pytest.raises(Crash):
        trainer().run(trials, report=crashing_report(2))
    assert sorted(fake.calls) == [(1, False), (2, True)]
    messages = [r.getMessage() for r in caplog.records]
    assert any("spills the array of 2 to the host: measured 150.0" in m for m in messages)
    assert any(m.startswith("offload: host") for m in messages)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="hfsweep.trainer"):
        resumed = trainer().run(trials, resume=True)
    assert len(fake.calls) == 2  # the choice came from the profile cache
    assert any(r.getMessage().endswith("(cached)") for r in caplog.records)
    assert any(r.getMessage().startswith("offload: host") for r in caplog.records)
    for a, b in zip(resumed, reference[:2], strict=True):
        assert_same(a, b, rng=True)
