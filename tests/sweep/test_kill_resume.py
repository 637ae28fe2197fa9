"""`hfsweep run` killed mid-sweep (SIGKILL, or Ctrl-C) and run again with --resume.

The plain SIGKILL of `hfsweep run` on the Ray backend is tests/test_lifecycle.py's ``ray-cli``
case (the same kill and resume, checked further: refills, resumed arrays, every trial as alone);
here: the refusal to run again without --resume, elastic arrays, and Ctrl-C."""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import pytest
from optuna.trial import TrialState

from ._killed import (
    _study,
    check_final_study,
    finished,
    interrupt_after,
    reaped,
    start_cli,
    unlogged_tells,
    wait_for_tells,
)
from ._toy import HOLD_AFTER

TOY = Path(__file__).resolve().parent / "_toy.py"
#: as tests/test_lifecycle.py: three arrays of 4 at first, ASHA stops some and refills their slots
TRIALS = 12

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs POSIX signals"),
]


def _write_sweep(folder: Path, backend: str = "local") -> Path:
    sweep = folder / "sweep.yaml"
    sweep.write_text(
        f"""
task: "{TOY}:HELD_TASK"
search_space:
  lr: {{type: float, low: 1.0e-3, high: 0.5, log: true}}
  momentum: {{type: float, low: 0.0, high: 0.9}}
searcher: random
scheduler: {{name: asha, options: {{grace_period: 1, reduction_factor: 2}}}}
budget: {{trials: {TRIALS}, epochs: 4}}
metric: val_accuracy
mode: max
fusion: {{size: 4, device: cpu}}
backend: {backend.split("-")[0]}
output: run
"""
        + (_ELASTIC if backend == "ray-elastic" else "")
    )
    return sweep


#: elastic arrays: data-parallel on 1 or 2 workers, resized as arrays start and end
_ELASTIC = "ray: {elastic: {enabled: true, max_workers_per_array: 2, resize_every_s: 0}}\n"


@pytest.mark.parametrize("backend", ["local", "ray-elastic"])
def test_sigkill_then_resume_finishes_the_sweep(
    tmp_path: Path, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The killed run trains HELD_TASK, which stops drawing batches after two tells, so the
    SIGKILL lands mid-sweep however late it is sent. With elastic arrays the resumed run starts
    a new local Ray and continues two arrays at once from their checkpoints, whatever workers
    each had. (Plain ``backend: ray``: tests/test_lifecycle.py's ``ray-cli`` case.)"""
    if backend.startswith("ray"):
        pytest.importorskip("ray")
    sweep = _write_sweep(tmp_path, backend)
    run = tmp_path / "run"
    monkeypatch.setenv("HFSWEEP_TEST_HOLD_LOG", str(run / "sweep.log"))
    # in a session of its own: a killed driver's local Ray leaves processes behind, ended here
    with reaped(start_cli(sweep, session=True)) as proc:
        interrupt_after(proc, run, HOLD_AFTER, signal.SIGKILL)
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert finished(run) < TRIALS  # killed mid-sweep
    # a tell in flight when the kill came: told to the study, its log line cut off
    unlogged = unlogged_tells(run)
    assert len(unlogged) <= 1, unlogged
    # the elastic allocator's totals as of the killed driver's last plan, which the resumed
    # run goes on from
    earlier = json.loads((run / "elastic.json").read_text()) if backend == "ray-elastic" else {}
    monkeypatch.delenv("HFSWEEP_TEST_HOLD_LOG")  # the runs after this one are not held

    again = start_cli(sweep)
    _out, err = again.communicate(timeout=300)
    assert again.returncode == 2 and "--resume" in err  # not without --resume
    with reaped(start_cli(sweep, "--resume", session=True)) as resumed:
        _out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    check_final_study(run, TRIALS, unlogged)
    if earlier:
        totals = json.loads((run / "elastic.json").read_text())
        assert totals["plans"] > earlier["plans"] > 0
        assert totals["arrays_waited_s"] >= earlier["arrays_waited_s"]
        assert totals["workers_idle_s"] >= earlier["workers_idle_s"]


def test_ctrl_c_stops_cleanly_and_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The interrupted run trains HELD_TASK, which stops drawing batches after two tells, so the
    sweep is still running when Ctrl-C reaches it however late the test sends it."""
    sweep = _write_sweep(tmp_path)
    run = tmp_path / "run"
    monkeypatch.setenv("HFSWEEP_TEST_HOLD_LOG", str(run / "sweep.log"))
    proc = start_cli(sweep)
    wait_for_tells(proc, run, HOLD_AFTER)
    monkeypatch.delenv("HFSWEEP_TEST_HOLD_LOG")
    # a second run on the directory while the first is in it is refused before it touches it
    before = (run / "state.json").read_bytes()
    second = start_cli(sweep, "--resume")
    _out, err = second.communicate(timeout=300)
    assert second.returncode == 2
    assert re.search(rf"is in use by another sweep \(process [^:]+:{proc.pid},", err), err
    assert (run / "state.json").read_bytes() == before
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert "interrupted" in err and "--resume" in err and "Traceback" not in err
    resumed = start_cli(sweep, "--resume")  # the hold is off: HFSWEEP_TEST_HOLD_LOG is unset
    _out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    check_final_study(run, TRIALS)


@pytest.mark.parametrize("backend", ["local", "ray"])
def test_sigterm_stops_cleanly_and_resumes(
    tmp_path: Path, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM (timeout, docker stop, Slurm, Kubernetes) takes Ctrl-C's path, on Ray too (whose
    ray.init installs a SIGTERM handler that would exit 15 unsaid): exit 143, the command that
    resumes, the trials in training left RUNNING, and the resumed run tells each trial once.
    HELD_TASK holds its arrays between two steps, mid-epoch, after two tells, and never lets
    them go on: the stop is honoured there, at the step the arrays are at."""
    if backend == "ray":
        pytest.importorskip("ray")
    sweep = _write_sweep(tmp_path, backend)
    run = tmp_path / "run"
    monkeypatch.setenv("HFSWEEP_TEST_HOLD_LOG", str(run / "sweep.log"))
    with reaped(start_cli(sweep, session=True)) as proc:
        interrupt_after(proc, run, HOLD_AFTER, signal.SIGTERM)
        _out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "hfsweep run: stopped by SIGTERM. Every finished trial is recorded in run;" in err
    assert f"continue with: hfsweep run {sweep} --resume" in err and "Traceback" not in err
    assert "the sweep was stopped by SIGTERM" in (run / "sweep.log").read_text()
    study = _study(run)
    assert any(t.state == TrialState.RUNNING for t in study.get_trials())  # for --resume
    assert finished(run) < TRIALS
    monkeypatch.delenv("HFSWEEP_TEST_HOLD_LOG")
    with reaped(start_cli(sweep, "--resume", session=True)) as resumed:
        _out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    check_final_study(run, TRIALS)
