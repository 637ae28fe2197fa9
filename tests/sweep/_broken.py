"""Tiny tasks whose code is broken, as users' tasks are: each attribute is a task a sweep file
names as ``<this file>:NAME`` (Ray workers import it as ``sweep._broken``).

``TASK`` is healthy. The others break in one place each: the ones a dry run meets (its forward
pass, its loss, its data, its model for some configs), and the ones only a run meets (the short
last validation batch, configs inside the space that no corner reaches).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import hfsweep as hs
from hfsweep.tasks import TensorBatches

#: the model rejects lr in this range (inside the space, away from its corners)
REJECTED_LR = (0.01, 0.1)
#: a test "fixes" BATCH_16 by setting this (the task keeps its name, so a sweep resumes)
BATCH_16_FIXED = False


class Net(nn.Module):
    """A two-layer MLP; ``kind`` says where it breaks."""

    def __init__(self, config: Mapping[str, Any], kind: str = "") -> None:
        super().__init__()
        if kind == "init_high" and config["lr"] > 0.3:
            raise ValueError(f"lr={config['lr']} is too large for this model")
        low, high = REJECTED_LR
        if kind == "init_middle" and low < config["lr"] < high:
            raise ValueError(f"lr={config['lr']} is not supported by this model")
        self.kind = kind
        hidden = config["hidden"]
        self.body = nn.Sequential(nn.Linear(4, hidden), nn.Tanh())
        self.head = nn.Linear(hidden + (1 if kind == "shape" else 0), 3)

    def forward(self, x: Tensor) -> Tensor:
        if self.kind == "batch_16" and x.shape[0] != 16 and not BATCH_16_FIXED:
            raise RuntimeError(f"this model takes batches of 16, got {x.shape[0]}")
        if self.kind == "unpicklable" and x.shape[0] != 16:
            raise _LockedError(threading.Lock())
        return self.head(self.body(x))


class _LockedError(RuntimeError):
    """An exception that cannot be pickled (it holds a lock)."""

    def __init__(self, lock: Any) -> None:
        super().__init__("an error holding a lock")
        self.lock = lock


def _data(config: Mapping[str, Any], *, float_targets: bool = False) -> tuple[Any, Any]:
    gen = torch.Generator().manual_seed(config["data_seed"])
    x = torch.randn(88, 4, generator=gen)
    y = x[:, :3].argmax(1)
    if float_targets:
        y = y.float()
    b = config["batch_size"]
    # 40 validation samples in batches of 16: the last one holds 8
    return TensorBatches(x[:48], y[:48], b, shuffle=True), TensorBatches(
        x[48:], y[48:], 16, shuffle=False
    )


def _per_sample_loss(out: Tensor, y: Tensor) -> Tensor:
    """Each member's loss per sample, [B, N]: the mean over the batch is missing."""
    target = y.unsqueeze(0).expand(out.shape[0], -1)
    return F.cross_entropy(out.movedim(-1, 1), target, reduction="none")


def _small_arrays_only(out: Tensor, y: Tensor) -> Tensor:
    """Each member's cross-entropy, for arrays of up to 2 members (the dry run's size): larger
    ones, such as the profiler measures, raise. Each call sleeps 100 ms, whatever the array's
    size, so the profiler's throughput doubles with B however loaded the machine is, and its
    doubling always reaches B=4 (with the tiny model alone, a busy machine could make B=2 look
    slower than B=1 and stop the search there)."""
    time.sleep(0.1)
    if out.shape[0] > 2:
        raise RuntimeError(f"this loss takes arrays of up to 2 members, got {out.shape[0]}")
    target = y.unsqueeze(0).expand(out.shape[0], -1)
    return F.cross_entropy(out.movedim(-1, 1), target, reduction="none").mean(1)


def _task(name: str, kind: str = "", **kw: Any) -> hs.Task:
    def model(config: Mapping[str, Any]) -> nn.Module:
        return Net(config, kind)

    def data(config: Mapping[str, Any]) -> tuple[Any, Any]:
        return _data(config, float_targets=kind == "float_targets")

    return hs.Task(
        name=name, model=model, data=data, defaults={"hidden": 8, "batch_size": 16}, **kw
    )


TASK = _task("tiny")
SHAPE = _task("shape", "shape")
PER_SAMPLE_LOSS = _task("per_sample_loss", loss=_per_sample_loss, metrics={})
FLOAT_TARGETS = _task("float_targets", "float_targets")
INIT_HIGH = _task("init_high", "init_high")
INIT_MIDDLE = _task("init_middle", "init_middle")
BATCH_16 = _task("batch_16", "batch_16")
UNPICKLABLE = _task("unpicklable", "unpicklable")
SMALL_ARRAYS_ONLY = _task("small_arrays_only", loss=_small_arrays_only, metrics={})


def sweep_yaml(task: str, **overrides: str) -> str:
    """A small sweep file of the task ``NAME`` of this file; ``overrides`` replace lines."""
    lines = {
        "task": f'"{__file__}:{task}"',
        "search_space": "{lr: {type: float, low: 1.0e-3, high: 0.5, log: true}}",
        "searcher": "random",
        "budget": "{trials: 4, epochs: 2}",
        "metric": "val_loss",
        "mode": "min",
        "fusion": "{size: 2, device: cpu}",
        "output": "run",
    }
    lines.update(overrides)
    return "".join(f"{k}: {v}\n" for k, v in lines.items())
