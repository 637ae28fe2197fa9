"""``storage: journal://PATH``: an Optuna journal file outside the run directory, which several
drivers share: how the sweep file spells it, the checks before anything is written, a run, a
resume and a report on it, and a torn tail cut off by one driver while another reads the file."""

from __future__ import annotations

import json
import os
from pathlib import Path

import optuna
import pytest
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState

from hfsweep import report
from hfsweep.cli import main
from hfsweep.config import parse_sweep
from hfsweep.storage.journal import GroupedJournalFileBackend

TOY = Path(__file__).resolve().parent / "_toy.py"
SWEEP = f"""\
task: "{TOY}:TASK"
search_space:
  lr: {{type: float, low: 1.0e-3, high: 0.5, log: true}}
  momentum: {{type: float, low: 0.0, high: 0.9}}
searcher: random
budget: {{trials: 4, epochs: 2}}
metric: val_accuracy
mode: max
fusion: {{size: 2, device: cpu}}
output: run
"""


def _sweep(folder: Path, storage: str) -> Path:
    path = folder / "sweep.yaml"
    path.write_text(SWEEP + f"storage: {json.dumps(storage)}\n", encoding="utf-8")
    return path


def _config(storage: str, source: Path | None = None) -> str | None:
    import yaml

    data = yaml.safe_load(SWEEP)
    data["storage"] = storage
    return parse_sweep(data, source=source).storage


def test_a_relative_journal_path_is_taken_from_the_sweep_files_folder(tmp_path: Path) -> None:
    assert _config("journal://shared/study.log", tmp_path / "sweep.yaml") == (
        f"journal://{tmp_path.resolve() / 'shared' / 'study.log'}"
    )
    assert (
        _config("journal:///abs/study.log", tmp_path / "sweep.yaml") == "journal:///abs/study.log"
    )
    assert _config("journal://${WHERE}/s.log") == "journal://${WHERE}/s.log"  # expanded when opened


def test_a_journal_in_a_missing_or_read_only_folder_exits_2_naming_storage(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sweep = _sweep(tmp_path, "journal://nowhere/study.log")
    assert main(["validate", str(sweep)]) == 2
    assert main(["run", str(sweep), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "storage" in err and f"{tmp_path / 'nowhere'} does not exist" in err
    assert not (tmp_path / "run").exists()  # nothing written
    assert "Traceback" not in err

    (tmp_path / "folder").mkdir()
    assert main(["validate", str(_sweep(tmp_path, "journal://folder"))]) == 2
    assert "is a folder" in capsys.readouterr().err
    if os.geteuid() != 0:  # root writes anywhere
        (tmp_path / "locked").mkdir(mode=0o500)
        assert main(["validate", str(_sweep(tmp_path, "journal://locked/s.log"))]) == 2
        assert "is not writable" in capsys.readouterr().err


def test_a_sweep_on_a_shared_journal_runs_resumes_and_reports(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "shared").mkdir()
    sweep = _sweep(tmp_path, "journal://shared/study.log")
    journal = tmp_path / "shared" / "study.log"
    assert main(["validate", str(sweep)]) == 0
    assert f"storage journal://{journal}" in capsys.readouterr().out  # the summary names it
    assert main(["run", str(sweep), "--quiet"]) == 0
    run = tmp_path / "run"
    assert not (run / "optuna.journal").exists()
    assert json.loads((run / "sweep.json").read_text())["storage"] == f"journal://{journal}"
    study = optuna.load_study(
        study_name="sweep", storage=JournalStorage(JournalFileBackend(str(journal)))
    )
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 4
    assert main(["run", str(sweep), "--quiet", "--resume"]) == 0  # nothing left: ends at once
    assert len(report.load_study(run, report.read_sweep(run)).trials) == 4
    capsys.readouterr()
    journal.rename(tmp_path / "moved.log")  # resuming must not start over in a new file
    assert main(["run", str(sweep), "--quiet", "--resume"]) == 2
    assert f"the journal {journal} (storage journal://{journal})" in capsys.readouterr().err
    assert not journal.exists()
    saved = json.loads((run / "sweep.json").read_text())
    saved["storage"] = "journal://${HFSWEEP_TEST_UNSET}/study.log"  # a path from a variable
    (run / "sweep.json").write_text(json.dumps(saved))
    assert main(["report", str(run)]) != 0
    assert "HFSWEEP_TEST_UNSET" in capsys.readouterr().err


def test_a_read_that_stopped_at_a_torn_tail_sees_what_follows_its_repair(tmp_path: Path) -> None:
    """Driver b reads the shared file while it ends with a torn record; driver a cuts the
    tail off and appends a record of exactly its length: b must read that record (a file of
    the same size is not one with nothing new)."""
    path = tmp_path / "study.log"
    a, b = GroupedJournalFileBackend(path), GroupedJournalFileBackend(path)
    a.append_logs([{"op_code": 0, "worker_id": "a", "study_name": "s", "directions": [1]}])
    record = {"op_code": 2, "worker_id": "a", "study_id": 0, "user_attr": {"k": 1}}
    line = json.dumps(record, separators=(",", ":")) + "\n"  # as the backend writes it
    with open(path, "ab") as f:
        f.write(line[:-2].encode() + b"xy")  # as long as the line, cut before its end
    assert len(list(b.read_logs(0))) == 1
    torn = a.drop_torn_tail()
    assert torn is not None and torn.dropped == len(line)
    a.append_logs([record])
    assert [log["op_code"] for log in b.read_logs(1)] == [2]


def test_an_append_after_another_drivers_torn_record_cuts_it_off_first(tmp_path: Path) -> None:
    """Driver a dies part way through an append to the shared file; driver b, still running,
    appends next: its record must not join a's torn bytes (and be lost with them)."""
    path = tmp_path / "study.log"
    a, b = GroupedJournalFileBackend(path), GroupedJournalFileBackend(path)
    a.append_logs([{"op_code": 0, "worker_id": "a", "study_name": "s", "directions": [1]}])
    with open(path, "ab") as f:
        f.write(b'{"op_code":6,"worker_id":"a","trial_id":3,"sta')  # a killed mid-write
    b.append_logs([{"op_code": 2, "worker_id": "b", "study_id": 0, "user_attr": {"k": 1}}])
    logs = list(JournalFileBackend(str(path)).read_logs(0))
    assert [(log["op_code"], log["worker_id"]) for log in logs] == [(0, "a"), (2, "b")]
    (copy,) = tmp_path.glob("study.log.torn-*")  # the file as a left it is kept
    assert copy.read_bytes().endswith(b'"trial_id":3,"sta')
