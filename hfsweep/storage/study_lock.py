"""A lock on one study that every driver sharing it takes, whatever its storage.

Two drivers on one study must not both see 15 trials of a 16-trial budget and both ask the
16th, nor both adopt the same abandoned trial. Optuna's API has no transaction spanning
"count the trials, then create one", so the drivers serialise those steps under a lock of the
storage's own kind, which the storage's server (or file system) releases when a holder dies:

- a journal file: the file's own lock (``GroupedJournalFileBackend.held``), which every append
  takes anyway;
- PostgreSQL: a session advisory lock (``pg_advisory_lock``) keyed by the study's name;
- MySQL: a named lock (``GET_LOCK``);
- an SQLite file: an ``flock`` on ``<database>.hfsweep-lock`` beside it;
- anything else: a lock of this process only, with a warning that drivers in other processes
  could overrun ``budget.trials``.

Inside the process a re-entrant mutex comes first, so threads of one driver never wait on the
database for each other.

A database lock lives as long as its connection: a server restart ends it while its holder
still counts on it, and the connection pool then reconnects the holder's next call without an
error. So a step that must not run twice (asking a trial under the budget) runs
:meth:`StudyLock.fenced`: a lost connection inside it raises :class:`LockLost` instead of being
retried, the step takes the lock again with :meth:`StudyLock.renew` and looks again; and before
the step counts as done, :meth:`StudyLock.intact` checks that the lock's own connection held it
throughout.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext, suppress
from pathlib import Path
from typing import Any

from .transient import is_transient

try:
    import fcntl
except ImportError:  # pragma: no cover - only where fcntl is missing (Windows)
    fcntl = None  # type: ignore[assignment]

__all__ = ["LockLost", "StudyLock", "find_backend"]

_log = logging.getLogger("hfsweep.sweep")
#: attributes under which storage wrappers (Optuna's cache, retrying wrappers) keep the storage
#: they wrap
_WRAPPED = ("_backend", "_storage", "storage", "backend", "_inner", "inner", "__wrapped__")


def find_backend(storage: Any, test: Callable[[Any], bool]) -> Any | None:
    """The first object in the chain of wrappers from ``storage`` for which ``test`` holds
    (``storage`` itself included), or ``None``."""
    seen: set[int] = set()
    todo = [storage]
    while todo:
        obj = todo.pop(0)
        if obj is None or id(obj) in seen:
            continue
        seen.add(id(obj))
        if test(obj):
            return obj
        todo += [getattr(obj, name, None) for name in _WRAPPED]
    return None


class LockLost(Exception):
    """A connection to the database was lost inside :meth:`StudyLock.fenced`: the study lock,
    held by a connection of the same server, may have been released meanwhile, so whatever was
    counted under it must be counted again under a renewed lock."""


def _advisory_key(name: str) -> int:
    """A signed 64-bit key for ``pg_advisory_lock``, the same in every process."""
    digest = hashlib.sha256(f"hfsweep study {name}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


class StudyLock:
    """The lock of the study named ``study_name`` in ``storage`` (see the module docstring);
    ``with lock:`` holds it. Re-entrant within the process."""

    def __init__(self, storage: Any, study_name: str) -> None:
        self._name = study_name
        self._mutex = threading.RLock()
        self._depth = 0
        self._held: AbstractContextManager[Any] | None = None
        #: the connection holding a database lock, while it is held (see :meth:`intact`)
        self._conn: Any = None
        self._check: Callable[[Any], bool] | None = None
        self.kind, self._take = self._choose(storage)
        #: the retrier of a storage that rides out a database restart (hfsweep.storage.database):
        #: the lock is taken through it too, else a restart would end the sweep at the next hook
        self._retrier = getattr(
            find_backend(storage, lambda o: hasattr(o, "_retrier")), "_retrier", None
        )

    def _choose(self, storage: Any) -> tuple[str, Callable[[], AbstractContextManager[Any]]]:
        journal = find_backend(storage, lambda o: callable(getattr(o, "held", None)))
        if journal is not None:
            return "journal file lock", journal.held
        rdb = find_backend(storage, lambda o: type(getattr(o, "engine", None)).__name__ == "Engine")
        if rdb is not None:
            engine = rdb.engine
            dialect = engine.dialect.name
            if dialect == "postgresql":
                return "PostgreSQL advisory lock", lambda: self._advisory(engine)
            if dialect in ("mysql", "mariadb"):
                return "MySQL named lock", lambda: self._named(engine)
            if dialect == "sqlite" and engine.url.database not in (None, "", ":memory:"):
                path = Path(str(engine.url.database)).expanduser().resolve()
                return "SQLite file lock", lambda: _flocked(Path(f"{path}.hfsweep-lock"))
            if dialect == "sqlite":
                return "in-process lock", nullcontext
        warnings.warn(
            f"hfsweep cannot lock study {self._name!r} in a storage of type "
            f"{type(storage).__name__} across processes: drivers on other machines sharing it "
            "could ask more than budget.trials between them",
            stacklevel=2,
        )
        return "in-process lock", nullcontext

    def __enter__(self) -> StudyLock:
        self._mutex.acquire()
        try:
            if self._depth == 0:
                self._held = self._retrier.run(self._enter) if self._retrier else self._enter()
            self._depth += 1
        except BaseException:
            self._mutex.release()
            raise
        return self

    def fenced(self) -> AbstractContextManager[None]:
        """A block (under the lock) in which a lost database connection raises
        :class:`LockLost` instead of being tried again: the lock may have died with it. Only
        for a storage that retries lost connections; elsewhere the block is plain."""
        return self._retrier.fenced() if self._retrier is not None else nullcontext()

    def intact(self) -> bool:
        """Whether the lock is still held by the connection that took it (a database lock
        dies with its connection, and a server restart ends every connection). Call it while
        holding the lock; always true for locks that are no database connection's."""
        if self._conn is None or self._check is None:
            return True
        try:
            return bool(self._check(self._conn))
        except Exception:
            return False

    def renew(self) -> None:
        """Take the lock again while holding it (after :class:`LockLost`, or when
        :meth:`intact` says it was lost), waiting for the storage as taking it does."""
        with self._mutex:
            if self._depth == 0:
                raise RuntimeError("StudyLock.renew() outside a `with lock:` block")
            held, self._held = self._held, None
            if held is not None:
                with suppress(Exception):  # its connection is gone, and so is the lock
                    held.__exit__(None, None, None)
            self._held = self._retrier.run(self._enter) if self._retrier else self._enter()

    def _enter(self) -> AbstractContextManager[Any]:
        held = self._take()  # a new one on every try: a failed __enter__ cannot be retried
        held.__enter__()
        return held

    def __exit__(self, *exc: object) -> None:
        try:
            self._depth -= 1
            if self._depth == 0 and self._held is not None:
                held, self._held = self._held, None
                try:
                    held.__exit__(None, None, None)
                except Exception as error:
                    # a database lock dies with its connection: a lost one has released it
                    if not is_transient(error):
                        raise
        finally:
            self._mutex.release()

    @contextmanager
    def _holding(self, conn: Any, check: Callable[[Any], bool]) -> Iterator[None]:
        """Keep ``conn`` (holding the lock) and how to ask it whether it still does."""
        self._conn, self._check = conn, check
        try:
            yield
        finally:
            self._conn = self._check = None

    @contextmanager
    def _advisory(self, engine: Any) -> Iterator[None]:
        from sqlalchemy import text

        key = _advisory_key(self._name)
        held = text(
            "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' "
            "AND pid = pg_backend_pid() AND granted)"
        )
        with engine.connect() as conn:
            conn.execute(text("SELECT pg_advisory_lock(:k)"), {"k": key})
            try:
                with self._holding(conn, lambda c: c.execute(held).scalar()):
                    yield
            finally:
                conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": key})
                conn.commit()

    @contextmanager
    def _named(self, engine: Any) -> Iterator[None]:
        from sqlalchemy import text

        name = f"hfsweep:{hashlib.sha256(self._name.encode()).hexdigest()[:40]}"
        held = text("SELECT IS_USED_LOCK(:n) = CONNECTION_ID()")
        with engine.connect() as conn:
            conn.execute(text("SELECT GET_LOCK(:n, -1)"), {"n": name})
            try:
                with self._holding(conn, lambda c: c.execute(held, {"n": name}).scalar()):
                    yield
            finally:
                conn.execute(text("SELECT RELEASE_LOCK(:n)"), {"n": name})
                conn.commit()


@contextmanager
def _flocked(path: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``path`` (created if missing), released when the block ends
    or the process dies."""
    if fcntl is None:  # pragma: no cover - only where fcntl is missing (Windows)
        yield
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
