"""The parts of sharing a study between drivers, in one process: the study lock, counting the
budget under it, and telling a gone driver from a live one (the two-driver sweeps themselves
are in tests/sweep/test_two_drivers.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import optuna
import pytest

from hfsweep.storage import drivers as _drivers
from hfsweep.storage.drivers import DRIVER_ATTR, Beat, Drivers, driver_id
from hfsweep.storage.journal import journal_storage
from hfsweep.storage.study_lock import StudyLock


def _study(storage: Any) -> optuna.Study:
    return optuna.create_study(study_name="s", storage=storage, load_if_exists=True)


def test_a_run_directory_keeps_its_driver_id(tmp_path: Path) -> None:
    first = driver_id(tmp_path)
    assert first == driver_id(tmp_path) != driver_id(tmp_path / "other")


def test_drivers_asking_at_once_ask_exactly_the_budget(tmp_path: Path) -> None:
    """Three drivers in threads, each on its own storage object for one journal file."""
    path = tmp_path / "study.journal"
    _study(journal_storage(path))

    def drive(name: str) -> int:
        study = _study(journal_storage(path))
        me = Drivers(study, tmp_path / name, shared=True)
        asked = 0

        def ask(n: int) -> list[tuple[optuna.Trial, None]]:
            time.sleep(0.01)  # a sampler that takes a moment: the others count meanwhile
            return [(study.ask(), None) for _ in range(n)]

        while got := me.ask(ask, 10):
            asked += len(got)
        return asked

    with ThreadPoolExecutor(3) as pool:
        counts = list(pool.map(drive, "abc"))
    trials = _study(journal_storage(path)).get_trials()
    assert sum(counts) == len(trials) == 10
    owners = Counter(t.user_attrs[DRIVER_ATTR] for t in trials)
    assert sorted(owners.values()) == sorted(c for c in counts if c)


@pytest.fixture(params=["postgresql", "sqlite"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "postgresql":
        return str(request.getfixturevalue("postgres"))
    return f"sqlite:///{tmp_path / 'study.db'}"


def test_the_study_lock_excludes_another_connection(url: str) -> None:
    """Held through one storage object, the lock keeps a second one (another connection, as
    another process's) waiting until it is released."""
    first = StudyLock(optuna.storages.RDBStorage(url), "s")
    second = StudyLock(optuna.storages.RDBStorage(url), "s")
    assert first.kind in ("PostgreSQL advisory lock", "SQLite file lock")
    entered = threading.Event()

    def take() -> None:
        with second:
            entered.set()

    with first:
        waiting = threading.Thread(target=take)
        waiting.start()
        assert not entered.wait(1.0)
    waiting.join(30)
    assert entered.is_set()


def test_a_driver_is_gone_when_it_ended_died_or_stopped_beating(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = {"wall": 1000.0, "mono": 50.0}
    monkeypatch.setattr(_drivers, "_wall", lambda: now["wall"])
    monkeypatch.setattr(_drivers, "_monotonic", lambda: now["mono"])
    me = Drivers(_study(journal_storage(tmp_path / "j")), tmp_path / "me", shared=True, grace=5)
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    here = Beat("x", me.host, me.node, os.getpid(), "r", 1, now["wall"], False)
    assert not me.gone("x", {"x": here})
    assert me.gone("x", {"x": replace(here, ended=True)})
    assert me.gone("x", {})  # never beat
    assert me.gone(None, {})  # a trial no driver claimed
    assert not me.gone(me.id, {})
    assert me.gone("x", {"x": replace(here, pid=int(dead.stdout))})
    now["wall"] += 6  # same node: its clock says the heartbeat is older than the grace
    assert me.gone("x", {"x": here})
    # another machine: only this driver's own watching counts, however old its time looks
    there = replace(here, id="y", node="elsewhere", time=0.0)
    assert not me.gone("y", {"y": there})
    now["mono"] += 4
    assert not me.gone("y", {"y": there})
    there = replace(there, seq=2)  # it beat again: watched from now on
    now["mono"] += 4
    assert not me.gone("y", {"y": there})
    now["mono"] += 4.5
    assert not me.gone("y", {"y": there})
    now["mono"] += 1
    assert me.gone("y", {"y": there})


def test_a_driver_adopts_only_the_trials_of_gone_drivers(tmp_path: Path) -> None:
    """Its own trials, a dead driver's and an old hfsweep's (no driver, but an array) are its
    to train; a live driver's and another tool's (no driver, no array) are left alone."""
    study = _study(journal_storage(tmp_path / "j"))
    me = Drivers(study, tmp_path / "me", shared=True)
    live = Drivers(study, tmp_path / "live", shared=True)
    live.beat()
    dead = Drivers(study, tmp_path / "dead", shared=True)
    dead.beat()
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    key = f"hfsweep:driver:{dead.id}"
    record = study._storage.get_study_system_attrs(study._study_id)[key]
    study._storage.set_study_system_attr(study._study_id, key, {**record, "pid": int(gone.stdout)})
    attrs = [
        {DRIVER_ATTR: me.id},
        {DRIVER_ATTR: dead.id},
        {"array": 0},
        {DRIVER_ATTR: live.id},
        {},
    ]
    for a in attrs:
        trial = study.ask()
        for k, v in a.items():
            trial.set_user_attr(k, v)
    study.tell(study.ask(), 1.0)  # finished: nobody's to train
    with me.lock:
        own, adopted = me.claim(study.get_trials())
    assert [t.number for t in own] == [0]
    assert [t.number for t in adopted] == [1, 2]
    assert me.foreign == 2
    owners = [t.user_attrs.get(DRIVER_ATTR) for t in study.get_trials()]
    assert owners == [me.id, me.id, me.id, live.id, None, None]
    assert me.adopt_stale() == []  # nothing more to adopt
