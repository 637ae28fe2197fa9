"""Driver storms (issue 45): three ``hfsweep run --resume`` drivers share one study on a
``journal://`` file or on PostgreSQL; seeded random SIGKILLs hit random drivers at random
moments (and one driver, started first, kills itself just after Optuna created a trial for
it), each killed driver is resumed, and once all exit 0 the whole budget is finished, exactly, none running,
none told twice, none trained by two drivers at once (tests/sweep/_storm.py).

Before the fix a trial created just before its driver's death named no driver: no driver
adopted it, it stayed RUNNING and every driver exited 0 with "1 still running"."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from ._storm import storm

#: small enough for a storm to take a minute or two on two cores
TRIALS = 24
KILLS = 4

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs POSIX signals"),
]


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("kind", ["journal", "postgresql"])
def test_a_storm_of_killed_and_resumed_drivers_finishes_the_budget(
    tmp_path: Path, request: pytest.FixtureRequest, kind: str, seed: int
) -> None:
    if kind == "postgresql":
        url = str(request.getfixturevalue("postgres"))
    else:
        (tmp_path / "shared").mkdir()
        url = f"journal://{tmp_path / 'shared' / 'study.log'}"
    report = storm(tmp_path, url, trials=TRIALS, seed=seed, kills=KILLS)  # prints its report
    assert any(how.startswith("after create") for _d, _n, how in report.kills), report
