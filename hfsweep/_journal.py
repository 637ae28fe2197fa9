"""The sweep's default Optuna storage: a journal file whose flushes to disk are grouped, and
whose lock one stretch of the sweep's bookkeeping can take once for all its appends."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from typing import Any

import optuna
from optuna.storages.journal import JournalFileBackend, JournalFileSymlinkLock

from ._io import written

__all__ = ["GroupedJournalFileBackend", "journal_storage"]

_log = logging.getLogger("hfsweep.sweep")
#: the clock and the sleep of :meth:`GroupedJournalFileBackend.clear_stale_lock`'s wait (tests
#: replace both with a fake time)
_clock: Callable[[], float] = time.monotonic
_sleep: Callable[[float], None] = time.sleep


class GroupedJournalFileBackend(JournalFileBackend):
    """Optuna's ``JournalFileBackend`` (same file format and lock), except that each append is
    flushed to disk with :func:`hfsweep._io.grouped_sync`'s group when one is open, instead of
    at once. Appends still reach the operating system before they return, so a killed process
    loses none; other processes read them at once.

    Optuna's storage reads the file for new operations before every query; here a read that
    starts where the last one ended, while the file has not grown since, returns nothing
    without opening the file (a sweep makes several such reads per append).

    Each append takes Optuna's lock on the file (a symlink made, renamed and removed: three
    metadata operations, slow while flushes to disk run). Inside :meth:`held` the lock is taken
    once, and every append of this process goes in under it: the engine holds it around each of
    its hooks (asking for trials, reporting, ending them), which make several appends each. Other
    processes wait for the hold to end, as for an append. Another thread's append during a hold
    goes in under it, and a mutex keeps a hold from beginning or ending between an append's
    check and its write; the engine takes its holds under its own lock besides.
    """

    def __init__(self, file_path: str | os.PathLike[str]) -> None:
        self._path = os.fspath(file_path)
        self._append_lock = JournalFileSymlinkLock(self._path)
        super().__init__(self._path, lock_obj=self._append_lock)
        #: (file size, number of the next log) after the last read that reached the end
        self._read_to: tuple[int, int] | None = None
        #: open holds (:meth:`held`), and the mutex that keeps a write from straddling the
        #: release at the end of the last one
        self._holds = 0
        self._mutex = threading.Lock()

    @contextmanager
    def held(self) -> Iterator[None]:
        """Hold the file's lock for every append of this process until the block ends
        (nested holds share the outermost one's)."""
        with self._mutex:
            if self._holds == 0:
                self._append_lock.acquire()
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
            self._append_lock.release()
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

    def read_logs(self, log_number_from: int) -> Generator[dict[str, Any], None, None]:
        """The logs from ``log_number_from`` on, as Optuna's backend reads them. The journal is
        only ever appended to, so a file of the size it had when a read from here reached its
        end holds nothing new."""
        size = os.stat(self._path).st_size
        if self._read_to == (size, log_number_from):
            return
        number = log_number_from
        for log in super().read_logs(log_number_from):
            number += 1
            yield log
        self._read_to = (size, number)

    def append_logs(self, logs: list[dict[str, Any]]) -> None:
        """Append ``logs``, one JSON object per line, under the journal's file lock."""
        data = "".join(json.dumps(log, separators=(",", ":")) + "\n" for log in logs).encode()
        with self._mutex:  # a hold cannot begin or end between the check and the write
            if self._holds:
                self._write(data)
                return
            self._append_lock.acquire()
            try:
                self._write(data)
            finally:
                self._append_lock.release()

    def _write(self, data: bytes) -> None:
        with open(self._path, "ab") as f:
            f.write(data)
            f.flush()
            written(self._path, f.fileno())


def journal_storage(path: str | os.PathLike[str]) -> optuna.storages.JournalStorage:
    """An Optuna ``JournalStorage`` on the journal file ``path``."""
    return optuna.storages.JournalStorage(GroupedJournalFileBackend(path))
