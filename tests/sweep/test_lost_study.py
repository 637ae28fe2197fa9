"""The run directory's study journal (``optuna.journal``) deleted: while the sweep runs, or
before ``--resume``. The sweep says what was lost (the trials ``trials.csv`` lists) and stops
with exit 2; a resume refuses to start a new, empty study in its place, which would train the
finished trials again."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import hfsweep as hs
from hfsweep.cli import main

from ._toy import sweep_config

TOY = Path(__file__).resolve().parent / "_toy.py"


def _write_sweep(folder: Path) -> Path:
    sweep = folder / "sweep.yaml"
    sweep.write_text(
        f"""
task: "{TOY}:TASK"
search_space:
  lr: {{type: float, low: 1.0e-3, high: 0.5, log: true}}
searcher: random
scheduler: fifo
budget: {{trials: 4, epochs: 1}}
metric: val_accuracy
mode: max
fusion: {{size: 2, device: cpu}}
output: run
"""
    )
    return sweep


def test_a_resume_without_the_journal_says_what_was_lost_and_starts_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sweep, run = _write_sweep(tmp_path), tmp_path / "run"
    assert main(["run", str(sweep), "--quiet"]) == 0
    capsys.readouterr()
    (run / "optuna.journal").unlink()
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file() and p.name != ".lock"}

    assert main(["run", str(sweep), "--quiet", "--resume"]) == 2
    err = capsys.readouterr().err
    assert f"{run / 'optuna.journal'} is missing" in err
    assert f"4 trial(s) as {run / 'trials.csv'} lists them (4 completed)" in err
    assert "start a new, empty study" in err and "Restore optuna.journal" in err
    assert "--output NEW_DIR" in err and "bug in hfsweep" not in err
    # nothing was started or rewritten: no new study, the ledger and trials.csv as they were
    assert not (run / "optuna.journal").exists()
    after = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file() and p.name != ".lock"}
    assert after.keys() == before.keys()
    for name in ("trials.csv", "state.json", "state.jsonl", "best.json"):
        assert after[name] == before[name], name


class _DeleteJournal(hs.Callback):
    """Deletes the run directory's journal as the first trial ends, as a user's cleanup
    script might while the sweep runs."""

    def __init__(self, run: Path) -> None:
        self.run = run

    def on_trial_end(self, trial: Any, status: Any, value: Any, error: Any) -> None:
        (self.run / "optuna.journal").unlink(missing_ok=True)


def test_a_journal_deleted_while_the_sweep_runs_stops_it_with_what_was_lost(
    tmp_path: Path,
) -> None:
    run = tmp_path / "run"
    config = sweep_config(run, budget={"trials": 4, "epochs": 1}, fusion={"size": 2})
    with pytest.raises(hs.SweepError) as caught:
        hs.sweep(config, progress=False, callbacks=[_DeleteJournal(run)])
    message = str(caught.value)
    assert message.startswith(f"{run / 'optuna.journal'}, the study's journal, was deleted")
    assert "which is lost with it: this run had 4 trial(s) in it" in message
    assert "start a new, empty study" in message
    assert "bug in hfsweep" not in message
    # no new journal in its place, holding a study without its first records
    assert not (run / "optuna.journal").exists()
    with pytest.raises(hs.SweepError, match=r"optuna\.journal is missing"):
        hs.sweep(config, resume=True, progress=False)
    assert not (run / "optuna.journal").exists()
