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
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from ..schedulers import Decision, Report, TrialScheduler
from ..schedulers._base import decode_float, encode_float
from ._ledger_file import LedgerFile
from .status import Status

__all__ = ["ArrayLike", "Ledger", "decision_key"]


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


class Ledger:
    """The engine's persisted state (see the module docstring).

    ``arrays``, ``sizes`` and ``best`` are the engine's to change in place (append an array,
    mark one done, set a key's size, replace the kept best trials); :meth:`save` finds the
    changes. ``decisions`` and ``ended`` change through :meth:`decide` and :meth:`end` only.
    """

    def __init__(
        self,
        file: LedgerFile,
        scheduler: TrialScheduler,
        elapsed: Callable[[], float],
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
        decided = self.scheduler.decide(reports)
        go = {r.trial: decided[r.trial] is Decision.CONTINUE for r in reports}
        for r, step in evaluated:
            self.decisions[decision_key(r.trial, step)] = go[r.trial]
        rows = [[r.trial, r.resource, encode_float(r.value), step] for r, step in evaluated]
        self._pending.append(["decide", rows, [go[r.trial] for r in reports]])
        return go

    def end(self, member: str, status: Status | str) -> bool:
        """Tell the scheduler that ``member`` ended with ``status``, once; ``False`` (nothing
        done) for a member that had ended."""
        if member in self.ended:
            return False
        status = Status.parse(status)
        self.scheduler.on_trial_end(member, status.value)
        self.ended[member] = status
        self._pending.append(["end", member, status.value])
        return True

    # ------------------------------------------------------------------ saving
    def save(self) -> None:
        """Append the changes since the last save (nothing when there are none), then compact
        once the log has outgrown the snapshot; a run's first save writes the snapshot."""
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
            self.file.append(self._elapsed(), changes)
        if self.file.due():
            self.compact()

    def compact(self) -> None:
        """Write the whole state as the snapshot and start a new log."""
        self._mark_saved()
        self._compacted = True
        self.file.compact(
            {
                "scheduler": self.scheduler.state_dict(),
                "decisions": self.decisions,
                "ended": {m: s.value for m, s in self.ended.items()},
                "arrays": [_array_dict(a) for a in self.arrays],
                "sizes": self.sizes,
                "best": [list(b) for b in self.best],
                "elapsed_s": self._elapsed(),
            }
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
    def restore(self, saved: Mapping[str, Any], array: Callable[..., ArrayLike]) -> None:
        """Load a saved state (:meth:`LedgerFile.read`'s): the snapshot, then every logged
        change after it in order, the scheduler's calls replayed. ``array(index=, key=, size=,
        done=)`` makes the engine's record of an array. Raises ``KeyError``, ``TypeError``,
        ``ValueError`` or ``AttributeError`` for a state this sweep did not write."""
        self.scheduler.load_state_dict(saved["scheduler"])
        self.decisions = {str(k): bool(v) for k, v in saved["decisions"].items()}
        ended = saved["ended"]
        if isinstance(ended, list):  # version 1: the statuses are the scheduler's
            ended = {m: saved["scheduler"]["ended"].get(m, Status.FAILED) for m in ended}
        self.ended = {str(m): Status.parse(s) for m, s in ended.items()}
        self.arrays = [array(**a) for a in saved["arrays"]]
        self.sizes = {str(k): int(v) for k, v in saved["sizes"].items()}
        self.best = [(float(v), int(n)) for v, n in saved["best"]]
        self.elapsed_before = float(saved["elapsed_s"])
        self.file.seq = int(saved.get("seq", 0))
        for record in saved["changes"]:
            for change in record["c"]:
                self._apply(change, array)
            self.elapsed_before = float(record["t"])
            self.file.seq = int(record["n"])
        self._mark_saved()

    def _apply(self, change: list[Any], array: Callable[..., ArrayLike]) -> None:
        kind, args = change[0], change[1:]
        if kind == "decide":
            rows, go = args
            self.scheduler.replay([Report(str(t), res, decode_float(v)) for t, res, v, _ in rows])
            for (trial, _, _, step), g in zip(rows, go, strict=True):
                self.decisions[decision_key(str(trial), step)] = bool(g)
        elif kind == "end":
            member, status = str(args[0]), Status.parse(args[1])
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


def _array_dict(a: ArrayLike) -> dict[str, Any]:
    return {"index": a.index, "key": a.key, "size": a.size, "done": a.done}
