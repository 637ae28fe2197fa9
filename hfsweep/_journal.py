"""The sweep's default Optuna storage: a journal file whose flushes to disk are grouped."""

from __future__ import annotations

import json
import os
from typing import Any

import optuna
from optuna.storages.journal import JournalFileBackend, JournalFileSymlinkLock

from ._io import written

__all__ = ["GroupedJournalFileBackend", "journal_storage"]


class GroupedJournalFileBackend(JournalFileBackend):
    """Optuna's ``JournalFileBackend`` (same file format and lock), except that each append is
    flushed to disk with :func:`hfsweep._io.grouped_sync`'s group when one is open, instead of
    at once. Appends still reach the operating system before they return, so a killed process
    loses none; other processes read them at once."""

    def __init__(self, file_path: str | os.PathLike[str]) -> None:
        self._path = os.fspath(file_path)
        self._append_lock = JournalFileSymlinkLock(self._path)
        super().__init__(self._path, lock_obj=self._append_lock)

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
