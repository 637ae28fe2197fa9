"""What a sweep returns and raises: :class:`SweepResult`, :class:`SweepError` and
:class:`TrainingError` (``hs.SweepResult``, ``hs.SweepError``, ``hs.TrainingError``)."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .._errors import SweepError
from .._usercode import NOT_TRAINING, OPTIMIZER_STEP, describe, phase_of, unwrap
from ..training.task import TaskError
from ._progress import _counted
from .status import FINAL, Status

if TYPE_CHECKING:
    import optuna

__all__ = ["StatusCounts", "SweepError", "SweepResult", "TrainingError"]


class TrainingError(SweepError):
    """Training stopped because code raised while an array trained (or while the profiler
    measured one): almost always the task's code (its model's forward, its loss, its data),
    which would fail every trial alike.

    The trials that array held and every other unfinished trial are marked ``FAIL`` in the
    study, the reason in their user attr ``error``; no trial is left ``RUNNING``. The exception
    that stopped the sweep is the ``__cause__``; the message names the array, the part of the
    task that failed (the forward pass, the loss, ...) and, for a forward pass, the submodule.
    """


class RunDirUnwritable(SweepError):
    """The run directory could not be written (a full disk, a read-only file system, no
    permission) while the sweep ran: it stopped, resumable once that is fixed."""


class _Failed(SweepError):
    """An array's training (or a profile) raised: ``where`` it happened, the exception, and the
    array's index (``None`` for a profile). The engine turns it into :class:`TrainingError`
    (should one escape, it still reads as a sweep error)."""

    def __init__(self, where: str, exc: Exception, array: int | None = None) -> None:
        super().__init__(f"{where} raised {describe(exc)}")
        self.where = where
        self.exc = exc
        self.array = array


class StatusCounts(dict[Status, int]):
    """A sweep's trials counted by :class:`~hfsweep.core.status.Status` (a plain ``dict`` whose
    keys are ``Status`` members, so ``counts["completed"]`` and ``counts[Status.COMPLETED]``
    read the same entry, and ``counts == {"completed": 8, ...}`` compares as a dict does).

    Looking up an Optuna state name (``"COMPLETE"``, ``"PRUNED"``, ``"FAIL"``, ``"RUNNING"``),
    the keys of :attr:`SweepResult.counts` before the one status vocabulary, reads the count of
    its status and warns (``DeprecationWarning``): code written for those keys keeps working.
    """

    def __missing__(self, key: object) -> int:
        status = self._translated(key)
        if status is None:
            raise KeyError(key)
        return dict.get(self, status, 0)

    def get(self, key: Any, default: Any = None) -> Any:
        """The count of ``key`` (a status, its value or a deprecated Optuna state name), else
        ``default``."""
        status = key if key in self.keys() else self._translated(key)
        return super().get(status, default) if status is not None else default

    @staticmethod
    def _translated(key: object) -> Status | None:
        """The status an Optuna state name ``key`` stands for (warning that it is deprecated),
        or ``None`` for any other key."""
        if not isinstance(key, str) or key in {s.value for s in Status}:
            return None
        try:
            status = Status.parse(key)
        except ValueError:
            return None
        warnings.warn(
            f"SweepResult.counts[{key!r}]: counts are keyed by status now; use "
            f"counts[{status.value!r}] (Optuna's state names are deprecated here)",
            DeprecationWarning,
            stacklevel=3,
        )
        return status


@dataclass
class SweepResult:
    """What a finished (or interrupted) sweep produced.

    ``study`` is the Optuna study (every trial with its params, intermediate values, state and
    user attrs ``array``, ``status``, ``steps``); ``best_*`` describe the best completed trial
    (``None``/empty when none completed); ``counts`` the trials by
    :class:`~hfsweep.core.status.Status` (``completed``, ``stopped``, ``failed``, ``running``:
    a ``Status`` is a ``str`` equal to its value, so ``counts["completed"]`` reads it). An
    Optuna state name (``counts["COMPLETE"]``, hfsweep 0.x's keys) still reads the same count,
    with a ``DeprecationWarning``.
    """

    run_dir: Path
    study: optuna.Study
    metric: str
    mode: str
    best_trial: optuna.trial.FrozenTrial | None
    best_value: float | None
    best_params: dict[str, Any]
    best_config: dict[str, Any]
    counts: StatusCounts
    wall_s: float
    arrays: int
    best_checkpoint: Path | None = None
    top: list[optuna.trial.FrozenTrial] = field(default_factory=list)
    #: with elastic arrays (``ray.elastic.enabled``), the allocator's totals as in
    #: ``elastic.json`` (``arrays_waited_s``, ``workers_idle_s``, ``plans``, ``workers``)
    elastic: dict[str, Any] | None = None

    def summary(self, top: int = 5) -> str:
        """The end-of-sweep report: counts, the best trial and a table of the top trials."""
        c = self.counts
        done = sum(c.get(s, 0) for s in FINAL)
        running = c.get(Status.RUNNING, 0)
        lines = [
            f"Sweep finished in {self.wall_s:.1f} s: {done} trials ({_counted(c)}) in "
            f"{self.arrays} fused array(s)" + (f", {running} still running" if running else "")
        ]
        failed = [
            t
            for t in self.study.get_trials(deepcopy=False)
            if Status.of_trial_state(t.state) is Status.FAILED
        ]
        if failed:
            reasons = Counter(str(t.user_attrs.get("error", "no error recorded")) for t in failed)
            shown = "; ".join(f"{n} x {why}" for why, n in reasons.most_common(2))
            more = f"; {len(reasons) - 2} other reasons" if len(reasons) > 2 else ""
            lines.append(f"Failed: {shown}{more} (trials.csv, column user_attrs_error)")
        if self.best_trial is None:
            lines.append("No trial completed, so there is no best trial.")
        else:
            lines.append(
                f"Best {self.metric}: {self.best_value:.6g} (trial {self.best_trial.number})"
            )
            lines.append(
                "Best params: " + ", ".join(f"{k}={_fmt(v)}" for k, v in self.best_params.items())
            )
            rows = self.top[:top]
            names = sorted({p for t in rows for p in t.params})
            header = ["trial", self.metric, *names]
            table = [header] + [
                [str(t.number), _fmt(t.value), *(_fmt(t.params.get(n, "")) for n in names)]
                for t in rows
            ]
            widths = [max(len(r[i]) for r in table) for i in range(len(header))]
            lines.append(f"Top {len(rows)} completed trials:")
            lines += [
                "  " + "  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) for r in table
            ]
        files = "trials.csv, best.json, histories/, checkpoints/"
        if self.elastic is not None:
            e = self.elastic
            lines.append(
                f"Elastic arrays: {e['plans']} allocator plans; arrays waited "
                f"{e['arrays_waited_s']:.0f} s, workers idle {e['workers_idle_s']:.0f} s "
                "(summed over arrays and over workers, as the plans left them)"
            )
            files += ", elastic.json"
        lines.append(f"Run directory: {self.run_dir} ({files})")
        return "\n".join(lines)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


#: errors of a disk or file system rather than of a program: no space, no quota, read-only, no
#: permission, an I/O error
_DISK_ERRORS = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO}
)


#: what torch.save's writer says when a write of the file under it failed: it raises a
#: RuntimeError, the OSError of the failed write (a full disk) being only its ``__context__``
#: ("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598", or "...
#: PytorchStreamWriter failed writing file data/0: file write failed" writing to a path)
_TORCH_WRITE_FAILED = ("PytorchStreamWriter failed writing file", "unexpected pos")
#: free bytes under which a run directory whose torch.save failed (with no OSError to say
#: why) is taken to be on a full disk
_NEARLY_FULL = 1 << 20


def _torch_write_failed(exc: BaseException, folder: Path) -> OSError | None:
    """The disk error behind ``exc`` when it is torch.save's ``RuntimeError`` for a write that
    failed: the ``OSError`` of the disk (:data:`_DISK_ERRORS`) in its chain of causes, else
    (a writer that kept no cause) an ``ENOSPC`` when ``folder``'s file system has less than
    :data:`_NEARLY_FULL` bytes free. ``None`` for any other error: only torch's writer's
    messages are recognised, so that no bug is read as a full disk."""
    if isinstance(exc, Exception):
        exc = unwrap(exc)  # a Ray worker's, raised on the driver
    if not isinstance(exc, RuntimeError):
        return None
    text = str(exc)
    if not any(m in text for m in _TORCH_WRITE_FAILED) or "inline_container" not in text:
        return None
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        if isinstance(link, OSError) and link.errno in _DISK_ERRORS:
            return link
        link = link.__cause__ or link.__context__
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return None
    if free >= _NEARLY_FULL:
        return None
    why = f"{os.strerror(errno.ENOSPC)} ({free} bytes free)"
    return OSError(errno.ENOSPC, why, str(folder))


def _raised_by_the_task(exc: Exception) -> bool:
    """Whether ``exc`` came from the task's code: a phase of its training (its model's forward,
    its loss, its data...) labels it. Only such an error stops the sweep with its trials
    ``FAIL`` (the same code would fail every array); so does a :class:`TaskError`, hfsweep's word
    that what the task gave is wrong. An error with no phase, or the engine's
    own (its hooks, the checkpoint's files, the fused optimizer step), is hfsweep's or the
    machine's: it propagates as it is, leaving the trials ``RUNNING`` for ``--resume``, as after
    a crash. Running out of memory in the optimizer step (its state is allocated at the first
    step) is the array's size, not a bug: it stops the sweep as the task's errors do."""
    inner = unwrap(exc)
    if isinstance(inner, TaskError):  # what the task gave is wrong (empty data...)
        return True
    phase = phase_of(exc) or phase_of(inner)
    if phase == OPTIMIZER_STEP:
        return isinstance(inner, torch.OutOfMemoryError)
    return phase is not None and phase not in NOT_TRAINING


def _blame_hfsweep(exc: Exception, log: Path | None = None) -> bool:
    """Say on ``exc`` (a note, which the CLI's one-line message and the traceback show) that
    hfsweep's own code raised it where it did (the fused optimizer step), not the task's, and
    ask for a report; ``True`` if it did. The sweep lets it propagate (see
    :func:`_raised_by_the_task`)."""
    inner = unwrap(exc)
    phase = phase_of(exc) or phase_of(inner)
    if phase != OPTIMIZER_STEP or _raised_by_the_task(exc):
        return False
    where = f", which is in {log}" if log is not None else " (--debug prints it)"
    note = (
        f"(raised in {phase}: hfsweep's own fused optimizer code, not the task's; this is a "
        f"bug in hfsweep, please report it with the traceback{where})"
    )
    for e in {id(exc): exc, id(inner): inner}.values():
        notes = getattr(e, "__notes__", None)
        if not isinstance(notes, list):  # (exc.add_note is Python 3.11's; this is the same)
            notes = []
            with contextlib.suppress(AttributeError, TypeError):  # a type refusing attributes
                e.__notes__ = notes  # type: ignore[attr-defined]
        if note not in notes:
            notes.append(note)
    return True
