"""What a data-parallel worker sends its launcher travels as plain data: a file planted in the
scratch folder that holds code is refused without running it, and outcomes and exceptions still
come back whole (no processes here; tests/parallel/test_worker_errors.py runs real workers)."""

from __future__ import annotations

import os
import pickle
import sys
from pathlib import Path

import pytest
import torch

from hfsweep._usercode import phase_of, remote_traceback
from hfsweep.parallel import WorkerRaised
from hfsweep.parallel._launch import _raised
from hfsweep.parallel._sent import load_error, load_outcome, sent_error, sent_outcome
from hfsweep.training import MemberResult


class _Planted:
    """Unpickled, it creates the folder ``marker``: code a full pickle would run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.makedirs, (str(self.marker),)


class BadWidth(ValueError):
    """A task's own exception type."""


class TwoArgs(Exception):
    """A type whose ``__init__`` takes other arguments than its ``args``."""

    def __init__(self, name: str, width: int) -> None:
        super().__init__(f"{name} is {width} wide")


def test_a_planted_pickle_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    torch.save(_Planted(marker), tmp_path / "error-0.pt")
    torch.save(("done", [_Planted(marker)]), tmp_path / "outcome.pt")
    assert _raised(tmp_path, 1) == {}  # the worker's traceback text tells instead
    with pytest.raises(pickle.UnpicklingError):
        load_outcome(tmp_path / "outcome.pt")
    assert not marker.exists()


def test_an_exception_comes_back_as_its_own_type_with_its_phase_and_traceback(
    tmp_path: Path,
) -> None:
    exc = BadWidth("width 16 is not allowed")
    setattr(exc, "_hfsweep_phase", "the model's forward")  # noqa: B010 (as label() sets it)
    torch.save(sent_error(exc, "Traceback ... in forward"), tmp_path / "error-1.pt")
    back = _raised(tmp_path, 2)
    assert list(back) == [1]
    assert type(back[1]) is BadWidth and str(back[1]) == "width 16 is not allowed"
    assert phase_of(back[1]) == "the model's forward"
    assert remote_traceback(back[1]) == "Traceback ... in forward"


@pytest.mark.parametrize(
    "exc",
    [TwoArgs("layer", 3), BadWidth(object()), KeyError("x")],
    ids=["other-init", "not-plain-args", "builtin"],
)
def test_what_is_not_rebuilt_says_what_the_worker_raised(tmp_path: Path, exc: Exception) -> None:
    path = tmp_path / "error-0.pt"
    sent = sent_error(exc, "tb")
    torch.save(sent, path)
    back = load_error(path, 0)
    if isinstance(exc, KeyError):  # a builtin type with plain arguments is rebuilt
        assert type(back) is KeyError and back.args == ("x",)
        return
    assert isinstance(back, WorkerRaised)
    assert str(back) == f"worker 0 raised {sent['type']}: {exc}"
    assert back.type_name == f"{__name__}.{type(exc).__qualname__}"
    assert remote_traceback(back) == "tb"


def test_a_type_of_a_module_not_imported_here_is_not_imported(tmp_path: Path) -> None:
    path = tmp_path / "error-0.pt"
    torch.save({**sent_error(ValueError("v"), "tb"), "type": "this.Fly"}, path)
    back = load_error(path, 3)
    assert isinstance(back, WorkerRaised) and str(back) == "worker 3 raised this.Fly: v"
    assert "this" not in sys.modules  # importing it would print the Zen of Python


def test_an_outcome_comes_back_whole(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, betas=(0.8, 0.9))
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    result = MemberResult(
        id="m0",
        config={"lr": 0.1, "layers": [1, 2], "act": "relu", "dropout": None},
        status="completed",
        steps=7,
        history=[{"step": 7.0, "val_accuracy": 0.5}],
        state={"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": None},
        start_step=3,
    )
    torch.save(sent_outcome(("done", [result])), tmp_path / "outcome.pt")
    kind, [back] = load_outcome(tmp_path / "outcome.pt")
    assert kind == "done" and isinstance(back, MemberResult)
    assert (back.id, back.config, back.steps, back.history, back.start_step) == (
        "m0", result.config, 7, result.history, 3
    )  # fmt: skip
    assert back.state is not None
    torch.testing.assert_close(back.state["model"], model.state_dict())
    assert back.state["optimizer"]["param_groups"] == opt.state_dict()["param_groups"]
    torch.save(sent_outcome(("resize", 3)), tmp_path / "outcome.pt")
    assert load_outcome(tmp_path / "outcome.pt") == ("resize", 3)
