"""Starting the servers and clusters the tests need, on a loaded machine.

A fixture that starts a PostgreSQL server or a Ray must not fail the tests that use it because
the machine was busy while it started: under ``pytest -n 2`` with other work beside it, Ray's
raylet can miss its own fixed 30 s registration wait, and a port found free can be taken by
another process before the server binds it. :func:`start_with_retries` starts such a thing
again (after cleaning up the failed try) a few times, waiting longer each time, and raises one
error naming every try's cause when none succeeds, so a real breakage still fails at once with
its reason and only a slow start is ridden out.

The waits the servers themselves take are set generously too: ``pg_ctl -w -t``
(:data:`SERVER_START_S`), Ray's GCS port wait (``RAY_gcs_server_port_wait_time_s``) and a
cluster's ``wait_for_nodes`` timeout.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

_T = TypeVar("_T")

#: seconds a server (or a cluster's nodes) may take to come up on a loaded 2-core machine
SERVER_START_S = 180
#: how many times a fixture starts a server before it reports the start as failed
START_TRIES = 3


class StartFailed(RuntimeError):
    """A server or cluster did not start in :data:`START_TRIES` tries; names each try's cause."""


def start_with_retries(
    what: str,
    start: Callable[[], _T],
    clean_up: Callable[[], object],
    *,
    tries: int = START_TRIES,
    pause_s: float = 2.0,
    sleep: Callable[[float], object] = time.sleep,
) -> _T:
    """``start()``'s result; on an error ``clean_up()`` runs (ending what the failed try left)
    and ``start`` is tried again after ``pause_s`` (doubled each time), up to ``tries`` times.
    ``KeyboardInterrupt`` and pytest's own outcomes (a skip) are not retried."""
    causes: list[str] = []
    for attempt in range(1, tries + 1):
        try:
            return start()
        except Exception as exc:
            if type(exc).__module__.startswith("_pytest"):
                raise
            causes.append(f"try {attempt}: {type(exc).__name__}: {exc}")
            clean_up()
            if attempt < tries:
                sleep(pause_s * 2 ** (attempt - 1))
    raise StartFailed(f"{what} did not start in {tries} tries:\n" + "\n".join(causes))
