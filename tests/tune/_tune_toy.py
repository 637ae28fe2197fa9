"""A toy task for the Tune plugin tests: generated data, 5 steps per epoch, milliseconds per step.

``CRASH_TASK`` is the same task whose training data raises once, at a chosen epoch, the first
time any worker reaches it (a marker file records that it did): an array trainable that crashes
once mid-run.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

import hfsweep as hs
from hfsweep.tasks import TensorBatches

#: where CRASH_TASK's marker lives, and the epoch it crashes at: set before the workers start
CRASH_DIR_ENV = "HFSWEEP_TUNE_TEST_CRASH_DIR"
CRASH_EPOCH = 2


def _model(config: Mapping[str, Any]) -> nn.Module:
    return nn.Sequential(
        nn.Linear(8, config["hidden"]),
        nn.Tanh(),
        nn.Dropout(0.0),
        nn.Linear(config["hidden"], 3),
    )


def _tensors(config: Mapping[str, Any]) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(config["data_seed"])
    x = torch.randn(200, 8, generator=gen)
    y = (x[:, :3] + 0.3 * torch.randn(200, 3, generator=gen)).argmax(1)
    return x, y


def _data(config: Mapping[str, Any]) -> tuple[TensorBatches, TensorBatches]:
    x, y = _tensors(config)
    b = config["batch_size"]
    return TensorBatches(x[:160], y[:160], b, shuffle=True), TensorBatches(
        x[160:], y[160:], 40, shuffle=False
    )


class _CrashOnce(TensorBatches):
    """Training batches that raise once at :data:`CRASH_EPOCH` (counted in passes)."""

    def __init__(self, x: Tensor, y: Tensor, batch_size: int, marker: Path) -> None:
        super().__init__(x, y, batch_size, shuffle=True)
        self.marker = marker
        self.passes = 0

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        self.passes += 1
        if self.passes > CRASH_EPOCH and _first(self.marker):
            raise RuntimeError("the array trainable crashes once (test)")
        return super().__iter__()


def _first(marker: Path) -> bool:
    """Whether this call created ``marker`` (atomic: one caller in all processes wins)."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def _crash_data(config: Mapping[str, Any]) -> tuple[TensorBatches, TensorBatches]:
    x, y = _tensors(config)
    marker = Path(os.environ[CRASH_DIR_ENV]) / "crashed"
    b = config["batch_size"]
    return _CrashOnce(x[:160], y[:160], b, marker), TensorBatches(
        x[160:], y[160:], 40, shuffle=False
    )


TASK = hs.Task(
    name="tune_toy",
    model=_model,
    data=_data,
    defaults={"hidden": 8, "batch_size": 32, "epochs": 4},
)

CRASH_TASK = hs.Task(
    name="tune_toy_crash",
    model=_model,
    data=_crash_data,
    defaults={"hidden": 8, "batch_size": 32, "epochs": 4},
)
