"""Helpers for tests that run a sweep in a subprocess, interrupt it (SIGKILL, Ctrl-C) and resume
it: start the CLI, wait for the sweep's log to show tells, check the study it ends with, and
end what is left of a killed process's session (its local Ray)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path

import optuna
import pytest
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState

from ._toy import _tells

#: a line of the sweep's log per trial told (flushed as it is written)
TOLD_LINE = r"hfsweep\.sweep: trial (\d+) (?:completed|stopped|failed)"


def start_cli(sweep: Path, *extra: str, session: bool = False) -> subprocess.Popen[str]:
    """``hfsweep run sweep --quiet *extra`` in ``sweep``'s folder; ``session``: in a session of
    its own, so that :func:`end_session` can end what it leaves behind when killed."""
    return start_python(
        ["-m", "hfsweep.cli", "run", str(sweep), "--quiet", *extra], sweep.parent, session=session
    )


def start_python(
    args: list[str], cwd: Path, *, session: bool = False, env: Mapping[str, str] | None = None
) -> subprocess.Popen[str]:
    """This Python with ``args``, in ``cwd``, output unbuffered, profiles cached in ``cwd``,
    ``env`` added to this process's environment."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HFSWEEP_CACHE_DIR": str(cwd), **(env or {})}
    return subprocess.Popen(
        [sys.executable, *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_default_sigint,
        start_new_session=session,
    )


def _default_sigint() -> None:
    """In the child: Ctrl-C as at a terminal. A test process that ignores SIGINT (as after a
    local Ray ran in it) would pass the ignore on, and Python then installs no handler."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def finished(run: Path) -> int:
    """Trials the sweep's log shows as told (a line per tell, flushed as it is written)."""
    return _tells(str(run / "sweep.log"))


def wait_for_tells(proc: subprocess.Popen[str], run: Path, told: int) -> None:
    """Wait until the sweep in ``run`` has told ``told`` trials; fail if it ends first."""
    deadline = time.monotonic() + 240
    while finished(run) < told:
        if proc.poll() is not None:
            _out, err = proc.communicate()
            pytest.fail(
                f"the sweep ended (exit {proc.returncode}) before it was interrupted:\n{err}"
            )
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("the sweep told no trial within 240 s")
        time.sleep(0.02)


def interrupt_after(proc: subprocess.Popen[str], run: Path, told: int, sig: int) -> None:
    """Send ``sig`` to the sweep once it has told ``told`` trials."""
    wait_for_tells(proc, run, told)
    proc.send_signal(sig)


@contextlib.contextmanager
def reaped(proc: subprocess.Popen[str]) -> Iterator[subprocess.Popen[str]]:
    """``proc`` (started with ``session=True``), killed if still running when the block ends,
    and what is left of its session ended (:func:`end_session`)."""
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()
        end_session(proc)


def end_session(proc: subprocess.Popen[str]) -> None:
    """SIGKILL what is left of the session ``proc`` led (started with ``session=True``), by
    process id: a local Ray that a killed process had started, for one."""
    assert proc.returncode is not None
    for pid in _session_members(proc.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _session_members(sid: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if os.getsid(int(entry.name)) == sid:
                    members.append(int(entry.name))
    return members


def unlogged_tells(run: Path) -> set[int]:
    """Trials the study in ``run`` holds as ended that the sweep's log names in no tell line.
    After a SIGKILL that is at most one trial: the driver tells one trial at a time (under its
    lock) and logs the line straight after the study's tell, so a kill between the two leaves
    that one trial told, which is what matters, and its line unwritten."""
    logged = {int(n) for n in re.findall(TOLD_LINE, (run / "sweep.log").read_text())}
    ended = {t.number for t in _study(run).get_trials() if t.state.is_finished()}
    return ended - logged


def check_final_study(
    run: Path, trials: int, unlogged: set[int] | frozenset[int] = frozenset()
) -> list[optuna.trial.FrozenTrial]:
    """The study in ``run`` holds ``trials`` trials, every one finished and told once (one log
    line over every run of the sweep, none for those in ``unlogged``, told by a killed run
    whose line the kill cut off (:func:`unlogged_tells`): the study itself refuses a second
    tell, which would have failed the resumed run). Returns them."""
    found = _study(run).get_trials()
    assert [t.number for t in found] == list(range(trials))
    assert all(t.state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL) for t in found)
    told = Counter(re.findall(TOLD_LINE, (run / "sweep.log").read_text()))
    expected = Counter({str(n): 1 for n in range(trials) if n not in unlogged})
    assert told == expected, f"tell lines per trial {dict(told)}, expected {dict(expected)}"
    return found


def _study(run: Path) -> optuna.Study:
    storage = optuna.storages.JournalStorage(JournalFileBackend(str(run / "optuna.journal")))
    return optuna.load_study(study_name="sweep", storage=storage)
