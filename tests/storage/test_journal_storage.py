"""The run directory's journal backend against Optuna's own storage tests, and what those do
not cover: pickling (a study sent to another process) and Optuna's ``lock_obj``."""

from __future__ import annotations

import os
import pickle
import threading
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import optuna
import pytest
from optuna.storages.journal import JournalFileOpenLock, JournalFileSymlinkLock
from optuna.testing.pytest_storages import StorageTestCase
from sweep._toy import sweep_config

import hfsweep as hs
from hfsweep.storage.journal import GroupedJournalFileBackend


@pytest.fixture
def storage(tmp_path: Path) -> Iterator[optuna.storages.JournalStorage]:
    """What ``StorageTestCase`` runs on: the sweep's backend, on a fresh file."""
    yield optuna.storages.JournalStorage(GroupedJournalFileBackend(tmp_path / "study.journal"))


class TestGroupedJournalAsOptunaStorage(StorageTestCase):
    """Every test of Optuna's shared storage test class (``optuna.testing.pytest_storages``),
    pickling included."""


def _count_trials(study: optuna.Study) -> int:
    """In a worker process: the trials of a pickled study, after telling one more."""
    trial = study.ask()
    study.tell(trial, trial.suggest_float("x", 0.0, 1.0))
    return len(study.trials)


@pytest.mark.slow
def test_a_sweeps_study_goes_to_a_process_pool(tmp_path: Path) -> None:
    """``SweepResult.study`` pickles, and another process reads and appends to its journal."""
    result = hs.sweep(sweep_config(tmp_path / "run", budget={"trials": 2, "epochs": 1}))
    study = result.study
    with ProcessPoolExecutor(1) as pool:
        assert pool.submit(_count_trials, study).result(timeout=120) == 3
    assert len(study.trials) == 3  # the worker's trial is in the file


def test_a_copy_starts_with_no_hold_and_nothing_read(tmp_path: Path) -> None:
    """A backend pickled during a hold: the copy holds nothing (its appends take the lock
    themselves, after the hold ends) and reads the file from its start."""
    path = tmp_path / "study.journal"
    backend = GroupedJournalFileBackend(path)
    backend.append_logs([{"op_code": 0, "n": 0}])
    assert list(backend.read_logs(0)) == [{"op_code": 0, "n": 0}]
    with backend.held():
        copy = pickle.loads(pickle.dumps(backend))
        assert copy.path == backend.path
        done = threading.Event()
        appender = threading.Thread(
            target=lambda: (copy.append_logs([{"op_code": 0, "n": 1}]), done.set())
        )
        appender.start()
        assert not done.wait(0.2)  # the copy waits for the original's hold, like a stranger
    appender.join(10)
    assert done.is_set() and not os.path.lexists(f"{path}.lock")
    assert [log["n"] for log in copy.read_logs(0)] == [0, 1]
    assert [log["n"] for log in backend.read_logs(1)] == [1]


@pytest.mark.parametrize("lock", [JournalFileOpenLock, JournalFileSymlinkLock])
def test_optunas_lock_obj_is_used(
    tmp_path: Path, lock: type, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The constructor takes Optuna's ``lock_obj``; appends and holds take that lock, and a
    copy keeps its kind."""
    path = tmp_path / "study.journal"
    taken: list[str] = []
    real = lock.acquire

    def acquire(self: object) -> bool:
        taken.append(type(self).__name__)
        return real(self)

    monkeypatch.setattr(lock, "acquire", acquire)
    backend = GroupedJournalFileBackend(path, lock_obj=lock(str(path)))
    backend.append_logs([{"op_code": 0}])
    with backend.held():
        backend.append_logs([{"op_code": 0}])
    pickle.loads(pickle.dumps(backend)).append_logs([{"op_code": 0}])
    assert taken == [lock.__name__] * 3
    assert len(list(backend.read_logs(0))) == 3
