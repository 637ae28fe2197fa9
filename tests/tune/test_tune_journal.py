"""The fused Tune sweep's own save (``hfsweep-sweep.journal``), without a Ray cluster: written
before the inner searcher hears anything, a restore from it makes the calls the searcher had not
heard once, and the restored sweep agrees with the trials Tune restored from its older save."""

from __future__ import annotations

import copy
from typing import Any

import pytest

pytest.importorskip("ray.tune")

from hfsweep.schedulers._tune_joint import TuneDecider
from hfsweep.schedulers._tune_sweep import SweepState
from ray.tune.schedulers import ASHAScheduler
from test_tune_state import ListSearcher, _report, _state

from hfsweep.core.status import Status


class FakeJournal:
    """Keeps every save, with what the searcher had heard when it was written."""

    def __init__(self) -> None:
        self.saves: list[dict[str, Any]] = []

    def write(self, number: int, state: Any, searcher: ListSearcher, pending: list[Any]) -> None:
        self.saves.append(
            {
                "saves": number,
                "state": copy.deepcopy(state),
                "pending": list(pending),
                "heard": (list(searcher.results), dict(searcher.told)),
            }
        )


def _asha(state: SweepState) -> None:
    state.decider = TuneDecider(
        ASHAScheduler(
            metric="val_accuracy", mode="max", max_t=4, grace_period=1, reduction_factor=2
        )
    )


def test_the_sweep_saves_each_end_before_its_searcher_hears_it() -> None:
    state, searcher, _ = _state([{"lr": 0.1}, {"lr": 0.2}], members=2, size=2, refill=False)
    _asha(state)
    state.journal = journal = FakeJournal()
    state.suggest("A")
    state.on_result("A", _report("t1", [("A-0", 1, 0.9), ("A-1", 1, 0.1)]))
    assert searcher.outcome == {"A-1": "PRUNED"}
    save = journal.saves[-1]
    assert save["pending"] == [
        ("result", "A-0", searcher.last["A-0"]),
        ("result", "A-1", searcher.last["A-1"]),
        ("complete", "A-1", save["pending"][2][2]),
    ]
    assert save["heard"] == ([], {})  # written before the searcher heard any of them
    assert save["state"]["ledger"]["ended"] == {"A-1": "stopped"}
    assert save["state"]["members"]["A-1"]["status"] == "stopped"
    assert save["state"]["saves"] == save["saves"] == state.saves
    state.on_result("A", _report("t1", [("A-0", 1, 0.9), ("A-1", 1, 0.1)]))  # seen: no save
    assert journal.saves[-1] is save


def test_a_restore_from_the_sweeps_save_makes_the_calls_not_heard_once() -> None:
    state, _, posted = _state([{"lr": 0.1}, {"lr": 0.2}], members=2, size=2, refill=False)
    _asha(state)
    state.journal = journal = FakeJournal()
    state.suggest("A")
    state.on_result("A", _report("t1", [("A-0", 1, 0.9), ("A-1", 1, 0.1)]))
    # killed as the searcher was told: the restored searcher is the one that was saved
    restored, searcher2, posted2 = _state([], members=2, size=2, refill=False)
    restored.resume_from(journal.saves[-1])
    assert searcher2.told == {"A-1": 1} and searcher2.outcome == {"A-1": "PRUNED"}
    assert sorted(searcher2.results) == [("A-0", 1), ("A-1", 1)]
    assert restored.members["A-1"].status is Status.STOPPED
    restored.on_result("A", _report("t9", [("A-0", 1, 0.9), ("A-1", 1, 0.1)]))  # a replay
    assert posted2["t9"]["go"] == posted["t1"]["go"] == {"A-0": True, "A-1": False}
    assert searcher2.told == {"A-1": 1} and len(searcher2.results) == 2  # nothing again


def test_an_array_tune_did_not_save_ends_and_its_members_not_told_train_again() -> None:
    configs = [{"lr": 0.1}, {"lr": 0.2}, {"lr": 0.3}, {"lr": 0.4}]
    state, searcher, _ = _state(configs, members=4, size=2, refill=False)
    _asha(state)
    state.suggest("A")
    state.on_result("A", _report("t1", [("A-0", 1, 0.9), ("A-1", 1, 0.1)]))
    tunes = copy.deepcopy(state.state_dict())  # Tune's last save: array A, running
    state.suggest("B")
    state.on_result("B", _report("t2", [("B-0", 1, 0.95), ("B-1", 1, 0.05)]))
    assert searcher.outcome == {"A-1": "PRUNED", "B-1": "PRUNED"}
    state.reconcile({"A": "PENDING"}, tunes["arrays"])
    assert state.arrays["B"].done and state.arrays["B"].returned == ["B-0"]
    b0, b1 = state.members["B-0"], state.members["B-1"]
    assert b1.status is Status.STOPPED and b1.value == 0.05  # told: kept as it was told
    assert b0.status is Status.WAITING and b0.array is None and b0.history == []
    assert state.ledger.logged("B-0", 5) is None and state.ledger.logged("B-1", 5) is False
    assert not state.finished
    again = state.suggest("C")  # B-0 trains again from the start, in a new array
    assert isinstance(again, dict)
    assert [m["id"] for m in again["hfsweep"]["members"]] == ["B-0"]
    assert state.members["B-0"].array == "C"


def test_members_handed_to_an_array_after_tunes_save_are_taken_back() -> None:
    configs = [{"lr": 0.1}, {"lr": 0.2}, {"lr": 0.3}]
    state, _, posted = _state(configs, members=3, size=2)
    _asha(state)
    state.suggest("A")
    tunes = copy.deepcopy(state.state_dict())  # Tune's last save: A handed nobody yet
    state.on_result("A", _report("t1", [("A-0", 1, 0.9), ("A-1", 1, 0.1)]))
    assert [m["id"] for m in posted["t1"]["given"]] == ["A-2"]
    state.reconcile({"A": "PENDING"}, tunes["arrays"])
    assert state.arrays["A"].given == []
    assert state.members["A-2"].status is Status.WAITING
    # A resumes from its checkpoint of before t1 and replays it: the same answer
    state.on_result("A", _report("t5", [("A-0", 1, 0.9), ("A-1", 1, 0.1)], resumed=True))
    assert posted["t5"]["go"] == posted["t1"]["go"]
    assert [m["id"] for m in posted["t5"]["given"]] == ["A-2"]
    assert state.members["A-2"].array == "A" and state.members["A-1"].status is Status.STOPPED
