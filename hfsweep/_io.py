"""Atomic file writes, and grouped flushes to disk.

An atomic write goes to a temporary file in the same folder, which is then renamed over the
target, so a crash at any moment leaves the old file or the new one, never half of one.

Written data is in the operating system's hands as soon as the write returns, so a killed
process (SIGKILL, the OOM killer, Ctrl-C) loses none of it. Only a crash of the machine itself
(a power cut) can lose what the kernel has not yet put on disk, which ``fsync`` forces. Outside a
:func:`grouped_sync` block every write is flushed to disk before it returns. Inside one (a sweep
runs inside one), flushes are grouped: each file written is flushed at most ``interval`` seconds
later, once however often it was written meanwhile, and every file when the block ends. A sweep's
bookkeeping writes a few files per trial and a journal record per operation; flushing each as it
is written took several milliseconds apiece, a large share of a sweep of small models.

Files are created with the permissions the process's umask gives (``0o666`` less the umask), as
folders are and as other tools' files are: a team sharing run directories sets a umask of
``002`` and every file is group-writable (``tempfile.mkstemp``'s files would be ``0600``).
"""

from __future__ import annotations

import os
import secrets
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import torch

__all__ = [
    "append_lines",
    "atomic_save",
    "atomic_write_text",
    "grouped_sync",
    "new_temporary",
    "read_lines",
    "written",
]


class _Flusher:
    """Flushes the files noted with :meth:`add` to disk, ``interval`` seconds after the first
    one was noted (a timer thread), or when :meth:`flush` is called.

    :meth:`add` only waits for the short lock around the set of pending files, never for the
    flushes to disk (about half a millisecond each here), which run under a lock of their own:
    a :meth:`flush` returns once everything noted before it is on disk, including files a
    flush in the timer thread took up just before.
    """

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._pending: set[str] = set()
        self._lock = threading.Lock()
        self._syncing = threading.Lock()
        self._timer: threading.Timer | None = None

    def add(self, path: str) -> None:
        with self._lock:
            self._pending.add(path)
            if self._timer is None:
                self._timer = threading.Timer(self.interval, self.flush)
                self._timer.daemon = True
                self._timer.start()

    def flush(self) -> None:
        with self._syncing:
            with self._lock:
                paths, self._pending = self._pending, set()
                if self._timer is not None:
                    self._timer.cancel()
                    self._timer = None
            for folder in {os.path.dirname(p) or "." for p in paths}:
                _fsync_path(folder)  # the renames that put the files there
            for path in paths:
                _fsync_path(path)


def _fsync_path(path: str) -> None:
    """Flush ``path`` (a file or a folder) to disk; a path gone since it was written is skipped."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_flusher: _Flusher | None = None
_flusher_lock = threading.Lock()


@contextmanager
def grouped_sync(interval: float = 1.0) -> Iterator[None]:
    """Within the block, group the flushes to disk of every file written through this module
    (and of :func:`written`'s files): each is flushed at most ``interval`` seconds after it was
    written, and all of them when the block ends. A block inside another uses the outer one's."""
    global _flusher
    with _flusher_lock:
        if _flusher is not None:
            outer = True
        else:
            outer = False
            _flusher = _Flusher(interval)
    if outer:
        yield
        return
    try:
        yield
    finally:
        with _flusher_lock:
            flusher, _flusher = _flusher, None
        if flusher is not None:
            flusher.flush()


def written(path: str | os.PathLike[str], fd: int | None = None) -> None:
    """``path`` was written: flush it to disk now (through ``fd`` when it is open), or, inside
    :func:`grouped_sync`, with the group."""
    flusher = _flusher
    if flusher is not None:
        flusher.add(os.fspath(path))
    elif fd is not None:
        os.fsync(fd)
    else:
        _fsync_path(os.fspath(path))


def new_temporary(folder: Path, prefix: str, suffix: str = "") -> tuple[int, str]:
    """``(fd, path)`` of a new empty file in ``folder`` named ``prefix``, random letters and
    ``suffix``, open for writing: ``tempfile.mkstemp`` with the umask's permissions instead
    of ``0600``, for a file that is renamed over its target."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    flags |= getattr(os, "O_BINARY", 0)
    for _ in range(100):
        path = os.path.join(folder, f"{prefix}{secrets.token_hex(4)}{suffix}")
        try:
            return os.open(path, flags, 0o666), path
        except FileExistsError:
            continue
    raise FileExistsError(f"{folder}: no free name for a temporary file {prefix}...{suffix}")


def _atomic(path: Path, mode: str, write: Callable[[IO[Any]], object]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = new_temporary(path.parent, f".{path.name}.")
    grouped = _flusher is not None
    try:
        opts: dict[str, Any] = {"encoding": "utf-8", "newline": ""} if "b" not in mode else {}
        with os.fdopen(fd, mode, **opts) as f:
            write(f)
            f.flush()
            if not grouped:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if grouped:
        written(path)


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    _atomic(path, "w", lambda f: f.write(text))


def atomic_save(obj: Any, path: Path) -> None:
    """``torch.save(obj)`` to ``path`` atomically."""
    _atomic(path, "wb", lambda f: torch.save(obj, f))


def append_lines(path: Path, lines: list[str]) -> None:
    """Append ``lines`` (each without its newline) to the UTF-8 file ``path``.

    A crash can cut the last line of an append short; the next append first ends such a line,
    so that the cut line stays on its own and :func:`read_lines` skips it.
    """
    if not lines:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    data = "".join(f"{line}\n" for line in lines).encode("utf-8")
    with open(path, "a+b") as f:
        end = f.seek(0, os.SEEK_END)
        if end > 0:
            f.seek(end - 1)
            if f.read(1) != b"\n":
                data = b"\n" + data
        f.write(data)
        f.flush()
        written(path, f.fileno())


def read_lines(path: Path) -> list[str]:
    """The lines of ``path`` without their newlines, none when the file does not exist. A last
    line cut short by a crash is left out; one that :func:`append_lines` ended later is not, so
    readers skip lines they cannot parse."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    lines = data.split(b"\n")
    return [line.decode("utf-8", errors="replace") for line in lines[:-1]]
