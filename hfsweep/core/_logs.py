"""Where a sweep's log lines go while it runs: hfsweep's INFO messages into the run directory's
``sweep.log``, and Optuna's own per-trial lines kept quiet (they would drown the progress line;
the log and trials.csv hold the same information).

A log file that cannot be written (a full disk, an I/O error, a folder removed or made
read-only) says so once, in one line on stderr naming the file and the reason, and is written
no more: the sweep goes on and ends with its own message, instead of Python's logging printing a
traceback for every record (:class:`QuietFileHandler`).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["QuietFileHandler", "logged_to", "quiet_optuna"]


class QuietFileHandler(logging.FileHandler):
    """A :class:`logging.FileHandler` that, when writing fails, says once on stderr which file
    could not be written and why, and then drops every record (it writes to that file no more;
    flushing and closing it raise nothing). Python's own handler prints a traceback for every
    record instead, and a full disk buries the sweep's final message under them."""

    def __init__(self, filename: str | Path, encoding: str | None = "utf-8") -> None:
        super().__init__(filename, encoding=encoding)
        self.failed = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.failed:
            super().emit(record)

    def flush(self) -> None:
        if self.failed:
            return
        try:
            super().flush()
        except OSError as exc:
            self._fail(exc)

    def close(self) -> None:
        try:
            super().close()
        except OSError as exc:  # the last flush of a file that just filled up
            self._fail(exc)

    def handleError(self, record: logging.LogRecord) -> None:
        exc = sys.exc_info()[1]
        if not isinstance(exc, OSError):
            super().handleError(record)  # a bad format string: logging's own report
            return
        self._fail(exc)

    def _fail(self, exc: OSError) -> None:
        if self.failed:
            return
        self.failed = True
        reason = exc.strerror or str(exc) or type(exc).__name__
        with contextlib.suppress(Exception):  # stderr itself is gone: nothing left to tell
            sys.stderr.write(
                f"hfsweep: cannot write the log {self.baseFilename} ({reason}); it is written "
                "no more, the sweep goes on\n"
            )
        stream, self.stream = self.stream, None
        if stream is not None:
            with contextlib.suppress(OSError):  # its buffer cannot be written either
                stream.close()


@contextmanager
def logged_to(path: Path) -> Iterator[None]:
    """Log hfsweep's INFO messages to ``path`` (the run directory's ``sweep.log``) until the
    block ends; the ``hfsweep`` logger's level is put back as it was."""
    logger = logging.getLogger("hfsweep")
    handler = QuietFileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.setLevel(logging.INFO)
    level = logger.level
    logger.addHandler(handler)
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        handler.close()


@contextmanager
def quiet_optuna() -> Iterator[None]:
    """Optuna's per-trial INFO lines and experimental-feature warnings off until the block
    ends (its verbosity put back as it was)."""
    import optuna

    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            yield
    finally:
        optuna.logging.set_verbosity(verbosity)
