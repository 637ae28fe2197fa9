"""A toy task for the engine tests: generated data, 5 steps per epoch, milliseconds per step.

Sweep files in the tests name it as ``<this file>:TASK``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

import hfsweep as hs
from hfsweep.tasks import TensorBatches


def _model(config: Mapping[str, Any]) -> nn.Module:
    return nn.Sequential(
        nn.Linear(8, config["hidden"]),
        nn.Tanh(),
        nn.Dropout(0.0),
        nn.Linear(config["hidden"], 3),
    )


def _data(config: Mapping[str, Any]) -> tuple[TensorBatches, TensorBatches]:
    gen = torch.Generator().manual_seed(config["data_seed"])
    x = torch.randn(200, 8, generator=gen)
    y = (x[:, :3] + 0.3 * torch.randn(200, 3, generator=gen)).argmax(1)
    b = config["batch_size"]
    return TensorBatches(x[:160], y[:160], b, shuffle=True), TensorBatches(
        x[160:], y[160:], 40, shuffle=False
    )


TASK = hs.Task(
    name="toy",
    model=_model,
    data=_data,
    defaults={"hidden": 8, "batch_size": 32, "epochs": 3},
)


def sweep_config(output: Any, **overrides: Any) -> dict[str, Any]:
    """A small sweep of TASK into ``output``; ``overrides`` replace top-level keys."""
    config: dict[str, Any] = {
        "task": TASK,
        "search_space": {
            "lr": {"type": "float", "low": 1e-3, "high": 0.5, "log": True},
            "momentum": {"type": "float", "low": 0.0, "high": 0.9},
        },
        "searcher": {"name": "random"},
        "scheduler": "fifo",
        "budget": {"trials": 8, "epochs": 3},
        "metric": "val_accuracy",
        "mode": "max",
        "fusion": {"size": 4, "device": "cpu"},
        "output": str(output),
        "seed": 0,
    }
    config.update(overrides)
    return config
