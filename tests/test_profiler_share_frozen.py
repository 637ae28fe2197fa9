"""The profiler measures arrays as the trainer builds them: with ``share_frozen=False`` every
member holds its own copy of a frozen backbone, so the measured peak (live tensor bytes on the
CPU) holds it B times, and such profiles are cached under their own key."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import hfsweep as hs
from hfsweep.sizing.cache import ProfileCache
from hfsweep.sizing.task import measure_step, profile_task
from hfsweep.tasks import TensorBatches


class _Backbone(nn.Module):
    """A frozen "pretrained" backbone much larger than the trainable head on top of it."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(3)
        self.backbone = nn.Sequential(nn.Linear(16, 256), nn.Tanh(), nn.Linear(256, 16))
        with torch.no_grad():
            for p in self.backbone.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) / 16)
        self.backbone.requires_grad_(False)
        self.head = nn.Linear(16, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.backbone(x))


def _data(config: Mapping[str, Any]) -> tuple[TensorBatches, TensorBatches]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, 16, generator=gen)
    y = torch.randint(0, 4, (16,), generator=gen)
    return TensorBatches(x, y, 8, shuffle=False), TensorBatches(x, y, 8, shuffle=False)


TASK = hs.Task(name="frozen_backbone", model=lambda c: _Backbone(), data=_data)
BACKBONE_BYTES = sum(p.numel() * 4 for p in _Backbone().backbone.parameters())


def _peak(share: bool, size: int) -> int:
    x, y = next(iter(_data({})[0]))
    m = measure_step(
        TASK,
        TASK.resolve({"optimizer": "adamw"}),
        size,
        device=torch.device("cpu"),
        dtype=torch.float32,
        batch=(x, y),
        min_seconds=0.01,
        min_steps=1,
        warmup=1,
        share_frozen=share,
    )
    return m.peak_bytes


def test_without_sharing_the_measured_peak_holds_the_backbone_per_member() -> None:
    b = 4
    shared, unshared = _peak(True, b), _peak(False, b)
    # the stacked backbone is B copies where the shared one is one: B - 1 more at least
    assert unshared - shared >= (b - 1) * BACKBONE_BYTES
    # one member: nothing to share, the same peak either way
    assert _peak(True, 1) == _peak(False, 1)


def test_profiles_with_and_without_sharing_are_cached_apart(tmp_path: Path) -> None:
    cache = ProfileCache(tmp_path / "profiles.json")
    kw: dict[str, Any] = {"sizes": [1, 2], "min_seconds": 0.01, "cache": cache}
    shared = profile_task(TASK, {}, **kw)
    unshared = profile_task(TASK, {}, share_frozen=False, **kw)
    assert shared.key != unshared.key
    by_size = {m.size: m.peak_bytes for m in unshared.measurements}
    assert by_size[2] > {m.size: m.peak_bytes for m in shared.measurements}[2]
    # a second call finds its own profile again
    assert profile_task(TASK, {}, share_frozen=False, **kw).measurements == unshared.measurements
    with pytest.raises(ValueError, match=r"share_frozen='no'.*True"):
        profile_task(TASK, {}, share_frozen="no", **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("share", [True, False])
def test_hfsweep_profile_of_a_sweep_file_measures_with_its_share_frozen(
    share: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import hfsweep.sizing.task as sizing
    from hfsweep.cli import main

    seen: list[bool] = []
    real = sizing.profile_task

    def recording(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs["share_frozen"])
        return real(*args, **kwargs)

    monkeypatch.setattr(sizing, "profile_task", recording)
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(
        "task: digits_mlp\nconfig: {hidden: 8}\n"
        "search_space: {lr: {type: float, low: 0.01, high: 0.1, log: true}}\n"
        "budget: {trials: 2, epochs: 1}\nmetric: val_accuracy\nmode: max\n"
        f"fusion: {{device: cpu, share_frozen: {str(share).lower()}}}\n"
    )
    args = ["profile", str(sweep), "--sizes", "1", "--seconds", "0.01", "--no-plot", "--no-cache"]
    assert main(args) == 0, capsys.readouterr().err
    assert seen == [share]
