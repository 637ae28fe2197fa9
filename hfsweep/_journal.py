"""The sweep's default Optuna storage: a journal file whose flushes to disk are grouped."""

from __future__ import annotations

import json
import os
from collections.abc import Generator
from typing import Any

import optuna
from optuna.storages.journal import JournalFileBackend, JournalFileSymlinkLock

from ._io import written

__all__ = ["GroupedJournalFileBackend", "journal_storage"]


class GroupedJournalFileBackend(JournalFileBackend):
    """Optuna's ``JournalFileBackend`` (same file format and lock), except that each append is
    flushed to disk with :func:`hfsweep._io.grouped_sync`'s group when one is open, instead of
    at once. Appends still reach the operating system before they return, so a killed process
    loses none; other processes read them at once.

    Optuna's storage reads the file for new operations before every query; here a read that
    starts where the last one ended, while the file has not grown since, returns nothing
    without opening the file (a sweep makes about three such reads per append)."""

    def __init__(self, file_path: str | os.PathLike[str]) -> None:
        self._path = os.fspath(file_path)
        self._append_lock = JournalFileSymlinkLock(self._path)
        super().__init__(self._path, lock_obj=self._append_lock)
        #: (file size, number of the next log) after the last read that reached the end
        self._read_to: tuple[int, int] | None = None

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
        text = "".join(json.dumps(log, separators=(",", ":")) + "\n" for log in logs)
        self._append_lock.acquire()
        try:
            with open(self._path, "ab") as f:
                f.write(text.encode("utf-8"))
                f.flush()
                written(self._path, f.fileno())
        finally:
            self._append_lock.release()


def journal_storage(path: str | os.PathLike[str]) -> optuna.storages.JournalStorage:
    """An Optuna ``JournalStorage`` on the journal file ``path``."""
    return optuna.storages.JournalStorage(GroupedJournalFileBackend(path))
