"""A sweep log that cannot be written (a full disk, an I/O error) says so once, in one line on
stderr, and is written no more; the sweep still ends with its own message. Python's logging
would print a traceback of a dozen lines for every record instead."""

from __future__ import annotations

import errno
import io
import logging
import os
from pathlib import Path

import pytest

from hfsweep.cli import main
from hfsweep.core._logs import QuietFileHandler, logged_to


class _FullDisk(io.StringIO):
    """A stream whose every write fails as on a full disk; counts the writes tried."""

    def __init__(self) -> None:
        super().__init__()
        self.tries = 0

    def write(self, text: str) -> int:
        self.tries += 1
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_failing_stream_is_reported_once_and_then_left_alone(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "sweep.log"
    log = logging.getLogger("hfsweep.test_log_file_fails")
    full = _FullDisk()
    with logged_to(path):
        handler = next(
            h for h in logging.getLogger("hfsweep").handlers if h.baseFilename == str(path)
        )  # type: ignore[attr-defined]
        handler.stream = full  # type: ignore[attr-defined]
        for i in range(50):
            log.info("record %d", i)
            log.error("failed %d", i, exc_info=ValueError("x"))
    err = capfd.readouterr().err
    assert err == (
        f"hfsweep: cannot write the log {path} (No space left on device); it is written no "
        "more, the sweep goes on\n"
    )
    assert full.tries == 1  # not tried again


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full here")
def test_a_full_device_fails_at_the_flush_and_at_the_close_once(
    capfd: pytest.CaptureFixture[str],
) -> None:
    handler = QuietFileHandler("/dev/full")
    handler.setLevel(logging.INFO)
    log = logging.getLogger("hfsweep.test_log_file_fails.dev_full")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        for i in range(20):
            log.warning("record %d", i)
    finally:
        log.removeHandler(handler)
        handler.close()  # its buffer cannot be written either: no error
    err = capfd.readouterr().err
    assert err.splitlines() == [
        "hfsweep: cannot write the log /dev/full (No space left on device); it is written no "
        "more, the sweep goes on"
    ]


def test_a_format_error_is_still_reported_as_logging_does(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Only a failing file is silenced: a record that cannot be formatted is a bug in the
    caller, and logging's own report names it."""
    handler = QuietFileHandler(tmp_path / "x.log")
    record = logging.LogRecord("hfsweep", logging.INFO, __file__, 1, "%d", ("not a number",), None)
    handler.emit(record)
    handler.close()
    assert "--- Logging error ---" in capfd.readouterr().err
    assert not handler.failed


def test_a_sweep_whose_log_fills_the_disk_ends_with_its_own_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    from tests.sweep.test_pg_storage import TOY_SWEEP

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(QuietFileHandler, "_open", lambda self: _FullDisk())
    Path("sweep.yaml").write_text(TOY_SWEEP, encoding="utf-8")
    assert main(["run", "sweep.yaml", "--quiet"]) == 0  # no progress line on stderr
    captured = capfd.readouterr()
    log = tmp_path / "runs" / "sweep" / "sweep.log"
    assert captured.err.splitlines() == [
        f"hfsweep: cannot write the log {log} (No space left on device); it is written no "
        "more, the sweep goes on"
    ]
    assert (log.parent / "best.json").is_file() and (log.parent / "trials.csv").is_file()
