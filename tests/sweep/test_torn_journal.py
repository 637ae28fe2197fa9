"""A run directory a crash left torn: a journal whose last record was cut short, a missing or
unreadable ``state.json``. Resume, report and Optuna itself must read what is whole, lose no
trial and tell none twice, or refuse with a message that names the file."""

from __future__ import annotations

import json
import shutil
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState

import hfsweep.training.run
from hfsweep.cli import main
from hfsweep.storage.journal import GroupedJournalFileBackend, find_torn_tail, journal_storage

from ._toy import write_sweep_file as _write_sweep

TRIALS = 4
#: the journal's operation codes used here
_TELL, _USER_ATTR = 6, 8


def _run(sweep: Path, run: Path, *extra: str) -> int:
    return main(["run", str(sweep), "--output", str(run), "--quiet", *extra])


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished sweep of TRIALS trials in one array (copied by each test that tears it)."""
    folder = tmp_path_factory.mktemp("finished")
    sweep = _write_sweep(folder)
    assert _run(sweep, folder / "run") == 0
    return folder


@pytest.fixture
def copy(finished: Path, tmp_path: Path) -> Iterator[Path]:
    shutil.copytree(finished, tmp_path, dirs_exist_ok=True)
    yield tmp_path


def _records(journal: Path) -> list[tuple[int, int, dict[str, Any]]]:
    """(start offset, end offset, record) of each line of ``journal``."""
    out, offset = [], 0
    for line in journal.read_bytes().splitlines(keepends=True):
        out.append((offset, offset + len(line), json.loads(line)))
        offset += len(line)
    return out


def _load(journal: Path) -> optuna.Study:
    """The study as Optuna itself reads the file."""
    storage = optuna.storages.JournalStorage(JournalFileBackend(str(journal)))
    return optuna.load_study(study_name="sweep", storage=storage)


def _check_whole(run: Path, values: dict[int, float]) -> None:
    """Every trial finished with the value it had before the tear, and told once: one end
    record per trial in the journal (Optuna's own reader)."""
    trials = _load(run / "optuna.journal").get_trials()
    assert [t.number for t in trials] == list(range(TRIALS))
    assert all(t.state == TrialState.COMPLETE for t in trials)
    assert {t.number: t.value for t in trials} == values
    ends = Counter(
        r["trial_id"] for _, _, r in _records(run / "optuna.journal") if r["op_code"] == _TELL
    )
    assert ends == Counter(range(TRIALS))


def _cuts(journal: Path) -> dict[str, int]:
    """Offsets to cut the journal at, in the records that end its last trial: its user attrs
    (``status``, ``steps``, ``start_step``), then the trial's end."""
    records = _records(journal)
    tell_start, tell_end, tell = records[-1]
    assert tell["op_code"] == _TELL

    def attr(name: str) -> tuple[int, int]:
        start, end, record = next(
            r
            for r in reversed(records)
            if r[2]["op_code"] == _USER_ATTR and name in r[2]["user_attr"]
        )
        assert record["trial_id"] == tell["trial_id"]
        return start, end

    (status_start, status_end), (steps_start, steps_end) = attr("status"), attr("steps")
    return {
        "end: 1 byte": tell_start + 1,
        "end: half": (tell_start + tell_end) // 2,
        "end: all but its line end": tell_end - 1,
        "end: none of it (a whole record last)": tell_start,
        "steps attr: half": (steps_start + steps_end) // 2,
        "status attr: half": (status_start + status_end) // 2,
    }


CUTS = [
    "end: 1 byte",
    "end: half",
    "end: all but its line end",
    "end: none of it (a whole record last)",
    "steps attr: half",
    "status attr: half",
]


@pytest.mark.parametrize("cut", CUTS)
def test_a_torn_last_trial_is_trained_again_and_told_once(copy: Path, cut: str) -> None:
    """Its array had ended (its checkpoint removed): the trial whose end was torn off trains
    again, from scratch, and ends with the same value; resume, report and Optuna read the
    repaired file."""
    sweep, run = copy / "sweep.yaml", copy / "run"
    journal = run / "optuna.journal"
    values = {t.number: t.value for t in _load(journal).get_trials()}
    offset = _cuts(journal)[cut]
    torn = journal.read_bytes()[:offset]
    journal.write_bytes(torn)
    whole = not cut.startswith("end: none")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _run(sweep, run, "--resume") == 0
    messages = [str(w.message) for w in caught if "cut short" in str(w.message)]
    if whole:
        # the record that stood last was half written: it was dropped, and a copy kept
        dropped = len(torn) - torn.rindex(b"\n") - 1
        assert len(messages) == 1 and f"{dropped} byte(s) of " in messages[0]
        if b'"op_code":' in torn[-dropped:]:  # the operation, when the bytes tell it
            op = "set trial state" if cut.startswith("end") else "set trial user attr"
            assert f'a "{op}' in messages[0]
        else:
            assert "an unreadable record" in messages[0]
        copies = list(run.glob("optuna.journal.torn-*"))
        assert len(copies) == 1 and copies[0].read_bytes() == torn
        assert str(copies[0]) in messages[0]
    else:
        assert messages == [] and not list(run.glob("optuna.journal.torn-*"))
    _check_whole(run, values)
    resumed = (run / "sweep.log").read_text().split("sweep sweep:")[-1]
    assert "trial 3 completed" in resumed and "trial 2 completed" not in resumed
    assert main(["report", str(run), "--out", str(copy / "report")]) == 0


def test_a_delivered_end_whose_record_was_torn_is_told_from_the_array_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The crash came after the trainer had recorded the ends as delivered and before the
    array was marked done: the trainer does not deliver them again, so the engine tells the
    trial whose end was torn off from the delivered record, without training it again."""
    sweep, run = _write_sweep(tmp_path), tmp_path / "run"
    real = hfsweep.training.run.append_lines

    def crash_after(path: Path, lines: list[str]) -> None:
        real(path, lines)
        if path.name == "delivered.log":
            raise RuntimeError("power loss")

    monkeypatch.setattr(hfsweep.training.run, "append_lines", crash_after)
    assert _run(sweep, run) == 1  # an unexpected error: one paragraph, exit 1
    assert "power loss" in capsys.readouterr().err
    monkeypatch.setattr(hfsweep.training.run, "append_lines", real)
    journal = run / "optuna.journal"
    assert (run / "arrays" / "0" / "delivered.log").exists()
    values = {t.number: t.value for t in _load(journal).get_trials()}
    assert len(values) == TRIALS
    start, end, last = _records(journal)[-1]
    assert last["op_code"] == _TELL
    journal.write_bytes(journal.read_bytes()[: (start + end) // 2])

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert _run(sweep, run, "--resume") == 0
    _check_whole(run, values)
    log = (run / "sweep.log").read_text().split("cut short")[-1]  # the resumed run's
    assert "trial 3: its end was lost from the study" in log
    assert "told again from its array's checkpoint" in log
    assert " training " not in log  # no array started: the trial was not trained again
    assert len(json.loads((run / "state.json").read_text())["arrays"]) == 1
    assert not (run / "arrays" / "0").exists()


def test_a_trial_whose_array_record_was_torn_trains_once_in_its_array(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The crash came after the array's first checkpoint, and the record of the array its
    last trial joined was torn off: the resumed array trains that trial, and it is not also
    put in a new array (which trained it a second time)."""
    sweep, run = _write_sweep(tmp_path), tmp_path / "run"
    real = hfsweep.training.run.atomic_save

    def crash_after(obj: Any, path: Path) -> None:
        real(obj, path)
        if path.name == "array.pt":
            raise RuntimeError("power loss")

    monkeypatch.setattr(hfsweep.training.run, "atomic_save", crash_after)
    assert _run(sweep, run) == 1  # an unexpected error: one paragraph, exit 1
    assert "power loss" in capsys.readouterr().err
    monkeypatch.setattr(hfsweep.training.run, "atomic_save", real)
    journal = run / "optuna.journal"
    records = _records(journal)
    start, end, last = next(r for r in reversed(records) if r[2]["op_code"] == _USER_ATTR)
    assert last["user_attr"] == {"array": 0} and last["trial_id"] == TRIALS - 1
    # the records after it (the first evaluation's values) were lost too: the flushes to
    # disk are grouped, and a power loss can lose more than the last write
    assert {r["op_code"] for _, _, r in records[records.index((start, end, last)) + 1 :]} == {7}
    journal.write_bytes(journal.read_bytes()[: (start + end) // 2])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert _run(sweep, run, "--resume") == 0
    trials = _load(journal).get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE] * TRIALS
    assert len(json.loads((run / "state.json").read_text())["arrays"]) == 1
    ends = Counter(r["trial_id"] for _, _, r in _records(journal) if r["op_code"] == _TELL)
    assert ends == Counter(range(TRIALS))


def test_an_arrays_checkpoint_is_removed_only_once_the_journal_is_on_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The delivered record in an array's checkpoint is what tells a trial again after a
    power loss tore its end off the journal; it is removed (the array done) only after the
    journal's appends reached the disk, though the sweep groups its flushes otherwise."""
    import os

    from hfsweep.core._rundir import RunDir

    sweep, run = _write_sweep(tmp_path), tmp_path / "run"
    journal = run / "optuna.journal"
    synced: list[int] = []  # the journal's size at each of its flushes to disk
    real_fsync, real_remove = os.fsync, RunDir.remove_array

    def fsync(fd: int) -> None:
        real_fsync(fd)
        if os.readlink(f"/proc/self/fd/{fd}") == str(journal):
            synced.append(os.fstat(fd).st_size)

    removed: list[tuple[int, int]] = []  # (journal size, size on disk) at each removal

    def remove_array(self: RunDir, index: int) -> None:
        if self.array(index).exists():
            removed.append((journal.stat().st_size, synced[-1] if synced else 0))
        real_remove(self, index)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(RunDir, "remove_array", remove_array)
    assert main(["run", str(sweep), "--output", str(run), "--quiet"]) == 0
    assert removed and all(size == on_disk for size, on_disk in removed)


def test_report_reads_a_torn_journal_without_changing_it(copy: Path) -> None:
    run = copy / "run"
    journal = run / "optuna.journal"
    start, end, _ = _records(journal)[-1]
    torn = journal.read_bytes()[: (start + end) // 2]
    journal.write_bytes(torn)
    with pytest.warns(UserWarning, match=r"cut short.*left out.*--resume"):
        assert main(["report", str(run), "--out", str(copy / "report")]) == 0
    assert journal.read_bytes() == torn and not list(run.glob("optuna.journal.torn-*"))


def test_a_journal_damaged_before_its_end_is_refused_naming_it(
    copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = copy / "run"
    journal = run / "optuna.journal"
    lines = journal.read_bytes().splitlines(keepends=True)
    lines[3] = lines[3][:20] + b"\n"
    journal.write_bytes(b"".join(lines))
    assert _run(copy / "sweep.yaml", run, "--resume") == 2
    err = capsys.readouterr().err
    assert f"{journal} cannot be read as an Optuna journal" in err and "Traceback" not in err


# ---------------------------------------------------------------- the torn tail itself
def _tell_three(path: Path) -> None:
    study = optuna.create_study(study_name="s", storage=journal_storage(path))
    for i in range(3):
        trial = study.ask()
        study.tell(trial, trial.suggest_float("x", 0, 1) + i)


@pytest.mark.parametrize("keep", [1, 40, -2, -1])
def test_the_torn_tail_is_the_last_record_only(tmp_path: Path, keep: int) -> None:
    """Cut anywhere in the last record (``keep`` bytes of it; -1: all but its line end, -2:
    also without its closing brace), only that record is dropped, and Optuna reads the rest."""
    path = tmp_path / "j.journal"
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    _tell_three(path)
    whole = path.read_bytes()
    start, end, _ = _records(path)[-1]
    assert find_torn_tail(path) is None
    cut = whole[: start + keep] if keep > 0 else whole[: end + keep]
    path.write_bytes(cut)
    torn = find_torn_tail(path)
    assert torn is not None and torn.offset == start and torn.dropped == len(cut) - start
    backend = GroupedJournalFileBackend(path)
    dropped = backend.drop_torn_tail()
    assert dropped is not None and dropped.dropped == torn.dropped
    assert dropped.copy is not None and Path(dropped.copy).read_bytes() == cut
    assert path.read_bytes() == whole[:start]
    assert backend.drop_torn_tail() is None  # nothing more to drop
    study = optuna.load_study(study_name="s", storage=optuna.storages.JournalStorage(backend))
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 2 + [TrialState.RUNNING]
    study.tell(study.trials[2].number, 2.5)  # appends after the repair are whole lines
    assert _load_s(path).trials[2].value == 2.5


def _load_s(path: Path) -> optuna.Study:
    storage = optuna.storages.JournalStorage(JournalFileBackend(str(path)))
    return optuna.load_study(study_name="s", storage=storage)


def test_a_failed_append_leaves_no_half_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write that fails part way (a full disk) is cut back off before the error goes on."""
    import os

    path = tmp_path / "j.journal"
    backend = GroupedJournalFileBackend(path)
    backend.append_logs([{"op_code": 0, "n": 1}])
    before = path.read_bytes()
    real_write = os.write
    calls = []

    def full_disk(fd: int, data: Any) -> int:
        calls.append(len(data))
        if len(calls) == 1:
            return real_write(fd, bytes(data[:7]))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "write", full_disk)
    with pytest.raises(OSError, match="No space"):
        backend.append_logs([{"op_code": 0, "n": 2}])
    monkeypatch.setattr(os, "write", real_write)
    assert path.read_bytes() == before and find_torn_tail(path) is None


# ---------------------------------------------------------------- state.json
@pytest.mark.parametrize(
    "damage",
    ["deleted", "cut short", "not an object", "a key missing"],
)
def test_a_lost_state_is_refused_naming_the_file(
    copy: Path, damage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without the scheduler's state and decision log, a resume would take other pruning
    decisions: it is refused (exit 2) with the file and what to do, and the study keeps
    every record."""
    run = copy / "run"
    state = run / "state.json"
    text = state.read_text()
    if damage == "deleted":
        state.unlink()
    elif damage == "cut short":
        state.write_text(text[: len(text) // 2])
    elif damage == "not an object":
        state.write_text("[]")
    else:
        data = json.loads(text)
        del data["decisions"]
        state.write_text(json.dumps(data))
    journal = (run / "optuna.journal").read_bytes()
    assert _run(copy / "sweep.yaml", run, "--resume") == 2
    err = capsys.readouterr().err
    assert str(state) in err and "Restore the file" in err and "Traceback" not in err
    assert "another `output` directory" in err
    assert _load(run / "optuna.journal").get_trials()  # the study is still readable
    assert (run / "optuna.journal").read_bytes()[: len(journal)] == journal


def test_a_state_of_another_version_is_refused_naming_the_version(
    copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = copy / "run" / "state.json"
    state.write_text(json.dumps({**json.loads(state.read_text()), "version": 99}))
    assert _run(copy / "sweep.yaml", copy / "run", "--resume") == 2
    err = capsys.readouterr().err
    assert f"{state}: run directory state version 99" in err and "resume it with that" in err
