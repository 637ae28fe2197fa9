"""An elastic array the policy gives no workers when it starts (hfsweep.executors._elastic)
waits in the driver, holding no actor, queue or placement group, until the policy starts it,
and then launches on the workers the policy gives; an executor that stops meanwhile ends it
without a launch. While an array waits the Ray executor's slots hold the engine to the arrays
it has (hfsweep.executors._ray._elastic_slots). A relayed hook takes the answer to its own
call only. Ray's queues are replaced by in-process stand-ins and the launch by a recorder: no
Ray, no training."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from _elastic_stand_ins import InProcessQueue as _Queue
from _elastic_stand_ins import QuietPolicy, ray_queue
from test_elastic_paused_array import _task

import hfsweep.parallel
from hfsweep.executors import _elastic
from hfsweep.executors._errors import Stopped
from hfsweep.executors._ray import _elastic_slots
from hfsweep.executors.base import ArrayHooks
from hfsweep.training.results import Member


class _WaitingPolicy(QuietPolicy):
    """Gives 0 workers at the start, then ``answers`` to each look, in order."""

    def __init__(self, answers: list[int]) -> None:
        self.answers = answers
        self.calls: list[tuple[str, Any]] = []

    def started(
        self, folder: str, key: str, members: int, total: int, config: Any = None, **kw: Any
    ) -> int:
        self.calls.append(("started", kw))
        return 0

    def waiting(self, folder: str, total: int) -> int:
        answer = self.answers.pop(0)
        self.calls.append(("waiting", answer))
        return answer

    def ended(self, folder: str, total: int) -> None:
        self.calls.append(("ended", None))


def _run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, policy: _WaitingPolicy, closed: Any
) -> list[dict[str, Any]]:
    """run_elastic_array with a recording launch; the launches' arguments."""
    launches: list[dict[str, Any]] = []

    def launch(task: Any, members: Any, **kw: Any) -> list[Any]:
        launches.append({"workers": kw["workers"], "looks": len(policy.calls)})
        return []

    monkeypatch.setattr(ray_queue, "Queue", _Queue)
    monkeypatch.setattr(hfsweep.parallel, "train_data_parallel_ray", launch)
    monkeypatch.setattr(_elastic, "_POLL_S", 0.01)
    members = [Member("trial-0", {"lr": 0.1, "seed": 0})]
    _elastic.run_elastic_array(
        _task(),
        str(tmp_path / "arrays" / "0"),
        members,
        ArrayHooks(report=lambda e: {}, refill=lambda: None, on_finish=lambda r: None),
        resume=False,
        policy=policy,
        total=lambda: 2,
        closed=closed,
        bundle={"CPU": 1.0},
        threads=1,
        options={},
    )
    return launches


def test_an_array_without_workers_waits_then_launches_on_the_workers_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    policy = _WaitingPolicy([0, 0, 2])
    launches = _run(tmp_path, monkeypatch, policy, closed=lambda: False)
    assert launches == [{"workers": 2, "looks": 4}]  # launched once, after the third look
    assert policy.calls[0] == ("started", {"resume": False})
    assert policy.calls[-1] == ("ended", None)


def test_an_executor_stopping_ends_a_waiting_array_without_a_launch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    policy = _WaitingPolicy([0, 0, 0, 0])

    def closed() -> bool:
        return len(policy.calls) >= 3

    with pytest.raises(Stopped):
        _run(tmp_path, monkeypatch, policy, closed)
    assert [c[0] for c in policy.calls] == ["started", "waiting", "waiting", "ended"]


def test_the_engine_forms_no_array_beyond_what_the_policy_admits() -> None:
    assert _elastic_slots(4, 1, None, None) == 4  # every worker an array's minimum
    assert _elastic_slots(4, 2, None, None) == 2
    assert _elastic_slots(4, 1, 3, None) == 3  # ray.max_concurrent
    assert _elastic_slots(4, 1, None, 2) == 2  # an array waits: the two the engine holds
    assert _elastic_slots(0, 1, None, None) == 1  # no worker: one array may wait for one
    assert _elastic_slots(4, 1, None, 0) == 1


def test_a_relayed_call_drops_an_answer_meant_for_a_lost_caller() -> None:
    """Rank 0 lost while the driver ran its hook leaves that answer on the queue; the next
    relayed call (the relaunch's, or the new rank 0's) takes its own answer, not that one."""
    events, answers = _Queue(), _Queue()
    answers.put(("a lost rank 0's call", {"trial-0": False}))

    def driver() -> None:
        kind, payload, call = events.get(timeout=5.0)
        answers.put((call, (kind, payload * 2)))

    thread = threading.Thread(target=driver)
    thread.start()
    assert _elastic._Relay("relaunch", events, answers)(21) == ("relaunch", 42)
    thread.join()
