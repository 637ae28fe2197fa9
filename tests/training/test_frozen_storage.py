"""New members' models share their frozen tensors' storage as each is built
(hfsweep.training._frozen): the array's build holds one backbone, not one per member, and the
members train exactly as with their own copies."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import hfsweep as hs
import hfsweep.training.run as run_module
from hfsweep.tasks import TensorBatches
from hfsweep.training._frozen import share_frozen_storage


class _FineTune(nn.Module):
    """A frozen backbone read from a fixed generator (BatchNorm in eval mode) and a head from
    torch's generator (the trial's seed)."""

    def __init__(self, backbone_seed: int = 7) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh())
        gen = torch.Generator().manual_seed(backbone_seed)
        with torch.no_grad():
            for t in [*self.backbone.parameters(), *self.backbone.buffers()]:
                if t.is_floating_point():
                    t.copy_(torch.rand(t.shape, generator=gen) + 0.1)
        self.backbone.requires_grad_(False).eval()
        self.head = nn.Linear(16, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.backbone(x))

    def train(self, mode: bool = True) -> _FineTune:
        super().train(mode)
        self.backbone.eval()
        return self


def _backbone_bytes(dtype: torch.dtype = torch.float32) -> int:
    """The backbone's bytes in ``dtype`` (its integer buffer, BatchNorm's batch count, as is)."""
    b = _FineTune().backbone.to(dtype)
    return sum(t.numel() * t.element_size() for t in [*b.parameters(), *b.buffers()])


def test_equal_frozen_tensors_share_storage_and_the_rest_stays_apart() -> None:
    a, b, other = _FineTune(), _FineTune(), _FineTune(backbone_seed=8)
    assert share_frozen_storage(b, a) == _backbone_bytes()
    for ta, tb in zip(
        [*a.backbone.parameters(), *a.backbone.buffers()],
        [*b.backbone.parameters(), *b.backbone.buffers()],
        strict=True,
    ):
        assert tb is not ta and tb.untyped_storage().data_ptr() == ta.untyped_storage().data_ptr()
    assert b.head.weight.data_ptr() != a.head.weight.data_ptr()  # trained: never shared
    assert share_frozen_storage(b, a) == 0  # already shared
    # other values: its own copy, but for BatchNorm's batch count (0 in both, 8 bytes)
    assert share_frozen_storage(other, a) == 8
    assert other.backbone[0].weight.data_ptr() != a.backbone[0].weight.data_ptr()
    b.backbone[0].weight.requires_grad_(True)  # unfrozen in one model: not shared
    c = _FineTune()
    c.backbone[0].weight.requires_grad_(True)
    assert share_frozen_storage(c, a) == _backbone_bytes() - 16 * 6 * 4


def _data(config: Mapping[str, Any]) -> tuple[TensorBatches, TensorBatches]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(48, 6, generator=gen)
    y = (x @ torch.randn(6, 3, generator=gen)).argmax(1)
    return TensorBatches(x[:32], y[:32], 8, shuffle=True), TensorBatches(
        x[32:], y[32:], 16, shuffle=False
    )


TASK = hs.Task(name="frozen_storage", model=lambda c: _FineTune(), data=_data)


@pytest.mark.parametrize("share", [True, False])
def test_the_trainer_builds_one_backbone_and_members_train_the_same(
    monkeypatch: pytest.MonkeyPatch, share: bool
) -> None:
    saved: list[int] = []
    real = run_module.share_frozen_storage

    def recording(model: nn.Module, reference: nn.Module) -> int:
        saved.append(real(model, reference))
        return saved[-1]

    monkeypatch.setattr(run_module, "share_frozen_storage", recording)
    configs = [{"seed": i, "lr": 0.05 * (i + 1), "epochs": 2} for i in range(3)]
    members = [hs.Member(f"t{i}", c) for i, c in enumerate(configs)]
    results = hs.ArrayTrainer(TASK, dtype=torch.float64, share_frozen=share).run(members)
    # each model is cast to the trainer's dtype before it is compared; the last two members'
    # backbones were shared, once each
    assert saved == ([_backbone_bytes(torch.float64)] * 2 if share else [])
    monkeypatch.setattr(run_module, "share_frozen_storage", real)
    alone = [hs.ArrayTrainer(TASK, dtype=torch.float64).run([m])[0] for m in members]
    for r, a in zip(results, alone, strict=True):
        assert len(r.history) == len(a.history) > 0
        for row, row_alone in zip(r.history, a.history, strict=True):
            assert row == pytest.approx(row_alone, rel=1e-9)
