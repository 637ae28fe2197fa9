"""A relaunch of an elastic array is decided in the driver (hfsweep.executors._elastic): the
launcher's ``target`` is relayed like a hook, and a member that a refill added after the
checkpoint the relaunch resumes from goes back to the engine through ``requeue`` instead of
being lost with the workers. The launcher and Ray's queues are replaced by stand-ins in this
process (no Ray), so the driver's side runs exactly as in a sweep."""

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
from hfsweep.tasks import TensorBatches
from hfsweep.training.results import Member
from hfsweep.training.trainer import ArrayTrainer


class _Policy(QuietPolicy):
    def __init__(self) -> None:
        self.relaunches: list[tuple[int, int]] = []

    def started(
        self, folder: str, key: str, members: int, total: int, config: Any = None, **_: Any
    ) -> int:
        return 2

    def relaunch(self, folder: str, workers: int, lost: int, total: int) -> int:
        self.relaunches.append((workers, lost))
        return 1


def _task() -> hs.Task:
    def data(config: Mapping[str, Any]) -> tuple[TensorBatches, TensorBatches]:
        x = torch.randn(8, 4)
        return TensorBatches(x, x[:, 0].gt(0).long(), 4), TensorBatches(x, x[:, 0].gt(0).long(), 8)

    return hs.Task(name="relaunch_toy", model=lambda c: nn.Linear(4, 2), data=data)


@pytest.mark.parametrize("checkpointed", [False, True])
def test_a_member_refilled_after_the_checkpoint_goes_back_to_the_pool_on_relaunch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, checkpointed: bool
) -> None:
    started = [Member("trial-0", {"lr": 0.1}), Member("trial-1", {"lr": 0.2})]
    refill = Member("trial-9", {"lr": 0.3})
    held = {"trial-0", "trial-1"} | ({"trial-9"} if checkpointed else set())
    launched: dict[str, Any] = {}

    def launcher(task: Any, members: Any, *, workers: int, target: Any, **kw: Any) -> None:
        """A launch whose rank 0 refills a slot, then loses a worker."""
        launched["refilled"] = kw["refill"]()
        launched["relaunched_on"] = target(workers, 1)

    monkeypatch.setattr(ray_queue, "Queue", _Queue)
    monkeypatch.setattr(hfsweep.parallel, "train_data_parallel_ray", launcher)
    monkeypatch.setattr(ArrayTrainer, "checkpointed_members", staticmethod(lambda folder: held))
    requeued: list[Member] = []
    hooks = ArrayHooks(
        report=lambda evaluations: {},
        refill=lambda: refill,
        on_finish=lambda result: None,
        requeue=requeued.append,
    )
    policy = _Policy()
    _elastic.run_elastic_array(
        _task(),
        str(tmp_path),
        started,
        hooks,
        resume=False,
        policy=policy,
        total=lambda: 2,
        closed=lambda: False,
        bundle={"CPU": 1.0},
        threads=1,
        options={},
    )
    assert launched == {"refilled": refill, "relaunched_on": 1}
    assert policy.relaunches == [(2, 1)]  # the driver's policy decided the relaunch
    # refilled after the checkpoint: handed back, not trained by the relaunch and not lost
    assert requeued == ([] if checkpointed else [refill])
