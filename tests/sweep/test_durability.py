"""Grouped flushes to disk (``hfsweep._io``) and the sweep's journal backend."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import optuna
import pytest
from optuna.storages.journal import JournalFileBackend

from hfsweep._io import append_lines, atomic_write_text, grouped_sync, read_lines
from hfsweep.storage import journal as _journal
from hfsweep.storage.journal import GroupedJournalFileBackend, journal_storage

from ._clock import FakeTime


@pytest.fixture
def fsyncs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths ``os.fsync`` flushed, in order (the real fsync still runs)."""
    seen: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        seen.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return seen


def test_outside_a_group_every_write_is_flushed_before_it_returns(
    tmp_path: Path, fsyncs: list[str]
) -> None:
    target = tmp_path / "state.json"
    for i in range(3):
        atomic_write_text(target, str(i))
        assert len(fsyncs) == i + 1
    assert target.read_text() == "2"


def test_in_a_group_each_file_is_flushed_once_when_the_group_ends(
    tmp_path: Path, fsyncs: list[str]
) -> None:
    a, b = tmp_path / "a.json", tmp_path / "sub" / "b.json"
    with grouped_sync(interval=60):
        for i in range(5):
            atomic_write_text(a, str(i))
            atomic_write_text(b, str(i))
        assert fsyncs == []  # the data is already readable: it reached the OS
        assert a.read_text() == b.read_text() == "4"
        with grouped_sync(interval=60):  # an inner block joins the outer group
            atomic_write_text(a, "5")
        assert fsyncs == []
    assert sorted(fsyncs) == sorted([str(a), str(b), str(tmp_path), str(b.parent)])


def test_appended_lines_are_flushed_like_atomic_writes(tmp_path: Path, fsyncs: list[str]) -> None:
    log = tmp_path / "sub" / "delivered.log"
    append_lines(log, ["a", "b"])
    assert fsyncs == [str(log)]
    with grouped_sync(interval=60):
        append_lines(log, ["c"])
        append_lines(log, [])
        assert len(fsyncs) == 1
    assert sorted(fsyncs[1:]) == sorted([str(log.parent), str(log)])
    assert read_lines(log) == ["a", "b", "c"]


def test_a_line_cut_short_stays_on_its_own(tmp_path: Path) -> None:
    log = tmp_path / "delivered.log"
    assert read_lines(log) == []
    append_lines(log, ["first"])
    with open(log, "ab") as f:
        f.write(b"half a li")  # a crash in the middle of an append
    assert read_lines(log) == ["first"]
    append_lines(log, ["second", "third"])
    assert read_lines(log) == ["first", "half a li", "second", "third"]


def test_in_a_group_a_write_is_flushed_within_the_interval(
    tmp_path: Path, fsyncs: list[str]
) -> None:
    target = tmp_path / "state.json"
    with grouped_sync(interval=0.05):
        atomic_write_text(target, "x")
        deadline = time.monotonic() + 10
        while str(target) not in fsyncs and time.monotonic() < deadline:
            time.sleep(0.01)
        assert str(target) in fsyncs
        flushed = len(fsyncs)
    assert len(fsyncs) == flushed  # nothing was left to flush at the end


def test_writes_do_not_wait_for_a_flush_in_progress_and_the_group_end_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the timer thread flushes, writes go on; the end of the group waits until the
    files that flush took up are on disk."""
    started, release = threading.Event(), threading.Event()
    synced: list[str] = []
    real = os.fsync

    def slow_fsync(fd: int) -> None:
        if isinstance(threading.current_thread(), threading.Timer):  # the timed flush
            started.set()
            assert release.wait(5)
        real(fd)
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))

    monkeypatch.setattr(os, "fsync", slow_fsync)
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    wrote, ended = threading.Event(), threading.Event()

    def group() -> None:
        with grouped_sync(interval=0.01):
            atomic_write_text(first, "1")
            assert started.wait(10)  # the timer's flush of first.json is stuck
            atomic_write_text(second, "2")  # returns though
            wrote.set()
        ended.set()

    worker = threading.Thread(target=group)
    worker.start()
    assert wrote.wait(10)
    assert not ended.wait(0.3)  # the group's end waits for the stuck flush
    release.set()
    worker.join(10)
    assert ended.is_set() and str(first) in synced and str(second) in synced


def test_a_file_removed_before_its_flush_is_skipped(tmp_path: Path, fsyncs: list[str]) -> None:
    gone, kept = tmp_path / "gone.pt", tmp_path / "kept.pt"
    with grouped_sync(interval=60):
        atomic_write_text(gone, "x")
        atomic_write_text(kept, "y")
        gone.unlink()
    assert str(kept) in fsyncs and str(gone) not in fsyncs


def _tell_some(storage: optuna.storages.BaseStorage) -> None:
    study = optuna.create_study(
        study_name="s", storage=storage, sampler=optuna.samplers.RandomSampler(seed=0)
    )
    for i in range(3):
        trial = study.ask()
        x = trial.suggest_float("x", 0, 1)
        trial.report(x, 0)
        trial.set_user_attr("i", i)
        study.tell(trial, x)


def test_the_grouped_journal_is_optunas_journal(tmp_path: Path, fsyncs: list[str]) -> None:
    """Same bytes as Optuna's JournalFileBackend for the same operations, readable by it; each
    append flushed at once outside a group, once at the end of one inside."""
    ours, theirs = tmp_path / "ours.journal", tmp_path / "theirs.journal"
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    _tell_some(journal_storage(ours))
    appends = len(fsyncs)
    assert appends >= 3 * 4 and set(fsyncs) == {str(ours)}
    fsyncs.clear()
    _tell_some(optuna.storages.JournalStorage(JournalFileBackend(str(theirs))))

    def normalized(path: Path) -> list[dict]:
        out = []
        for line in path.read_text().splitlines():
            log = json.loads(line)
            log.pop("worker_id", None)
            for key in ("datetime_start", "datetime_complete"):
                log.pop(key, None)
            out.append(log)
        return out

    assert normalized(ours) == normalized(theirs)
    loaded = optuna.load_study(
        study_name="s", storage=optuna.storages.JournalStorage(JournalFileBackend(str(ours)))
    )
    assert [t.user_attrs["i"] for t in loaded.trials] == [0, 1, 2]

    fsyncs.clear()
    grouped = tmp_path / "grouped.journal"
    with grouped_sync(interval=60):
        _tell_some(optuna.storages.JournalStorage(GroupedJournalFileBackend(grouped)))
        assert fsyncs == []
    assert sorted(fsyncs) == sorted([str(grouped), str(tmp_path)])


def test_the_journal_is_not_reopened_until_it_grows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A storage query re-reads the journal only when the file has grown since the last read
    reached its end; what another writer appends (a second backend, as another process would),
    a whole line or the rest of a torn one, is seen at the next query."""
    path = tmp_path / "study.journal"
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = journal_storage(path)
    study = optuna.create_study(study_name="s", storage=storage)
    study.tell(study.ask(), 1.0)
    opened: list[str] = []
    real_open = open

    def counting_open(file, *args, **kwargs):  # type: ignore[no-untyped-def]
        if os.fspath(file) == str(path):
            opened.append(args[0] if args else kwargs.get("mode", "r"))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr("builtins.open", counting_open)
    for _ in range(5):
        assert len(study.trials) == 1
        storage.get_all_trials(study._study_id)
    assert opened == []

    other = optuna.load_study(
        study_name="s", storage=optuna.storages.JournalStorage(JournalFileBackend(str(path)))
    )
    other.tell(other.ask(), 2.0)
    assert [t.value for t in study.trials] == [1.0, 2.0]
    assert "rb" in opened

    # a torn append: the first half of a line, then the rest
    line = json.dumps({"op_code": 2, "worker_id": "w", "study_id": 0, "user_attr": {"k": "v"}})
    with real_open(path, "ab") as f:
        f.write(line[:10].encode())
    assert study.user_attrs == {}
    assert study.user_attrs == {}
    with real_open(path, "ab") as f:
        f.write(line[10:].encode() + b"\n")
    assert study.user_attrs == {"k": "v"}


def test_a_hold_takes_the_journal_lock_once_and_other_writers_wait_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inside ``held()`` every append of the process goes in under one acquisition of Optuna's
    lock; another writer (a backend of its own, as another process has) waits for the hold to
    end, then appends after it; the lines stay whole and in order."""
    from optuna.storages.journal import JournalFileSymlinkLock

    path = tmp_path / "study.journal"
    ours = GroupedJournalFileBackend(path)
    theirs = JournalFileBackend(str(path))
    acquired: list[str] = []
    real_acquire = JournalFileSymlinkLock.acquire

    def counting(self: JournalFileSymlinkLock) -> bool:
        acquired.append(threading.current_thread().name)
        return real_acquire(self)

    monkeypatch.setattr(JournalFileSymlinkLock, "acquire", counting)
    ours.append_logs([{"n": 0}])
    assert len(acquired) == 1
    other = threading.Thread(target=lambda: theirs.append_logs([{"n": "theirs"}]), name="other")
    with ours.held():
        with ours.held():  # nested: the same hold
            ours.append_logs([{"n": 1}])
        other.start()
        time.sleep(0.1)
        assert other.is_alive()  # waiting for the lock
        for n in (2, 3):
            ours.append_logs([{"n": n}])
    other.join(timeout=10)
    assert not other.is_alive()
    assert acquired.count("MainThread") == 2  # the first append, then the hold
    assert not os.path.lexists(f"{path}.lock")
    lines = [json.loads(line)["n"] for line in path.read_text().splitlines()]
    assert lines == [0, 1, 2, 3, "theirs"]


def test_a_stale_journal_lock_is_cleared_and_a_live_one_waited_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lock left by a killed holder is removed after the wait; one its holder releases
    within the wait is not touched. Other writers act at fixed moments of a fake time."""
    fake = FakeTime()
    monkeypatch.setattr(_journal, "_clock", fake.now)
    monkeypatch.setattr(_journal, "_sleep", fake.sleep)
    path = tmp_path / "study.journal"
    backend = GroupedJournalFileBackend(path)
    lock = f"{path}.lock"

    def take() -> None:
        """Another writer takes the lock anew: a new symlink renamed over the old one, as
        Optuna's lock does (a new inode, even where the file system reuses inode numbers)."""
        os.symlink(path, f"{lock}.new")
        os.replace(f"{lock}.new", lock)

    def waited(**kwargs: float) -> tuple[bool, float]:
        """Whether the lock was removed, and after how long (to the poll's 10 ms)."""
        start = fake.now()
        return backend.clear_stale_lock(**kwargs), fake.now() - start

    assert backend.clear_stale_lock(wait_s=0.05) is False  # no lock: nothing to do
    os.symlink(path, lock)  # as a SIGKILL inside a hold leaves it
    removed, elapsed = waited(wait_s=0.2)
    assert removed and elapsed == pytest.approx(0.2, abs=0.011) and not os.path.lexists(lock)
    os.symlink(path, lock)
    fake.at(fake.now() + 0.05, lambda: os.unlink(lock))  # a writer that finishes
    removed, elapsed = waited(wait_s=2.0)
    assert not removed and elapsed == pytest.approx(0.05, abs=0.011)
    # a lock replaced during the wait is another writer's: the wait starts again
    os.symlink(path, lock)
    fake.at(fake.now() + 0.15, take)
    removed, elapsed = waited(wait_s=0.3)
    assert removed and elapsed == pytest.approx(0.45, abs=0.011) and not os.path.lexists(lock)
    # a writer that keeps taking the lock anew is never broken: the wait gives up
    os.symlink(path, lock)
    for k in range(1, 60):
        fake.at(fake.now() + 0.02 * k, take)
    removed, elapsed = waited(wait_s=0.1, give_up_s=0.5)
    assert not removed and elapsed == pytest.approx(0.5, abs=0.011) and os.path.lexists(lock)
    os.unlink(lock)
    backend.append_logs([{"n": 1}])
    assert path.read_text() == '{"n":1}\n'


def test_a_sweep_groups_its_flushes_and_leaves_every_file_flushed(
    tmp_path: Path, fsyncs: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each file of the run directory is flushed at most once per interval while the sweep runs,
    and every file it wrote is flushed by the time ``hs.sweep`` returns."""
    import hfsweep as hs

    from ._toy import sweep_config

    interval = 0.2
    real = grouped_sync
    monkeypatch.setattr(
        "hfsweep.core.loop.grouped_sync", lambda interval=interval: real(interval=interval)
    )
    run = tmp_path / "run"
    start = time.monotonic()
    result = hs.sweep(sweep_config(run), progress=False)
    elapsed = time.monotonic() - start
    assert result.counts["completed"] == 8
    journal = str(run / "optuna.journal")
    lines = len((run / "optuna.journal").read_text().splitlines())
    assert 0 < fsyncs.count(journal) <= 2 + elapsed / interval
    assert lines > 8  # appended once per operation
    for name in ("state.json", "trials.csv", "best.json", "histories/trial-7.csv"):
        assert str(run / name) in fsyncs
