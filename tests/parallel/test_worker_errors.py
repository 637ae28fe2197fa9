"""A data-parallel worker whose task code raises: the caller gets the task's own exception (its
type, message, phase label and the worker's traceback text), as with one worker, not a wrapper;
gloo on CPU, two forked workers."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _dp_tasks import Net, data
from torch import nn

import hfsweep as hs
from hfsweep._usercode import phase_of, remote_traceback
from hfsweep.parallel import WorkerError, train_data_parallel


class BadWidth(ValueError):
    """The task's own exception type (not a builtin), raised in a forward."""


class FailingNet(Net):
    """Raises :class:`BadWidth` in its third forward in the worker of rank ``rank`` (every
    worker when ``rank`` is None)."""

    def __init__(self, rank: int | None) -> None:
        super().__init__(bn=False)
        self.rank, self.calls = rank, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        me = dist.get_rank() if dist.is_initialized() else 0
        if self.calls == 3 and self.rank in (None, me):
            raise BadWidth(f"width 16 is not allowed on rank {me}")
        return super().forward(x)


def _model(config: Mapping[str, Any]) -> nn.Module:
    return FailingNet(config["fail_rank"])


def _task() -> hs.Task:
    return hs.Task(
        name="dp_failing",
        model=_model,
        data=data,
        defaults={"batch_size": 31, "epochs": 1, "bn": False, "kill_after": None, "fail_rank": 1},
    )


@pytest.mark.slow
@pytest.mark.parametrize("fail_rank", [1, None])
def test_a_worker_that_raises_surfaces_the_tasks_exception(
    tmp_path: Path, fail_rank: int | None
) -> None:
    members = [hs.Member(f"m{i}", {"lr": 0.1, "seed": i, "fail_rank": fail_rank}) for i in range(2)]
    with pytest.raises(BadWidth) as info:
        train_data_parallel(
            _task(), members, workers=2, checkpoint_dir=tmp_path / "dp", eval_every=3, timeout_s=20
        )
    exc = info.value
    rank = 1 if fail_rank == 1 else 0
    assert str(exc) == f"width 16 is not allowed on rank {rank}"
    assert phase_of(exc) is not None  # the engine fails the trials as with one worker
    text = remote_traceback(exc)
    assert text is not None and "in forward" in text and "BadWidth" in text
    assert isinstance(exc.__cause__, WorkerError)  # every failed worker's traceback
    assert "width 16 is not allowed" in str(exc.__cause__)


def test_the_exception_raised_is_the_tasks_not_a_broken_collectives() -> None:
    """Which worker's exception is raised (no processes): a training phase's first, then one
    with no phase, and a WorkerError when only collectives failed (the worker that left did not
    send its own back)."""
    from hfsweep._usercode import COLLECTIVE, label
    from hfsweep.parallel._launch import raise_worker_error

    def labelled(exc: Exception, phase: str | None) -> Exception:
        if phase is not None:
            label(exc, phase)
        return exc

    broken = labelled(RuntimeError("Connection closed by peer"), COLLECTIVE)
    task = labelled(BadWidth("width 16"), "the model's forward")
    other = KeyError("x")
    with pytest.raises(BadWidth):
        raise_worker_error("m", {0: broken, 1: other, 2: task})
    with pytest.raises(KeyError):
        raise_worker_error("m", {0: broken, 1: other})
    with pytest.raises(WorkerError, match="every traceback"):
        raise_worker_error("every traceback", {0: broken})
    with pytest.raises(WorkerError):
        raise_worker_error("no exception came back", {})
