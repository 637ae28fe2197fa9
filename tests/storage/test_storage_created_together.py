"""Drivers started together on an empty database: Optuna's RDB storage checks which of its
tables (and PostgreSQL enum types) exist, then creates the missing ones, so the slower of two
drivers opening it at the same moment collides with the other's CREATE
(``UniqueViolation ... pg_type_typname_nsp_index``) and stopped with "unexpected
IntegrityError". ``open_storage`` opens it again, and finds what the other created."""

from __future__ import annotations

import threading
from typing import Any

import optuna
import pytest
from sqlalchemy.exc import IntegrityError

from hfsweep.storage import database as _storage
from hfsweep.storage.database import open_storage


def _collision() -> IntegrityError:
    return IntegrityError("CREATE TYPE studydirection", {}, Exception("duplicate key value"))


def test_a_collision_while_another_creates_the_tables_is_opened_again(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[str] = []

    class _CollidingOnce(optuna.storages.RDBStorage):  # a subclass: isinstance checks hold
        def __init__(self, url: str, **kw: Any) -> None:
            calls.append(url)
            if len(calls) == 1:
                raise _collision()
            super().__init__(url, **kw)

    monkeypatch.setattr(optuna.storages, "RDBStorage", _CollidingOnce)
    monkeypatch.setattr(_storage, "_CREATE_WAIT_S", 0.0)
    url = f"sqlite:///{tmp_path / 'study.db'}"
    with caplog.at_level("INFO", logger="hfsweep.storage"):
        storage = open_storage(url, retry_s=0, resume="hfsweep run --resume")
    assert len(calls) == 2
    assert "another process was creating its tables; opening it again" in caplog.text
    optuna.create_study(study_name="s", storage=storage)  # the storage opened works


def test_a_collision_that_does_not_pass_is_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    def always(url: str, **kw: Any) -> Any:
        calls.append(url)
        raise _collision()

    monkeypatch.setattr(optuna.storages, "RDBStorage", always)
    monkeypatch.setattr(_storage, "_CREATE_WAIT_S", 0.0)
    with pytest.raises(IntegrityError):
        open_storage("sqlite:///unused.db", retry_s=0, resume="hfsweep run --resume")
    assert len(calls) == _storage._CREATE_TRIES


def test_drivers_opening_an_empty_database_at_once_all_open_it(
    postgres_server_shared: Any,
) -> None:
    """Four threads open one new PostgreSQL database at the same moment, as four drivers
    started together would (each its own connections)."""
    url = postgres_server_shared.create_database()
    start = threading.Barrier(4)
    errors: list[BaseException] = []

    def open_one() -> None:
        start.wait()
        try:
            open_storage(url, retry_s=0, resume="hfsweep run --resume")
        except BaseException as exc:  # collected: the test fails naming it
            errors.append(exc)

    threads = [threading.Thread(target=open_one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
