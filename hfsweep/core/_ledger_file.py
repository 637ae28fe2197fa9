"""The ledger's files: a snapshot (``state.json``) and an append-only log of the changes since
(``state.jsonl``), so that saving after every trial costs the change, not the whole state.

``state.json`` is ``{"version": 2, "seq": N, ...the state}``, written atomically. ``state.jsonl``
starts with ``{"after": N}`` (the snapshot it continues) and holds one JSON line per save,
``{"n": N + 1, "t": elapsed seconds, "c": [change, ...]}``, numbered on from the snapshot; a
save's changes are one line, so a crash keeps all of them or none, as the atomic rewrite of the
whole ``state.json`` did. :meth:`LedgerFile.compact` writes a new snapshot (flushed to disk before
anything else) and then starts a new log; a crash in between leaves lines the snapshot already
holds, which reading skips by their numbers. A last line cut short by a crash is left out (as
the journal's torn tail is); a line that cannot be read before it, a gap in the numbering or a
missing log is damage, and :meth:`LedgerFile.read` refuses it naming the file.

Version 1 run directories (a ``state.json`` rewritten whole at every save, no log) are read as a
snapshot with no changes after it; the next compaction writes version 2.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from contextlib import suppress
from pathlib import Path
from typing import Any

from .._io import append_lines, atomic_write_text, read_lines

__all__ = ["STATE_VERSION", "LedgerFile", "StateVersionError"]

#: the format ``state.json`` is written in; version 1 (no log) is still read
STATE_VERSION = 2
_READABLE = (1, STATE_VERSION)
#: the log is compacted once it is larger than the snapshot and than this
MIN_LOG_BYTES = 1 << 16


class StateVersionError(ValueError):
    """``state.json`` was written by another hfsweep version."""


class LedgerFile:
    """``snapshot`` (``state.json``) and ``log`` (``state.jsonl``) of one run directory."""

    def __init__(self, snapshot: Path, log: Path) -> None:
        self.snapshot = snapshot
        self.log = log
        #: the number of the last save written (the snapshot's, or the log's last line's)
        self.seq = 0
        #: bytes of the snapshot and of the log appended since it, for :meth:`due`
        self.snapshot_bytes = 0
        self.log_bytes = 0

    # ------------------------------------------------------------------ reading
    def read(self) -> dict[str, Any] | None:
        """The snapshot's state with ``"changes"``: the log's lines after it, in order
        (``{"n", "t", "c"}`` each); ``None`` if there is no ``state.json``.

        Raises :class:`ValueError` naming the file that cannot be read as the state this
        hfsweep version writes (cut short, edited or missing; :class:`StateVersionError`:
        another version's)."""
        if not self.snapshot.exists():
            return None
        try:
            state = json.loads(self.snapshot.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:  # ValueError: bad JSON or bad UTF-8
            raise ValueError(f"{self.snapshot} cannot be read ({exc})") from exc
        if not isinstance(state, dict):
            raise ValueError(f"{self.snapshot} holds a JSON {type(state).__name__}, not an object")
        version = state.get("version")
        if version not in _READABLE:
            raise StateVersionError(
                f"{self.snapshot}: run directory state version {version!r} is not "
                f"{STATE_VERSION}; it was written by another hfsweep version: resume it with "
                "that version"
            )
        if version == 1:
            state["changes"] = []
            return state
        seq = state.get("seq")
        if not isinstance(seq, int):
            raise ValueError(f"{self.snapshot} has no save number (key 'seq')")
        state["changes"] = self._read_log(seq)
        return state

    def _read_log(self, seq: int) -> list[dict[str, Any]]:
        if not self.log.exists():
            raise ValueError(
                f"{self.log} is missing: it holds the changes since {self.snapshot} was written"
            )
        lines = read_lines(self.log)
        records = []
        for i, line in enumerate(lines):
            try:
                record = json.loads(line)
            except ValueError:
                record = None
            if not isinstance(record, dict):
                raise ValueError(f"{self.log} line {i + 1} cannot be read: {line[:80]!r}")
            records.append(record)
        if not records or not isinstance(records[0].get("after"), int):
            raise ValueError(f"{self.log} does not start with the save it continues")
        after = records[0]["after"]
        if after > seq:
            raise ValueError(
                f"{self.log} continues save {after}, but {self.snapshot} holds save {seq} (an "
                "older copy of it?)"
            )
        changes = []
        expected = after + 1
        for i, record in enumerate(records[1:], start=2):
            if record.get("n") != expected or not isinstance(record.get("c"), list):
                raise ValueError(
                    f"{self.log} line {i}: save {record.get('n')!r} where save {expected} "
                    "should follow"
                )
            expected += 1
            if record["n"] > seq:  # those up to seq: the snapshot holds them (see module doc)
                changes.append(record)
        return changes

    # ------------------------------------------------------------------ writing
    def append(self, elapsed: float, changes: Sequence[Any]) -> None:
        """Append one save: ``changes`` (JSON values) at ``elapsed`` seconds of the sweep."""
        line = json.dumps({"n": self.seq + 1, "t": elapsed, "c": list(changes)}, allow_nan=False)
        size = self.log.stat().st_size if self.log.exists() else 0
        try:
            append_lines(self.log, [line])
        except BaseException:
            # cut a part-written line back off (a full disk): the next append must not end
            # it, which would leave a line that cannot be read before whole ones
            with suppress(OSError):
                os.truncate(self.log, size)
            raise
        self.seq += 1
        self.log_bytes += len(line) + 1

    def due(self) -> bool:
        """Whether the log has grown past the snapshot (and :data:`MIN_LOG_BYTES`): compacting
        then keeps the bytes written over a sweep proportional to its state's final size."""
        return self.log_bytes > max(MIN_LOG_BYTES, self.snapshot_bytes)

    def compact(self, state: Mapping[str, Any]) -> None:
        """Write ``state`` as the new snapshot, flushed to disk before the log restarts empty
        (a snapshot lost to a power cut behind a new log would refuse the resume)."""
        text = json.dumps({"version": STATE_VERSION, "seq": self.seq, **state}, allow_nan=False)
        atomic_write_text(self.snapshot, text)
        _sync(self.snapshot)
        _sync(self.snapshot.parent)
        atomic_write_text(self.log, json.dumps({"after": self.seq}) + "\n")
        self.snapshot_bytes = len(text)
        self.log_bytes = 0


def _sync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
