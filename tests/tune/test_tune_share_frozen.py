"""``Fusion(share_frozen=...)`` of the Ray Tune plugin: validated as a sweep file's
``fusion.share_frozen`` is, and it reaches ``hs.fuse`` in the worker's arrays (through the
trainable's executor) and the profiler's arrays (``array_size="auto"``). Both without a Tune
run: the trainable's executor trains an array directly, and the profiler call is recorded."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

pytest.importorskip("ray")

from hfsweep.schedulers._tune_trainable import make_executor
from hfsweep.schedulers.tune import Fusion

import hfsweep as hs
from hfsweep.executors import ArrayHooks
from hfsweep.fusion import FusedArray
from hfsweep.tasks import TensorBatches


class _Frozen(nn.Module):
    """A frozen backbone that every trial builds the same, and a trainable head (the seed's)."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(7)
        self.backbone = nn.Linear(6, 8).requires_grad_(False)
        with torch.no_grad():
            for p in self.backbone.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))
        self.head = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.backbone(x)))


def _data(config: Mapping[str, Any]) -> tuple[TensorBatches, TensorBatches]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(32, 6, generator=gen)
    y = torch.randint(0, 3, (32,), generator=gen)
    return TensorBatches(x, y, 16, shuffle=False), TensorBatches(x, y, 16, shuffle=False)


TASK = hs.Task(name="frozen_head", model=lambda c: _Frozen(), data=_data, defaults={"epochs": 1})


@pytest.mark.parametrize("bad", ["false", 0, None])
def test_share_frozen_must_be_true_or_false(bad: Any) -> None:
    with pytest.raises(ValueError, match=r"Fusion\(share_frozen=.*True or False"):
        Fusion(TASK, members=2, array_size=2, share_frozen=bad)


@pytest.mark.parametrize("share", [True, False])
def test_the_workers_arrays_share_the_frozen_backbone_as_the_fusion_says(
    share: bool, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import hfsweep.training.live as live

    built: list[FusedArray] = []
    fuse = live.fuse

    def recording(*args: Any, **kwargs: Any) -> FusedArray:
        built.append(fuse(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(live, "fuse", recording)
    fusion = Fusion(TASK, members=2, array_size=2, device="cpu", share_frozen=share)
    assert Fusion(TASK, members=2, array_size=2)._spec.arrays.share_frozen is True  # the default
    executor = make_executor(fusion._spec, TASK)
    finished: list[hs.MemberResult] = []
    hooks = ArrayHooks(
        report=lambda evaluations: {e.member: True for e in evaluations},
        refill=lambda: None,
        on_finish=finished.append,
    )
    members = [hs.Member(f"m{i}", {"seed": i, "lr": 0.1}) for i in range(2)]
    with executor:
        executor.run_array(tmp_path, members, hooks, resume=False)
    assert sorted(r.id for r in finished) == ["m0", "m1"]
    assert len(built) == 1 and built[0].size == 2
    shared = ["backbone.weight", "backbone.bias"] if share else []
    assert built[0].shared_frozen == shared


@pytest.mark.parametrize("share", [True, False])
def test_the_auto_array_size_profiles_arrays_built_the_same_way(
    share: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    import hfsweep.sizing.task as sizing

    calls: list[dict[str, Any]] = []
    profile_task = sizing.profile_task

    def recording(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs)
        return profile_task(
            *args, **{**kwargs, "cache": None, "sizes": [1, 2], "min_seconds": 0.01}
        )

    monkeypatch.setattr(sizing, "profile_task", recording)
    fusion = Fusion(TASK, members=4, array_size="auto", device="cpu", share_frozen=share)
    size = fusion._profiled_size(TASK.resolve({}))
    assert size in (1, 2)
    assert [c["share_frozen"] for c in calls] == [share]
