"""A driver SIGKILLed just after the storage created a trial for it, on PostgreSQL and on a
shared journal file (issue 45; tests/sweep/test_ownerless_trials.py has the fast, in-process
form): another driver adopts and trains the trial, the killed driver's ``--resume`` then finds
nothing left, and every trial of the budget ends once.

Before the fix the trial named no driver (hfsweep recorded it in a second write), so no driver
adopted it and both exited 0 with "1 still running"."""

from __future__ import annotations

import json
import signal
import threading
from collections import Counter
from pathlib import Path
from typing import Any

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


def test_a_database_stopped_inside_an_ask_past_storage_retry_leaves_the_trial_to_resume(
    postgres_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server stops 0.2 s after the storage created the third trial, while the driver is
    still inside its ask (a sampler taking its time), and stays down past ``storage_retry``:
    the sweep stops (exit 1) before it could take the study lock again, so the trial cannot be
    made void as a cut-off ask's would be. Its ``--resume`` must take it up. Before the fix the
    trial named no driver and stayed RUNNING for good (an outage like this lost 1 trial of 100
    in a three-driver storm)."""
    from hfsweep.cli import main
    from hfsweep.storage.database import RetryingStorage

    from .test_pg_storage import TOY_SWEEP, _tells

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HFSWEEP_CACHE_DIR", str(tmp_path))
    url = postgres_server.create_database()
    Path("sweep.yaml").write_text(
        TOY_SWEEP + f"storage: '{url}'\nstorage_retry: 1\n", encoding="utf-8"
    )
    original = RetryingStorage.create_new_trial
    stopper: list[threading.Thread] = []

    def create(self: RetryingStorage, study_id: int, template_trial: Any = None) -> int:
        ident = original(self, study_id, template_trial)
        if len(study_trials(url)) == NTH and not stopper:
            stopper.append(threading.Timer(0.2, postgres_server.stop))
            stopper[0].start()
            stopper[0].join()  # the ask goes on once the server is down
        return ident

    monkeypatch.setattr(RetryingStorage, "create_new_trial", create)
    assert main(["run", "sweep.yaml", "--quiet"]) == 1
    monkeypatch.setattr(RetryingStorage, "create_new_trial", original)
    cut = study_trials(url, start=postgres_server)[NTH - 1]
    assert cut.state == TrialState.RUNNING

    assert main(["run", "sweep.yaml", "--quiet", "--resume"]) == 0
    trials = study_trials(url)
    assert [(t.number, t.state) for t in trials if t.state != TrialState.COMPLETE] == []
    assert len(trials) == 4 and not any(t.user_attrs.get("void") for t in trials)
    assert _tells(Path("runs/sweep/sweep.log")) == Counter(range(4))  # each told once


def study_trials(url: str, start: Any = None) -> list[optuna.trial.FrozenTrial]:
    """The trials of the study in ``url`` (the server ``start`` started first)."""
    if start is not None:
        start.start()
    return optuna.load_study(study_name="sweep", storage=url).get_trials()
