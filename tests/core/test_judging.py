"""The core's one rule for an array's report (:func:`hfsweep.core.judging.judge`) on its own,
with a recording front door: the order it promises (nothing recorded before the metric check,
every decision and end saved in the ledger before the searcher hears), what reaches the
scheduler and the searcher, and a final evaluation going on whatever the scheduler says."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from hfsweep.core._ledger_file import LedgerFile
from hfsweep.core.judging import Evaluated, MissingMetricError, judge, trainer_status
from hfsweep.core.ledger import Ledger
from hfsweep.core.status import Status


class _Door:
    """Stops every member below ``floor``; checks, as the searcher hears, that the ledger was
    saved with the decision and the end already."""

    def __init__(self, ledger: Ledger, floor: float) -> None:
        self.ledger, self.floor = ledger, floor
        self.calls: list[tuple[str, Any]] = []
        self.saves_when_heard: list[int] = []

    def gone(self, member: str) -> bool:
        return member == "gone"

    def replayed(self, evaluation: Evaluated, go: bool) -> None:
        self.calls.append(("replayed", evaluation.member))

    def record(self, evaluation: Evaluated) -> str:
        self.calls.append(("record", evaluation.member))
        return f"seen {evaluation.member}"

    def decide(self, judged: list[Evaluated]) -> dict[str, bool]:
        self.calls.append(("decide", [e.member for e in judged]))
        return {e.member: e.metrics["acc"] >= self.floor for e in judged}

    def at_budget(self, evaluation: Evaluated) -> bool:
        return False

    def hear(self, evaluation: Evaluated, searcher: bool) -> None:
        assert self.ledger.logged(evaluation.member, evaluation.step) is not None
        self.saves_when_heard.append(self.ledger.file.seq)  # type: ignore[union-attr]
        if searcher:
            self.calls.append(("hear", evaluation.seen))

    def ended(self, evaluation: Evaluated, status: Status, error: str | None) -> None:
        assert self.ledger.status(evaluation.member) is status
        self.calls.append(("ended", (evaluation.member, status, error)))


def _eval(
    member: str, acc: float, *, step: int = 5, loss: float = 0.5, final: bool = False
) -> Evaluated:
    metrics = {"train_loss": loss, "val_loss": 0.5, "acc": acc}
    return Evaluated(member, step, step / 5, metrics, final)


def test_decisions_and_ends_are_saved_before_the_searcher_hears(tmp_path: Path) -> None:
    ledger = Ledger(LedgerFile(tmp_path / "state.json", tmp_path / "state.jsonl"))
    ledger.save()  # the snapshot (a run's first save)
    door = _Door(ledger, floor=0.5)
    ledger.log("old", 5, True)
    report = [
        _eval("a", 0.9),
        _eval("b", 0.1),  # stopped by the scheduler
        _eval("c", 0.1, final=True),  # at its budget: goes on, completed
        _eval("d", 0.8, loss=math.inf),  # diverged: failed, never judged or heard
        _eval("e", math.nan),  # a NaN metric is judged, not heard
        _eval("old", 0.0),  # a replay: the logged answer
        _eval("gone", 0.9),  # ended elsewhere
    ]
    out = judge(report, door, ledger, "acc", "set the metric")
    assert out.go == {
        "a": True,
        "b": False,
        "c": True,
        "d": False,
        "e": False,
        "old": True,
        "gone": False,
    }
    assert ("decide", ["a", "b", "c", "e"]) in door.calls
    assert [x for k, x in door.calls if k == "hear"] == ["seen a", "seen b", "seen c"]
    ends = [x for k, x in door.calls if k == "ended"]
    assert ends == [
        ("b", Status.STOPPED, None),
        ("c", Status.COMPLETED, None),
        ("d", Status.FAILED, "non-finite loss"),
        ("e", Status.STOPPED, None),
    ]
    assert [e.member for e in out.replayed] == ["old"] and ("replayed", "old") in door.calls
    assert ("record", "old") not in door.calls and ("record", "gone") not in door.calls
    assert set(door.saves_when_heard) == {ledger.file.seq} and ledger.file.seq == 1  # type: ignore[union-attr]
    # the same report again: every evaluation is a replay now, nothing decided or told again
    door.calls.clear()
    again = judge(report, door, ledger, "acc", "set the metric")
    assert again.go == out.go and not again.fresh
    assert {kind for kind, _ in door.calls} == {"replayed"}


def test_a_report_missing_the_metric_is_refused_before_anything_is_recorded() -> None:
    ledger = Ledger()
    door = _Door(ledger, floor=0.5)
    report = [_eval("a", 0.9), Evaluated("b", 5, 1.0, {"train_loss": 0.5, "val_loss": 0.5})]
    with pytest.raises(
        MissingMetricError,
        match=r"metric 'acc' is not among the metrics member b reports: \['train_loss', 'val_loss'\]; set the metric to one of them",
    ):
        judge(report, door, ledger, "acc", "set the metric")
    assert door.calls == [] and ledger.decisions == {} and ledger.ended == {}


def test_an_end_the_trainer_saw_outside_a_report_is_settled_by_one_rule() -> None:
    assert trainer_status("failed", 0.9) is Status.FAILED
    assert trainer_status("stopped", 0.9) is Status.STOPPED
    assert trainer_status("stopped", math.nan) is Status.FAILED  # nothing to rank it by
    assert trainer_status("stopped", None) is Status.FAILED  # never evaluated
    assert trainer_status("evicted", 0.9) is Status.FAILED  # a word hfsweep does not know
    # a completed one keeps its word: the ledger's settle fails it, saying why
    assert trainer_status("completed", math.nan) is Status.COMPLETED
    assert Ledger().settle("m", trainer_status("completed", math.nan), math.nan, "acc") == (
        Status.FAILED,
        "acc is nan",
    )
