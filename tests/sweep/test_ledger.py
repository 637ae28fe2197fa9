"""The ledger (hfsweep.core.ledger): the engine's state saved as appended changes over a
snapshot, read back with the scheduler's calls replayed; its files' damage refused; the one
status vocabulary."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hfsweep.schedulers import Report, make_scheduler

import hfsweep as hs
from hfsweep import _io
from hfsweep.core._ledger_file import LedgerFile, StateVersionError
from hfsweep.core._rundir import RunDir
from hfsweep.core.ledger import Ledger
from hfsweep.core.status import Status

from ._toy import sweep_config


@dataclass
class _Array:
    index: int
    key: str
    size: int
    done: bool = False


def _ledger(folder: Path, scheduler: str = "asha") -> Ledger:
    options = {"grace_period": 1, "reduction_factor": 2} if scheduler == "asha" else {}
    made = make_scheduler(scheduler, mode="max", max_resource=4, **options)
    return Ledger(RunDir(folder).ledger_file(), made, lambda: 1.5)


def _drive(ledger: Ledger, rounds: int, first: int = 0) -> None:
    """Arrays of two members reporting at every epoch; members stopped or at budget end and
    the array's next round starts another array."""
    for r in range(first, first + rounds):
        members = [f"trial-{2 * r}", f"trial-{2 * r + 1}"]
        ledger.arrays.append(_Array(r, "k", 2))
        ledger.sizes.setdefault("k", 2)
        ledger.save()
        alive = list(members)
        for epoch in range(1, 5):
            go = ledger.decide(
                [
                    (Report(m, float(epoch), 0.1 * (r % 3) + 0.01 * i), epoch)
                    for i, m in enumerate(alive)
                ]
            )
            ledger.save()
            for m in list(alive):
                if not go[m] or epoch == 4:
                    ledger.end(m, Status.STOPPED if epoch < 4 else Status.COMPLETED)
                    alive.remove(m)
            ledger.save()
        ledger.arrays[r].done = True
        ledger.best = [(0.5, 2 * r)]
        ledger.save()


def _same(a: Ledger, b: Ledger) -> None:
    assert a.scheduler.state_dict() == b.scheduler.state_dict()
    assert a.decisions == b.decisions and a.ended == b.ended
    assert [vars(x) for x in a.arrays] == [vars(x) for x in b.arrays]
    assert (a.sizes, a.best) == (b.sizes, b.best)


@pytest.mark.parametrize("compacting", [False, True])
@pytest.mark.parametrize("scheduler", ["asha", "median", "fifo"])
def test_a_restored_ledger_equals_the_one_that_saved(
    tmp_path: Path, scheduler: str, compacting: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The snapshot plus the logged changes (the scheduler's calls replayed) rebuild the whole
    state, the scheduler's included; also when the log is compacted as it outgrows the
    snapshot (``compacting``: without a minimum size, many times here)."""
    if compacting:
        monkeypatch.setattr("hfsweep.core._ledger_file.MIN_LOG_BYTES", 0)
    ledger = _ledger(tmp_path, scheduler)
    ledger.save()  # a run's first save writes the snapshot
    _drive(ledger, 3)
    seq = json.loads((tmp_path / "state.json").read_text())["seq"]
    assert (seq > 10) == compacting  # the snapshot was rewritten as the log grew
    assert len(_io.read_lines(tmp_path / "state.jsonl")) > (1 if compacting else 10)
    again = _ledger(tmp_path, scheduler)
    again.restore(RunDir(tmp_path).read_state() or {}, _Array)
    _same(ledger, again)
    assert again.elapsed_before == 1.5
    # the restored ledger goes on saving where the first one stopped (which goes on in memory,
    # its saves elsewhere)
    _drive(again, 2, first=3)
    ledger.file = RunDir(tmp_path / "elsewhere").ledger_file()
    _drive(ledger, 2, first=3)
    third = _ledger(tmp_path, scheduler)
    third.restore(RunDir(tmp_path).read_state() or {}, _Array)
    _same(ledger, third)


def test_saves_append_and_the_snapshot_is_rewritten_rarely(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sweep's saves append to state.jsonl; state.json is written at the start, at the end
    and when the log outgrows it: a few times, not after every trial end and decision."""
    written: list[str] = []
    real = _io.atomic_write_text

    def count(path: Path, text: str) -> None:
        written.append(path.name)
        real(path, text)

    monkeypatch.setattr("hfsweep.core._ledger_file.atomic_write_text", count)
    config = sweep_config(tmp_path / "run", budget={"trials": 12, "epochs": 2})
    result = hs.sweep(config, progress=False)
    assert result.counts["completed"] == 12
    assert written.count("state.json") == 2  # the start and the end
    state = RunDir(tmp_path / "run").read_state()
    assert state is not None and state["version"] == 2 and state["changes"] == []
    assert len(state["ended"]) == 12 and set(state["ended"].values()) == {"completed"}


def _finished_run(tmp_path: Path) -> tuple[dict[str, Any], Path]:
    config = sweep_config(tmp_path / "run", budget={"trials": 4, "epochs": 2})
    hs.sweep(config, progress=False)
    return config, tmp_path / "run"


def test_a_version_1_run_directory_resumes(tmp_path: Path) -> None:
    """A run directory of the previous format (state.json rewritten whole, no log) resumes: its
    state is read as a snapshot, and the sweep goes on to a larger budget in version 2."""
    config, run = _finished_run(tmp_path)
    state = json.loads((run / "state.json").read_text())
    del state["seq"]
    state.update(version=1, ended=sorted(state["ended"]))
    (run / "state.json").write_text(json.dumps(state))
    (run / "state.jsonl").unlink()
    result = hs.sweep({**config, "budget": {"trials": 8, "epochs": 2}}, resume=True, progress=False)
    assert result.counts["completed"] == 8
    again = RunDir(run).read_state()
    assert again is not None and again["version"] == 2 and len(again["ended"]) == 8
    assert again["scheduler"]["ended"] == again["ended"]


def _log_lines(run: Path) -> list[str]:
    return (run / "state.jsonl").read_text().splitlines()


def test_a_torn_last_line_is_left_out(tmp_path: Path) -> None:
    ledger = _ledger(tmp_path)
    ledger.save()
    _drive(ledger, 1)
    log = tmp_path / "state.jsonl"
    whole = RunDir(tmp_path).read_state()
    with open(log, "ab") as f:
        f.write(b'{"n": 99, "t": 2.0, "c": [["do')  # a crash in the middle of an append
    assert RunDir(tmp_path).read_state() == whole


def test_an_append_that_fails_part_way_is_cut_back_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk in the middle of a save: the part written is removed, so the next save's
    line follows the last whole one and the log reads back whole."""
    ledger = _ledger(tmp_path)
    ledger.save()
    _drive(ledger, 1)
    real = _io.append_lines

    def full_disk(path: Path, lines: list[str]) -> None:
        with open(path, "a") as f:
            f.write(lines[0][:15])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("hfsweep.core._ledger_file.append_lines", full_disk)
    ledger.arrays.append(_Array(1, "k", 2))
    with pytest.raises(OSError, match="No space"):
        ledger.save()
    monkeypatch.setattr("hfsweep.core._ledger_file.append_lines", real)
    _drive(ledger, 1, first=2)
    again = _ledger(tmp_path)
    again.restore(RunDir(tmp_path).read_state() or {}, _Array)
    assert again.decisions == ledger.decisions and again.ended == ledger.ended
    assert [a.index for a in again.arrays] == [0, 2]  # the failed save's array was not saved


def test_lines_the_snapshot_holds_are_skipped(tmp_path: Path) -> None:
    """A crash after a compaction's snapshot, before its new log: the old log's lines are in
    the snapshot already and are not applied twice."""
    ledger = _ledger(tmp_path)
    ledger.save()
    _drive(ledger, 2)
    old_log = (tmp_path / "state.jsonl").read_bytes()
    ledger.compact()
    (tmp_path / "state.jsonl").write_bytes(old_log)
    again = _ledger(tmp_path)
    again.restore(RunDir(tmp_path).read_state() or {}, _Array)
    _same(ledger, again)


@pytest.mark.parametrize("damage", ["deleted", "a line damaged", "a line missing", "newer log"])
def test_a_damaged_log_is_refused_naming_it(tmp_path: Path, damage: str) -> None:
    ledger = _ledger(tmp_path)
    ledger.save()
    _drive(ledger, 2)
    log = tmp_path / "state.jsonl"
    lines = _log_lines(tmp_path)
    if damage == "deleted":
        log.unlink()
        match = "is missing: it holds the changes since"
    elif damage == "a line damaged":
        log.write_text("\n".join([*lines[:3], lines[3][:10], *lines[4:]]) + "\n")
        match = "line 4 cannot be read"
    elif damage == "a line missing":
        log.write_text("\n".join([*lines[:3], *lines[4:]]) + "\n")
        match = "line 4: save 4 where save 3 should follow"
    else:
        log.write_text(json.dumps({"after": 999}) + "\n")
        match = "continues save 999, but .* holds save"
    with pytest.raises(ValueError, match=match) as info:
        RunDir(tmp_path).read_state()
    assert str(log) in str(info.value)


def test_a_sweep_with_a_damaged_log_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """As a damaged state.json is: a SweepError naming the file and what to do."""
    config, run = _finished_run(tmp_path)
    (run / "state.jsonl").unlink()
    with pytest.raises(hs.SweepError, match=r"state\.jsonl is missing") as info:
        hs.sweep(config, resume=True, progress=False)
    assert "Restore the file" in str(info.value)


def test_another_version_is_refused(tmp_path: Path) -> None:
    file = LedgerFile(tmp_path / "state.json", tmp_path / "state.jsonl")
    (tmp_path / "state.json").write_text(json.dumps({"version": 3}))
    with pytest.raises(StateVersionError, match="state version 3 is not 2"):
        file.read()


def test_the_optuna_pruner_replays_without_its_trials(tmp_path: Path) -> None:
    """An OptunaPruner's record is in the study: replaying its decisions only notes the steps,
    without the Optuna trials attached (a resume attaches them after)."""
    pruner = make_scheduler("optuna:median", mode="max", max_resource=4)
    before = pruner.state_dict()
    pruner.replay([Report("trial-0", 1.0, 0.5), Report("trial-1", 2.0, math.nan)])
    pruner.replay([Report("trial-0", 2.0, 0.6)])
    pruner.on_trial_end("trial-1", "stopped")
    state = pruner.state_dict()
    assert state["last_step"] == {"trial-0": 2} and before["last_step"] == {}
    assert state["ended"] == {"trial-1": "stopped"}


def test_one_status_vocabulary() -> None:
    assert Status.COMPLETED == "completed" and Status("stopped") is Status.STOPPED
    assert f"{Status.FAILED}" == "failed" and json.dumps([Status.FAILED]) == '["failed"]'
    assert [Status.parse(n) for n in ("COMPLETE", "PRUNED", "FAIL", "RUNNING", "WAITING")] == [
        Status.COMPLETED,
        Status.STOPPED,
        Status.FAILED,
        Status.RUNNING,
        Status.WAITING,
    ]
    assert [s.optuna_name for s in Status] == ["WAITING", "RUNNING", "COMPLETE", "PRUNED", "FAIL"]
    assert [s.trial_state().name for s in Status] == [s.optuna_name for s in Status]
    assert [s.told for s in Status if s.final] == ["complete", "pruned", "failed"]
    with pytest.raises(ValueError, match="has not ended"):
        Status.RUNNING.told  # noqa: B018
    with pytest.raises(ValueError, match=r"unknown trial status 'done'; valid: waiting, running"):
        Status.parse("done")


def test_a_log_line_that_is_not_a_change_is_refused(tmp_path: Path) -> None:
    """A line that reads as JSON but is no change this sweep wrote (edited): refused naming
    both files, as a state.json with a key missing is."""
    config, run = _finished_run(tmp_path)
    seq = json.loads((run / "state.json").read_text())["seq"]
    with open(run / "state.jsonl", "a") as f:
        f.write(json.dumps({"n": seq + 1, "t": 1.0, "c": [["renamed", 3]]}) + "\n")
    with pytest.raises(hs.SweepError, match="is not the state this sweep wrote") as info:
        hs.sweep(config, resume=True, progress=False)
    message = str(info.value)
    assert str(run / "state.json") in message and "state.jsonl" in message
    assert "unknown change 'renamed'" in message and "Restore the file" in message
