"""A small task for the offload tests: a custom module class around layers (not an
``nn.Sequential`` itself, so offload traces its forward), with BatchNorm and dropout, and the
configs the tests share (the comparison of results: tests/_same_results.py), and a CPU transfer
that counts the bytes it copies in."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

import hfsweep as hs
from hfsweep.offload import CpuTransfer, Fetch
from hfsweep.tasks import TensorBatches


class Counting(CpuTransfer):
    """A CPU transfer (``delay`` seconds per fetch, in a background thread) that adds up the
    bytes it copies to the compute side and counts its fetches."""

    def __init__(self, delay: float = 0.0) -> None:
        super().__init__(delay)
        self.fetched = 0
        self.fetches = 0

    def fetch(self, tensors: Sequence[Tensor], urgent: bool = False) -> Fetch:
        self.fetched += sum(t.numel() * t.element_size() for t in tensors)
        self.fetches += 1
        return super().fetch(tensors, urgent)


class Net(nn.Module):
    """A custom class around layers (not an nn.Sequential itself): offload traces its forward."""

    def __init__(self, hidden: int, dropout: float) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(12, hidden), nn.BatchNorm1d(hidden), nn.Tanh(), nn.Linear(hidden, hidden)
        )
        self.head = nn.Sequential(nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x.view(-1, 12)))


def data(config: Mapping[str, Any]) -> tuple[TensorBatches, TensorBatches]:
    gen = torch.Generator().manual_seed(config["data_seed"])
    x = torch.randn(120, 12, generator=gen)
    y = (x @ torch.randn(12, 4, generator=gen)).argmax(1)
    b = config["batch_size"]
    return TensorBatches(x[:96], y[:96], b, shuffle=True), TensorBatches(
        x[96:], y[96:], 12, shuffle=False
    )


def toy_task() -> hs.Task:
    return hs.Task(
        name="offload_toy",
        model=lambda c: Net(16, float(c["dropout"] or 0.0)),
        data=data,
        defaults={"batch_size": 24, "epochs": 2},
    )


SGD = [
    {
        "seed": i,
        "lr": 0.05 + 0.02 * i,
        "momentum": 0.3 * i,
        "weight_decay": 1e-3 * i,
        "dropout": 0.1 * i,
        "label_smoothing": 0.05 * i,
        "grad_clip": None if i % 2 else 0.5,
        "lr_schedule": "cosine",
        "eta_min": 1e-3 * i,
    }
    for i in range(3)
]
ADAMW = [
    {
        "optimizer": "adamw",
        "lr": 1e-3 * (i + 1),
        "beta1": 0.8 + 0.05 * i,
        "weight_decay": 0.01 * i,
        "lr_schedule": "step",
        "step_size": 1,
        "gamma": 0.5 + 0.1 * i,
        "seed": 10 + i,
        "dropout": 0.2,
    }
    for i in range(3)
]


class FrozenNet(nn.Module):
    """A frozen "pretrained" backbone (from a fixed generator: the same in every trial, wide
    enough that its layers outweigh the head) and a head of the trial's seed (torch's
    generator, which the trainer seeds per member)."""

    def __init__(self, dropout: float, width: int = 48) -> None:
        super().__init__()
        self.backbone = nn.Sequential(
            nn.Linear(12, width),
            nn.Tanh(),
            nn.Linear(width, width),
            nn.Tanh(),
            nn.Linear(width, 16),
        )
        gen = torch.Generator().manual_seed(1234)
        with torch.no_grad():
            for p in self.backbone.parameters():
                p.copy_((torch.rand(p.shape, generator=gen) - 0.5) / p.shape[-1] ** 0.5)
        self.backbone.requires_grad_(False)
        self.head = nn.Sequential(nn.ReLU(), nn.Dropout(dropout), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x.view(-1, 12)))


def frozen_task() -> hs.Task:
    return hs.Task(
        name="offload_frozen_toy",
        model=lambda c: FrozenNet(float(c["dropout"] or 0.0)),
        data=data,
        defaults={"batch_size": 24, "epochs": 2},
    )
