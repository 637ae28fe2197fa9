"""The executor seam: both executors implement :class:`hfsweep.executors.Executor`, and the
engine drives any executor through that interface alone."""

from __future__ import annotations

import dataclasses
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import hfsweep as hs
from hfsweep.core import _backend
from hfsweep.executors import ArrayHooks, Executor, LocalExecutor, RayExecutor


def test_the_local_and_ray_executors_implement_the_base() -> None:
    assert issubclass(LocalExecutor, Executor) and issubclass(RayExecutor, Executor)
    assert Executor.__abstractmethods__ == {"slots", "array_size", "run_array", "close"}


def test_an_executor_missing_a_method_cannot_be_made() -> None:
    class NoClose(Executor):
        slots = 1  # type: ignore[assignment]

        def array_size(self, config: Any) -> tuple[int, str]:
            return 1, "one"

        def run_array(
            self, checkpoint_dir: Any, members: Any, hooks: ArrayHooks, *, resume: bool
        ) -> None:
            pass

    with pytest.raises(TypeError, match="close"):
        NoClose()  # type: ignore[abstract]


class _Recording(Executor):
    """A third executor: trains through a local one, checks the contract's hook rules and
    records what it saw."""

    slots = 1  # type: ignore[assignment]

    def __init__(self, inner: LocalExecutor) -> None:
        self.inner = inner
        self.device = inner.device
        self.finished: Counter[str] = Counter()
        self.stopped: set[str] = set()
        self.closed = 0

    def array_size(self, config: Any) -> tuple[int, str]:
        return self.inner.array_size(config)

    def run_array(
        self, checkpoint_dir: Any, members: Any, hooks: ArrayHooks, *, resume: bool
    ) -> None:
        caller = threading.get_ident()
        report, on_finish = hooks.report, hooks.on_finish

        def reporting(evaluations: Any) -> Any:
            assert threading.get_ident() == caller
            answer = report(evaluations)
            self.stopped |= {m for m, go in (answer or {}).items() if not go}
            return answer

        def finishing(result: Any) -> None:
            assert threading.get_ident() == caller
            self.finished[result.id] += 1
            on_finish(result)

        hooks = dataclasses.replace(hooks, report=reporting, on_finish=finishing)
        self.inner.run_array(checkpoint_dir, members, hooks, resume=resume)

    def close(self) -> None:
        self.closed += 1
        self.inner.close()


def test_the_engine_drives_a_third_executor_through_the_base(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sweep._toy import sweep_config

    made: list[_Recording] = []

    def recording(*args: Any, **kwargs: Any) -> _Recording:
        made.append(_Recording(LocalExecutor(*args, **kwargs)))
        return made[-1]

    monkeypatch.setattr(_backend, "LocalExecutor", recording)
    asha = {"name": "asha", "options": {"grace_period": 1, "reduction_factor": 2}}
    result = hs.sweep(
        sweep_config(tmp_path / "run", scheduler=asha, budget={"trials": 6, "epochs": 3}),
        progress=False,
    )
    (executor,) = made
    assert executor.finished == Counter({f"trial-{n}": 1 for n in range(6)})
    assert executor.stopped and result.counts["stopped"] == len(executor.stopped)
    assert executor.closed == 1
