"""`hfsweep run` and `hfsweep report` from the command line, on a shipped example."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from hfsweep.cli import main

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.slow
def test_run_an_example_end_to_end_then_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "quick"
    assert main(["run", str(EXAMPLES / "digits_quick.yaml"), "--output", str(run)]) == 0
    out = capsys.readouterr().out
    assert "Sweep finished" in out and "Best val_accuracy" in out
    assert out.endswith(
        f"Look at the results: hfsweep report {run} (PNG plots into {run}/report)\n"
    )
    with (run / "trials.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 16 and {r["state"] for r in rows} <= {"COMPLETE", "PRUNED"}
    assert "COMPLETE" in {r["state"] for r in rows}
    # the status column says the core's word for the same end, as the trial's user attr does
    for r in rows:
        assert r["status"] == {"COMPLETE": "completed", "PRUNED": "stopped"}[r["state"]]
        assert r["status"] == r["user_attrs_status"]

    # the same command again is refused: the directory holds a sweep
    assert main(["run", str(EXAMPLES / "digits_quick.yaml"), "--output", str(run)]) == 2
    assert "--resume" in capsys.readouterr().err
    # resuming a finished sweep changes nothing, and says again where the results are
    argv = ["run", str(EXAMPLES / "digits_quick.yaml"), "--output", str(run), "--resume"]
    assert main(argv) == 0
    with (run / "trials.csv").open(newline="") as f:
        assert [r["value"] for r in csv.DictReader(f)] == [r["value"] for r in rows]
    assert f"Look at the results: hfsweep report {run} " in capsys.readouterr().out

    capsys.readouterr()
    assert main(["report", str(run)]) == 0
    paths = [Path(line) for line in capsys.readouterr().out.split()]
    assert {p.name for p in paths} >= {"history.png", "curves.png"}
    assert all(p.exists() and p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)


def test_custom_searcher_example_from_a_sweep_file(tmp_path: Path) -> None:
    """examples/custom_searcher.py through the sweep file's `searcher: {name: file.py:Class}`,
    on the fast toy task."""
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(
        f"""
task: "{Path(__file__).resolve().parent / "_toy.py"}:TASK"
search_space:
  lr: {{type: float, low: 1.0e-3, high: 0.5, log: true}}
  momentum: {{type: float, low: 0.0, high: 0.9}}
searcher: {{name: "{EXAMPLES / "custom_searcher.py"}:LocalSearch", options: {{explore: 3}}}}
budget: {{trials: 6, epochs: 2}}
metric: val_accuracy
mode: max
fusion: {{size: 2, device: cpu}}
output: run
"""
    )
    assert main(["run", str(sweep), "--quiet"]) == 0
    with (tmp_path / "run" / "trials.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 6 and {r["state"] for r in rows} == {"COMPLETE"}


def test_run_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "task: digits_mlp\nsearch_space: sgd_momentum\nbudget: {trials: 0, epochs: 1}\nmetric: val_accuracy\nmode: max\n"
    )
    assert main(["run", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "budget.trials" in err and not (tmp_path / "runs").exists()
    ray = tmp_path / "ray.yaml"
    ray.write_text(
        "task: digits_mlp\nsearch_space: sgd_momentum\nbudget: {trials: 1, epochs: 1}\n"
        "metric: val_accuracy\nmode: max\nbackend: ray\nray: {cpus_per_array: 0}\n"
    )
    assert main(["run", str(ray)]) == 2
    err = capsys.readouterr().err
    assert "ray.cpus_per_array" in err and "0" in err and not (tmp_path / "runs").exists()
    assert main(["report", str(tmp_path / "nothing")]) == 2
    assert "nothing" in capsys.readouterr().err


TOY_SWEEP = f"""
task: "{Path(__file__).resolve().parent / "_toy.py"}:TASK"
search_space: {{lr: {{type: float, low: 1.0e-3, high: 0.5, log: true}}}}
budget: {{trials: 2, epochs: 1}}
metric: val_accuracy
mode: max
fusion: {{size: 2, device: cpu}}
"""


def test_a_run_ends_with_its_run_directory_and_the_report_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The README's first command must say where the results went and how to look at them:
    the path as typed from here (runs/<sweep file's name> next to the sweep file)."""
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "my_sweep.yaml").write_text(TOY_SWEEP)
    monkeypatch.chdir(tmp_path)
    assert main(["run", "examples/my_sweep.yaml"]) == 0
    out = capsys.readouterr().out
    assert f"Run directory: {tmp_path / 'examples' / 'runs' / 'my_sweep'} (" in out
    last = out.splitlines()[-1]
    assert last == (
        "Look at the results: hfsweep report examples/runs/my_sweep "
        "(PNG plots into examples/runs/my_sweep/report)"
    )
    assert main(["report", "examples/runs/my_sweep"]) == 0  # the command it printed works
    assert "examples/runs/my_sweep/report/history.png" in capsys.readouterr().out.split()


def test_an_interrupted_run_says_how_to_resume_and_to_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import hfsweep.core.loop

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    (tmp_path / "sweep.yaml").write_text(TOY_SWEEP)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(hfsweep.core.loop, "sweep", interrupted)
    assert main(["run", "sweep.yaml", "--output", "my runs/one", "--quiet"]) == 130
    err = capsys.readouterr().err
    assert "interrupted. Every finished trial is recorded in my runs/one;" in err
    assert "continue with: hfsweep run sweep.yaml --output 'my runs/one' --resume\n" in err
    assert err.endswith("See the trials finished so far: hfsweep report 'my runs/one'\n")


def test_a_run_stopped_by_sigterm_exits_143_and_says_how_to_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """SIGTERM (timeout, docker stop, Slurm, Kubernetes) is hfsweep._signals.Terminated while a
    sweep runs: Ctrl-C's path, with the shell's status for a SIGTERM (128 + 15)."""
    import signal

    import hfsweep.core.loop
    from hfsweep._signals import Terminated

    def terminated(*args: object, **kwargs: object) -> None:
        raise Terminated(signal.SIGTERM)

    (tmp_path / "sweep.yaml").write_text(TOY_SWEEP)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(hfsweep.core.loop, "sweep", terminated)
    assert main(["run", "sweep.yaml", "--quiet"]) == 143
    err = capsys.readouterr().err
    assert "hfsweep run: stopped by SIGTERM. Every finished trial is recorded in" in err
    assert "continue with: hfsweep run sweep.yaml --resume\n" in err


def test_the_command_stopped_by_a_signal_ends_without_the_interpreter_teardown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Run as the command (no argv), a stopped run ends its process with os._exit once the
    message is out and the atexit functions ran: Python's teardown of torch, Optuna and Ray,
    seconds on a loaded machine, is skipped. A call with its own argv returns."""
    import atexit
    import os
    import signal
    import sys

    import hfsweep.core.loop

    def interrupted(*args: object, **kwargs: object) -> None:
        signal.raise_signal(signal.SIGINT)  # as a Ctrl-C would, through the run's handler

    class Ended(Exception):
        pass

    ended: list[int] = []
    at_exit: list[str] = []

    def exit_now(code: int) -> None:
        ended.append(code)
        raise Ended

    (tmp_path / "sweep.yaml").write_text(TOY_SWEEP)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(hfsweep.core.loop, "sweep", interrupted)
    monkeypatch.setattr(os, "_exit", exit_now)
    monkeypatch.setattr(atexit, "_run_exitfuncs", lambda: at_exit.append("ran"))
    monkeypatch.setattr(sys, "argv", ["hfsweep", "run", "sweep.yaml", "--quiet"])
    with pytest.raises(Ended):
        main()
    assert ended == [130] and at_exit == ["ran"]
    assert "hfsweep run: interrupted." in capsys.readouterr().err
    assert main(["run", "sweep.yaml", "--quiet"]) == 130  # called from Python: returns
