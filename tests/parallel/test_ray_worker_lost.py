"""One worker of a 2-worker elastic array SIGKILLed at each moment of its step, on a local Ray
(2 CPUs, loopback): in the gradient all-reduce, while rank 0 waits for the driver's answer to a
relayed hook call, and half-way through rank 0's checkpoint write; and one that hangs without
dying before an all-reduce, noticed when its peer's all-reduce times out. Each moment is made
deterministic by patching that moment's code in the worker's own process
(:class:`_dp_tasks.Fault`), not by a sleep racing the training.

Each time the array goes on on the one worker left from its last complete checkpoint, the
driver's hooks hear every (member, step) once and every member's end once (a report the lost
rank 0 had sent is not applied again when the relaunch evaluates that step again: it gets the
decision already taken), and every member ends as in the unkilled one-process run (float64).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from pathlib import Path
from typing import Any

import _dp_tasks
import pytest
import torch
from test_data_parallel import _members, _same_results

import hfsweep as hs

pytestmark = pytest.mark.slow


class _Policy:
    """Two workers to start with, and what the launcher asks for after a loss (the allocator's
    part is tested on a fake clock in tests/elastic); every relaunch is recorded with the time
    it was asked for."""

    def __init__(self) -> None:
        self.relaunches: list[tuple[int, int, float]] = []

    def started(self, folder: str, key: str, members: int, total: int, **_: Any) -> int:
        return 2

    def admits(self) -> int | None:
        return None

    def relaunch(self, folder: str, workers: int, lost: int, total: int) -> int:
        self.relaunches.append((workers, lost, time.time()))
        return workers

    def waiting(self, folder: str, total: int) -> int:
        return 1

    def reported(self, folder: str, evaluations: Any, live: int) -> None:
        pass

    def ended(self, folder: str, total: int) -> None:
        pass


def _stop_at_six(evaluations: list[hs.Evaluation]) -> dict[str, bool]:
    """The scheduler's stand-in: member ``sgd2`` stops at step 6 (so a report applied twice, or
    a decision not replayed to the relaunch, would change the results)."""
    return {e.member: False for e in evaluations if e.member == "sgd2" and e.step == 6}


@pytest.mark.parametrize(
    ("moment", "rank", "nth", "resumed_from"),
    [
        ("allreduce", 1, 8, 6),  # rank 0 waits in step 8's all-reduce; checkpoint of step 6
        ("hook", 0, 2, 3),  # the report of step 6 sent, its answer never taken
        ("checkpoint", 0, 2, 3),  # step 6's checkpoint half written
        ("hang", 1, 8, 6),  # rank 1 hangs before step 8's all-reduce: rank 0 times out in it
    ],
)
def test_a_worker_lost_at_any_moment_of_a_step_shrinks_the_array_which_goes_on_exactly(
    moment: str,
    rank: int,
    nth: int,
    resumed_from: int,
    tmp_path: Path,
    shared_ray: Any,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ray import cloudpickle

    import hfsweep.parallel
    from hfsweep.executors import _elastic

    if moment == "hang":  # the survivor's all-reduce times out after 15 s, not 120 s
        monkeypatch.setattr(hfsweep.parallel, "COLLECTIVE_TIMEOUT_S", 15.0)
    from hfsweep.executors.base import ArrayHooks
    from hfsweep.training.results import MemberResult

    shared_ray.start()
    flag = tmp_path / "die-once"
    flag.write_text("")
    members = [
        hs.Member(m.id, {**m.config, "fault": f"{moment}:{rank}:{nth}:{flag}"})
        for m in _members("sgd")
    ]
    task = _dp_tasks.make_faulty_task()
    reference = hs.ArrayTrainer(
        task, dtype=torch.float64, eval_every=3, checkpoint_dir=tmp_path / "reference"
    ).run(members, report=_stop_at_six)
    assert flag.exists()  # the one-process run has no peer to lose: nothing fired

    folder = tmp_path / "arrays" / "0"
    heard: Counter[tuple[str, int]] = Counter()
    finished: list[MemberResult] = []

    def report(evaluations: list[hs.Evaluation]) -> dict[str, bool]:
        heard.update((e.member, e.step) for e in evaluations)
        return _stop_at_six(evaluations)

    policy = _Policy()
    cloudpickle.register_pickle_by_value(_dp_tasks)  # the actors cannot import tests/parallel
    caplog.set_level(logging.INFO, logger="hfsweep")
    try:
        _elastic.run_elastic_array(
            task,
            str(folder),
            members,
            ArrayHooks(report=report, refill=lambda: None, on_finish=finished.append),
            resume=False,
            policy=policy,
            total=lambda: 2,
            closed=lambda: False,
            bundle={"CPU": 1.0},
            threads=1,
            options={"dtype": torch.float64, "eval_every": 3},
        )
    finally:
        cloudpickle.unregister_pickle_by_value(_dp_tasks)

    assert not flag.exists()  # the fault fired, once
    killed_at = float(Path(str(flag) + ".killed-at").read_text())
    assert [(k, lost) for k, lost, _ in policy.relaunches] == [(1, 1)]
    waited = policy.relaunches[0][2] - killed_at
    logging.getLogger(__name__).warning("%s: relaunch asked %.2f s after the kill", moment, waited)
    assert "1 of 2 workers lost; going on with 1 from the last checkpoint" in caplog.text
    if moment == "hang":  # noticed when the survivor's collective timed out, not before
        assert "worker(s) 1 of the data-parallel array in" in caplog.text
        assert "did not end 2 s after the others' collectives failed" in caplog.text
        assert waited >= 15.0
    # every (member, step) heard once, every member's end once
    assert heard and set(heard.values()) == {1}, heard
    assert sorted(heard) == sorted((r.id, h["step"]) for r in reference for h in r.history)
    assert Counter(r.id for r in finished) == Counter(m.id for m in members)
    _same_results(reference, sorted(finished, key=lambda r: r.id))
    assert [r.steps for r in finished if r.id == "sgd2"] == [6]
    if moment == "checkpoint":  # the half-written file was left beside the checkpoint, unread
        assert list(folder.glob(".array.pt.*"))
    # the relaunch from step 3 evaluates step 6 again: its report is answered from the driver's
    # record; from step 6, no evaluation comes twice
    replays = caplog.text.count("already heard")
    assert replays == (0 if resumed_from == 6 else 1), caplog.text
