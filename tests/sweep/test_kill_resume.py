"""`hfsweep run` killed mid-sweep (SIGKILL, or Ctrl-C) and run again with --resume."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import optuna
import pytest
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState

from ._toy import HOLD_AFTER, _tells

TOY = Path(__file__).resolve().parent / "_toy.py"
TRIALS = 24

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs POSIX signals"),
]


def _write_sweep(folder: Path, backend: str = "local") -> Path:
    sweep = folder / "sweep.yaml"
    sweep.write_text(
        f"""
task: "{TOY}:TASK"
search_space:
  lr: {{type: float, low: 1.0e-3, high: 0.5, log: true}}
  momentum: {{type: float, low: 0.0, high: 0.9}}
searcher: random
scheduler: {{name: asha, options: {{grace_period: 1, reduction_factor: 2}}}}
budget: {{trials: {TRIALS}, epochs: 4}}
metric: val_accuracy
mode: max
fusion: {{size: 4, device: cpu}}
backend: {backend}
output: run
"""
    )
    return sweep


def _finished(run: Path) -> int:
    """Trials the sweep's log shows as told (a line per tell, flushed as it is written)."""
    return _tells(str(run / "sweep.log"))


def _start(sweep: Path, *extra: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HFSWEEP_CACHE_DIR": str(sweep.parent)}
    return subprocess.Popen(
        [sys.executable, "-m", "hfsweep.cli", "run", str(sweep), "--quiet", *extra],
        cwd=sweep.parent,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_default_sigint,
    )


def _default_sigint() -> None:
    """In the child: Ctrl-C as at a terminal. A test process that ignores SIGINT (as after a
    local Ray ran in it) would pass the ignore on, and Python then installs no handler."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _interrupt_after(proc: subprocess.Popen[str], run: Path, told: int, sig: int) -> None:
    _wait_for_tells(proc, run, told)
    proc.send_signal(sig)


def _wait_for_tells(proc: subprocess.Popen[str], run: Path, told: int) -> None:
    deadline = time.monotonic() + 240
    while _finished(run) < told:
        if proc.poll() is not None:
            _out, err = proc.communicate()
            pytest.fail(
                f"the sweep ended (exit {proc.returncode}) before it was interrupted:\n{err}"
            )
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("the sweep told no trial within 240 s")
        time.sleep(0.02)


def _check_final_study(run: Path) -> None:
    storage = optuna.storages.JournalStorage(JournalFileBackend(str(run / "optuna.journal")))
    study = optuna.load_study(study_name="sweep", storage=storage)
    trials = study.get_trials()
    assert [t.number for t in trials] == list(range(TRIALS))
    assert all(t.state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL) for t in trials)
    # each trial was told once: one "trial N <state>" log line over both runs (the study
    # itself refuses a second tell, which would have failed the resumed run)
    told = Counter(
        re.findall(
            r"hfsweep\.sweep: trial (\d+) (?:complete|pruned|fail)", (run / "sweep.log").read_text()
        )
    )
    assert told == Counter({str(n): 1 for n in range(TRIALS)})


@pytest.mark.parametrize("backend", ["local", "ray"])
def test_sigkill_then_resume_finishes_the_sweep(tmp_path: Path, backend: str) -> None:
    """With ``backend: ray`` the resumed run starts a new local Ray and continues two arrays at
    once from their checkpoints."""
    if backend == "ray":
        pytest.importorskip("ray")
    sweep = _write_sweep(tmp_path, backend)
    run = tmp_path / "run"
    proc = _start(sweep)
    _interrupt_after(proc, run, 3, signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert _finished(run) < TRIALS  # killed mid-sweep

    again = _start(sweep)
    _out, err = again.communicate(timeout=300)
    assert again.returncode == 2 and "--resume" in err  # not without --resume
    resumed = _start(sweep, "--resume")
    _out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    _check_final_study(run)


def test_ctrl_c_stops_cleanly_and_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The interrupted run trains HELD_TASK, which stops drawing batches after two tells, so the
    sweep is still running when Ctrl-C reaches it however late the test sends it."""
    sweep = _write_sweep(tmp_path)
    sweep.write_text(sweep.read_text().replace(":TASK", ":HELD_TASK"))
    run = tmp_path / "run"
    monkeypatch.setenv("HFSWEEP_TEST_HOLD_LOG", str(run / "sweep.log"))
    proc = _start(sweep)
    _wait_for_tells(proc, run, HOLD_AFTER)
    monkeypatch.delenv("HFSWEEP_TEST_HOLD_LOG")
    # a second run on the directory while the first is in it is refused before it touches it
    before = (run / "state.json").read_bytes()
    second = _start(sweep, "--resume")
    _out, err = second.communicate(timeout=300)
    assert second.returncode == 2
    assert re.search(rf"is in use by another sweep \(process [^:]+:{proc.pid},", err), err
    assert (run / "state.json").read_bytes() == before
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert "interrupted" in err and "--resume" in err and "Traceback" not in err
    resumed = _start(sweep, "--resume")  # the hold is off: HFSWEEP_TEST_HOLD_LOG is unset
    _out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    _check_final_study(run)
