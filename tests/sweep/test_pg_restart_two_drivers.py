"""A storage outage longer than the drivers' grace period (a PostgreSQL server restart) while
two drivers share a study: neither may take the other for gone.

Heartbeats cannot be written while the storage is away, so when it comes back every driver's
heartbeat looks stopped. A driver whose own heartbeat was held up by the outage gives the others
a whole grace period from then (``hfsweep.storage.drivers``); without that, two live drivers adopted each other's trials after the restart, trained them twice, and
one of them stopped with ``unexpected KeyError`` (a trial it had just re-adopted was both told
and waiting for a slot).

tests/sweep/test_pg_storage.py restarts the server under one driver in-process; here two
``hfsweep run --resume`` processes share the study, as two machines would."""

from __future__ import annotations

import os
import signal
from dataclasses import replace
from pathlib import Path
from typing import Any

import optuna
import pytest

from hfsweep.storage import drivers as _drivers
from hfsweep.storage.drivers import Beat, Drivers
from hfsweep.storage.journal import journal_storage

from ._toy import GATE_ENV
from .test_two_drivers import HERE, _check, _Driver, _wait

#: arrays that hold after their first epoch while the gate file exists
GATED = f"{HERE / '_toy.py'}:GATED_TASK"

#: the drivers' grace period here (as in test_two_drivers.py), and the server's time down: with
#: its stop and start the storage is away about 3.5 s, longer than the grace period (on the code
#: before the fix, two runs of two adopted each other's trials)
GRACE_S = 3.0
DOWN_S = 2.0


def _beat_of(me: Drivers, driver: str, node: str, time: float) -> Beat:
    return Beat(driver, me.host, node, os.getpid(), "r", 1, time, False)


def test_an_outage_gives_every_other_driver_a_new_grace_period(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fake clocks; the storage's write of this driver's heartbeat is held up 12 s (grace 5 s),
    as by a database restart; the other drivers (one on this machine, alive, one elsewhere)
    could not beat meanwhile either."""
    now = {"wall": 1000.0, "mono": 50.0}
    monkeypatch.setattr(_drivers, "_wall", lambda: now["wall"])
    monkeypatch.setattr(_drivers, "_monotonic", lambda: now["mono"])

    def later(s: float) -> None:
        now["wall"] += s
        now["mono"] += s

    storage = journal_storage(tmp_path / "j")
    study = optuna.create_study(study_name="s", storage=storage)
    me = Drivers(study, tmp_path / "me", shared=True, grace=5)
    here = _beat_of(me, "x", me.node, now["wall"])  # a live process on this machine
    there = _beat_of(me, "y", "elsewhere", 0.0)  # another machine
    assert not me.gone("x", {"x": here}) and not me.gone("y", {"y": there})

    # looks far apart are no outage: a heartbeat that does not move is stopped after the grace
    later(3)
    assert not me.gone("y", {"y": there})
    later(3)
    assert me.gone("y", {"y": there}) and me.gone("x", {"x": here})

    write = storage.set_study_system_attr
    seen_during: list[bool] = []

    def held_up(*args: Any) -> None:
        later(12)  # the storage is away; meanwhile the sweep's main thread looks
        seen_during.append(me.gone("x", {"x": here}) or me.gone("y", {"y": there}))
        write(*args)

    monkeypatch.setattr(storage, "set_study_system_attr", held_up)
    me.beat()
    assert seen_during == [False], "taken for gone while this driver's own beat was held up"
    monkeypatch.setattr(storage, "set_study_system_attr", write)
    assert not me.gone("x", {"x": here}) and not me.gone("y", {"y": there})
    later(4.5)  # not yet a whole grace period since the storage came back
    assert not me.gone("x", {"x": here}) and not me.gone("y", {"y": there})
    assert not me.gone("x", {"x": replace(here, seq=2, time=now["wall"])})  # it beat: alive
    later(1)
    assert me.gone("x", {"x": here}) and me.gone("y", {"y": there})  # never beat again


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs POSIX signals")
def test_two_drivers_ride_out_a_database_restart_longer_than_their_grace_period(
    postgres_server: Any, tmp_path: Path
) -> None:
    """The drivers train GATED_TASK, whose arrays hold after their first epoch while the gate
    file exists, so that the restart comes while both are mid-sweep however fast they train
    (the 12 trials took 4 s once, and a driver finished before the server went down); the gate
    opens once both have reached the server again."""
    url = postgres_server.create_database()
    a, b = _Driver(tmp_path / "a", url, GATED), _Driver(tmp_path / "b", url, GATED)
    gate = tmp_path / "gate"
    gate.touch()
    env = {"HFSWEEP_DRIVER_GRACE_S": str(GRACE_S), GATE_ENV: str(gate)}
    a.start(**env)
    b.start(**env)
    try:
        _wait(
            "both drivers training", lambda: "training" in a.log() and "training" in b.log(), a, b
        )
        postgres_server.restart(down_s=DOWN_S)  # pg_ctl stop -m fast: open connections are cut
        # still held: each driver's calls (its heartbeat's at least) ride the outage out
        _wait(
            "both drivers reaching the server again",
            lambda: all("reachable again after" in d.log() for d in (a, b)),
            a,
            b,
        )
        gate.unlink()
        a.finished(timeout=300)
        b.finished(timeout=300)
    finally:
        for d in (a, b):
            if d.proc is not None and d.proc.poll() is None:
                d.kill()
    _check(url, a, b, void=True)
    for d in (a, b):  # each noticed the outage, carried on, and adopted nothing
        log = d.log()
        assert "trying again for up to 120 s" in log and "reachable again after" in log, log
        assert "adopted" not in log, log
