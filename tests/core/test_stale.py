"""What a resume can rebuild of a ledger older than its study, and what it must refuse
(hfsweep.core._stale); the sweeps that meet it are in tests/sweep/test_stale_ledger.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optuna
from hfsweep.schedulers import FIFOScheduler
from optuna.trial import TrialState

from hfsweep.core._parts import _Array
from hfsweep.core._stale import lost_with_them, rank_best, unended, unrecorded_arrays
from hfsweep.core.ledger import Ledger
from hfsweep.core.status import Status

ME, OTHER = "me", "other"


def _ledger(tmp_path: Path, arrays: int = 1, ended: tuple[int, ...] = ()) -> Ledger:
    from hfsweep.core._ledger_file import LedgerFile

    ledger = Ledger(
        LedgerFile(tmp_path / "state.json", tmp_path / "state.jsonl"),
        FIFOScheduler(max_resource=10),
        float,
    )
    ledger.arrays = [_Array(index=i, key="{}", size=2, done=True) for i in range(arrays)]
    ledger.ended = {f"trial-{n}": Status.COMPLETED for n in ended}
    return ledger


def _trial(
    number: int,
    state: TrialState = TrialState.COMPLETE,
    *,
    array: int | None = None,
    driver: str = ME,
    reports: dict[int, float] | None = None,
    value: float | None = 1.0,
    trained: bool = True,
) -> optuna.trial.FrozenTrial:
    attrs: dict[str, Any] = {"driver": driver}
    if array is not None:
        attrs["array"] = array
    if trained and state != TrialState.RUNNING:
        attrs["steps"] = 10
    t = optuna.trial.create_trial(
        state=state,
        value=value if state == TrialState.COMPLETE else None,
        params={},
        distributions={},
        user_attrs=attrs,
        intermediate_values=reports or {},
    )
    t.number = number
    return t


def _mine(t: optuna.trial.FrozenTrial) -> bool:
    return t.user_attrs.get("driver") == ME


def _never(index: int) -> bool:
    return False


def test_unended_is_this_drivers_finished_trials_the_ledger_lacks(tmp_path: Path) -> None:
    ledger = _ledger(tmp_path, ended=(0,))
    trials = [
        _trial(0),  # ended in the ledger
        _trial(1, TrialState.FAIL),
        _trial(2, TrialState.RUNNING),  # not finished
        _trial(3, driver=OTHER),  # another driver's
        _trial(4, TrialState.PRUNED),
    ]
    assert [t.number for t in unended(ledger, trials, _mine)] == [1, 4]


def test_reports_lost_only_matter_to_a_scheduler_that_ranks_them(tmp_path: Path) -> None:
    ledger = _ledger(tmp_path)
    ledger.decisions = {"trial-1@5": True, "trial-1@10": True, "trial-2@5": True}
    trials = [_trial(1, reports={5: 0.1, 10: 0.2}), _trial(2, reports={5: 0.1, 10: 0.2})]
    # in steps: the study's steps are the logged ones; trial 2's step 10 is lost
    lost = lost_with_them(ledger, trials, ranks_reports=True, by_steps=True)
    assert lost == {2: "its reports at steps 10 (the scheduler's record of them)"}
    # in epochs: counted (several evaluations can share one rounded epoch)
    assert set(lost_with_them(ledger, trials, ranks_reports=True, by_steps=False)) == {2}
    assert lost_with_them(ledger, trials, ranks_reports=False, by_steps=True) == {}


def test_a_finished_array_the_ledger_lacks_is_rebuilt_when_it_follows_its_arrays(
    tmp_path: Path,
) -> None:
    ledger = _ledger(tmp_path, arrays=1)
    trials = [_trial(0, array=0), _trial(2, array=1), _trial(3, TrialState.FAIL, array=1)]
    arrays, why = unrecorded_arrays(ledger, trials, _mine, _never)
    assert why is None and {k: [t.number for t in v] for k, v in arrays.items()} == {1: [2, 3]}


def test_an_array_in_training_or_after_a_gap_cannot_be_rebuilt(tmp_path: Path) -> None:
    ledger = _ledger(tmp_path, arrays=1)
    in_training = [_trial(2, array=1), _trial(3, TrialState.RUNNING, array=1)]
    _, why = unrecorded_arrays(ledger, in_training, _mine, _never)
    assert why == "array 1, which holds trial 3 in training"
    after_a_gap = [_trial(4, array=2)]
    _, why = unrecorded_arrays(ledger, after_a_gap, _mine, _never)
    assert why == "array 1, whose trials it cannot tell"


def test_arrays_that_are_not_this_ledgers_to_rebuild_are_left_alone(tmp_path: Path) -> None:
    """Running trials named for an array the engine never saved (it stopped in between: no
    checkpoint), a trial the ledger ended whose array number another driver gave it before this
    one adopted it, another driver's trials, and a trial failed before it trained."""
    ledger = _ledger(tmp_path, arrays=1, ended=(5,))
    trials = [
        _trial(2, TrialState.RUNNING, array=1),
        _trial(5, TrialState.FAIL, array=7, trained=False),
        _trial(6, array=3, driver=OTHER),
        _trial(8, TrialState.FAIL, array=9, trained=False),
    ]
    assert unrecorded_arrays(ledger, trials, _mine, _never) == ({}, None)
    # the same running trials, with a checkpoint of their array: it trained, and is lost
    _, why = unrecorded_arrays(ledger, trials[:1], _mine, lambda index: index == 1)
    assert why == "array 1, which holds trial 2 in training"


def test_rank_best_ranks_the_rebuilt_trials_with_a_checkpoint_among_the_kept(
    tmp_path: Path,
) -> None:
    best = [(0.9, 0), (0.5, 1)]
    missing = [
        _trial(2, value=0.8),
        _trial(3, value=0.95),
        _trial(4, value=0.99),  # no checkpoint kept: not rankable
        _trial(5, TrialState.FAIL),
    ]

    def rank(value: float, number: int) -> tuple[float, int]:
        return (-value, number)

    kept, dropped = rank_best(best, missing, has_checkpoint=lambda n: n != 4, rank=rank, keep=3)
    assert kept == [(0.95, 3), (0.9, 0), (0.8, 2)] and dropped == [1]
