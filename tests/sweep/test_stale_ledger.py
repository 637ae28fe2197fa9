"""A ledger (``state.json`` + ``state.jsonl``) older than the study it resumes with: the study
holds finished trials of this driver that the ledger does not list as ended. That happens when a
copy of the two files is restored from a backup while the study (its journal, its database) went
on, when a sweep is killed while it stops after a failure (its trials are told FAIL one by one,
the ledger saved once after), and when a power cut keeps the journal's last lines but not the
ledger's (both are flushed in groups). The resume must not take it silently: it rebuilds the
missing ends from the study when nothing the scheduler decided from is lost (the scheduler then
hears of them, the best kept checkpoints are ranked again), and refuses, naming the file and
what to do, when it is (the trials' reports to a scheduler that ranks them are not in it)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import optuna
import pytest

import hfsweep as hs
from hfsweep.core.ledger import Ledger

from . import _broken
from ._toy import sweep_config

_ASHA = {"name": "asha", "options": {"grace_period": 1, "reduction_factor": 2}}


def _study(run: Path) -> list[optuna.trial.FrozenTrial]:
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    storage = JournalStorage(JournalFileBackend(str(run / "optuna.journal")))
    name = json.loads((run / "sweep.json").read_text())["study_name"]
    return optuna.load_study(study_name=name, storage=storage).get_trials()


def _ended(run: Path) -> dict[str, str]:
    """The ends the run directory's ledger holds: the snapshot's and its log's."""
    from hfsweep.core._rundir import RunDir

    saved = RunDir(run).read_state()
    assert saved is not None
    ended = dict(saved["ended"])
    for record in saved["changes"]:
        for change in record["c"]:
            if change[0] == "end":
                ended[change[1]] = change[2]
    return ended


def _finished(run: Path) -> dict[str, str]:
    done = {"COMPLETE": "completed", "PRUNED": "stopped", "FAIL": "failed"}
    return {f"trial-{t.number}": done[t.state.name] for t in _study(run) if t.state.name in done}


def _restore_older_copy(run: Path, copy: Path) -> None:
    for name in ("state.json", "state.jsonl"):
        shutil.copy2(copy / name, run / name)


def _sweep_with_an_older_ledger(tmp_path: Path, **overrides: Any) -> tuple[Path, dict[str, Any]]:
    """A run directory whose ledger is a copy taken after 2 trials, restored after 4."""
    run = tmp_path / "run"
    copy = tmp_path / "copy"
    config = sweep_config(run, budget={"trials": 2, "epochs": 2}, **overrides)
    hs.sweep(config, progress=False)
    copy.mkdir()
    for name in ("state.json", "state.jsonl"):
        shutil.copy2(run / name, copy / name)
    config["budget"] = {"trials": 4, "epochs": 2}
    hs.sweep(config, resume=True, progress=False)
    assert len(_finished(run)) == 4
    _restore_older_copy(run, copy)
    assert set(_ended(run)) == {"trial-0", "trial-1"}
    config["budget"] = {"trials": 6, "epochs": 2}
    return run, config


def test_a_restored_older_ledger_gets_the_ends_it_lacks_from_the_study(tmp_path: Path) -> None:
    """FIFO decides nothing from the reports, so the ends are rebuilt: the scheduler hears of
    trials 2 and 3, the ledger saves them, the kept checkpoints are ranked with them, and a
    warning names the trials and the file."""
    run, config = _sweep_with_an_older_ledger(tmp_path)
    heard: list[str] = []
    end = Ledger.end

    def spy(self: Ledger, member: str, status: Any) -> bool:
        heard.append(member)
        return end(self, member, status)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Ledger, "end", spy)
        with pytest.warns(UserWarning, match=r"state\.json.*trials 2, 3 as ended nor array 1") as w:
            result = hs.sweep(config, resume=True, progress=False)
    assert heard[:2] == ["trial-2", "trial-3"]
    assert "older copy restored from a backup" in str(w[0].message)
    assert result.counts["completed"] == 6
    # array 1 (trials 2 and 3) is recorded again, done; the new trials trained in array 2
    assert result.arrays == 3
    saved = json.loads((run / "state.json").read_text())
    assert [(a["index"], a["done"]) for a in saved["arrays"]] == [(0, True), (1, True), (2, True)]
    assert {t.user_attrs["array"] for t in _study(run) if t.number >= 4} == {2}
    assert _ended(run) == _finished(run)
    kept = {n for _, n in saved["best"]}
    ranked = sorted(
        (t for t in _study(run) if t.state.name == "COMPLETE"),
        key=lambda t: (-(t.value or 0.0), t.number),
    )
    assert kept == {t.number for t in ranked[:3]}
    assert {p.name for p in (run / "checkpoints").iterdir()} == {f"trial-{n}.pt" for n in kept}


def test_a_restored_older_ledger_whose_scheduler_lost_reports_is_refused(
    tmp_path: Path,
) -> None:
    """ASHA ranks trials by what they reported: the copy lacks trials 2 and 3's reports, so
    its rungs are not those the sweep decided with. The resume is refused before anything is
    written, naming the file and the way out; the newest ledger, restored, resumes."""
    run, config = _sweep_with_an_older_ledger(tmp_path, scheduler=_ASHA)
    before = {p: p.read_bytes() for p in (run / "state.json", run / "state.jsonl")}
    with pytest.raises(hs.SweepError) as info:
        hs.sweep(config, resume=True, progress=False)
    message = str(info.value)
    assert str(run / "state.json") in message and "trials 2, 3" in message, message
    assert "older" in message and "restore" in message.lower(), message
    assert {p: p.read_bytes() for p in before} == before
    assert len(_study(run)) == 4


def test_a_sweep_killed_while_it_stops_resumes_with_every_failed_trial_ended(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A task error stops the sweep: each unfinished trial is told FAIL, then the ledger is
    saved once. Killed in between (here: the ledger's writes never reach the disk), the study
    holds FAIL trials the ledger does not; the resume rebuilds their ends."""
    config = _config(tmp_path)
    killed = {"now": False}
    stop = _engine()._stop
    save, compact = Ledger.save, Ledger.compact

    def stopping(self: Any, failed: Any) -> Any:
        killed["now"] = True
        return stop(self, failed)

    monkeypatch.setattr(_engine(), "_stop", stopping)
    monkeypatch.setattr(Ledger, "save", lambda self: None if killed["now"] else save(self))
    monkeypatch.setattr(Ledger, "compact", lambda self: None if killed["now"] else compact(self))
    with pytest.raises(hs.TrainingError):
        hs.sweep(config, progress=False)
    monkeypatch.undo()
    run = tmp_path / "run"
    failed = _finished(run)
    assert failed and set(failed.values()) == {"failed"}
    assert not set(failed) <= set(_ended(run))

    monkeypatch.setattr(_broken, "BATCH_16_FIXED", True)
    with pytest.warns(UserWarning, match="state.json"):
        result = hs.sweep(config, resume=True, progress=False)
    assert result.counts["failed"] == len(failed) and result.counts["running"] == 0
    assert _ended(run) == _finished(run)


def _config(tmp_path: Path) -> dict[str, Any]:
    return {
        "task": _broken.BATCH_16,
        "search_space": {"lr": {"type": "float", "low": 1e-3, "high": 0.5, "log": True}},
        "searcher": "random",
        "budget": {"trials": 6, "epochs": 2},
        "metric": "val_loss",
        "mode": "min",
        "fusion": {"size": 2, "device": "cpu"},
        "output": str(tmp_path / "run"),
    }


def _engine() -> Any:
    from hfsweep.core.loop import _Engine

    return _Engine


def test_a_torn_last_line_of_the_ledgers_log_loses_an_end_the_study_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The journal and the ledger's log are flushed to disk in groups: a power cut can keep the
    journal's record of a trial's end and tear the log's line holding it. Reading drops the
    torn line; the resume rebuilds the end from the study."""
    run = tmp_path / "run"
    config = sweep_config(run, budget={"trials": 4, "epochs": 2})
    compact = Ledger.compact
    compactions = {"n": 0}

    def first_only(self: Ledger) -> None:  # killed before the last compaction
        compactions["n"] += 1
        if compactions["n"] == 1:
            compact(self)

    monkeypatch.setattr(Ledger, "compact", first_only)
    hs.sweep(config, progress=False)
    monkeypatch.undo()
    log = run / "state.jsonl"
    lines = log.read_bytes().splitlines(keepends=True)
    last_end = max(i for i, line in enumerate(lines) if b'["end", ' in line)
    ended_there = [c[1] for c in json.loads(lines[last_end])["c"] if c[0] == "end"]
    log.write_bytes(b"".join(lines[:last_end]) + lines[last_end][: len(lines[last_end]) // 2])
    assert not set(ended_there) & set(_ended(run))

    with pytest.warns(UserWarning, match="state.json"):
        result = hs.sweep(config, resume=True, progress=False)
    assert result.counts == {"completed": 4, "stopped": 0, "failed": 0, "running": 0}
    assert _ended(run) == _finished(run)
