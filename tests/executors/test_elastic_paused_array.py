"""A paused elastic array (hfsweep.executors._elastic) stops at its evaluation boundary, gives
its workers back, waits in the driver while the policy says 0 workers, and resumes from the
checkpoint written there: its members end exactly as without the pause. Ray's queues are
replaced by in-process stand-ins and each launch trains on one worker in this process (a
one-process gloo group on 127.0.0.1) through the real relaunch loop
(:func:`hfsweep.parallel._launch.elastic_loop`), so the driver's side and the trainer's
stop-and-resume run as in a sweep, without Ray."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from _elastic_stand_ins import InProcessQueue as _Queue
from _elastic_stand_ins import QuietPolicy, ray_queue
from torch import nn

import hfsweep as hs
import hfsweep.parallel
from hfsweep.executors import _elastic
from hfsweep.executors.base import ArrayHooks
from hfsweep.parallel import read_resize, request_resize
from hfsweep.parallel._launch import _Job, elastic_loop, free_port, train_worker
from hfsweep.tasks import TensorBatches
from hfsweep.training.results import Evaluation, Member, MemberResult


class _PausingPolicy(QuietPolicy):
    """Gives 1 worker; a relaunch is paused (0) and ``waits`` calls of ``waiting`` answer 0
    before it may go on."""

    def __init__(self, waits: int) -> None:
        self.waits = waits
        self.calls: list[tuple[str, int]] = []

    def started(
        self, folder: str, key: str, members: int, total: int, config: Any = None, **_: Any
    ) -> int:
        return 1

    def relaunch(self, folder: str, workers: int, lost: int, total: int) -> int:
        self.calls.append(("relaunch", workers))
        return 0

    def waiting(self, folder: str, total: int) -> int:
        self.waits -= 1
        self.calls.append(("waiting", 0 if self.waits > 0 else 1))
        return 0 if self.waits > 0 else 1


def _task() -> hs.Task:
    def data(config: Mapping[str, Any]) -> tuple[TensorBatches, TensorBatches]:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(24, 4, generator=g)
        y = x[:, 0].gt(0).long()
        return TensorBatches(x, y, 6, shuffle=True), TensorBatches(x, y, 24, shuffle=False)

    return hs.Task(
        name="pause_toy",
        model=lambda c: nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)),
        data=data,
        defaults={"max_steps": 12},
    )


#: the workers of every launch of the stand-in below
launches: list[int] = []
#: train_data_parallel_ray's own arguments (the rest are the trainer's options)
_LAUNCH_ARGS = {"checkpoint_dir", "resume", "report", "refill", "on_finish", "target"}
_LAUNCH_ARGS |= {"cpus_per_worker", "gpus_per_worker", "threads", "timeout_s"}


def _in_process(task: hs.Task, members: Any, *, workers: int, **kw: Any) -> list[MemberResult]:
    """``train_data_parallel_ray`` with every launch on one worker in this process."""
    options = {k: v for k, v in kw.items() if k not in _LAUNCH_ARGS}
    job = _Job(
        task,
        list(members),
        workers,
        Path(kw["checkpoint_dir"]),
        kw["resume"],
        kw["report"],
        kw["on_finish"],
        "gloo",
        kw["refill"],
    )

    def launch(j: _Job) -> tuple[str, Any]:
        launches.append(j.workers)
        return train_worker(0, f"127.0.0.1:{free_port()}", j, 1, kw["timeout_s"], options)

    return elastic_loop(job, launch, kw["target"])


@pytest.mark.slow  # two launches, each joining a gloo group: seconds on a loaded CPU
def test_a_paused_array_resumes_from_its_checkpoint_and_ends_as_unpaused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    task = _task()
    members = [Member(f"trial-{i}", {"lr": lr, "seed": i}) for i, lr in enumerate([0.05, 0.2])]
    alone = {r.id: r for r in hs.ArrayTrainer(task, eval_every=4).run(members)}

    monkeypatch.setattr(ray_queue, "Queue", _Queue)
    monkeypatch.setattr(hfsweep.parallel, "train_data_parallel_ray", _in_process)
    launches.clear()
    folder = tmp_path / "arrays" / "0"
    reports: list[int] = []
    finished: list[MemberResult] = []

    def report(evaluations: list[Evaluation]) -> dict[str, bool]:
        reports.append(evaluations[0].step)
        if len(reports) == 1:  # the allocator pauses the array: it stops at this boundary
            request_resize(folder, 0)
        return {}

    hooks = ArrayHooks(report=report, refill=lambda: None, on_finish=finished.append)
    policy = _PausingPolicy(waits=3)
    _elastic.run_elastic_array(
        task,
        str(folder),
        members,
        hooks,
        resume=False,
        policy=policy,
        total=lambda: 1,
        closed=lambda: False,
        bundle={"CPU": 1.0},
        threads=1,
        options={"eval_every": 4, "keep_states": False, "final_states": "completed"},
    )
    # launched, paused at step 4 (its workers ended), waited, relaunched once from there
    assert launches == [1, 1]
    assert policy.calls == [("relaunch", 0), ("waiting", 0), ("waiting", 0), ("waiting", 1)]
    assert read_resize(folder) is None
    assert reports == [4, 8, 12]  # nothing reported twice, nothing skipped
    assert sorted(r.id for r in finished) == ["trial-0", "trial-1"]
    for result in finished:
        want = alone[result.id]
        assert result.status == want.status and result.steps == want.steps == 12
        assert len(result.history) == len(want.history)
        for got, ref in zip(result.history, want.history, strict=True):
            assert got.keys() == ref.keys()
            for name in ref:
                assert got[name] == pytest.approx(ref[name], rel=1e-5, abs=1e-7), name
