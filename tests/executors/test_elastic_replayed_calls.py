"""A rank 0 lost after its relayed call reached the driver never takes the answer; the relaunch
resumes from the last complete checkpoint and sends the same calls again. The driver answers
them from what it already heard (hfsweep.executors._elastic): a replayed evaluation gets the
decision taken then, without the engine's report hook, and a replayed end is not told again.
The launcher and Ray's queues are stand-ins in this process (no Ray); the same rule on a local
Ray, with workers SIGKILLed, is tests/parallel/test_ray_worker_lost.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from _elastic_stand_ins import InProcessQueue as _Queue
from _elastic_stand_ins import QuietPolicy, ray_queue
from torch import nn

import hfsweep as hs
import hfsweep.parallel
from hfsweep.executors import _elastic
from hfsweep.executors.base import ArrayHooks
from hfsweep.parallel import COLLECTIVE_TIMEOUT_S
from hfsweep.training.results import Evaluation, Member, MemberResult


class _Policy(QuietPolicy):
    def started(self, folder: str, key: str, members: int, total: int, **_: Any) -> int:
        return 2

    def relaunch(self, folder: str, workers: int, lost: int, total: int) -> int:
        return 1


def _evaluation(member: str, step: int) -> Evaluation:
    return Evaluation(member, step, step / 6, {"loss": 1.0 / step}, False)


def _result(member: str) -> MemberResult:
    return MemberResult(member, {}, "completed", 12, [])


def test_calls_sent_again_after_a_lost_rank_0_are_answered_not_applied_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    answers: dict[str, Any] = {}

    def launcher(task: Any, members: Any, *, workers: int, **kw: Any) -> list[MemberResult]:
        """rank 0 reports step 3 and step 6 (stopping b), is lost, and the relaunch from the
        checkpoint of step 3 sends step 6 again, then ends a twice (lost after its end was
        told, before delivered.log had it)."""
        report, finish, target = kw["report"], kw["on_finish"], kw["target"]
        answers["timeout_s"] = kw["timeout_s"]
        report([_evaluation("a", 3), _evaluation("b", 3)])
        report([_evaluation("a", 6), _evaluation("b", 6)])
        answers["relaunch"] = target(workers, 1)
        answers["again"] = report([_evaluation("a", 6), _evaluation("b", 6)])
        answers["fresh"] = report([_evaluation("a", 9)])
        finish(_result("a"))
        finish(_result("a"))
        return []

    heard: list[tuple[str, int]] = []
    told: list[str] = []

    def report(evaluations: list[Evaluation]) -> dict[str, bool]:
        heard.extend((e.member, e.step) for e in evaluations)
        return {"a": True, "b": False} if evaluations[0].step == 6 else {}

    monkeypatch.setattr(ray_queue, "Queue", _Queue)
    monkeypatch.setattr(hfsweep.parallel, "train_data_parallel_ray", launcher)
    hooks = ArrayHooks(
        report=report, refill=lambda: None, on_finish=lambda r: told.append(r.id), requeue=None
    )
    members = [Member("a", {}), Member("b", {})]
    _elastic.run_elastic_array(
        hs.Task(name="replay_toy", model=lambda c: nn.Linear(4, 2), data=lambda c: ([], [])),
        str(tmp_path),
        members,
        hooks,
        resume=False,
        policy=_Policy(),
        total=lambda: 2,
        closed=lambda: False,
        bundle={"CPU": 1.0},
        threads=1,
        options={},
    )
    assert heard == [("a", 3), ("b", 3), ("a", 6), ("b", 6), ("a", 9)]
    assert answers["relaunch"] == 1
    assert answers["again"] == {"b": False}  # b's stop replayed; a goes on
    assert answers["fresh"] == {}
    assert told == ["a"]
    # the process group's timeout is the documented one, not torch's 30 minutes
    assert answers["timeout_s"] == COLLECTIVE_TIMEOUT_S == 120.0
