"""The fixtures' start-up under load (tests/_ready.py): a slow or unlucky start is tried again
after cleaning up, and a start that keeps failing is reported with every try's cause."""

from __future__ import annotations

import pytest
from _ready import StartFailed, start_with_retries


def test_a_start_that_fails_twice_is_tried_again_after_cleaning_up() -> None:
    calls: list[str] = []
    pauses: list[float] = []

    def start() -> str:
        calls.append("start")
        if calls.count("start") < 3:
            raise TimeoutError("the raylet did not register in 30 s")
        return "up"

    got = start_with_retries(
        "a server", start, lambda: calls.append("clean"), tries=3, pause_s=1.0, sleep=pauses.append
    )
    assert got == "up"
    assert calls == ["start", "clean", "start", "clean", "start"]
    assert pauses == [1.0, 2.0]


def test_a_start_that_keeps_failing_names_every_cause() -> None:
    causes = iter(["port 5432 taken", "port 5433 taken"])

    def start() -> None:
        raise OSError(next(causes))

    with pytest.raises(StartFailed) as failed:
        start_with_retries("PostgreSQL", start, lambda: None, tries=2, sleep=lambda s: None)
    text = str(failed.value)
    assert "PostgreSQL did not start in 2 tries" in text
    assert "try 1: OSError: port 5432 taken" in text and "try 2: OSError: port 5433 taken" in text


def test_a_skip_is_not_retried() -> None:
    calls = []

    def start() -> None:
        calls.append(1)
        pytest.skip("no binaries")

    with pytest.raises(pytest.skip.Exception):
        start_with_retries("x", start, lambda: None, sleep=lambda s: None)
    assert calls == [1]


def test_postgres_starts_on_another_port_when_its_port_was_taken(monkeypatch) -> None:
    """The port found free is taken (by another process's server) before PostgreSQL binds it:
    the fixture's server starts on a new port instead of failing the tests that use it."""
    import socket

    import _postgres

    reason = _postgres.skip_reason()
    if reason is not None:
        pytest.skip(reason)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        ports = iter([busy])
        real = _postgres.free_port
        monkeypatch.setattr(_postgres, "free_port", lambda: next(ports, None) or real())
        monkeypatch.setattr("_ready.time.sleep", lambda s: None)
        server = _postgres.PostgresServer()
        try:
            assert server.port != busy
            import psycopg2

            psycopg2.connect(server.url()).close()
        finally:
            server.close()
