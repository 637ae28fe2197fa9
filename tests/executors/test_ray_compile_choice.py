"""``fusion.compile`` on the Ray backend, with Ray stood in for: the actors are in-process
:class:`~hfsweep.executors._worker.ArrayWorker` objects behind a scripted pool, ``ray.get``
runs the call, the profile is injected and the trainer records the ``compile=`` it is built
with. What is checked is the executor's own bookkeeping: with ``compile: auto`` the profiler's
choice travels from the actor that profiled the key to the actor that trains it, and to the
one that restarts the array after that actor died (with no member left to look its key up
by); ``true`` reaches every worker's trainer; the log line says how each array trains."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from sweep._toy import TASK

from hfsweep.config import RayConfig
from hfsweep.executors import ArrayHooks, RayExecutor
from hfsweep.executors import local as local_module
from hfsweep.executors._worker import ArrayWorker
from hfsweep.profiler import Measurement, MemoryModel, Profile, choose_compile
from hfsweep.settings import YAML, ArraySettings, array_settings
from hfsweep.sizing import task as sizing_task
from hfsweep.training import Member

ray = pytest.importorskip("ray")
from ray.exceptions import RayActorError  # noqa: E402

_CONFIG = {"hidden": 8, "batch_size": 32, "epochs": 1, "data_seed": 0}


class _Method:
    """``actor.method.remote(...)``: a call ``ray.get`` (stood in for) runs, or raises
    :class:`RayActorError` once the actor is dead."""

    def __init__(self, actor: _Actor, fn: Callable[..., Any]) -> None:
        self._actor, self._fn = actor, fn

    def remote(self, *args: Any) -> Callable[[], Any]:
        def call() -> Any:
            if self._actor.dead:
                raise RayActorError()
            value = self._fn(*args)
            if self._actor.dies_after_start:  # its process died while training
                self._actor.dead = True
                raise RayActorError()
            return value

        return call


class _Actor:
    """An :class:`ArrayWorker` of its own in this process, named for the log."""

    def __init__(self, name: str, compile: bool | str, *, dies_after_start: bool = False) -> None:
        self.name = name
        self.dead = False
        self.dies_after_start = False
        self.worker = ArrayWorker(
            TASK,
            arrays=ArraySettings(device="cpu", compile=compile),  # type: ignore[arg-type]
            threads=torch.get_num_threads(),
        )
        self.array_size = _Method(self, self.worker.array_size)
        self.reply = _Method(self, self.worker.reply)
        self.start = _Method(self, self._start)
        self._dies = dies_after_start

    def _start(self, *args: Any) -> Any:
        self.dies_after_start = self._dies
        return self.worker.start(*args)


class _Pool:
    """The actor pool, scripted: ``acquire`` hands out ``actors`` in order."""

    def __init__(self, actors: list[_Actor]) -> None:
        self._actors: Iterator[_Actor] = iter(actors)
        self.released: list[tuple[str, bool]] = []

    def acquire(self, ready: Any) -> _Actor:
        return next(self._actors)

    def release(self, actor: _Actor, *, dead: bool = False) -> None:
        self.released.append((actor.name, dead))

    def where(self, actor: _Actor) -> str:
        return actor.name

    def close(self) -> None:
        pass


class _Executor(RayExecutor):
    """A :class:`RayExecutor` on the scripted pool, joining no Ray."""

    pool: _Pool

    def _setup(self, task: Any, device: str, settings: RayConfig) -> None:
        self.cpus_per_array, self.gpus_per_array = 1.0, 0.0
        self._pool = self.pool  # type: ignore[assignment]


def _profile(compiled: bool) -> Profile:
    step = (0.044, 0.01) if compiled else (0.01, 0.044)
    return Profile(
        key="k",
        device="cpu",
        batch_size=32,
        dtype="float32",
        measurements=(Measurement(2, 100.0, 10, 0.04),),
        memory=MemoryModel(0.0, 10.0),
        budget_bytes=1e9,
        chosen=2,
        reason="r",
        compile=choose_compile(2, *step, 1.0),
    )


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any]]:
    """The ``(folder, compile)`` of every trainer the workers build, which trains nothing;
    profiles chose to compile; Ray is stood in for."""
    made: list[tuple[str, Any]] = []

    class Trainer:
        def __init__(self, *args: Any, **kw: Any) -> None:
            made.append((str(kw["checkpoint_dir"]), kw["compile"]))

        @classmethod
        def from_settings(cls, task: Any, settings: Any, **kw: Any) -> Trainer:
            return cls(task, compile=settings.compile, **kw)

        def run(self, *args: Any, **kw: Any) -> None:
            pass

    monkeypatch.setattr(local_module, "ArrayTrainer", Trainer)
    monkeypatch.setattr(sizing_task, "profile_task", lambda *a, **kw: _profile(True))
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "get", lambda ref: ref())
    return made


def _executor(compile: bool | str, actors: list[_Actor]) -> _Executor:
    _Executor.pool = _Pool(actors)
    return _Executor(
        TASK,
        arrays=ArraySettings(device="cpu", compile=compile),  # type: ignore[arg-type]
        settings=RayConfig(max_failures=2),
    )


def _hooks() -> ArrayHooks:
    return ArrayHooks(report=lambda e: None, refill=lambda: None, on_finish=lambda r: None)


def test_the_profilers_choice_trains_on_another_actor_and_over_a_restart(
    built: list[tuple[str, Any]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    profiling = _Actor("actor-a", "auto")
    training = _Actor("actor-b", "auto", dies_after_start=True)
    restarted = _Actor("actor-c", "auto")
    executor = _executor("auto", [profiling, training, restarted])
    assert executor.array_size(_CONFIG) == (2, "r")
    # only the profiling actor holds the choice itself
    assert profiling.worker.local.compile_choice(_CONFIG) is True
    assert training.worker.local.compile_choice(_CONFIG) is None
    assert restarted.worker.local.compile_choice(_CONFIG) is None
    # b dies while training; its checkpoint holds the member, so c restarts with none
    monkeypatch.setattr(
        "hfsweep.executors._ray.ArrayTrainer.checkpointed_members", lambda folder: {"trial-0"}
    )
    folder = str(tmp_path / "array-0")
    with caplog.at_level(logging.INFO, logger="hfsweep.ray"):
        executor.run_array(folder, [Member("trial-0", dict(_CONFIG))], _hooks(), resume=False)
    assert built == [(folder, True), (folder, True)]  # b, then c after b died
    assert executor._pool.released == [  # type: ignore[attr-defined]
        ("actor-a", False),
        ("actor-b", True),
        ("actor-c", False),
    ]
    lines = [r.getMessage() for r in caplog.records if "trains on" in r.getMessage()]
    assert lines == [
        f"{folder} trains on {name}, compiled (compile: auto, as profiled)"
        for name in ("actor-b", "actor-c")
    ]


def test_a_key_profiled_as_eager_trains_eager_and_one_never_profiled_uncompiled(
    built: list[tuple[str, Any]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(sizing_task, "profile_task", lambda *a, **kw: _profile(False))
    executor = _executor("auto", [_Actor(n, "auto") for n in ("a", "b", "c")])
    executor.array_size(_CONFIG)
    other = {**_CONFIG, "hidden": 16}  # another key: a fixed size would never profile it
    with caplog.at_level(logging.INFO, logger="hfsweep.ray"):
        executor.run_array("eager", [Member("trial-0", dict(_CONFIG))], _hooks(), resume=False)
        executor.run_array("never", [Member("trial-1", other)], _hooks(), resume=False)
    assert built == [("eager", False), ("never", False)]
    text = caplog.text
    assert "eager trains on b, uncompiled (compile: auto, as profiled)" in text
    assert "never trains on c, uncompiled (compile: auto, no profile taken for its key)" in text


def test_compile_true_reaches_every_workers_trainer(
    built: list[tuple[str, Any]], caplog: pytest.LogCaptureFixture
) -> None:
    executor = _executor(True, [_Actor("a", True)])
    with caplog.at_level(logging.INFO, logger="hfsweep.ray"):
        executor.run_array("d", [Member("trial-0", dict(_CONFIG))], _hooks(), resume=False)
    assert built == [("d", True)]
    assert "d trains on a, compiled (compile: true)" in caplog.text


def test_the_actors_are_made_with_compile_and_say_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """The actor class gets ``compile`` from the executor; its ``where`` names it."""

    class Context:
        def get_node_id(self) -> str:
            return "n1"

    monkeypatch.setattr(ray, "get_runtime_context", lambda: Context())
    worker = _Actor("a", "auto").worker
    assert worker.local.compile == "auto"
    assert "cpu (compile: auto) node n1" in worker.where()
    assert "compile" not in _Actor("b", False).worker.where()


def test_compile_with_offload_is_refused(built: list[Any]) -> None:
    with pytest.raises(ValueError, match=r"fusion\.compile: True together with offload: host"):
        array_settings({"offload": "host", "compile": True}, YAML)


def test_an_elastic_array_is_launched_with_the_profilers_choice(
    built: list[tuple[str, Any]], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``ray.elastic``: the data-parallel launcher gets the choice the profiling actor made in
    its trainer options, which every launch and relaunch of the array builds its workers'
    trainers from."""
    from hfsweep.config.schema import ElasticConfig
    from hfsweep.executors import _ray as ray_module

    launched: list[dict[str, Any]] = []
    monkeypatch.setattr(
        ray_module, "run_elastic_array", lambda *a, **kw: launched.append(kw["options"])
    )
    _Executor.pool = _Pool([_Actor("a", "auto")])
    executor = _Executor(
        TASK,
        arrays=ArraySettings(device="cpu", compile="auto"),
        settings=RayConfig(elastic=ElasticConfig(enabled=True)),
    )
    executor.policy = object()  # type: ignore[assignment]
    monkeypatch.setattr(executor._pool, "fit", lambda: 2, raising=False)
    executor.array_size(_CONFIG)
    with caplog.at_level(logging.INFO, logger="hfsweep.ray"):
        executor.run_array("dp", [Member("trial-0", dict(_CONFIG))], _hooks(), resume=False)
    assert [options["compile"] for options in launched] == [True]
    assert "dp trains data-parallel, compiled (compile: auto, as profiled)" in caplog.text
