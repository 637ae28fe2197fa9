"""Small, fast tasks for the trainer tests (generated data, a few steps per epoch)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

import hfsweep as hs
from hfsweep.tasks import TensorBatches


class Net(nn.Module):
    def __init__(self, hidden: int, bn: bool) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(12, hidden)]
        if bn:
            layers.append(nn.BatchNorm1d(hidden))
        layers += [nn.Tanh(), nn.Dropout(0.0), nn.Linear(hidden, 4)]
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def data(config: Mapping[str, Any]) -> tuple[TensorBatches, TensorBatches]:
    gen = torch.Generator().manual_seed(config["data_seed"])
    x = torch.randn(200, 12, generator=gen)
    w = torch.randn(12, 4, generator=gen)
    y = (x @ w + 0.5 * torch.randn(200, 4, generator=gen)).argmax(1)
    b = config["batch_size"]
    return TensorBatches(x[:160], y[:160], b, shuffle=True), TensorBatches(
        x[160:], y[160:], 16, shuffle=False
    )


class Attention(nn.Module):
    """A Transformer encoder layer whose every dropout, the attention weights' included, is the
    config's ``dropout`` (what ``TransformerEncoderLayer(dropout=p)`` builds)."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.embed = nn.Linear(3, 8)
        self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout, batch_first=True)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(self.embed(x.view(-1, 4, 3))).mean(1))


def make_attention_task() -> hs.Task:
    return hs.Task(
        name="toy_attention",
        model=lambda c: Attention(float(c["dropout"] or 0.0)),
        data=data,
        defaults={"batch_size": 32, "epochs": 2},
    )


def make_task(bn: bool = False) -> hs.Task:
    return hs.Task(
        name="toy",
        model=lambda c: Net(c["hidden"], bn),
        data=data,
        defaults={"hidden": 16, "batch_size": 32, "epochs": 3},
    )
