"""The one sweep (``hfsweep.core.sweep.Sweep``) on its own: members asked and packed by key, an
array's report turned into decisions and ends, each end told once (also for a replayed report),
refill, the end of an array, and a save and restore, driven through its two ports by a fake
searcher and a fake decider instead of Ray Tune; and the ledger's one rule for ending a
member."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from typing import Any

import pytest
from torch import nn

import hfsweep as hs
from hfsweep.core.ledger import Ledger
from hfsweep.core.members import MemberRecord
from hfsweep.core.ports import EXHAUSTED, Exhausted
from hfsweep.core.status import Status
from hfsweep.core.sweep import Sweep

TASK = hs.Task(
    name="core_toy",
    model=lambda c: nn.Linear(2, c["hidden"]),
    data=lambda c: ([], []),
    defaults={"hidden": 4, "batch_size": 8, "epochs": 3},
)


class FakeSearcher:
    """Hands out ``configs`` in order, then says it is exhausted; records what it hears."""

    def __init__(self, configs: list[dict[str, Any]]) -> None:
        self.configs = list(configs)
        self.heard: list[tuple[str, int]] = []
        self.told: Counter[str] = Counter()

    def ask(self, member_id: str) -> Mapping[str, Any] | Exhausted | None:
        return self.configs.pop(0) if self.configs else EXHAUSTED

    def report(self, member: MemberRecord, result: Mapping[str, Any]) -> None:
        self.heard.append((member.id, result["step"]))

    def tell(self, member: MemberRecord, status: Status, result: Mapping[str, Any] | None) -> None:
        self.told[member.id] += 1


class FakeDecider:
    """Stops every member whose value is below ``floor``; records the ends it is told."""

    def __init__(self, floor: float) -> None:
        self.floor = floor
        self.ended: list[tuple[str, Status]] = []

    def decide(self, fresh: list[tuple[MemberRecord, dict[str, Any]]]) -> dict[str, bool]:
        return {rec.id: result["acc"] >= self.floor for rec, result in fresh}

    def at_budget(self, member: MemberRecord, result: Mapping[str, Any]) -> bool:
        return False

    def end(self, member: MemberRecord, status: Status, result: Mapping[str, Any] | None) -> None:
        self.ended.append((member.id, status))


class Scripted(Sweep):
    """A sweep over a :class:`FakeSearcher` and a :class:`FakeDecider`, its answers kept."""

    def __init__(self, configs: list[dict[str, Any]], floor: float, **sizing: Any) -> None:
        self.fake_searcher = FakeSearcher(configs)
        self.fake_decider = FakeDecider(floor)
        super().__init__(TASK, searcher=self.fake_searcher, decider=self.fake_decider, **sizing)
        self.posted: dict[str, dict[str, Any]] = {}
        self.post = lambda token, message: self.posted.__setitem__(token, message)
        self.configure("acc", "max")

    @property
    def heard(self) -> list[tuple[str, int]]:
        return self.fake_searcher.heard

    @property
    def told(self) -> Counter[str]:
        return self.fake_searcher.told


def _report(token: str, evals: list[tuple[str, int, float]], **extra: Any) -> dict[str, Any]:
    """An array report: ``(member, epoch, acc)`` per evaluated member (2 steps per epoch)."""
    evaluations = [
        {
            "member": m,
            "step": 2 * epoch,
            "epoch": float(epoch),
            "metrics": {"train_loss": 0.5, "val_loss": 0.5, "acc": acc},
            "final": epoch == 3,
        }
        for m, epoch, acc in evals
    ]
    return {"token": token, "evaluations": evaluations, **extra}


def test_an_array_report_becomes_decisions_ends_told_once_and_a_refill() -> None:
    configs = [{"lr": 0.1 * (i + 1), "hidden": 4} for i in range(3)]
    sweep = Scripted(configs, floor=0.5, members=3, array_size=2)
    array = sweep.start_array("A")
    assert array is not None and array.members == ["A-0", "A-1"]
    assert sweep.counts()[Status.RUNNING] == 2 and sweep.counts()[Status.WAITING] == 0

    assert sweep.on_report("A", _report("t1", [("A-0", 1, 0.9), ("A-1", 1, 0.2)]))
    answer = sweep.posted["t1"]
    assert answer["go"] == {"A-0": True, "A-1": False}
    # the stopped member's slot went to the third config, asked for array A
    assert [g["id"] for g in answer["given"]] == ["A-2"] and sweep.arrays["A"].given == ["A-2"]
    assert sweep.members["A-1"].status is Status.STOPPED and sweep.ledger.status("A-1") == "stopped"
    assert sweep.heard == [("A-0", 2), ("A-1", 2)]

    # the same evaluations again (a resumed array's replay): the logged answers, nothing told
    assert sweep.on_report("A", _report("t1b", [("A-0", 1, 0.1), ("A-1", 1, 0.9)]))
    assert sweep.posted["t1b"]["go"] == {"A-0": True, "A-1": False}
    assert sweep.arrays["A"].replayed == 2 and len(sweep.members["A-0"].history) == 1

    report = _report("t2", [("A-0", 3, 0.95), ("A-2", 3, math.nan)], consumed=1)
    assert not sweep.on_report("A", report)
    assert sweep.members["A-0"].status is Status.COMPLETED and sweep.members["A-0"].value == 0.95
    # a completed member whose metric is not finite failed, by the ledger's one rule
    assert sweep.members["A-2"].status is Status.FAILED
    assert sweep.members["A-2"].error == "acc is nan"
    sweep.on_array_end("A", None)
    assert sweep.told == Counter({"A-0": 1, "A-1": 1, "A-2": 1})
    # each end reaches the decider once, in the order the members ended
    assert sweep.fake_decider.ended == [
        ("A-1", Status.STOPPED),
        ("A-0", Status.COMPLETED),
        ("A-2", Status.FAILED),
    ]
    assert sweep.start_array("B") is None and sweep.finished


def test_members_an_array_never_started_go_back_and_a_restore_agrees_with_the_ledger() -> None:
    configs = [{"lr": 0.1, "hidden": h} for h in (4, 4, 8, 4)]
    sweep = Scripted(configs, floor=0.5, members=4, array_size=2)
    assert sweep.start_array("A") is not None  # A-0, A-1 (key hidden=4); A-2 waits (hidden=8)
    sweep.on_report("A", _report("t1", [("A-0", 1, 0.9), ("A-1", 1, 0.1)]))
    given = sweep.arrays["A"].given
    assert given == ["A-3"]
    # the array ended before it started the refill member: back to its key's pool, untold
    sweep.on_array_end("A", None)
    assert sweep.members["A-3"].status is Status.WAITING and sweep.arrays["A"].returned == given
    assert sweep.members["A-0"].status is Status.STOPPED  # evaluated, stopped from outside

    saved = sweep.state_dict()
    saved["members"]["A-1"]["status"] = "running"  # a record older than the ledger
    restored = Scripted([], floor=0.5, members=4, array_size=2)
    restored.load_state_dict(saved)
    assert restored.members["A-1"].status is Status.STOPPED  # the ledger's end wins
    assert restored.counts() == sweep.counts()
    array = restored.start_array("B")
    # nothing more to ask: the fullest pool, ties to the key met first (hidden=4's)
    assert array is not None and array.members == ["A-3"]
    assert restored.members["A-2"].status is Status.WAITING


def test_the_ledger_ends_a_member_once_by_the_settle_rule() -> None:
    ledger = Ledger()
    assert ledger.settle("m0", Status.COMPLETED, 0.7, "acc") == (Status.COMPLETED, None)
    assert ledger.settle("m0", Status.FAILED, None, "acc") is None  # ended already
    assert ledger.settle("m1", "completed", math.inf, "acc") == (Status.FAILED, "acc is inf")
    assert ledger.settle("m2", Status.STOPPED, math.nan, "acc") == (Status.STOPPED, None)
    assert ledger.ended == {"m0": Status.COMPLETED, "m1": Status.FAILED, "m2": Status.STOPPED}


def test_a_report_without_the_metric_is_refused_before_anything_is_recorded() -> None:
    sweep = Scripted([{"lr": 0.1, "hidden": 4}], floor=0.5, members=1, array_size=1)
    assert sweep.start_array("A") is not None
    report = _report("t1", [("A-0", 1, 0.9)])
    del report["evaluations"][0]["metrics"]["acc"]
    with pytest.raises(ValueError, match=r"metric 'acc' is not among .* member A-0 reports"):
        sweep.on_report("A", report)
    assert sweep.members["A-0"].history == [] and sweep.ledger.decisions == {}
