"""The sweep's default Optuna storage: a journal file whose flushes to disk are grouped, and
whose lock one stretch of the sweep's bookkeeping can take once for all its appends; and the
repair of a journal whose last record a crash cut short."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Protocol

import optuna
from optuna.storages.journal import BaseJournalBackend, JournalFileBackend, JournalFileSymlinkLock

from .._errors import SweepError
from .._io import written

__all__ = [
    "GroupedJournalFileBackend",
    "JournalLost",
    "JournalPrefix",
    "TornTail",
    "find_torn_tail",
    "journal_storage",
]

_log = logging.getLogger("hfsweep.sweep")
#: the clock and the sleep of :meth:`GroupedJournalFileBackend.clear_stale_lock`'s wait (tests
#: replace both with a fake time)
_clock: Callable[[], float] = time.monotonic
_sleep: Callable[[float], None] = time.sleep

#: the journal's operation codes (its file format), as a user reads them in a warning
_OPERATIONS = {
    0: "create study",
    1: "delete study",
    2: "set study user attr",
    3: "set study system attr",
    4: "create trial",
    5: "set trial param",
    6: "set trial state (the trial's end)",
    7: "report intermediate value",
    8: "set trial user attr",
    9: "set trial system attr",
    10: "discard trials",
}


class JournalLost(SweepError):
    """The journal file was deleted (or moved away) while the sweep had it open: the study it
    held is gone. Nothing is appended to a new file in its place, which would hold a study
    without its first records."""

    def __init__(self, path: str) -> None:
        super().__init__(f"{path}, the study's journal, was deleted while the sweep ran")
        self.path = path


class _FileLock(Protocol):
    """What Optuna's journal file locks do (``JournalFileSymlinkLock``, ``JournalFileOpenLock``;
    their base class is not public)."""

    def acquire(self) -> bool: ...

    def release(self) -> None: ...


#: bytes read at a time while looking back from the end of a journal for its last whole record
_CHUNK = 1 << 16


class GroupedJournalFileBackend(BaseJournalBackend):
    """A journal file in Optuna's format (that of ``JournalFileBackend``, which reads it, and
    with the same lock), except that each append is flushed to disk with
    :func:`hfsweep._io.grouped_sync`'s group when one is open, instead of at once. Appends
    still reach the operating system before they return, so a killed process loses none;
    other processes read them at once. An append that fails part way (a full disk) is cut
    back off, so that the file never keeps half a record.

    Optuna's storage reads the file for new operations before every query; here a read that
    starts where the last one ended, while the file has not grown since, returns nothing
    without opening the file (a sweep makes several such reads per append).

    Each append takes the file's lock (``lock_obj``, Optuna's symlink lock by default: a
    symlink made, renamed and removed, three metadata operations, slow while flushes to disk
    run). Inside :meth:`held` the lock is taken once, and every append of this process goes in
    under it: the engine holds it around each of its hooks (asking for trials, reporting,
    ending them), which make several appends each. Other processes wait for the hold to end,
    as for an append. Another thread's append during a hold goes in under it, and a mutex
    keeps a hold from beginning or ending between an append's check and its write; the engine
    takes its holds under its own lock besides.

    The backend pickles (so does a study on it, for a process pool or a Ray task): a copy
    opens the same file with the same kind of lock, holding nothing and with nothing read yet.
    """

    def __init__(
        self, file_path: str | os.PathLike[str], lock_obj: _FileLock | None = None
    ) -> None:
        self._path = os.fspath(file_path)
        self._lock: _FileLock = (
            lock_obj if lock_obj is not None else JournalFileSymlinkLock(self._path)
        )
        self._start()

    def _start(self) -> None:
        """The per-process parts: a reader (which creates a missing file and remembers where
        each record starts), no hold and no read yet."""
        self._reader = JournalFileBackend(self._path, lock_obj=self._lock)  # type: ignore[arg-type]
        #: (file size, number of the next log) after the last read that reached the end
        self._read_to: tuple[int, int] | None = None
        #: open holds (:meth:`held`), and the mutex that keeps a write from straddling the
        #: release at the end of the last one
        self._holds = 0
        self._mutex = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self._path, "lock": self._lock}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._path = state["path"]
        self._lock = state["lock"]
        self._start()

    @property
    def path(self) -> str:
        """The journal file."""
        return self._path

    @contextmanager
    def held(self) -> Iterator[None]:
        """Hold the file's lock for every append of this process until the block ends
        (nested holds share the outermost one's)."""
        with self._mutex:
            if self._holds == 0:
                self._lock.acquire()
            self._holds += 1
        try:
            yield
        finally:
            with self._mutex:
                self._holds -= 1
                if self._holds == 0:
                    self._release()

    def _release(self) -> None:
        try:
            self._lock.release()
        except RuntimeError:
            # another process broke the lock as stale (Optuna does after 30 s without change):
            # the appends made under it are whole lines, each written by one call
            _log.warning("the lock on %s was broken by another process during a hold", self._path)

    def clear_stale_lock(self, wait_s: float = 2.0, give_up_s: float = 30.0) -> bool:
        """Remove the file's lock if the same lock stays for ``wait_s`` seconds: a writer holds
        it for a moment, so a lock that stays is one a killed process left (a sweep killed
        while it held the lock). A lock replaced meanwhile (another inode or change time) is
        a live writer's: the wait starts again, until ``give_up_s``. Only for a journal no
        other sweep can be writing (the run directory's, under its lock); other Optuna
        processes break such a lock after 30 s. Returns whether one was removed."""
        lock = self._path + ".lock"
        start = _clock()
        seen: tuple[int, int] | None = None
        since = start
        while _clock() - start < give_up_s:
            try:
                st = os.lstat(lock)
            except FileNotFoundError:
                return False
            now = _clock()
            if (st.st_ino, st.st_ctime_ns) != seen:
                seen, since = (st.st_ino, st.st_ctime_ns), now
            elif now - since >= wait_s:
                try:
                    os.unlink(lock)
                except FileNotFoundError:
                    return False
                _log.warning("removed %s, the journal lock a killed sweep had left", lock)
                return True
            _sleep(0.01)
        return False

    def drop_torn_tail(self) -> TornTail | None:
        """Cut off the journal's torn tail (see :func:`find_torn_tail`), under the file's lock
        (so that no append is under way), after copying the whole file next to it
        (``<journal>.torn-<UTC time>``); returns what was dropped, ``None`` when the journal
        ends with a whole record. Optuna skips such a tail when it reads, but an append after
        it would join the next record to it and make the file unreadable from there on."""
        with self.held():
            return self._cut_torn_tail()

    def _cut_torn_tail(self) -> TornTail | None:
        """:meth:`drop_torn_tail`'s work, for a caller that holds the file's lock."""
        torn = find_torn_tail(self._path)
        if torn is None:
            return None
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
        copy = f"{self._path}.torn-{stamp}"
        shutil.copyfile(self._path, copy)
        with open(copy, "rb") as f:
            os.fsync(f.fileno())
        with open(self._path, "r+b") as f:
            f.truncate(torn.offset)
            f.flush()
            os.fsync(f.fileno())
        self._reader = JournalFileBackend(self._path, lock_obj=self._lock)  # type: ignore[arg-type]
        self._read_to = None
        return TornTail(torn.offset, torn.dropped, torn.operation, copy)

    def sync(self) -> None:
        """Flush the journal to disk now, whether or not a group of flushes is open: before
        removing what would be the only other record of the appends made so far."""
        fd = os.open(self._path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def read_logs(self, log_number_from: int) -> Generator[dict[str, Any], None, None]:
        """The logs from ``log_number_from`` on, as Optuna's backend reads them. The journal is
        only appended to, so a file of the size it had when a read from here reached its end
        holds nothing new. Only a read that ended exactly at the file's end counts: one that
        stopped before a torn tail must not, as another driver sharing the file may cut that
        tail off (:meth:`drop_torn_tail`) and append records of the same length after it."""
        try:
            size = os.stat(self._path).st_size
        except FileNotFoundError:
            raise JournalLost(self._path) from None
        if self._read_to == (size, log_number_from):
            return
        number = log_number_from
        for log in self._reader.read_logs(log_number_from):
            number += 1
            yield log
        ends = getattr(self._reader, "_log_number_offset", {})  # Optuna's: log -> its offset
        self._read_to = (size, number) if ends.get(number) == size else None

    def append_logs(self, logs: list[dict[str, Any]]) -> None:
        """Append ``logs``, one JSON object per line, under the journal's file lock."""
        data = "".join(json.dumps(log, separators=(",", ":")) + "\n" for log in logs).encode()
        with self._mutex:  # a hold cannot begin or end between the check and the write
            if self._holds:
                self._write(data)
                return
            self._lock.acquire()
            try:
                self._write(data)
            finally:
                self._lock.release()

    def _write(self, data: bytes) -> None:
        """Append ``data`` (whole records); the caller holds the file's lock. A file that does
        not end with a line end has a torn tail whose writer is gone (every writer appends
        under the lock): with several drivers on one file, another one's crash leaves it while
        this one runs. It is cut off first (:meth:`drop_torn_tail`), else this append's first
        record would join it and be lost."""
        try:  # not created again: the reader created it, a missing one was deleted since
            fd = os.open(self._path, os.O_RDWR | os.O_APPEND)
        except FileNotFoundError:
            raise JournalLost(self._path) from None
        try:
            end = os.lseek(fd, 0, os.SEEK_END)
            if end and os.pread(fd, 1, end - 1) != b"\n":
                torn = self._cut_torn_tail()
                if torn is not None:
                    _log.warning("%s", torn.describe(self._path))
                end = os.lseek(fd, 0, os.SEEK_END)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
            except BaseException:
                # a full disk (or an interrupt) part way: cut the part written back off, so
                # that the next append does not join its first record to half of this one
                # (if that fails too, drop_torn_tail does it when the sweep is resumed)
                with suppress(OSError):
                    os.ftruncate(fd, end)
                raise
            written(self._path, fd)
        finally:
            os.close(fd)


@dataclass(frozen=True)
class TornTail:
    """The end of a journal that is not a whole record: what a crash, a full disk or a lost
    network mount leaves of the last append."""

    #: where the journal's whole records end (the bytes from here on are dropped)
    offset: int
    #: how many bytes are dropped
    dropped: int
    #: the operation the dropped record was, as far as its bytes tell
    operation: str
    #: the copy of the whole file made before the tail was dropped, if any
    copy: str | None = None

    def describe(self, path: str | os.PathLike[str]) -> str:
        """One sentence for a warning: the file, what was dropped and where the copy is."""
        text = (
            f"{os.fspath(path)}: its last record was cut short (a crash, a full disk or a lost "
            f"network mount during a write): {self.dropped} byte(s) of {self.operation} "
        )
        if self.copy is not None:
            return text + f"were dropped; the file as it was is kept as {self.copy}"
        return text + "are left out"


def find_torn_tail(path: str | os.PathLike[str]) -> TornTail | None:
    """The torn tail of the journal at ``path``: a last line that is not a whole record (no
    line end, or not a JSON object with an operation code), or ``None`` when the journal ends
    with a whole record. Only the last line is looked at (it is read from the end of the file):
    a bad line with whole records after it is damage a torn append cannot make, and reading
    the journal reports it."""
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return None
        last_end = _rfind_newline(f, size) + 1
        if last_end == size:  # a line end last: is the last line a whole record?
            last_end = _rfind_newline(f, size - 1) + 1
        f.seek(last_end)
        tail = f.read()
    if tail.endswith(b"\n") and _is_record(tail):
        return None
    return TornTail(last_end, len(tail), _operation(tail))


def _rfind_newline(f: Any, before: int) -> int:
    """The offset of the last line end in ``f`` before offset ``before``, or -1."""
    pos = before
    while pos > 0:
        start = max(0, pos - _CHUNK)
        f.seek(start)
        found = f.read(pos - start).rfind(b"\n")
        if found >= 0:
            return start + found
        pos = start
    return -1


def _is_record(line: bytes) -> bool:
    try:
        record = json.loads(line)
    except ValueError:  # JSONDecodeError, and UnicodeDecodeError for bytes cut in a character
        return False
    return isinstance(record, dict) and "op_code" in record


def _operation(tail: bytes) -> str:
    """What the start of a record says it is: ``a "set trial state" record of trial id 3``."""
    text = tail.decode("utf-8", "replace")
    code = re.search(r'"op_code"\s*:\s*(\d+)', text)
    if code is None:
        return "an unreadable record"
    name = _OPERATIONS.get(int(code.group(1)), f"operation {code.group(1)}")
    trial = re.search(r'"trial_id"\s*:\s*(\d+)', text)
    study = re.search(r'"study_id"\s*:\s*(\d+)', text)
    if trial is not None:
        return f'a "{name}" record of trial id {trial.group(1)}'
    if study is not None:
        return f'a "{name}" record of study id {study.group(1)}'
    return f'a "{name}" record'


class JournalPrefix(BaseJournalBackend):
    """The whole records of a journal file up to ``end`` (a byte offset), read-only: a torn
    journal read without changing it (``hfsweep report``)."""

    def __init__(self, file_path: str | os.PathLike[str], end: int) -> None:
        self._path = os.fspath(file_path)
        self._end = end
        self._logs: list[dict[str, Any]] | None = None  # read once: the prefix cannot change

    def read_logs(self, log_number_from: int) -> Generator[dict[str, Any], None, None]:
        if self._logs is None:
            with open(self._path, "rb") as f:
                self._logs = [json.loads(line) for line in f.read(self._end).splitlines()]
        yield from self._logs[log_number_from:]

    def append_logs(self, logs: list[dict[str, Any]]) -> None:
        raise PermissionError(f"{self._path} is opened read-only")


def journal_storage(path: str | os.PathLike[str]) -> optuna.storages.JournalStorage:
    """An Optuna ``JournalStorage`` on the journal file ``path``."""
    return optuna.storages.JournalStorage(GroupedJournalFileBackend(path))
