"""The study lock lost between counting and asking: a database lock lives as long as its
connection, and a server restart ends every connection while the holder goes on.

In CI two drivers on one PostgreSQL study asked 13 trials of a 12-trial budget across a server
restart (tests/sweep/test_pg_restart_two_drivers.py): the driver holding the advisory lock had
counted 11, the restart released the lock, the other driver took it, counted 11 and asked the
12th, and the first driver's ask then went through on a new connection. Here the same
interleaving is made on purpose in one process: the server drops every connection (as a
restart does) while driver A is inside its ask, driver B asks the last trial of the budget
meanwhile, and A's ask either fails with the lost connection or is silently reconnected by
the connection pool."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.trial import TrialState
from sweep.test_pg_storage import _Flaky

from hfsweep._compat import ask_with_user_attrs
from hfsweep.storage.database import RetryingStorage, _Retrier, engine_kwargs
from hfsweep.storage.drivers import DRIVER_ATTR, VOID_ATTR, Drivers, countable

TOTAL = 3


def _storage(url: str, flaky: str | None = None, *, after: bool = False) -> RetryingStorage:
    """A sweep's storage for ``url`` (pooled connections checked before use, retries), whose
    call ``flaky`` loses its connection once (after doing its work, with ``after``)."""
    inner: Any = optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs(url))
    if flaky is not None:
        inner = _Flaky(inner, flaky, times=1, after=after)
    retrier = _Retrier(where="db", url=url, retry_s=30, resume="--resume")
    return RetryingStorage(inner, retrier)


def _asker(study: optuna.Study, driver: Drivers, before: Any = None) -> Any:
    """Asks as the sweep does: each trial created naming ``driver``."""

    def ask(n: int) -> list[tuple[optuna.Trial, None]]:
        if before is not None:
            before()
        return [(ask_with_user_attrs(study, {DRIVER_ATTR: driver.id}), None) for _ in range(n)]

    return ask


def _drop_every_connection(url: str) -> None:
    """What a server restart does to the clients: every other connection to the database is
    ended (and with it any advisory lock it held)."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.pool import NullPool

    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            conn.execute(
                text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND pid <> pg_backend_pid()"
                )
            )
    finally:
        engine.dispose()


@pytest.mark.parametrize("how", ["reconnected silently", "the ask fails"])
def test_a_lock_lost_while_asking_does_not_overrun_the_budget(
    postgres: str, tmp_path: Path, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    url = postgres
    # "the ask fails": A's create loses its connection before the server did the work
    a_storage = _storage(url, "create_new_trial" if how == "the ask fails" else None)
    study_a = optuna.create_study(study_name="s", storage=a_storage)
    study_b = optuna.load_study(study_name="s", storage=_storage(url))
    a = Drivers(study_a, tmp_path / "a", shared=True)
    b = Drivers(study_b, tmp_path / "b", shared=True)
    assert a.lock.kind == "PostgreSQL advisory lock"
    for _ in range(TOTAL - 1):
        assert len(b.ask(_asker(study_b, b), TOTAL)) == 1
    got_b: list[Any] = []

    def restart_and_b_asks() -> None:
        if got_b:
            return  # A asks again after taking the lock again: no second restart
        _drop_every_connection(url)
        got_b.extend(b.ask(_asker(study_b, b), TOTAL))  # takes the lock A held

    got_a = a.ask(_asker(study_a, a, restart_and_b_asks), TOTAL)

    assert len(got_b) == 1 and got_a == []
    trials = optuna.load_study(study_name="s", storage=url).get_trials()
    assert countable(trials) == TOTAL == a.count
    counted = [t for t in trials if not t.user_attrs.get(VOID_ATTR)]
    assert [t.number for t in counted] == list(range(TOTAL))
    assert {t.user_attrs[DRIVER_ATTR] for t in counted} == {b.id}
    void = [t for t in trials if t.user_attrs.get(VOID_ATTR)]
    if how == "the ask fails":  # asked again under the renewed lock, and found the budget full
        assert void == []
    else:  # created on a new connection; found past the budget under the renewed lock
        assert [(t.number, t.state) for t in void] == [(TOTAL, TrialState.FAIL)]
        assert "asked past budget.trials" in void[0].user_attrs["error"]
        assert "the study lock (PostgreSQL advisory lock) was lost" in caplog.text
    # the lock was taken again and given back: another driver can take it now
    with b.lock:
        assert b.lock.intact()


def test_an_ask_whose_answer_was_lost_leaves_no_orphan(tmp_path: Path) -> None:
    """The storage created the trial but the answer was lost with the connection: the ask
    takes the lock again, ends that trial void (nothing would ever train it: it names no
    driver that asked it) and asks once more; the budget counts the one trial it trains."""
    url = f"sqlite:///{tmp_path / 'study.db'}"
    storage = _storage(url, "create_new_trial", after=True)
    study = optuna.create_study(study_name="s", storage=storage)
    me = Drivers(study, tmp_path / "me", shared=True)
    assert me.lock.kind == "SQLite file lock"

    got = me.ask(_asker(study, me), 2)

    assert [pair[0].number for pair in got] == [1]
    trials = study.get_trials()
    assert [(t.number, t.state, bool(t.user_attrs.get(VOID_ATTR))) for t in trials] == [
        (0, TrialState.FAIL, True),
        (1, TrialState.RUNNING, False),
    ]
    assert "lost the connection" in trials[0].user_attrs["error"]
    assert trials[1].user_attrs[DRIVER_ATTR] == me.id
    assert countable(trials) == me.count == 1
    # a resumed driver counts the same
    assert Drivers(study, tmp_path / "me", shared=True).count == 1


def test_an_ask_that_keeps_losing_the_lock_stops_the_sweep_with_a_clear_error(
    tmp_path: Path,
) -> None:
    from hfsweep.storage.database import StorageUnavailable

    url = f"sqlite:///{tmp_path / 'study.db'}"
    storage = _storage(url)
    study = optuna.create_study(study_name="s", storage=storage)
    me = Drivers(study, tmp_path / "me", shared=True)
    storage._inner = _Flaky(storage.inner, "get_all_trials", times=100)
    with pytest.raises(StorageUnavailable, match="was lost 8 times in a row while asking"):
        me.ask(_asker(study, me), 2)
    assert optuna.load_study(study_name="s", storage=url).get_trials() == []
