"""The array trainable's side of a report, without a Ray cluster: each member's own clock.

The channel between the trainer and the driver is driven by hand here: a fake clock, the
driver's answers scripted, ``tune.report`` captured. What it sends is what the driver turns into
each member's ``time_total_s``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ray.tune")

import torch
from hfsweep.schedulers import _tune_trainable
from hfsweep.schedulers._tune_format import WEIGHTS_DIR
from hfsweep.schedulers._tune_trainable import _Channel

from hfsweep.training import Evaluation, MemberResult


class FakeClock:
    """A settable ``time.monotonic``."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _evals(*members: str) -> list[Evaluation]:
    return [Evaluation(m, 5, 1.0, {"val_accuracy": 0.5}, False) for m in members]


def test_each_member_reports_its_own_training_time_through_a_refill_and_a_restore(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ray import tune

    sent: list[dict[str, Any]] = []
    monkeypatch.setattr(
        tune, "report", lambda metrics, checkpoint=None: sent.append(json.loads(metrics["hfsweep"]))
    )
    answers: list[dict[str, Any]] = []
    monkeypatch.setattr(_tune_trainable, "await_answer", lambda hub, token: answers.pop(0))

    def times() -> dict[str, float]:
        return {e["member"]: e["time"] for e in sent[-1]["evaluations"]}

    (tmp_path / "array.pt").write_bytes(b"trainer state")  # a checkpoint goes with each report
    meta = {"metric": "val_accuracy", "mode": "max", "members": [{"id": "a"}, {"id": "b"}]}
    clock = FakeClock(1000.0)
    channel = _Channel(object(), meta, tmp_path, resumed=False, clock=clock)
    clock.now = 1100.0  # the array has trained 100 s
    answers.append({"go": {"a": True, "b": False}, "given": [{"id": "c", "config": {}}]})
    channel.report(_evals("a", "b"))
    assert times() == {"a": 100.0, "b": 100.0}
    assert channel.refill() is not None  # c takes b's slot at the array's 100 s
    clock.now = 1130.0
    answers.append({"go": {"a": True, "c": True}, "given": []})
    channel.report(_evals("a", "c"))
    assert times() == {"a": 130.0, "c": 30.0}  # c's clock started when it joined
    assert sent[-1]["elapsed"] == 130.0

    # the trainable crashes and is retried from the checkpoint sent with that report (the
    # trainer's state as of its save after the first report): a new process, another clock
    clock = FakeClock(7.0)
    retried = _Channel(object(), meta, tmp_path, resumed=True, clock=clock)
    clock.now = 37.0
    answers.append({"go": {"a": True, "c": True}, "given": []})
    retried.report(_evals("a", "c"))  # the replay of the second report
    assert times() == {"a": 130.0, "c": 30.0}
    clock.now = 67.0
    answers.append({"go": {"a": True, "c": True}, "given": []})
    retried.report(_evals("a", "c"))
    assert times() == {"a": 160.0, "c": 60.0}  # both clocks go on; neither restarted at 0


def test_complete_members_weights_go_with_the_next_checkpoint_and_the_last_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ray import tune

    sent: list[tuple[dict[str, Any], set[str] | None]] = []

    def report(metrics: dict[str, Any], checkpoint: Any = None) -> None:
        held = None
        if checkpoint is not None:  # what the checkpoint directory holds at this report
            held = {p.name for p in (Path(checkpoint.path) / WEIGHTS_DIR).glob("*.pt")}
        sent.append((json.loads(metrics["hfsweep"]), held))

    monkeypatch.setattr(tune, "report", report)
    answers: list[dict[str, Any]] = []
    monkeypatch.setattr(_tune_trainable, "await_answer", lambda hub, token: answers.pop(0))

    def finished(member: str, status: str) -> MemberResult:
        weights = {"w": torch.full((2, 3), float(len(member))), "b": torch.arange(3.0)}
        state = {"model": weights, "optimizer": {}, "scheduler": None, "rng": None}
        return MemberResult(member, {}, status, 10, [{"val_accuracy": 0.5}], state)

    (tmp_path / "array.pt").write_bytes(b"trainer state")
    members = [{"id": m} for m in ("a", "bb", "ccc", "dddd")]
    meta = {"metric": "val_accuracy", "mode": "max", "members": members}
    channel = _Channel(object(), meta, tmp_path, resumed=False)
    # the driver stops bb and ccc: bb at the scheduler's budget (complete), ccc pruned
    answers.append({"go": {"bb": False, "ccc": False}, "given": [], "complete": ["bb"]})
    channel.report(_evals("a", "bb", "ccc", "dddd"))
    channel.on_finish(finished("bb", "stopped"))
    channel.on_finish(finished("ccc", "stopped"))
    channel.on_finish(finished("dddd", "failed"))
    answers.append({"go": {"a": True}, "given": []})
    channel.report(_evals("a"))
    assert sent[-1][1] == {"bb.pt"}  # the complete member's weights, not the pruned one's
    channel.on_finish(finished("a", "completed"))  # trained to its budget, after its report
    channel.close()
    assert sent[-1][0]["final"] and sent[-1][1] == {"a.pt", "bb.pt"}  # the last word has them

    for member in ("a", "bb"):
        saved = torch.load(tmp_path / WEIGHTS_DIR / f"{member}.pt", weights_only=True)
        assert set(saved) == {"w", "b"}
        assert torch.equal(saved["w"], torch.full((2, 3), float(len(member))))
