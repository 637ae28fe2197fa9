"""The ledger: what a sweep has decided and how its trials ended, saved as it goes.

It holds what the study (the journal) cannot rebuild: the trial scheduler's state and the log of
its decisions (``decisions``: ``"trial-N@step"`` -> go on), the members that ended and how
(``ended``: member id -> :class:`~hfsweep.core.status.Status`), the arrays (index, key, size,
done), each key's array size (``sizes``), the best completed trials whose weights are kept
(``best``) and the sweep's elapsed time. Every call to the scheduler goes through the ledger
(:meth:`Ledger.decide`, :meth:`Ledger.end`), so that a resume can replay them.

:meth:`Ledger.save` appends what changed since the last save as one line of ``state.jsonl``
(see :mod:`hfsweep.core._ledger_file`): the changes the ledger's own methods recorded, plus the
arrays, sizes and best trials the engine added or changed in the lists it shares with the ledger.
A save costs what changed, not the whole state: the log is compacted into ``state.json`` only when
it outgrows it, so the bytes written over a sweep grow with the number of trials, not its
square. The scheduler's state (which grows with the trials too) is in the snapshot; the log
holds its calls since (the reports of each joint decision, each trial's end), which a resume
replays onto it (:meth:`~hfsweep.schedulers.TrialScheduler.replay`).

The ledger is an in-memory object first: :meth:`Ledger.state_dict` is its whole state as plain
data (what ``state.json``'s snapshot holds) and :meth:`Ledger.load_state_dict` loads one. The
file store is attached (``file``): ``hfsweep run`` attaches its run directory's
(:meth:`~hfsweep.core._rundir.RunDir.ledger_file`) and saves as it goes; the Ray Tune plugin
keeps a ledger without one and pickles its :meth:`~Ledger.state_dict` in the searcher's
checkpoint (Tune restores that and nothing else). A ledger without a scheduler records decisions
(:meth:`Ledger.log`) and ends (:meth:`Ledger.end`) that its owner's scheduler took: the Tune
plugin's, whose Tune schedulers decide on result dicts and are pickled whole.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from ..schedulers import Decision, Report, TrialScheduler, decode_float, encode_float
from ._ledger_file import LedgerFile
from .status import Status

__all__ = ["ArrayLike", "Ledger", "decision_key"]

_T = TypeVar("_T")


def decision_key(member: str, step: int) -> str:
    """The key a joint decision on ``member`` at trainer ``step`` is logged under
    (``"<member>@<step>"``, :attr:`Ledger.decisions`): a replayed evaluation (after a resume)
    is answered from the log by it. The Tune plugin logs its decisions under the same keys."""
    return f"{member}@{step}"


class ArrayLike(Protocol):
    """What the ledger keeps of an array (the engine's record of one)."""

    index: int
    key: str
    size: int
    done: bool


def _no_clock() -> float:
    """The elapsed time of a ledger given no clock (a module function: the ledger pickles)."""
    return 0.0


class Ledger:
    """A sweep's decisions, ends, arrays and sizes (see the module docstring).

    ``arrays``, ``sizes`` and ``best`` are the owner's to change in place (append an array,
    mark one done, set a key's size, replace the kept best trials); :meth:`save` finds the
    changes. ``decisions`` and ``ended`` change through :meth:`decide`, :meth:`log` and
    :meth:`end` only.

    ``file``: where :meth:`save` and :meth:`compact` write (``None``: an in-memory ledger, saved
    by its owner through :meth:`state_dict`). ``scheduler``: the trial scheduler that
    :meth:`decide` asks and :meth:`end` tells (``None``: the owner's scheduler decides, and the
    ledger records). ``elapsed``: the seconds this run has swept (saved with the state).
    """

    def __init__(
        self,
        file: LedgerFile | None = None,
        scheduler: TrialScheduler | None = None,
        elapsed: Callable[[], float] = _no_clock,
    ) -> None:
        self.file = file
        self.scheduler = scheduler
        self.elapsed = elapsed
        self.decisions: dict[str, bool] = {}
        self.ended: dict[str, Status] = {}
        self.arrays: list[ArrayLike] = []
        self.sizes: dict[str, int] = {}
        self.best: list[tuple[float, int]] = []
        #: elapsed seconds saved by the runs before this one
        self.elapsed_before = 0.0
        self._pending: list[Any] = []
        #: what the last save wrote of the shared collections: arrays, arrays not yet done,
        #: sizes, best
        self._arrays = 0
        self._running: set[int] = set()
        self._sizes = 0
        self._best: list[tuple[float, int]] = []
        #: whether this run wrote a snapshot yet (its first save does)
        self._compacted = False

    # ------------------------------------------------------------------ the scheduler's calls
    def decide(self, evaluated: Sequence[tuple[Report, int]]) -> dict[str, bool]:
        """The scheduler's joint decision on ``evaluated`` (each report with its trainer step):
        whether each trial goes on, logged under ``"<trial>@<step>"``."""
        reports = [r for r, _ in evaluated]
        decided = self._scheduler().decide(reports)
        go = {r.trial: decided[r.trial] is Decision.CONTINUE for r in reports}
        for r, step in evaluated:
            self.decisions[decision_key(r.trial, step)] = go[r.trial]
        rows = [[r.trial, r.resource, encode_float(r.value), step] for r, step in evaluated]
        self._record(["decide", rows, [go[r.trial] for r in reports]])
        return go

    def log(self, member: str, step: int, go: bool) -> None:
        """Log a decision the owner's scheduler took: ``member`` goes on (``go``) after its
        evaluation at trainer ``step``; a replay of that evaluation is answered by
        :meth:`logged`. (:meth:`decide` logs the decisions of the ledger's own scheduler.)"""
        self.decisions[decision_key(member, step)] = bool(go)
        self._record(["log", member, step, bool(go)])

    def logged(self, member: str, step: int) -> bool | None:
        """The decision logged on ``member`` at ``step``; ``None`` if none was."""
        return self.decisions.get(decision_key(member, step))

    def end(self, member: str, status: Status | str) -> bool:
        """Record that ``member`` ended with ``status`` and tell the scheduler (if the ledger
        has one), once; ``False`` (nothing done) for a member that had ended."""
        if member in self.ended:
            return False
        status = Status.parse(status)
        if self.scheduler is not None:
            self.scheduler.on_trial_end(member, status.value)
        self.ended[member] = status
        self._record(["end", member, status.value])
        return True

    def settle(
        self, member: str, status: Status | str, value: object, metric: str
    ) -> tuple[Status, str | None] | None:
        """End ``member`` by the core's rule, once: ``status`` settled against its last
        ``metric`` value (:meth:`Status.settle`: a completed member whose value is not a finite
        number failed) and recorded by :meth:`end`. Returns the settled status and why it
        changed (``None`` if it did not); ``None`` for a member that had ended (nothing done).
        Every front door ends its members through this."""
        settled, why = Status.parse(status).settle(value, metric)
        return (settled, why) if self.end(member, settled) else None

    def status(self, member: str) -> Status | None:
        """How ``member`` ended (a final :class:`Status`); ``None`` while it has not."""
        return self.ended.get(member)

    def _scheduler(self) -> TrialScheduler:
        return _given(
            self.scheduler,
            "this ledger has no trial scheduler to decide (Ledger(scheduler=None)); its owner "
            "decides and logs each decision with Ledger.log",
        )

    def _record(self, change: list[Any]) -> None:
        """Keep ``change`` for the next :meth:`save`; a ledger without a file keeps nothing
        (its owner saves :meth:`state_dict`), so it does not grow a log in memory."""
        if self.file is not None:
            self._pending.append(change)

    # ------------------------------------------------------------------ saving
    def save(self) -> None:
        """Append the changes since the last save (nothing when there are none), then compact
        once the log has outgrown the snapshot; a run's first save writes the snapshot."""
        file = self._file()
        if not self._compacted:
            self.compact()
            return
        changes = self._pending
        self._pending = []
        for a in self.arrays[self._arrays :]:
            changes.append(["array", a.index, a.key, a.size, a.done])
            if not a.done:
                self._running.add(a.index)
        self._arrays = len(self.arrays)
        for index in sorted(self._running):
            if self._array(index).done:
                changes.append(["done", index])
                self._running.discard(index)
        if len(self.sizes) != self._sizes:
            changes += [["size", k, v] for k, v in list(self.sizes.items())[self._sizes :]]
            self._sizes = len(self.sizes)
        if self.best != self._best:
            changes.append(["best", [list(b) for b in self.best]])
            self._best = list(self.best)
        if changes:
            file.append(self._elapsed(), changes)
        if file.due():
            self.compact()

    def compact(self) -> None:
        """Write the whole state as the snapshot and start a new log."""
        file = self._file()
        self._mark_saved()
        self._compacted = True
        file.compact(self.state_dict())

    def state_dict(self) -> dict[str, Any]:
        """The whole state as plain data (JSON values; a copy): what ``state.json`` holds
        besides its version and save number. ``"scheduler"`` is the scheduler's own
        ``state_dict`` (``None`` for a ledger without one)."""
        scheduler = self.scheduler.state_dict() if self.scheduler is not None else None
        return {
            "scheduler": scheduler,
            "decisions": dict(self.decisions),
            "ended": {m: s.value for m, s in self.ended.items()},
            "arrays": [_array_dict(a) for a in self.arrays],
            "sizes": dict(self.sizes),
            "best": [list(b) for b in self.best],
            "elapsed_s": self._elapsed(),
        }

    def _file(self) -> LedgerFile:
        return _given(
            self.file,
            "this ledger has no file to save to (Ledger(file=None)); its owner saves "
            "Ledger.state_dict()",
        )

    def _mark_saved(self) -> None:
        """Mark everything as saved (the snapshot about to be written, or just read, holds it)."""
        self._pending = []
        self._arrays = len(self.arrays)
        self._running = {a.index for a in self.arrays if not a.done}
        self._sizes = len(self.sizes)
        self._best = list(self.best)

    def _array(self, index: int) -> ArrayLike:
        """The array of ``index`` (the engine numbers them by position; looked up all the same)."""
        if index < len(self.arrays) and self.arrays[index].index == index:
            return self.arrays[index]
        return next(a for a in self.arrays if a.index == index)

    def _elapsed(self) -> float:
        return self.elapsed_before + self.elapsed()

    # ------------------------------------------------------------------ restoring
    def load_state_dict(
        self, saved: Mapping[str, Any], array: Callable[..., ArrayLike] | None = None
    ) -> None:
        """Load :meth:`state_dict`'s output (the scheduler's state into the scheduler, if the
        ledger has one). ``array(index=, key=, size=, done=)`` makes the owner's record of an
        array (needed only when the state holds arrays). Raises ``KeyError``, ``TypeError``,
        ``ValueError`` or ``AttributeError`` for a state no ledger wrote."""
        if self.scheduler is not None:
            self.scheduler.load_state_dict(saved["scheduler"])
        self.decisions = {str(k): bool(v) for k, v in saved["decisions"].items()}
        ended = saved["ended"]
        if isinstance(ended, list):  # version 1: the statuses are the scheduler's
            ended = {m: saved["scheduler"]["ended"].get(m, Status.FAILED) for m in ended}
        self.ended = {str(m): Status.parse(s) for m, s in ended.items()}
        self.arrays = [_make(array)(**a) for a in saved["arrays"]]
        # in place: the owner's packer may share this dict (one dict: the packer sizes, the
        # ledger saves)
        self.sizes.clear()
        self.sizes.update({str(k): int(v) for k, v in saved["sizes"].items()})
        self.best = [(float(v), int(n)) for v, n in saved["best"]]
        self.elapsed_before = float(saved["elapsed_s"])
        self._mark_saved()

    def restore(self, saved: Mapping[str, Any], array: Callable[..., ArrayLike]) -> None:
        """Load a saved state (:meth:`LedgerFile.read`'s): the snapshot, then every logged
        change after it in order, the scheduler's calls replayed. ``array(index=, key=, size=,
        done=)`` makes the engine's record of an array. Raises ``KeyError``, ``TypeError``,
        ``ValueError`` or ``AttributeError`` for a state this sweep did not write."""
        file = self._file()
        self.load_state_dict(saved, array)
        file.seq = int(saved.get("seq", 0))
        for record in saved["changes"]:
            for change in record["c"]:
                self._apply(change, array)
            self.elapsed_before = float(record["t"])
            file.seq = int(record["n"])
        self._mark_saved()

    def _apply(self, change: list[Any], array: Callable[..., ArrayLike]) -> None:
        kind, args = change[0], change[1:]
        if kind == "decide":
            rows, go = args
            reports = [Report(str(t), res, decode_float(v)) for t, res, v, _ in rows]
            self._scheduler().replay(reports)
            for (trial, _, _, step), g in zip(rows, go, strict=True):
                self.decisions[decision_key(str(trial), step)] = bool(g)
        elif kind == "log":
            member, step, g = args
            self.decisions[decision_key(str(member), step)] = bool(g)
        elif kind == "end":
            member, status = str(args[0]), Status.parse(args[1])
            if self.scheduler is not None:
                self.scheduler.on_trial_end(member, status.value)
            self.ended[member] = status
        elif kind == "array":
            index, key, size, done = args
            self.arrays.append(array(index=int(index), key=str(key), size=int(size), done=done))
        elif kind == "done":
            self._array(int(args[0])).done = True
        elif kind == "size":
            self.sizes[str(args[0])] = int(args[1])
        elif kind == "best":
            self.best = [(float(v), int(n)) for v, n in args[0]]
        else:
            raise ValueError(f"unknown change {kind!r}")


def _given(part: _T | None, missing: str) -> _T:
    """``part`` of the ledger (its file, its scheduler); ``RuntimeError(missing)`` if it has none."""
    if part is None:
        raise RuntimeError(missing)
    return part


def _make(array: Callable[..., ArrayLike] | None) -> Callable[..., ArrayLike]:
    if array is None:
        raise ValueError("the saved ledger holds arrays, and no maker of array records was given")
    return array


def _array_dict(a: ArrayLike) -> dict[str, Any]:
    return {"index": a.index, "key": a.key, "size": a.size, "done": a.done}
