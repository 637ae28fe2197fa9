"""A driver stopped right after the storage created a trial for it (issue 45): the trial must
still be trained by someone, once.

Optuna creates a trial, and hfsweep used to record its driver (the user attr ``driver``) in a
second write. A driver killed between the two left a RUNNING trial that named no driver and no
array, which no driver adopted (it looked like a plain Optuna worker's) and the budget counted:
every driver exited 0 with "1 still running". Trials are now created naming their driver, so
such a trial is that driver's: its ``--resume`` takes it up, or another driver adopts it once
the driver is gone.

Here the driver is stopped inside the storage's ``create_new_trial``, just after the trial was
created; an exception that no handler catches stands in for the kill (the study holds what a
SIGKILL would leave). tests/sweep/test_ownerless_kill.py does the same with a real SIGKILL on
PostgreSQL and on a journal file.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState

from hfsweep._compat import ask_with_user_attrs
from hfsweep.cli import main
from hfsweep.storage.drivers import DRIVER_ATTR, VOID_ATTR, Drivers, countable
from hfsweep.storage.journal import journal_storage

TOY = Path(__file__).resolve().parent / "_toy.py"
TRIALS = 4
#: a line of a sweep's log per trial told
TOLD = r"hfsweep\.sweep: trial (\d+) (?:completed|stopped|failed)"


class _Killed(BaseException):
    """Stands in for a SIGKILL: no handler of the sweep catches it."""


def _sweep(folder: Path, journal: Path) -> Path:
    folder.mkdir()
    path = folder / "sweep.yaml"
    path.write_text(
        f"""\
task: "{TOY}:TASK"
search_space:
  lr: {{type: float, low: 1.0e-3, high: 0.5, log: true}}
  momentum: {{type: float, low: 0.0, high: 0.9}}
searcher: random
budget: {{trials: {TRIALS}, epochs: 2}}
metric: val_accuracy
mode: max
fusion: {{size: 2, device: cpu}}
storage: {json.dumps(f"journal://{journal}")}
study_name: shared
output: run
""",
        encoding="utf-8",
    )
    return path


def _killed_after_create(monkeypatch: pytest.MonkeyPatch, nth: int) -> None:
    """The ``nth`` trial the journal storage creates (from now on) is created, then the
    process 'dies' before anything else is written."""
    original = JournalStorage.create_new_trial
    made = {"n": 0}

    def create(self: JournalStorage, study_id: int, template_trial: Any = None) -> int:
        ident = original(self, study_id, template_trial)
        made["n"] += 1
        if made["n"] == nth:
            monkeypatch.setattr(JournalStorage, "create_new_trial", original)
            raise _Killed
        return ident

    monkeypatch.setattr(JournalStorage, "create_new_trial", create)


def _check(journal: Path, *runs: Path) -> None:
    """Every trial of the budget finished, none running, none void, each told once."""
    study = optuna.load_study(
        study_name="shared", storage=JournalStorage(JournalFileBackend(str(journal)))
    )
    trials = study.get_trials()
    assert [(t.number, t.state) for t in trials if t.state == TrialState.RUNNING] == []
    assert [t.number for t in trials] == list(range(TRIALS))
    assert {t.state for t in trials} <= {TrialState.COMPLETE, TrialState.PRUNED}
    told = Counter(n for run in runs for n in re.findall(TOLD, (run / "sweep.log").read_text()))
    assert told == Counter({str(n): 1 for n in range(TRIALS)})


@pytest.mark.parametrize(
    "then", [pytest.param("another driver", marks=pytest.mark.slow), "its own --resume"]
)
def test_a_driver_killed_just_after_a_create_leaves_a_trial_that_is_trained_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, then: str
) -> None:
    monkeypatch.setenv("HFSWEEP_CACHE_DIR", str(tmp_path))
    journal = tmp_path / "study.log"
    a = _sweep(tmp_path / "a", journal)
    _killed_after_create(monkeypatch, nth=2)  # trial 0 asked whole, trial 1 cut short
    with pytest.raises(_Killed):
        main(["run", str(a), "--quiet"])
    study = optuna.load_study(study_name="shared", storage=journal_storage(journal))
    cut = study.get_trials()[1]
    assert cut.state == TrialState.RUNNING and cut.params == {}
    assert cut.user_attrs.get(DRIVER_ATTR) is not None  # it names its driver from the start

    if then == "another driver":
        b = _sweep(tmp_path / "b", journal)
        assert main(["run", str(b), "--quiet", "--resume"]) == 0
        _check(journal, a.parent / "run", b.parent / "run")
        assert main(["run", str(a), "--quiet", "--resume"]) == 0  # nothing left for it
        _check(journal, a.parent / "run", b.parent / "run")
    else:
        assert main(["run", str(a), "--quiet", "--resume"]) == 0
        _check(journal, a.parent / "run")


def _study(tmp_path: Path) -> optuna.Study:
    return optuna.create_study(study_name="s", storage=journal_storage(tmp_path / "j"))


@pytest.mark.parametrize("lock", ["held", "lost meanwhile"])
def test_a_create_answered_only_on_a_second_try_leaves_no_orphan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lock: str
) -> None:
    """A storage that creates a trial, loses the answer and creates another (Optuna's RDB
    storage tries a failed create again by itself): the first is void, the second is asked,
    and the budget counts one; also where the study lock was found lost after the ask (a
    database restart both loses the answer and ends the lock's connection)."""
    study = _study(tmp_path)
    me = Drivers(study, tmp_path / "me", shared=True)
    if lock == "lost meanwhile":
        intact = iter([False])
        monkeypatch.setattr(me.lock, "intact", lambda: next(intact, True))
    storage = study._storage
    original = storage.create_new_trial

    def twice(study_id: int, template_trial: Any = None) -> int:
        original(study_id, template_trial)  # committed, its answer lost
        return original(study_id, template_trial)

    storage.create_new_trial = twice
    got = me.ask(lambda n: [(ask_with_user_attrs(study, {DRIVER_ATTR: me.id}), None)], 3)
    del storage.create_new_trial
    assert [pair[0].number for pair in got] == [1]
    trials = study.get_trials()
    assert [(t.number, t.state, bool(t.user_attrs.get(VOID_ATTR))) for t in trials] == [
        (0, TrialState.FAIL, True),
        (1, TrialState.RUNNING, False),
    ]
    assert "lost the connection to the storage after creating it" in trials[0].user_attrs["error"]
    assert countable(trials) == me.count == 1


def test_a_void_cut_short_is_finished_by_the_next_claim(tmp_path: Path) -> None:
    """A driver stopped between marking a trial void and ending it: the trial is not trained
    by whoever claims running trials next, but ended."""
    study = _study(tmp_path)
    me = Drivers(study, tmp_path / "me", shared=True)
    trial = ask_with_user_attrs(study, {DRIVER_ATTR: me.id})
    trial.set_user_attr(VOID_ATTR, True)
    with me.lock:
        own, adopted = me.claim(study.get_trials())
    assert own == adopted == []
    (t,) = study.get_trials()
    assert t.state == TrialState.FAIL and countable([t]) == 0


def test_a_plain_optuna_workers_trial_is_left_alone(tmp_path: Path) -> None:
    """A trial another tool asked (no driver, no array) is neither adopted nor made void by a
    driver's ask, even one that lost its lock."""
    study = _study(tmp_path)
    me = Drivers(study, tmp_path / "me", shared=True)
    plain = study.ask()
    assert me._void_cut_off(study.get_trials(), 0) == study.get_trials()
    with me.lock:
        assert me.claim(study.get_trials()) == ([], [])
    assert me.foreign == 1
    assert study.get_trials()[plain.number].state == TrialState.RUNNING


def test_a_custom_searchers_trial_cut_short_before_its_params_is_void_on_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A custom searcher's config is recorded after the create: a trial cut short between the
    two cannot be rebuilt on resume (the searcher gave its config to a process that is gone),
    so it is void, the searcher is told it failed, and the budget is asked in full."""
    import hfsweep as hs

    from ._toy import sweep_config
    from .test_engine import _ListSearcher

    monkeypatch.setenv("HFSWEEP_CACHE_DIR", str(tmp_path))
    configs = [{"lr": lr, "momentum": 0.5} for lr in (0.01, 0.05, 0.1, 0.2, 0.3, 0.4)]
    config = sweep_config(
        tmp_path / "run",
        budget={"trials": TRIALS, "epochs": 2},
        fusion={"size": 2, "device": "cpu"},
    )
    _killed_after_create(monkeypatch, nth=2)
    with pytest.raises(_Killed):
        hs.sweep(config, searcher=_ListSearcher(configs), progress=False)
    searcher = _ListSearcher(configs[2:])
    result = hs.sweep(config, searcher=searcher, resume=True, progress=False)

    trials = result.study.get_trials()
    void = [t.number for t in trials if t.user_attrs.get(VOID_ATTR)]
    assert void == [1] and trials[1].state == TrialState.FAIL
    assert "params ['lr', 'momentum'] were recorded" in trials[1].user_attrs["error"]
    counted = [t for t in trials if not t.user_attrs.get(VOID_ATTR)]
    assert len(counted) == TRIALS and {t.state for t in counted} == {TrialState.COMPLETE}
    assert searcher.told[1] == ("failed", None)
