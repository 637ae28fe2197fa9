"""A driver SIGKILLed just after the storage created a trial for it, on PostgreSQL and on a
shared journal file (issue 45; tests/sweep/test_ownerless_trials.py has the fast, in-process
form): another driver adopts and trains the trial, the killed driver's ``--resume`` then finds
nothing left, and every trial of the budget ends once.

Before the fix the trial named no driver (hfsweep recorded it in a second write), so no driver
adopted it and both exited 0 with "1 still running"."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from .test_two_drivers import STUDY, _check, _Driver, _opened

KILLER = Path(__file__).resolve().parent / "_kill_after_create.py"
#: the trial whose create the kill follows (the third: an array's worth asked before it)
NTH = 3

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs POSIX signals"),
]


@pytest.mark.parametrize("storage", ["postgresql", "journal"])
def test_a_trial_created_just_before_its_driver_was_killed_is_trained_once(
    tmp_path: Path, request: pytest.FixtureRequest, storage: str
) -> None:
    if storage == "postgresql":
        url = str(request.getfixturevalue("postgres"))
    else:
        (tmp_path / "shared").mkdir()
        url = f"journal://{tmp_path / 'shared' / 'study.log'}"
    a, b = _Driver(tmp_path / "a", url), _Driver(tmp_path / "b", url)
    a.start(launcher=(str(KILLER), str(NTH)))
    a.communicate(timeout=120)
    assert a.proc is not None and a.proc.returncode == -signal.SIGKILL, a.log()[-3000:]
    study = optuna.load_study(study_name=STUDY, storage=_opened(url))
    cut = study.get_trials()[NTH - 1]
    assert cut.state == TrialState.RUNNING and cut.params == {}

    b.start()
    b.finished()
    a.start()  # the killed driver resumed: its trial was adopted and finished meanwhile
    a.finished()
    _check(url, a, b)
    trials = optuna.load_study(study_name=STUDY, storage=_opened(url)).get_trials()
    assert not any(t.user_attrs.get("void") for t in trials)
    adopter = json.loads((b.run / "driver.json").read_text())["id"]
    assert trials[NTH - 1].user_attrs["driver"] == adopter  # b adopted it
