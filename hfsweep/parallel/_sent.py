"""What a data-parallel worker process sends its launcher, as plain data that loads with
``torch.load(weights_only=True)``.

A worker writes its outcome (the members' results, or a resize) and, when it raises, its
exception to files in the launch's scratch folder. Loading a full pickle from there would run
whatever code the file names; plain data (tensors, numbers, strings, lists, tuples, dicts)
runs none. So an outcome travels as dicts of :class:`~hfsweep.training.MemberResult`'s fields,
and an exception as its type's name, its arguments (when they are plain), its message, its
phase label and its traceback text. The launcher rebuilds the exception as the task's own type
only where that type is an ``Exception`` of a module already imported in the launcher and takes
those arguments back (as unpickling did); else it raises :class:`WorkerRaised`, which names
the worker's type and message. Either way it keeps the phase label (the engine fails the trials
as with one worker) and the worker's traceback text.
"""

from __future__ import annotations

import dataclasses
import pickle
import sys
from pathlib import Path
from typing import Any

import torch

from .._usercode import keep_traceback, label, phase_of
from ..training import MemberResult

__all__ = ["WorkerRaised", "load_error", "load_outcome", "sent_error", "sent_outcome"]


class WorkerRaised(RuntimeError):
    """A data-parallel worker raised an exception that the launcher does not rebuild as its
    own type (a type not imported here, or one whose arguments are not plain data); the
    message names the worker's type and message."""

    def __init__(self, message: str, type_name: str = "") -> None:
        super().__init__(message)
        self.type_name = type_name


def _plain(value: object) -> bool:
    """Whether ``value`` is plain data: None, a bool, number or string, or a list, tuple or
    dict (string keys) of plain data."""
    if value is None or isinstance(value, bool | int | float | str):
        return True
    if isinstance(value, list | tuple):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return False


# ---------------------------------------------------------------------------- outcomes
def sent_outcome(outcome: tuple[str, Any]) -> dict[str, Any]:
    """A worker's outcome (``("done", [MemberResult...])`` or ``("resize", workers)``) as plain
    data."""
    kind, value = outcome
    if kind == "done":
        results = [{f.name: getattr(r, f.name) for f in dataclasses.fields(r)} for r in value]
        return {"kind": "done", "results": results}
    return {"kind": kind, "value": value}


def load_outcome(path: Path) -> tuple[str, Any]:
    """The outcome a worker wrote to ``path`` with :func:`sent_outcome`. Loads plain data only:
    a file holding anything else (code to run, an object of some class) raises
    ``pickle.UnpicklingError`` without running any of it."""
    sent = torch.load(path, weights_only=True)
    if not isinstance(sent, dict) or sent.get("kind") not in ("done", "resize"):
        raise pickle.UnpicklingError(f"{path} holds no worker outcome")
    if sent["kind"] == "done":
        return "done", [MemberResult(**fields) for fields in sent["results"]]
    return "resize", int(sent["value"])


# ---------------------------------------------------------------------------- exceptions
def sent_error(exc: BaseException, text: str) -> dict[str, Any]:
    """``exc`` (with ``text``, its traceback) as plain data."""
    kind = type(exc)
    args = list(exc.args) if _plain(list(exc.args)) else None
    return {
        "type": f"{kind.__module__}.{kind.__qualname__}",
        "args": args,
        "message": str(exc),
        "phase": phase_of(exc),
        "traceback": text,
    }


def _imported(type_name: str) -> type[Exception] | None:
    """The ``Exception`` subclass named ``module.qualname`` where ``module`` is already
    imported here (nothing is imported for it), else None."""
    parts = type_name.split(".")
    for cut in range(len(parts) - 1, 0, -1):  # the longest module name first
        module = sys.modules.get(".".join(parts[:cut]))
        if module is None:
            continue
        found: object = module
        for part in parts[cut:]:
            found = getattr(found, part, None)
        if isinstance(found, type) and issubclass(found, Exception):
            return found
        return None
    return None


def load_error(path: Path, rank: int) -> Exception:
    """The exception worker ``rank`` wrote to ``path`` with :func:`sent_error`: its own type
    where :func:`_imported` finds it and its arguments rebuild it, else :class:`WorkerRaised`;
    with its phase label and traceback text. Loads plain data only (see
    :func:`load_outcome`)."""
    sent = torch.load(path, weights_only=True)
    if not isinstance(sent, dict) or not isinstance(sent.get("type"), str):
        raise pickle.UnpicklingError(f"{path} holds no worker exception")
    type_name, message = sent["type"], str(sent.get("message", ""))
    kind = _imported(type_name)
    exc: Exception | None = None
    if kind is not None and isinstance(sent.get("args"), list):
        try:
            exc = kind(*sent["args"])
        except Exception:  # a type whose __init__ takes other arguments than its args
            exc = None
    if exc is None:
        exc = WorkerRaised(f"worker {rank} raised {type_name}: {message}", type_name)
    if isinstance(sent.get("phase"), str):
        label(exc, sent["phase"])
    if isinstance(sent.get("traceback"), str):
        keep_traceback(exc, sent["traceback"])
    return exc
