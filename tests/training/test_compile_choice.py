"""``compile: auto``: the choice between the eager and the compiled fused step from injected
timings (never real ones), its place in the profile cache, and the executor following it."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from hfsweep.executors import ArrayHooks
from hfsweep.profiler import (
    CompileChoice,
    Measurement,
    MemoryModel,
    Profile,
    ProfileCache,
    choose_compile,
)
from hfsweep.settings import YAML, ArraySettings, array_settings
from hfsweep.sizing import task as sizing_task


def test_a_faster_compiled_step_wins_once_it_pays_for_its_compile_time() -> None:
    # 10 ms -> 6 ms per step saves 4 s over 1000 steps: a 3 s compile pays, a 5 s one does not
    pays = choose_compile(8, 0.010, 0.006, 3.0, horizon_steps=1000)
    assert pays.compiled and "saves 1 s over 1000 steps" in pays.reason
    late = choose_compile(8, 0.010, 0.006, 5.0, horizon_steps=1000)
    assert not late.compiled and "does not pay back within 1000 steps" in late.reason
    assert choose_compile(8, 0.010, 0.006, 5.0, horizon_steps=10_000).compiled


def test_a_slower_compiled_step_never_wins() -> None:
    choice = choose_compile(4, 0.010, 0.011, 0.0, horizon_steps=10**9)
    assert not choice.compiled and "not faster" in choice.reason
    assert not choose_compile(4, 0.010, 0.010, 0.0).compiled  # a tie stays eager


def test_bad_timings_are_refused() -> None:
    with pytest.raises(ValueError, match="compile_s"):
        choose_compile(4, 0.01, 0.005, -1.0)
    with pytest.raises(ValueError, match="horizon_steps"):
        choose_compile(4, 0.01, 0.005, 1.0, horizon_steps=0)


def _profile(compile: CompileChoice | None) -> Profile:
    return Profile(
        key="k",
        device="cpu",
        batch_size=4,
        dtype="float32",
        measurements=(Measurement(1, 100.0, 10, 0.04), Measurement(2, 180.0, 20, 0.044)),
        memory=MemoryModel(0.0, 10.0),
        budget_bytes=1e9,
        chosen=2,
        reason="r",
        compile=compile,
    )


def test_the_choice_is_stored_with_the_profile(tmp_path: Path) -> None:
    cache = ProfileCache(tmp_path / "profiles.json")
    choice = choose_compile(2, 0.044, 0.02, 1.0)
    cache.put(_profile(choice))
    assert cache.get("k") == _profile(choice)
    assert "compiled: saves" in _profile(choice).table()
    cache.put(_profile(None))  # a profile without the choice reads back without it
    assert cache.get("k") == _profile(None)


def test_profile_task_measures_compiled_at_the_chosen_size_and_caches_the_choice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Injected step times: eager at B=1, 2 from profile_sizes, compiled 3x faster with a first
    step of 2.5 s; a second call finds the choice in the cache and measures nothing."""
    from _tasks import make_task

    calls: list[tuple[int, bool]] = []

    def fake_measure_step(task: Any, config: Any, size: int, **kw: Any) -> Measurement:
        compiled = kw.get("compile", False) is True
        calls.append((size, compiled))
        step_s = 0.01 * size / (3 if compiled else 1) + 0.001
        if kw.get("first_step") is not None:
            kw["first_step"].append(2.5 + step_s)
        return Measurement(size, size * 32 / step_s, 1000 * size, step_s)

    monkeypatch.setattr("hfsweep.sizing.timing.measure_step", fake_measure_step)
    cache = ProfileCache(tmp_path / "p.json")
    task = make_task()
    profile = sizing_task.profile_task(
        task, sizes=[1, 2], cache=cache, compare_compiled=True, compile_horizon_steps=1000
    )
    assert calls == [(1, False), (2, False), (profile.chosen, True)]
    assert profile.compile is not None and profile.compile.compiled
    assert profile.compile.compile_s == pytest.approx(2.5)
    calls.clear()
    again = sizing_task.profile_task(task, sizes=[1, 2], cache=cache, compare_compiled=True)
    assert calls == [] and again.compile == profile.compile
    # a cached profile taken without the choice gets it measured once
    stored = cache.get(profile.key)
    assert stored is not None
    cache.put(dataclasses.replace(stored, compile=None))
    third = sizing_task.profile_task(task, sizes=[1, 2], cache=cache, compare_compiled=True)
    assert calls == [(profile.chosen, True)] and third.compile is not None
    assert cache.get(profile.key).compile is not None  # type: ignore[union-attr]


def test_the_local_executor_trains_as_the_profile_chose(monkeypatch: pytest.MonkeyPatch) -> None:
    from _tasks import make_task

    from hfsweep.executors import local

    task = make_task()
    made: list[Any] = []

    def fake_profile(*args: Any, **kw: Any) -> Profile:
        assert kw["compare_compiled"] is True
        return _profile(choose_compile(2, 0.044, 0.01, 1.0))

    class Trainer:
        def __init__(self, *args: Any, **kw: Any) -> None:
            made.append(kw["compile"])

        @classmethod
        def from_settings(cls, task: Any, settings: Any, **kw: Any) -> Trainer:
            return cls(task, compile=settings.compile, **kw)

        def run(self, *args: Any, **kw: Any) -> None:
            pass

    monkeypatch.setattr(sizing_task, "profile_task", fake_profile)
    monkeypatch.setattr(local, "ArrayTrainer", Trainer)
    executor = local.LocalExecutor(task, arrays=ArraySettings(device="cpu", compile="auto"))
    assert executor.array_size({}) == (2, "r")
    member = type("M", (), {"config": {}})()
    hooks = ArrayHooks(report=None, refill=None, on_finish=None)  # type: ignore[arg-type]
    executor.run_array("d", [member], hooks, resume=False)  # type: ignore[arg-type]
    assert made == [True]
    with pytest.raises(ValueError, match=r"fusion\.compile: 'sometimes' is not valid"):
        array_settings({"compile": "sometimes"}, YAML)
