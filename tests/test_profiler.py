"""Sizing: knee choice, memory model, the measuring loop, signatures, the cache and the plot.

Everything runs on recorded or synthetic measurements (a fake ``measure``), so the tests are fast,
deterministic and assert behaviour, never a timing.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import stat
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from hfsweep.profiler import (
    Measurement,
    MemoryModel,
    Profile,
    ProfileCache,
    cache_key,
    choose_size,
    device_budget,
    plot,
    profile_sizes,
    signature,
)
from hfsweep.sizing import cache as sizing_cache
from hfsweep.sizing import device as sizing_device

MIB = 2**20
GIB = 2**30


def series(throughputs, *, base=100 * MIB, per_member=10 * MIB, batch=32):
    """Measurements at B = 1, 2, 4, ... with the given member-samples/s and linear memory."""
    out = []
    for i, rate in enumerate(throughputs):
        size = 2**i
        out.append(
            Measurement(
                size=size,
                samples_per_s=float(rate),
                peak_bytes=base + per_member * size,
                step_s=size * batch / rate,
            )
        )
    return out


class FakeDevice:
    """A ``measure`` callable: throughput from a table, memory linear in B, optional OOM at a size."""

    def __init__(self, rates, *, base=100 * MIB, per_member=50 * MIB, oom_at=None, oom_exc=None):
        self.rates = rates
        self.base = base
        self.per_member = per_member
        self.oom_at = oom_at
        self.oom_exc = oom_exc or torch.OutOfMemoryError("CUDA out of memory. Tried to allocate")
        self.calls: list[int] = []

    def __call__(self, size: int) -> Measurement:
        self.calls.append(size)
        if self.oom_at is not None and size >= self.oom_at:
            raise self.oom_exc
        rate = self.rates(size) if callable(self.rates) else self.rates[size]
        return Measurement(
            size=size,
            samples_per_s=float(rate),
            peak_bytes=self.base + self.per_member * size,
            step_s=size * 32 / rate,
        )


# ------------------------------------------------------------------------------------- choose_size


def test_knee_picks_smallest_size_within_knee_of_best():
    ms = series([100, 190, 350, 600, 640, 650])  # B = 1 .. 32
    size, reason = choose_size(ms, budget_bytes=64 * GIB, knee=0.9)
    assert size == 8  # 600 >= 0.9 * 650 = 585; 350 is not
    assert "knee" in reason and "B=32" in reason


def test_knee_one_takes_the_fastest():
    ms = series([100, 190, 350, 600, 640, 650])
    size, reason = choose_size(ms, budget_bytes=64 * GIB, knee=1.0)
    assert size == 32
    assert reason == "B=32 is the fastest size that fits: 650.0 member-samples/s, 6.50x B=1"


def test_memory_cap_takes_largest_feasible_when_knee_does_not_fit():
    ms = series([100, 190, 350, 600, 640, 650], base=100 * MIB, per_member=100 * MIB)
    budget = 100 * MIB + 100 * MIB * 4  # B = 4 fits exactly, B = 8 does not
    size, reason = choose_size(ms, budget_bytes=budget)
    assert size == 4
    assert reason.startswith("memory cap") and "B=8" in reason


def test_fusion_does_not_pay_falls_back_to_one():
    ms = series([100, 80, 70, 60])
    size, reason = choose_size(ms, budget_bytes=64 * GIB)
    assert size == 1
    assert "does not pay" in reason


def test_small_gain_stays_at_one_by_the_knee():
    ms = series([100, 104, 105])  # fusion gains less than 1/0.9
    size, reason = choose_size(ms, budget_bytes=64 * GIB)
    assert size == 1
    assert "knee" in reason


def test_nothing_fits_returns_one_and_says_so():
    ms = series([100, 190, 350], base=2 * GIB)
    size, reason = choose_size(ms, budget_bytes=1 * GIB)
    assert size == 1
    assert "no measured size fits" in reason and "1.00 GiB" in reason


def test_only_one_size_measured():
    size, reason = choose_size(series([100]), budget_bytes=GIB)
    assert size == 1 and "only B=1" in reason
    m = Measurement(size=4, samples_per_s=10.0, peak_bytes=MIB, step_s=0.1)
    assert choose_size([m], budget_bytes=GIB) == (4, "only B=4 was measured")


def test_without_b1_the_knee_still_applies():
    ms = series([100, 190, 350, 600, 640, 650])[1:]  # B = 2 .. 32
    assert choose_size(ms, budget_bytes=64 * GIB)[0] == 8


def test_choose_size_order_does_not_matter():
    ms = series([100, 190, 350, 600, 640, 650])
    assert choose_size(list(reversed(ms)), budget_bytes=64 * GIB) == choose_size(
        ms, budget_bytes=64 * GIB
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"measurements": []}, "empty"),
        ({"budget_bytes": 0}, "budget_bytes"),
        ({"budget_bytes": -5.0}, "budget_bytes"),
        ({"knee": 0.0}, r"knee must be a number in \(0, 1\]"),
        ({"knee": 1.5}, "knee"),
    ],
)
def test_choose_size_rejects_bad_input(kwargs, match):
    args = {"measurements": series([100, 190]), "budget_bytes": GIB, **kwargs}
    knee = args.pop("knee", 0.9)
    with pytest.raises(ValueError, match=match):
        choose_size(args["measurements"], args["budget_bytes"], knee=knee)


def test_duplicate_sizes_rejected():
    ms = series([100, 190])
    with pytest.raises(ValueError, match=r"repeat the size\(s\) \[2\]"):
        choose_size([*ms, ms[1]], budget_bytes=GIB)


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("size", 0, "size must be an integer >= 1, got 0"),
        ("size", 1.5, "size"),
        ("samples_per_s", -1.0, "samples_per_s"),
        ("samples_per_s", float("inf"), "samples_per_s"),
        ("peak_bytes", -1, "peak_bytes"),
        ("step_s", -0.1, "step_s"),
    ],
)
def test_measurement_validates(field, value, match):
    fields = {"size": 1, "samples_per_s": 1.0, "peak_bytes": 0, "step_s": 0.1, field: value}
    with pytest.raises(ValueError, match=match):
        Measurement(**fields)


# ------------------------------------------------------------------------------------- MemoryModel


def test_memory_model_fits_linear_data_exactly():
    ms = series([1, 2, 3, 4], base=GIB, per_member=256 * MIB)
    model = MemoryModel.fit(ms)
    assert model == MemoryModel(base_bytes=float(GIB), per_member_bytes=float(256 * MIB))
    assert model.predict(16) == GIB + 16 * 256 * MIB
    assert model.max_size(GIB + 10 * 256 * MIB) == 10  # exactly on the budget fits
    assert model.max_size(GIB + 10 * 256 * MIB - 1) == 9
    assert model.max_size(GIB + 255 * MIB) == 0  # not even one member


def test_memory_model_slope_is_never_negative():
    ms = [
        Measurement(size=s, samples_per_s=1.0, peak_bytes=p, step_s=1.0)
        for s, p in [(1, 900), (2, 800), (4, 700)]
    ]
    model = MemoryModel.fit(ms)
    assert model.per_member_bytes == 0.0
    assert model.base_bytes == pytest.approx(800.0)
    assert model.max_size(1000) == sys.maxsize  # no per-member cost: unbounded


def test_memory_model_base_is_never_negative():
    # superlinear growth would give a negative intercept; the fit goes through the origin instead
    ms = [
        Measurement(size=s, samples_per_s=1.0, peak_bytes=p, step_s=1.0)
        for s, p in [(1, 10), (2, 40), (4, 160)]
    ]
    model = MemoryModel.fit(ms)
    assert model.base_bytes == 0.0
    assert model.per_member_bytes > 0


def test_memory_model_one_point_goes_through_origin():
    m = Measurement(size=4, samples_per_s=1.0, peak_bytes=400 * MIB, step_s=1.0)
    assert MemoryModel.fit([m]) == MemoryModel(0.0, float(100 * MIB))


def test_memory_model_validates():
    with pytest.raises(ValueError, match="per_member_bytes"):
        MemoryModel(base_bytes=0.0, per_member_bytes=-1.0)
    with pytest.raises(ValueError, match="budget_bytes"):
        MemoryModel(0.0, 1.0).max_size(0)
    with pytest.raises(ValueError, match="size"):
        MemoryModel(0.0, 1.0).predict(-1)
    with pytest.raises(ValueError, match="empty"):
        MemoryModel.fit([])


# ----------------------------------------------------------------------------------- profile_sizes


def test_profile_sizes_doubles_up_to_max_size():
    device = FakeDevice(lambda b: 100.0 * b)  # perfectly linear: never plateaus
    seen = []
    ms, model = profile_sizes(device, budget_bytes=64 * GIB, max_size=16, on_measure=seen.append)
    assert device.calls == [1, 2, 4, 8, 16]
    assert [m.size for m in ms] == [1, 2, 4, 8, 16]
    assert seen == ms
    assert model == MemoryModel(float(100 * MIB), float(50 * MIB))


def test_profile_sizes_ends_with_max_size_when_not_a_power_of_two():
    device = FakeDevice(lambda b: 100.0 * b)
    ms, _ = profile_sizes(device, budget_bytes=64 * GIB, max_size=12)
    assert [m.size for m in ms] == [1, 2, 4, 8, 12]


def test_profile_sizes_stops_on_plateau():
    rates = {1: 100, 2: 190, 4: 350, 8: 600, 16: 620, 32: 630, 64: 640}
    device = FakeDevice(rates)
    ms, _ = profile_sizes(device, budget_bytes=64 * GIB, max_size=64, plateau=1.05)
    # 600 -> 620 (x1.03) and 620 -> 630 (x1.02): two slow doublings in a row
    assert device.calls == [1, 2, 4, 8, 16, 32]
    assert choose_size(ms, 64 * GIB)[0] == 8


def test_profile_sizes_one_slow_doubling_is_not_a_plateau():
    rates = {1: 100, 2: 190, 4: 195, 8: 400, 16: 800}
    device = FakeDevice(rates)
    profile_sizes(device, budget_bytes=64 * GIB, max_size=16)
    assert device.calls == [1, 2, 4, 8, 16]


def test_profile_sizes_stops_when_throughput_falls_past_the_knee():
    device = FakeDevice({1: 100, 2: 200, 4: 400, 8: 300, 16: 900})
    ms, _ = profile_sizes(device, budget_bytes=64 * GIB, max_size=16)
    assert device.calls == [1, 2, 4, 8]
    assert choose_size(ms, 64 * GIB)[0] == 4


def test_profile_sizes_stops_before_predicted_over_budget():
    device = FakeDevice(lambda b: 100.0 * b, base=100 * MIB, per_member=50 * MIB)
    # B = 8 peaks at exactly 500 MiB and fits; B = 16 is predicted at 900 MiB
    ms, model = profile_sizes(device, budget_bytes=500 * MIB, max_size=64)
    assert device.calls == [1, 2, 4, 8]
    assert model.max_size(500 * MIB) == 8
    assert choose_size(ms, 500 * MIB)[0] == 8


def test_profile_sizes_measures_the_largest_predicted_fit_between_doublings():
    device = FakeDevice(lambda b: 100.0 * b, base=100 * MIB, per_member=50 * MIB)
    # the model says 7 fits (450 MiB) and 8 does not (500 MiB)
    ms, _ = profile_sizes(device, budget_bytes=450 * MIB, max_size=64)
    assert device.calls == [1, 2, 4, 7]
    assert choose_size(ms, 450 * MIB)[0] == 7


def test_profile_sizes_stops_after_measured_over_budget():
    # one point cannot split base from per-member memory, so B = 2 is measured, then it stops
    device = FakeDevice(lambda b: 100.0 * b, base=300 * MIB, per_member=100 * MIB)
    ms, _ = profile_sizes(device, budget_bytes=450 * MIB, max_size=64)
    assert device.calls == [1, 2]
    size, reason = choose_size(ms, 450 * MIB)
    assert size == 1
    assert reason.startswith("memory cap: B=2") and "500.0 MiB" in reason and "x B=1" not in reason


@pytest.mark.parametrize(
    "exc",
    [
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        RuntimeError("CUDA error: out of memory"),
        RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 GB"),
        MemoryError(),
    ],
)
def test_profile_sizes_stops_on_oom_keeping_earlier_points(exc):
    device = FakeDevice(lambda b: 100.0 * b, oom_at=16, oom_exc=exc)
    seen = []
    ms, model = profile_sizes(device, budget_bytes=64 * GIB, max_size=64, on_measure=seen.append)
    assert device.calls == [1, 2, 4, 8, 16]
    assert [m.size for m in ms] == [1, 2, 4, 8]
    assert [m.size for m in seen] == [1, 2, 4, 8]
    assert model.per_member_bytes == 50 * MIB


def test_profile_sizes_oom_at_first_size_raises():
    device = FakeDevice(lambda b: 100.0, oom_at=1)
    with pytest.raises(torch.OutOfMemoryError):
        profile_sizes(device, budget_bytes=GIB)


def test_profile_sizes_other_errors_propagate():
    def measure(size: int) -> Measurement:
        raise RuntimeError("shape mismatch")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        profile_sizes(measure, budget_bytes=GIB)


def test_profile_sizes_explicit_sizes_ascending_without_plateau_stop():
    device = FakeDevice(lambda b: 100.0)  # flat: doubling would stop early
    ms, _ = profile_sizes(device, budget_bytes=64 * GIB, sizes=[8, 1, 3, 2])
    assert device.calls == [1, 2, 3, 8]
    assert [m.size for m in ms] == [1, 2, 3, 8]


def test_profile_sizes_explicit_sizes_still_stop_on_memory():
    device = FakeDevice(lambda b: 100.0 * b, base=100 * MIB, per_member=50 * MIB)
    profile_sizes(device, budget_bytes=450 * MIB, sizes=[1, 2, 4, 8, 16])
    assert device.calls == [1, 2, 4]  # 8 predicted over budget; no in-between size


def test_profile_sizes_validates():
    device = FakeDevice(lambda b: 100.0)
    with pytest.raises(ValueError, match=r"sizes repeat \[2\]"):
        profile_sizes(device, budget_bytes=GIB, sizes=[1, 2, 2])
    with pytest.raises(ValueError, match="sizes"):
        profile_sizes(device, budget_bytes=GIB, sizes=[0, 1])
    with pytest.raises(ValueError, match="empty"):
        profile_sizes(device, budget_bytes=GIB, sizes=[])
    with pytest.raises(ValueError, match="max_size"):
        profile_sizes(device, budget_bytes=GIB, max_size=0)
    with pytest.raises(ValueError, match="budget_bytes"):
        profile_sizes(device, budget_bytes=0)
    with pytest.raises(ValueError, match="plateau"):
        profile_sizes(device, budget_bytes=GIB, plateau=0.5)
    with pytest.raises(ValueError, match="knee"):
        profile_sizes(device, budget_bytes=GIB, knee=0)
    assert device.calls == []

    def wrong_size(size: int) -> Measurement:
        return Measurement(size=size + 1, samples_per_s=1.0, peak_bytes=0, step_s=1.0)

    with pytest.raises(ValueError, match=r"measure\(1\) returned a Measurement of size 2"):
        profile_sizes(wrong_size, budget_bytes=GIB)


# --------------------------------------------------------------------------------------- signature


def mlp(width: int = 16) -> nn.Module:
    return nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Dropout(0.1), nn.Linear(width, 3))


def cnn(kernel: int = 3, padding: int = 1) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, kernel, padding=padding), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten()
    )


def test_signature_equal_for_independent_inits():
    torch.manual_seed(1)
    a = mlp()
    torch.manual_seed(2)
    b = mlp()
    assert not torch.equal(a[0].weight, b[0].weight)
    assert signature(a) == signature(b)
    assert signature(cnn()) == signature(cnn())
    assert len(signature(a)) == 16


def test_signature_changes_with_architecture():
    assert signature(mlp(16)) != signature(mlp(32))
    assert signature(cnn(kernel=3)) != signature(cnn(kernel=5))
    # same parameter shapes, different hyperparameter in extra_repr()
    assert signature(cnn(padding=1)) != signature(cnn(padding=0))
    assert signature(mlp()) != signature(mlp().double())


def test_signature_ignores_dropout_probability():
    a = mlp()
    b = mlp()
    b[2].p = 0.5
    assert signature(a) == signature(b)


def test_signature_sees_tied_weights():
    class TwoHeads(nn.Module):
        def __init__(self, tie: bool) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)
            if tie:
                self.b.weight = self.a.weight

    assert signature(TwoHeads(tie=True)) != signature(TwoHeads(tie=False))


# --------------------------------------------------------------------------------------- cache_key


def test_cache_key_parts():
    sig = signature(mlp())
    key = cache_key(sig, 64, torch.float32, "cpu")
    assert key.startswith(sig)
    assert "batch=64" in key and "float32" in key and "cpu:" in key
    assert key == cache_key(sig, 64, "float32", torch.device("cpu"))
    assert key == cache_key(sig, 64, "torch.float32", "cpu")
    assert key != cache_key(sig, 32, torch.float32, "cpu")
    assert key != cache_key(sig, 64, torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match="batch_size"):
        cache_key(sig, 0, torch.float32, "cpu")
    with pytest.raises(ValueError, match="model_signature"):
        cache_key("", 1, torch.float32, "cpu")


def fake_cuda(monkeypatch, *, free=60 * GIB, total=80 * GIB, reserved=2 * GIB):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index=None: (free, total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda index=None: reserved)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "Fake GPU 80GB")
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda index=None: SimpleNamespace(total_memory=total)
    )


def test_cuda_key_and_budget_with_a_fake_device(monkeypatch):
    fake_cuda(monkeypatch)
    key = cache_key("abc", 8, torch.float16, "cuda:0")
    assert "cuda:Fake GPU 80GB:80GiB" in key
    assert key == cache_key("abc", 8, torch.float16, "cuda")  # the index is not the hardware
    # other processes hold 80 - 60 - 2 = 18 GiB: the budget is a fraction of the remaining 62 GiB
    assert device_budget("cuda", 0.5) == 31 * GIB


def test_cuda_without_cuda_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="CUDA is not available"):
        device_budget("cuda:0")


# ----------------------------------------------------------------------------------- device_budget


def test_device_budget_cpu_positive():
    assert device_budget("cpu") > 0
    assert device_budget(torch.device("cpu"), 1.0) > 0


def test_device_budget_cpu_is_fraction_of_available_ram(monkeypatch):
    monkeypatch.setattr(sizing_device, "_available_ram_bytes", lambda: 8 * GIB)
    assert device_budget("cpu", 0.5) == 4 * GIB
    assert device_budget("cpu") == pytest.approx(0.8 * 8 * GIB)


def test_auto_device_is_cuda_where_torch_sees_one(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert sizing_device.resolve_device("auto") == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert sizing_device.resolve_device("auto") == "cpu"
    assert sizing_device.resolve_device("cuda:1") == "cuda:1"  # the caller checks it exists
    assert sizing_device.resolve_device(torch.device("cpu")) == "cpu"


def test_the_dtype_table_covers_every_dtype_a_sweep_yaml_accepts():
    from hfsweep.config import DTYPES as yaml_names

    assert set(sizing_device.DTYPES) == set(yaml_names)
    assert all(d.is_floating_point for d in sizing_device.DTYPES.values())


def test_meminfo_parsing(tmp_path):
    path = tmp_path / "meminfo"
    path.write_text("MemTotal:       16000000 kB\nMemAvailable:    2048 kB\n")
    assert sizing_device._meminfo_available(str(path)) == 2048 * 1024
    assert sizing_device._meminfo_available(str(tmp_path / "missing")) is None


@pytest.mark.parametrize("fraction", [0, 0.0, -0.5, 1.01, float("nan"), True, "0.5"])
def test_device_budget_validates_fraction(fraction):
    with pytest.raises(ValueError, match=r"fraction must be a number in \(0, 1\]"):
        device_budget("cpu", fraction)


def test_device_budget_unknown_device():
    with pytest.raises(ValueError, match="valid types: cpu, cuda, mps"):
        device_budget("meta")


@pytest.mark.gpu
def test_device_budget_and_key_on_a_real_gpu():
    budget = device_budget("cuda", 0.8)
    assert 0 < budget <= torch.cuda.get_device_properties(0).total_memory
    assert torch.cuda.get_device_name(0) in cache_key("abc", 1, torch.float32, "cuda")


# ------------------------------------------------------------------------------- Profile and cache


def make_profile(key: str = "k1", rates=(100, 190, 350, 600, 640, 650)) -> Profile:
    ms = series(list(rates))
    budget = 64.0 * GIB
    chosen, reason = choose_size(ms, budget)
    return Profile(
        key=key,
        device="cpu:Test CPU:2cores",
        batch_size=32,
        dtype="float32",
        measurements=tuple(ms),
        memory=MemoryModel.fit(ms),
        budget_bytes=budget,
        chosen=chosen,
        reason=reason,
    )


def test_profile_dict_round_trip_through_json():
    p = make_profile()
    d = json.loads(json.dumps(p.to_dict(), allow_nan=False))
    assert Profile.from_dict(d) == p


def test_profile_from_dict_errors_name_the_problem():
    d = make_profile().to_dict()
    del d["chosen"]
    with pytest.raises(ValueError, match="'chosen'"):
        Profile.from_dict(d)
    d = make_profile().to_dict()
    d["measurements"][0]["size"] = -1
    with pytest.raises(ValueError, match="size"):
        Profile.from_dict(d)


def test_profile_table_marks_the_chosen_row():
    p = make_profile()
    text = p.table()
    lines = text.splitlines()
    assert "member-samples/s" in lines[0] and "speed-up vs B=1" in lines[0]
    marked = [line for line in lines if line.startswith("*")]
    assert marked[0].split()[1] == "8"  # "*", then B
    assert "6.00x" in marked[0]
    assert f"chosen B=8: {p.reason}" in text


def test_cache_round_trip(tmp_path):
    cache = ProfileCache(tmp_path / "sub" / "profiles.json")
    assert cache.get("k1") is None
    p1, p2 = make_profile("k1"), make_profile("k2", rates=(100, 80))
    cache.put(p1)
    cache.put(p2)
    fresh = ProfileCache(tmp_path / "sub" / "profiles.json")
    assert fresh.get("k1") == p1
    assert fresh.get("k2") == p2
    assert fresh.get("k2").chosen == 1
    assert sorted(os.listdir(tmp_path / "sub")) == ["profiles.json", "profiles.json.lock"]


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_cache_files_follow_the_umask(tmp_path, umask):
    """As every file hfsweep writes: a cache shared through HFSWEEP_CACHE_DIR stays shared."""
    old = os.umask(umask)
    try:
        ProfileCache(tmp_path / "sub" / "profiles.json").put(make_profile("k1"))
    finally:
        os.umask(old)
    for path in [tmp_path / "sub", *(tmp_path / "sub").iterdir()]:
        expected = (0o777 if path.is_dir() else 0o666) & ~umask
        assert stat.S_IMODE(path.stat().st_mode) == expected, (path.name, oct(path.stat().st_mode))


def test_cache_default_path_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("HFSWEEP_CACHE_DIR", str(tmp_path))
    cache = ProfileCache()
    assert cache.path == tmp_path / "profiles.json"
    cache.put(make_profile())
    assert (tmp_path / "profiles.json").exists()
    monkeypatch.delenv("HFSWEEP_CACHE_DIR")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert ProfileCache().path == tmp_path / "home" / ".cache" / "hfsweep" / "profiles.json"


def test_cache_write_is_atomic(tmp_path, monkeypatch, caplog):
    path = tmp_path / "profiles.json"
    cache = ProfileCache(path)
    cache.put(make_profile("k1"))
    before = path.read_bytes()

    def crash(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(sizing_cache.os, "replace", crash)
    with caplog.at_level(logging.WARNING, logger="hfsweep.profiler"):
        cache.put(make_profile("k2"))  # logged, not raised: the cache only saves time
    assert "disk full" in caplog.text
    assert path.read_bytes() == before  # the old file is untouched
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]  # no temp file left
    monkeypatch.undo()
    assert cache.get("k1") == make_profile("k1")
    assert cache.get("k2") is None


@pytest.mark.parametrize(
    "content",
    [b"{not json", b"[1, 2, 3]", b'{"format": 99, "profiles": {}}', b"\xff\xfe\x00garbage"],
)
def test_cache_corrupt_file_reads_as_empty(tmp_path, caplog, content):
    path = tmp_path / "profiles.json"
    path.write_bytes(content)
    cache = ProfileCache(path)
    with caplog.at_level(logging.WARNING, logger="hfsweep.profiler"):
        assert cache.get("k1") is None
    assert "treating it as empty" in caplog.text
    cache.put(make_profile("k1"))  # replaces the corrupt file
    assert cache.get("k1") == make_profile("k1")


def test_cache_malformed_entry_is_skipped(tmp_path, caplog):
    path = tmp_path / "profiles.json"
    good = make_profile("good").to_dict()
    path.write_text(json.dumps({"format": 1, "profiles": {"bad": {"key": "bad"}, "good": good}}))
    cache = ProfileCache(path)
    with caplog.at_level(logging.WARNING, logger="hfsweep.profiler"):
        assert cache.get("bad") is None
    assert "unreadable profile" in caplog.text
    assert cache.get("good") == make_profile("good")


# ------------------------------------------------------------------------------------------ plot


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "profile.png"
    plot(make_profile(), out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    monkeypatch.setitem(sys.modules, "matplotlib.backends", None)
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        plot(make_profile(), tmp_path / "p.png")


# ------------------------------------------------------------------------------------------ import


def test_import_is_light():
    code = (
        "import sys, hfsweep.profiler\n"
        "heavy = [m for m in ('ray', 'optuna', 'matplotlib') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ------------------------------------------------------------------ the cache's conditions


def test_cache_key_names_threads_and_the_versions(monkeypatch):
    """What changes a profile's answer is in its key: another thread count, torch or hfsweep
    version is another key, so a profile measured under them is not reused."""
    import hfsweep

    sig = signature(mlp())
    key = cache_key(sig, 64, torch.float32, "cpu")
    assert f"threads={torch.get_num_threads()}" in key
    assert f"torch={torch.__version__}" in key and f"hfsweep={hfsweep.__version__}" in key
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert cache_key(sig, 64, torch.float32, "cpu") != key
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    assert cache_key(sig, 64, torch.float32, "cpu") != key
    monkeypatch.undo()
    monkeypatch.setattr(hfsweep._version, "__version__", "9.9.9")
    assert cache_key(sig, 64, torch.float32, "cpu") != key


def test_a_profile_records_when_and_under_what_it_was_measured_and_says_so_when_reused(
    tmp_path,
):
    from hfsweep.sizing._provenance import conditions

    cache = ProfileCache(tmp_path / "profiles.json")
    measured = dataclasses.replace(
        make_profile("k1"),
        measured_at=time.time() - 3 * 3600,
        measured_under={**conditions("cpu:Test CPU:2cores"), "load": "7.90", "pid": "4242"},
    )
    assert measured.provenance() == ""  # measured here: nothing to say
    cache.put(measured)
    hit = cache.get("k1")
    assert hit == measured and hit.cached_from == str(cache.path)
    said = hit.provenance()
    assert f"cached profile from {cache.path}, measured 3.0 h ago (" in said
    assert f"torch {torch.__version__}" in said and "cpu:Test CPU:2cores" in said
    assert f"{torch.get_num_threads()} threads" in said and "load 7.90 then" in said
    assert "by process 4242 on" in said
    assert "--refresh" in said and "HFSWEEP_PROFILE_REFRESH=1" in said
