"""Fine-tuning sweeps through the trainer: a task whose model is a frozen "pretrained" backbone
(the same in every trial) and a trainable head (the trial's seed). Each member of the array trains
as the same trial alone (float64, histories, weights, optimizer state), its saved state is the full
model (backbone included) that loads into the user's class and a ``torch.optim`` optimizer, a
resume from a mid-training checkpoint equals the uninterrupted run, and a refilled slot keeps the
backbone shared."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
import torch
from _same_results import Crash, assert_same, crashing_report, members
from torch import Tensor, nn

import hfsweep as hs
from hfsweep.fusion import FusedArray
from hfsweep.tasks import TensorBatches


class FineTune(nn.Module):
    """A backbone read from a fixed generator (the stand-in for pretrained weights), frozen, with
    BatchNorm in eval mode; a head initialised from torch's generator (the trial's seed)."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(
            nn.Linear(12, 24), nn.BatchNorm1d(24), nn.Tanh(), nn.Linear(24, 16), nn.Tanh()
        )
        gen = torch.Generator().manual_seed(1234)
        with torch.no_grad():
            for t in [*self.backbone.parameters(), *self.backbone.buffers()]:
                if t.is_floating_point():
                    t.copy_(torch.rand(t.shape, generator=gen) - 0.25)
            self.backbone[1].running_var.abs_().add_(0.5)
        # frozen, and in eval mode from the start (so at fuse time): its BatchNorm statistics
        # are shared too
        self.backbone.requires_grad_(False).eval()
        self.head = nn.Sequential(nn.Dropout(0.0), nn.Linear(16, 4))

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.backbone(x))

    def train(self, mode: bool = True) -> FineTune:
        super().train(mode)
        self.backbone.eval()
        return self


def data(config: Mapping[str, Any]) -> tuple[TensorBatches, TensorBatches]:
    gen = torch.Generator().manual_seed(config["data_seed"])
    x = torch.randn(200, 12, generator=gen)
    y = (x @ torch.randn(12, 4, generator=gen)).argmax(1)
    return (
        TensorBatches(x[:160], y[:160], 32, shuffle=True),
        TensorBatches(x[160:], y[160:], 16, shuffle=False),
    )


TASK = hs.Task(name="finetune", model=lambda c: FineTune(), data=data, defaults={"epochs": 3})

CONFIGS: list[dict[str, Any]] = [
    {
        "seed": i,
        "optimizer": "adamw" if i % 2 else "sgd",
        "lr": 0.01 * (i + 1),
        "weight_decay": 1e-3 * i,
        "dropout": 0.1 * i,
        "epochs": 2 + i % 2,
    }
    for i in range(4)
]
SGD_CONFIGS = [c for c in CONFIGS if c["optimizer"] == "sgd"]
BACKBONE = [f"backbone.{k}" for k in FineTune().backbone.state_dict()]


def _trainer(**kw: Any) -> hs.ArrayTrainer:
    return hs.ArrayTrainer(TASK, dtype=torch.float64, **kw)


@pytest.fixture
def built_arrays(monkeypatch: pytest.MonkeyPatch) -> list[FusedArray]:
    """Every array the trainer fuses in the test."""
    seen: list[FusedArray] = []
    import hfsweep.training.live as live

    fuse = live.fuse

    def recording(*args: Any, **kwargs: Any) -> FusedArray:
        array = fuse(*args, **kwargs)
        seen.append(array)
        return array

    monkeypatch.setattr(live, "fuse", recording)
    return seen


def test_members_with_a_frozen_backbone_train_as_alone(built_arrays: list[FusedArray]) -> None:
    configs = SGD_CONFIGS
    fused = _trainer().run(members(configs))
    array = built_arrays[0]
    assert array.size == len(configs) and array.shared_frozen == BACKBONE
    assert [n for n, _ in array.named_parameters()] == [
        "module.head.1.weight",
        "module.head.1.bias",
    ]
    for i, config in enumerate(configs):
        alone = _trainer().run([hs.Member(f"t{i}", config)])[0]
        assert_same(fused[i], alone, optimizer_atol=0)
    # the saved state is the whole model: it loads into the user's class and torch's optimizer
    state = fused[1].state
    assert state is not None and set(BACKBONE) <= set(state["model"])
    model = FineTune().double()
    model.load_state_dict(state["model"])
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    opt.load_state_dict(state["optimizer"])
    assert torch.equal(model.backbone[0].weight, FineTune().double().backbone[0].weight)


def test_resume_and_refill_keep_the_backbone_shared(
    tmp_path: Any, built_arrays: list[FusedArray]
) -> None:
    """Two AdamW trials start the array, a third refills the slot of the first to finish; a crash
    at the third evaluation and a resume give the uninterrupted run's results."""
    adamw = [{**c, "optimizer": "adamw"} for c in CONFIGS[:3]]
    first, late = adamw[:2], adamw[2]

    def run(
        directory: Any, crash_at: int | None = None, resume: bool = False, share: bool = True
    ) -> Any:
        queue = [] if resume else [hs.Member("late", late)]
        return _trainer(checkpoint_dir=directory, share_frozen=share).run(
            members(first),
            report=crashing_report(crash_at),
            refill=lambda: queue.pop() if queue else None,
            resume=resume,
        )

    full = run(tmp_path / "full")
    assert all(a.shared_frozen == BACKBONE for a in built_arrays)
    with pytest.raises(Crash):
        run(tmp_path / "crashed", crash_at=3)
    resumed = run(tmp_path / "crashed", resume=True)
    assert [r.id for r in resumed] == [r.id for r in full]
    for a, b in zip(resumed, full, strict=True):
        assert_same(a, b, optimizer_atol=0)
    assert all(a.shared_frozen == BACKBONE for a in built_arrays)
    # and the whole run, the refilled trial's included, equals the run with every tensor stacked
    # (ArrayTrainer(share_frozen=False), fusion.share_frozen: false in a sweep file)
    stacked = run(tmp_path / "stacked", share=False)
    assert built_arrays[-1].shared_frozen == []
    for a, b in zip(stacked, full, strict=True):
        assert_same(a, b, optimizer_atol=0)
