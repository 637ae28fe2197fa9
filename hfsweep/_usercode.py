"""Where an exception raised while an array trained came from, so that it can be reported.

A sweep calls the task's code (``model``, ``data``, the forward pass, the loss, the metrics) in
the middle of its own. When that code raises, the user needs to know which part of *their*
task failed, and the engine needs to know whether the failure belongs to the trials (a bug in
the task: the trials it hit fail and the sweep stops) or to the run's own bookkeeping (a hook,
an array's checkpoint file: the trials stay as they were, for a resume). The trainer wraps
each call into the task's code in :class:`Phase`, which labels an escaping exception with the
phase (the innermost label wins), and its checkpoint reads and writes with :data:`CHECKPOINT`;
the engine labels what escapes its hooks with :data:`HOOK`. The labels are attributes of
the exception object, so they survive pickling (a Ray worker hands its exception to the driver).
"""

from __future__ import annotations

import contextlib
import sys
import traceback
from types import TracebackType

__all__ = [
    "CHECKPOINT",
    "COLLECTIVE",
    "HOOK",
    "NOT_TRAINING",
    "OPTIMIZER_STEP",
    "Phase",
    "describe",
    "format_traceback",
    "keep_traceback",
    "label",
    "phase_of",
    "remote_traceback",
    "unwrap",
]

#: the phase label of an exception raised by one of the engine's hooks (report, refill, finish)
HOOK = "hook"
#: the phase label of an exception raised reading or writing an array's checkpoint (a full
#: disk, a file from another version or refused as unsafe): the run's, not the task's
CHECKPOINT = "the array's checkpoint"
#: the phase label of an exception raised by hfsweep's fused optimizer and schedule step (the
#: task names them, hfsweep's code runs them): an error there is hfsweep's, not the task's
OPTIMIZER_STEP = "the optimizer step"
#: the phase label of an exception raised by a collective of a data-parallel array's workers
#: (an all-reduce or broadcast failing, mostly because another worker left): the machine's
COLLECTIVE = "the workers' collectives"
#: the phases whose exceptions are not the task's training failing: they end the sweep as
#: they are, leaving its trials for a resume
NOT_TRAINING = (HOOK, CHECKPOINT, OPTIMIZER_STEP, COLLECTIVE)
_PHASE = "_hfsweep_phase"
_REMOTE = "_hfsweep_traceback"


class Phase:
    """``with Phase("the loss"):`` labels an exception escaping the block with ``"the loss"``,
    unless an inner block labelled it first. (A class, not a generator: it wraps every
    training step, and costs a fraction of a microsecond.)"""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is not None and isinstance(exc, Exception):
            label(exc, self.name)


def label(exc: BaseException, phase: str) -> None:
    """Give ``exc`` the phase ``phase`` unless it has one."""
    if getattr(exc, _PHASE, None) is None:
        with contextlib.suppress(AttributeError, TypeError):  # a type refusing attributes
            setattr(exc, _PHASE, phase)


def phase_of(exc: BaseException) -> str | None:
    """The phase ``exc`` was raised in (``None`` if no labelled block saw it)."""
    phase = getattr(exc, _PHASE, None)
    return phase if isinstance(phase, str) else None


def keep_traceback(exc: BaseException, text: str) -> None:
    """Remember the traceback of ``exc`` as text where it was raised (a Ray worker): the driver
    re-raises the exception without its frames."""
    with contextlib.suppress(AttributeError, TypeError):
        setattr(exc, _REMOTE, text)


def remote_traceback(exc: BaseException) -> str | None:
    """The traceback text :func:`keep_traceback` stored on ``exc``, if any."""
    text = getattr(exc, _REMOTE, None)
    return text if isinstance(text, str) else None


def unwrap(exc: Exception) -> Exception:
    """The task's exception inside a ``RayTaskError`` (an actor's method raised it; the error's
    text is the worker's traceback, kept with :func:`keep_traceback`), else ``exc``."""
    errors = sys.modules.get("ray.exceptions")
    if errors is not None and isinstance(exc, errors.RayTaskError):
        cause = getattr(exc, "cause", None)
        if isinstance(cause, Exception):
            if remote_traceback(cause) is None:
                keep_traceback(cause, str(exc))
            return cause
    return exc


def describe(exc: BaseException, limit: int = 600) -> str:
    """``exc`` in one line: its type, its message and its notes (the fused array adds the
    submodule that was running), cut at ``limit`` characters."""
    text = " ".join(str(exc).split()) or "(no message)"
    notes = getattr(exc, "__notes__", None) or []
    extra = " ".join(" ".join(str(n).split()) for n in notes)
    line = f"{type(exc).__name__}: {text}" + (f" {extra}" if extra else "")
    return line if len(line) <= limit else line[: limit - 3] + "..."


def format_traceback(exc: BaseException) -> str:
    """The full traceback of ``exc`` (and of the worker it came from, if it came from one)."""
    text = "".join(traceback.format_exception(exc))
    remote = remote_traceback(exc)
    if remote:
        text += "\nThe traceback in the worker that raised it:\n" + remote
    return text
