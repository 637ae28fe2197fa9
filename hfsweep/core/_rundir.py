"""The run directory of a sweep: what the engine writes, and the state it resumes from.

Layout (``RunDir`` names every path)::

    sweep.json             the resolved sweep config (SweepConfig.to_dict())
    optuna.journal         the Optuna study, unless the sweep names another storage
    state.json             the engine's own state (its ledger): scheduler, decisions, arrays,
                           sizes, as of its last compaction
    state.jsonl            the ledger's changes since state.json, one line per save
    trials.csv             one row per trial (Optuna's trials_dataframe() columns, then
                           status and array), rewritten at most every few seconds and at
                           the end
    histories/trial-N.csv  each finished trial's evaluations
    checkpoints/trial-N.pt the best completed trials' model state_dicts
    best.json              the best trial: number, value, params and full config
    elastic.json           with elastic arrays: the allocator's wait and idle totals, rewritten
                           at every plan and when the sweep ends
    sweep.log              the log
    arrays/K/              array K's trainer checkpoint while it trains (removed when done)
    arrays/array-K.pt.damaged-<time>
                           array K's checkpoint found damaged on resume, kept for a look
    .lock                  held by the process running the sweep (its pid inside)

Every file but the appended ones (the journal, state.jsonl) is written to a temporary file and
renamed over the old one, so a crash leaves the old version or the new one, never half of one;
an appended file's last line cut short by a crash is left out when it is read.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import shutil
import socket
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._io import atomic_write_text
from ._ledger_file import STATE_VERSION, LedgerFile, StateVersionError
from .status import Status

if TYPE_CHECKING:
    import optuna

try:
    import fcntl
except ImportError:  # pragma: no cover - only where fcntl is missing (Windows)
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "STATE_VERSION",
    "RunDir",
    "RunDirBusy",
    "StateVersionError",
    "member_id",
    "refuse_a_second_start",
    "trial_number",
]

_ID_PREFIX = "trial-"


def member_id(number: int) -> str:
    """The trainer's member id of Optuna trial ``number``."""
    return f"{_ID_PREFIX}{number}"


def trial_number(member: str) -> int:
    """Inverse of :func:`member_id`."""
    return int(member[len(_ID_PREFIX) :])


class RunDirBusy(Exception):
    """Another sweep holds the run directory."""


def refuse_a_second_start(
    output: Path, storage: str | None, source: Path | None, *, resume: bool
) -> None:
    """The one rule on starting a sweep in a run directory: unless it resumes, a sweep may not
    start in ``output`` when that holds a sweep already (see :meth:`RunDir.holds_sweep`), since
    it would add its trials to the other's study and overwrite its state. Raises
    :class:`~hfsweep.core.result.SweepError` saying how to resume it or go elsewhere.
    ``hfsweep validate``, ``hfsweep run`` and ``hs.sweep`` check it first, before the machine's
    checks and the dry run, and the engine again once it holds the directory's lock."""
    if resume or not RunDir(output).holds_sweep(storage):
        return
    from .result import SweepError

    raise SweepError(
        f"{output} already holds a sweep; continue it with "
        f"`hfsweep run {source or 'SWEEP'} --resume` (hs.sweep(..., resume=True)), or set "
        "`output` to another directory"
    )


def _unlocked(path: Path, why: str) -> None:
    warnings.warn(
        f"cannot lock the run directory {path} ({why}): a second sweep started on it while "
        "this one runs would not be refused",
        stacklevel=6,  # the caller of hs.sweep (through exclusive, contextlib and the engine)
    )


class RunDir:
    """The files of one sweep's run directory."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    @contextmanager
    def exclusive(self) -> Iterator[bool]:
        """Hold the run directory for this sweep, creating it if needed; yields whether it is
        locked.

        Two sweeps on one directory would train the same trials and tell them twice, and
        overwrite each other's state. A second holder (another process, or another sweep in
        this one) gets :class:`RunDirBusy`, naming the holder's host and pid, before either has
        read or written anything. The lock is an ``flock`` on ``.lock``: the kernel drops it
        when the holder ends, however it ends (SIGKILL included), and when the processes it
        forked without exec (data-loader workers) have ended too. Where the lock cannot be
        taken for another reason (a file system without ``flock``, a ``.lock`` this user
        cannot open, Windows, which has no ``fcntl``), a warning says so and nothing is locked.
        """
        if fcntl is None:  # pragma: no cover - only where fcntl is missing (Windows)
            _unlocked(self.path, "this platform has no fcntl.flock")
            yield False
            return
        self.path.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(self.path / ".lock", os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as exc:
            _unlocked(self.path, str(exc))
            yield False
            return
        locked = True
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 300).decode("utf-8", "replace").strip() or "unknown"
                raise RunDirBusy(
                    f"{self.path} is in use by another sweep (process {holder}, or a process it "
                    "started that is still running); wait for it to end, or set `output` to "
                    "another directory"
                ) from None
            except OSError as exc:  # a file system without locks (some network mounts)
                _unlocked(self.path, str(exc))
                locked = False
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{socket.gethostname()}:{os.getpid()}\n".encode(), 0)
            yield locked
        finally:
            os.close(fd)  # releases the lock (once forked children have closed theirs)

    def holds_sweep(self, storage: str | None) -> bool:
        """Whether a sweep was started here: the engine's ``state.json`` is here, or, for a
        sweep with the default storage (``storage`` ``None``), its study's journal is."""
        return self.state.exists() or (storage is None and self.journal.exists())

    # ---------------------------------------------------------------- paths
    @property
    def config(self) -> Path:
        return self.path / "sweep.json"

    @property
    def journal(self) -> Path:
        return self.path / "optuna.journal"

    @property
    def state(self) -> Path:
        return self.path / "state.json"

    @property
    def trials_csv(self) -> Path:
        return self.path / "trials.csv"

    @property
    def best(self) -> Path:
        return self.path / "best.json"

    @property
    def log(self) -> Path:
        return self.path / "sweep.log"

    @property
    def elastic(self) -> Path:
        return self.path / "elastic.json"

    def history(self, number: int) -> Path:
        return self.path / "histories" / f"trial-{number}.csv"

    def checkpoint(self, number: int) -> Path:
        return self.path / "checkpoints" / f"trial-{number}.pt"

    def array(self, index: int) -> Path:
        return self.path / "arrays" / str(index)

    # ---------------------------------------------------------------- state
    @property
    def state_log(self) -> Path:
        return self.path / "state.jsonl"

    def ledger_file(self) -> LedgerFile:
        """The engine's state files: ``state.json`` and ``state.jsonl``."""
        return LedgerFile(self.state, self.state_log)

    def read_state(self) -> dict[str, Any] | None:
        """The saved engine state with the changes logged since (``"changes"``), or ``None``
        if this directory holds no ``state.json`` (see :meth:`LedgerFile.read`).

        Raises :class:`ValueError`, naming the file, when it cannot be read as the state this
        hfsweep version writes (cut short, edited or missing; :class:`StateVersionError`:
        another version's)."""
        return self.ledger_file().read()

    def read_elastic(self) -> dict[str, Any] | None:
        """The elastic allocator's totals an earlier run wrote (:meth:`write_elastic`), or
        ``None`` if there is no ``elastic.json``. Raises :class:`ValueError`, naming the file,
        when it is not a JSON object (cut short, or edited)."""
        try:
            text = self.elastic.read_text()
        except FileNotFoundError:
            return None
        try:
            found = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{self.elastic} is not JSON ({exc})") from None
        if not isinstance(found, dict):
            raise ValueError(f"{self.elastic} holds a {type(found).__name__}, not an object")
        return found

    def remove_array(self, index: int) -> None:
        shutil.rmtree(self.array(index), ignore_errors=True)

    # ---------------------------------------------------------------- outputs
    def write_config(self, config: Mapping[str, Any]) -> None:
        atomic_write_text(self.config, json.dumps(config, indent=2) + "\n")

    def write_history(self, number: int, history: Sequence[Mapping[str, float]]) -> None:
        """Trial ``number``'s evaluations as CSV (``step, epoch, train_loss, ...``)."""
        columns: list[str] = []
        for row in history:
            columns += [k for k in row if k not in columns]
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n")
        writer.writeheader()
        for row in history:
            writer.writerow({k: _cell(v) for k, v in row.items()})
        atomic_write_text(self.history(number), buf.getvalue())

    def write_trials(self, trials: Sequence[optuna.trial.FrozenTrial]) -> None:
        """``trials.csv`` in the column convention of Optuna's ``trials_dataframe()``
        (``number, value, datetime_start, datetime_complete, duration, params_*,
        user_attrs_*, state``: ``state`` is Optuna's name, ``COMPLETE``, ``PRUNED``...) plus
        ``status``, the trial's :class:`~hfsweep.core.status.Status` (``completed``,
        ``stopped``, ``failed``, ``running``, ``waiting``), and ``array``, the array it trained
        in. The columns are read by name: ``status`` was added after ``state``, which readers
        of the older files keep finding."""
        params = sorted({p for t in trials for p in t.params})
        attrs = sorted({a for t in trials for a in t.user_attrs})
        columns = [
            "number",
            "value",
            "datetime_start",
            "datetime_complete",
            "duration",
            *(f"params_{p}" for p in params),
            *(f"user_attrs_{a}" for a in attrs),
            "state",
            "status",
            "array",
        ]
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(columns)
        for t in sorted(trials, key=lambda t: t.number):
            duration = (
                t.datetime_complete - t.datetime_start
                if t.datetime_complete is not None and t.datetime_start is not None
                else None
            )
            writer.writerow(
                [
                    t.number,
                    _cell(t.value),
                    _cell(t.datetime_start),
                    _cell(t.datetime_complete),
                    _cell(duration),
                    *(_cell(t.params.get(p)) for p in params),
                    *(_cell(t.user_attrs.get(a)) for a in attrs),
                    t.state.name,
                    Status.of_trial_state(t.state).value,
                    _cell(t.user_attrs.get("array")),
                ]
            )
        atomic_write_text(self.trials_csv, buf.getvalue())

    def write_elastic(self, totals: Mapping[str, Any]) -> None:
        """``elastic.json``: the elastic allocator's wait and idle totals
        (:meth:`~hfsweep.elastic.policy.ElasticPolicy.totals`)."""
        atomic_write_text(self.elastic, json.dumps(dict(totals), indent=2) + "\n")

    def write_best(self, best: Mapping[str, Any] | None) -> None:
        if best is None:
            self.best.unlink(missing_ok=True)
        else:
            atomic_write_text(self.best, json.dumps(best, indent=2, default=str) + "\n")


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else str(value)
    if isinstance(value, list | dict):
        return json.dumps(value)
    return str(value)
