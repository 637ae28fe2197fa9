"""``offload: auto`` measures the offloaded array with the trainer's ``offload_step``: the host
step, the device step, or (``auto``) both, the faster compared with splitting, so the
offload-or-split choice compares what will run. The measurements are injected (which way each
branch goes, never timings); the real step is checked to step on the device when asked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _offload_toy import ADAMW, SGD, toy_task
from _same_results import members

import hfsweep as hs
from hfsweep.offload import OffloadChoice, OffloadError, state_bytes
from hfsweep.sizing.cache import ProfileCache
from hfsweep.sizing.model import Measurement
from hfsweep.sizing.offloading import profile_offload
from hfsweep.training import _offload_auto


class FakeSteps:
    """``measure_step`` standing in for the timing: member-samples/s on the device
    (``on_device``) and offloaded by optimizer step (``offloaded``: ``{"host": ..., "device":
    ...}``; a step missing from it raises :class:`OffloadError`, as the engine refusing it
    would); no peak. Records ``(size, offload, offload_step)`` of each call."""

    def __init__(self, on_device: float, offloaded: dict[str, float]) -> None:
        self.on_device, self.offloaded = on_device, offloaded
        self.calls: list[tuple[int, bool, str | None]] = []

    def __call__(self, task: Any, config: Any, size: int, **kwargs: Any) -> Measurement:
        offload = bool(kwargs.get("offload", False))
        step = str(kwargs.get("offload_step", "host")) if offload else None
        self.calls.append((size, offload, step))
        if step is not None and step not in self.offloaded:
            raise OffloadError(f"stand-in: the {step} step cannot run this array")
        rate = self.offloaded[step] if step is not None else self.on_device
        return Measurement(size=size, samples_per_s=rate, peak_bytes=0, step_s=size * 24 / rate)


def _budget() -> int:
    task = toy_task()
    member = state_bytes(task.build_model(task.resolve(ADAMW[0])).double())
    return 2 * member + 5  # B' = 2 of B = 3


def _choose(
    fake: FakeSteps,
    step: str,
    monkeypatch: pytest.MonkeyPatch,
    config: dict[str, Any] = ADAMW[0],
    **kwargs: Any,
) -> OffloadChoice:
    monkeypatch.setattr("hfsweep.sizing.timing.measure_step", fake)
    return profile_offload(
        toy_task(),
        config,
        3,
        device_memory=_budget(),
        dtype=torch.float64,
        offload_step=step,
        **kwargs,
    )


def _offloaded_steps(fake: FakeSteps) -> list[str | None]:
    return [step for _, offload, step in fake.calls if offload]


def test_the_offloaded_array_is_measured_with_the_configured_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # offloaded, the device step is faster than splitting, the host step slower
    rates = {"host": 100.0, "device": 300.0}
    host = FakeSteps(200.0, rates)
    assert _choose(host, "host", monkeypatch).mode == "split"
    assert _offloaded_steps(host) == ["host"]
    device = FakeSteps(200.0, rates)
    chose = _choose(device, "device", monkeypatch)
    assert (chose.mode, chose.offloaded_rate) == ("host", 300.0)
    assert _offloaded_steps(device) == ["device"]
    assert "offloaded with the device step, offload_step: device" in chose.reason
    auto = FakeSteps(200.0, rates)  # both measured, the faster compared with splitting
    chose = _choose(auto, "auto", monkeypatch)
    assert (chose.mode, chose.offloaded_rate) == ("host", 300.0)
    assert _offloaded_steps(auto) == ["host", "device"]
    assert "offloaded with the device step, offload_step: auto" in chose.reason
    slow = FakeSteps(200.0, {"host": 250.0, "device": 150.0})  # auto keeps the host step
    chose = _choose(slow, "auto", monkeypatch)
    assert (chose.mode, chose.offloaded_rate) == ("host", 250.0)
    assert "offloaded with the host step" in chose.reason


def test_a_step_that_cannot_run_or_a_clipping_config_is_measured_on_the_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    no_device = FakeSteps(200.0, {"host": 250.0})  # the engine refuses the device step
    chose = _choose(no_device, "auto", monkeypatch)
    assert (chose.mode, chose.offloaded_rate) == ("host", 250.0)
    assert _offloaded_steps(no_device) == ["host", "device"]
    refused = FakeSteps(200.0, {"host": 250.0})  # device alone: it cannot be offloaded
    chose = _choose(refused, "device", monkeypatch)
    assert (chose.mode, chose.offloaded_rate) == ("split", None)
    clips = FakeSteps(200.0, {"host": 100.0, "device": 300.0})  # SGD[0] clips: the host step
    chose = _choose(clips, "auto", monkeypatch, config=SGD[0])
    assert chose.mode == "split" and _offloaded_steps(clips) == ["host"]


def test_each_step_is_cached_under_a_key_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = ProfileCache(tmp_path / "profiles.json")
    rates = {"host": 100.0, "device": 300.0}
    host = _choose(FakeSteps(200.0, rates), "host", monkeypatch, cache=cache)
    device = _choose(FakeSteps(200.0, rates), "device", monkeypatch, cache=cache)
    assert (host.mode, device.mode) == ("split", "host")
    assert len(cache._read()) == 2
    again = FakeSteps(200.0, rates)
    cached = _choose(again, "device", monkeypatch, cache=cache)
    assert cached.mode == "host" and cached.reason.endswith("(cached)") and again.calls == []


def test_the_trainer_asks_for_the_profile_with_its_offload_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked: list[str] = []

    def profiler(task: Any, config: Any, size: int, **kwargs: Any) -> OffloadChoice:
        asked.append(kwargs["offload_step"])
        return OffloadChoice(size, size, kwargs["device_memory"], "none", "stand-in")

    monkeypatch.setattr(_offload_auto, "_PROFILER", [profiler])
    hs.ArrayTrainer(
        toy_task(),
        dtype=torch.float64,
        offload="auto",
        offload_step="device",
        device_memory=_budget(),
    ).run(members(ADAMW))
    assert asked == ["device"]


@pytest.mark.parametrize("step", ["host", "device"])
def test_the_real_step_is_measured_with_the_offload_step(
    step: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hfsweep.sizing import timing as sizing

    stepped: list[bool] = []
    update = sizing.update

    def recorded(opt: Any, sched: Any, **kwargs: Any) -> None:
        stepped.append(bool(kwargs.get("stepped", False)))
        update(opt, sched, **kwargs)

    monkeypatch.setattr(sizing, "update", recorded)
    task = toy_task()
    resolved = task.resolve(ADAMW[0])
    x, y = next(iter(task.build_data(resolved)[0]))
    m = sizing.measure_step(
        task, resolved, 2, device=torch.device("cpu"), dtype=torch.float64,
        batch=(x.double(), y), min_seconds=0.0, min_steps=1, warmup=1, offload=True,
        device_memory=48 * 1024, offload_step=step,
    )  # fmt: skip
    assert m.size == 2 and m.peak_bytes > 0
    assert stepped and set(stepped) == {step == "device"}
