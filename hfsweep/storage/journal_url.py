"""``storage: journal://PATH``: an Optuna journal file outside the run directory, which several
drivers (run directories, machines on one shared file system) can share.

Optuna names a journal file by its path (``optuna-dashboard ./study.log``, the CLI's
``--storage PATH --storage-class JournalFileBackend``); a sweep file's ``storage`` names a
database by URL, so a journal file is written as a URL with the scheme ``journal``:

- ``journal:///abs/path/study.log``: an absolute path (three slashes, as in ``sqlite:////``'s
  absolute form, one fewer);
- ``journal://study.log`` or ``journal://../shared/study.log``: relative to the sweep file's
  folder (the working directory for a sweep without a file), made absolute when the config is
  read, so that ``sweep.json`` (and ``hfsweep report``) name the same file;
- ``~`` and ``${NAME}`` references (to environment variables) are expanded where the file is
  opened.

The file is opened with :class:`~hfsweep.storage.journal.GroupedJournalFileBackend` and Optuna's
symlink lock (the lock of a plain ``JournalFileBackend(path)``, so Optuna workers and
optuna-dashboard can share it). Its folder must exist and be writable (checked by ``hfsweep
validate`` and before a run creates anything); the file is created by the first driver.

Repairing a torn tail (a last record a crash cut short) on a shared file: every writer appends
only while it holds the file's lock, and the repair (``drop_torn_tail``) runs under it, so the
torn bytes it finds are not an append under way: their writer died, or failed part way and
could not cut them back. The one exception is a lock broken as stale: Optuna breaks a lock
left unchanged for 30 s, so a writer stalled longer than that inside its hold (stopped,
swapped out, a hung network mount) could resume after the repair; hfsweep's holds last a
bookkeeping step (milliseconds). A torn tail is cut off when a driver opens the file, and
also by the next append of a driver still running when another one died part way through an
append (else its first record would join the torn bytes and be lost). A stale lock left by a killed driver is therefore not cleared
early here (as in a run directory's own journal, which no other sweep can be writing): other
drivers wait out Optuna's 30 s. The other drivers' readers never read past a torn record (they
stop before a line without its end), so truncating it moves nothing they have read.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["SCHEME", "is_journal", "journal_file", "problem", "resolve"]

#: the prefix of a journal-file storage
SCHEME = "journal://"


def is_journal(storage: str | None) -> bool:
    """Whether ``storage`` names a journal file (``journal://...``)."""
    return storage is not None and storage.startswith(SCHEME)


def resolve(storage: str, base: Path) -> str:
    """``storage`` with a relative path made absolute against ``base`` (the sweep file's
    folder). A path that starts with ``~`` or a ``${NAME}`` reference is left as written:
    it is expanded where the file is opened."""
    path = storage[len(SCHEME) :]
    if path.startswith(("/", "~", "${")):
        return storage
    return SCHEME + os.fspath((base / path).resolve())


def journal_file(storage: str) -> Path:
    """The journal file a ``journal://`` storage names, its ``${NAME}`` references and ``~``
    expanded (raises :class:`hfsweep.storage.db_url.UnsetVariable` for an unset one)."""
    from .db_url import expand

    return Path(expand(storage[len(SCHEME) :])).expanduser()


def problem(storage: str) -> str | None:
    """Why the journal file of ``storage`` cannot be used, or ``None``: an empty path, a
    folder that is missing or not writable, a path that is a folder. Writes nothing."""
    from .db_url import UnsetVariable

    if not storage[len(SCHEME) :]:
        return "names no file; write journal:///abs/path/study.log or journal://relative/path"
    try:
        path = journal_file(storage)
    except UnsetVariable as exc:
        return str(exc)
    if path.is_dir():
        return f"{path} is a folder; name the journal file in it, e.g. {path / 'study.log'}"
    folder = path.parent
    if not folder.is_dir():
        return f"the folder {folder} does not exist; create it (drivers share the file in it)"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"the folder {folder} is not writable (the journal and its lock are made there)"
    if path.exists() and not os.access(path, os.R_OK | os.W_OK):
        return f"{path} cannot be read and written by this user"
    return None
