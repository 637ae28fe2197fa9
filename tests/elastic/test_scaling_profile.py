"""Scaling profiles: the all-reduce cost model, the modelled profile, measured overrides, the
cache, and one real gloo all-reduce measurement between two local processes."""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist

from hfsweep.profiler import AllReduceCost, Measurement, ScalingProfile, model_scaling, step_s_at
from hfsweep.sizing.allreduce import ScalingCache, allreduce_key, measure_allreduce


def test_ring_allreduce_time() -> None:
    cost = AllReduceCost(latency_s=1e-4, bandwidth_bytes_per_s=1e9)
    assert cost.time(1e6, 1) == 0.0
    # k = 2: 2 hops of latency, and the whole tensor once over the link
    assert cost.time(1e6, 2) == pytest.approx(2e-4 + 1e-3)
    # k = 4: 6 hops, 6/4 of the tensor
    assert cost.time(1e6, 4) == pytest.approx(6e-4 + 1.5e-3)


def test_fit_recovers_latency_and_bandwidth() -> None:
    truth = AllReduceCost(latency_s=5e-5, bandwidth_bytes_per_s=2e9)
    points = [(n, truth.time(n, 2)) for n in (4096, 1 << 20, 16 << 20)]
    fitted = AllReduceCost.fit(points, workers=2)
    assert fitted.latency_s == pytest.approx(5e-5)
    assert fitted.bandwidth_bytes_per_s == pytest.approx(2e9)
    with pytest.raises(ValueError, match="two distinct sizes"):
        AllReduceCost.fit([(10, 1.0), (10, 2.0)])


def test_model_follows_the_formula() -> None:
    cost = AllReduceCost(latency_s=1e-3, bandwidth_bytes_per_s=1e8)
    p = model_scaling(
        "k",
        step_s=0.1,
        members=4,
        batch_size=64,
        gradient_bytes=1e6,
        allreduce=cost,
        serial_s=0.02,
        max_workers=8,
    )
    assert sorted(p.points) == [1, 2, 4, 8]
    assert p.rate(1) == pytest.approx(4 * 64 / 0.1)
    step4 = 0.02 + 0.08 / 4 + cost.time(1e6, 4)
    assert p.rate(4) == pytest.approx(4 * 64 / step4)
    assert p.measured == frozenset()
    # interpolated between points, flat past the last one
    assert p.rate(3) == pytest.approx((p.rate(2) + p.rate(4)) / 2)
    assert p.rate(100) == p.rate(8)
    assert 0 < p.efficiency(8) < 1


def test_no_more_workers_than_samples_in_the_batch() -> None:
    cost = AllReduceCost(latency_s=0.0, bandwidth_bytes_per_s=1e12)
    p = model_scaling(
        "k", step_s=1.0, members=1, batch_size=6, gradient_bytes=0, allreduce=cost, max_workers=64
    )
    assert sorted(p.points) == [1, 2, 4, 6]
    assert p.speedup(4) == pytest.approx(4.0)  # free communication: perfect scaling


def test_measured_points_override_the_model() -> None:
    cost = AllReduceCost(latency_s=0.0, bandwidth_bytes_per_s=1e12)
    p = model_scaling(
        "k",
        step_s=1.0,
        members=1,
        batch_size=64,
        gradient_bytes=0,
        allreduce=cost,
        max_workers=4,
        measured={2: 50.0},
    )
    assert p.rate(2) == 50.0 and p.measured == {2}
    assert p.rate(4) == pytest.approx(256.0)
    assert "2: 50/s (m)" in p.describe()


def test_profile_checks() -> None:
    with pytest.raises(ValueError, match="no point at 1 worker"):
        ScalingProfile("k", {2: 1.0})
    with pytest.raises(ValueError, match="measured names"):
        ScalingProfile("k", {1: 1.0}, frozenset({2}))
    with pytest.raises(ValueError, match="finite number > 0"):
        ScalingProfile("k", {1: 0.0})


def test_step_time_between_measured_sizes() -> None:
    ms = [Measurement(1, 10.0, 0, 0.1), Measurement(4, 20.0, 0, 0.4)]
    assert step_s_at(ms, 1) == 0.1
    assert step_s_at(ms, 2) == pytest.approx(0.2)
    assert step_s_at(ms, 8) == pytest.approx(0.8)


def test_cache_round_trip(tmp_path) -> None:
    cache = ScalingCache(tmp_path / "scaling.json")
    assert cache.get_profile("k") is None
    profile = ScalingProfile("k", {1: 10.0, 2: 18.0}, frozenset({2}))
    cost = AllReduceCost(1e-4, 1e9, source="test")
    cache.put_profile(profile)
    cache.put_allreduce(allreduce_key(), cost)
    again = ScalingCache(tmp_path / "scaling.json")
    assert again.get_profile("k") == profile
    assert again.get_allreduce(allreduce_key()) == cost
    assert again.allreduce() == cost  # cached: nothing measured
    # a corrupt file reads as empty, it does not stop a sweep
    (tmp_path / "scaling.json").write_text("{not json")
    assert ScalingCache(tmp_path / "scaling.json").get_profile("k") is None
    (tmp_path / "scaling.json").write_text(json.dumps({"format": 1, "entries": {"scaling|k": 3}}))
    assert ScalingCache(tmp_path / "scaling.json").get_profile("k") is None


@pytest.mark.slow
@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built in")
def test_measure_allreduce_on_loopback() -> None:
    """Two gloo processes on 127.0.0.1: the measured times are positive and the fit is a cost
    with a finite positive bandwidth."""
    if not dist.is_gloo_available():
        pytest.skip("gloo is not built in")
    cost, points = measure_allreduce(sizes=(4096, 1 << 20), repeats=3)
    assert [n for n, _ in points] == [4096, 1 << 20]
    assert all(t > 0 for _, t in points)
    assert cost.bandwidth_bytes_per_s > 0 and cost.latency_s >= 0
    assert "gloo" in cost.source
