"""A toy task for the engine tests: generated data, 5 steps per epoch, milliseconds per step.

Sweep files in the tests name it as ``<this file>:TASK``.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
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


class _HeldBatches(TensorBatches):
    """Training batches that stop coming, until the process is interrupted, once the sweep log
    named by ``HFSWEEP_TEST_HOLD_LOG`` shows ``HOLD_AFTER`` tells: a sweep that cannot finish
    before a test's signal reaches it, however slowly the test polls."""

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        log = os.environ.get("HFSWEEP_TEST_HOLD_LOG", "")
        for batch in super().__iter__():
            while log and _tells(log) >= HOLD_AFTER:
                time.sleep(0.01)
            yield batch


#: tells after which HELD_TASK's training stops until the process is interrupted
HOLD_AFTER = 2


def _tells(log: str) -> int:
    try:
        text = Path(log).read_text()
    except FileNotFoundError:
        return 0
    return len(re.findall(r"hfsweep\.sweep: trial \d+ (?:completed|stopped|failed)", text))


def _held_data(config: Mapping[str, Any]) -> tuple[TensorBatches, TensorBatches]:
    train, val = _data(config)
    return _HeldBatches(train.x, train.y, train.batch_size, shuffle=True), val


HELD_TASK = hs.Task(name="toy", model=_model, data=_held_data, defaults=dict(TASK.defaults))


class _SlowBatches(TensorBatches):
    """Training batches that take ``SLOW_PAUSE_S`` more each: an array trains for a good part
    of a second, so that a sweep killed at a random moment is usually killed inside one."""

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for batch in super().__iter__():
            time.sleep(SLOW_PAUSE_S)
            yield batch


SLOW_PAUSE_S = 0.01


def _slow_data(config: Mapping[str, Any]) -> tuple[TensorBatches, TensorBatches]:
    train, val = _data(config)
    return _SlowBatches(train.x, train.y, train.batch_size, shuffle=True), val


SLOW_TASK = hs.Task(name="toy", model=_model, data=_slow_data, defaults=dict(TASK.defaults))


class _StartGatedBatches(TensorBatches):
    """Training batches that wait while the file named by ``HFSWEEP_TEST_GATE`` exists, once
    the sweep log named by ``HFSWEEP_TEST_GATE_LOG`` exists (the dry run, before the sweep
    starts, is not held): a sweep that has asked its trials and waits for the test."""

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        gate = os.environ.get("HFSWEEP_TEST_GATE", "")
        log = os.environ.get("HFSWEEP_TEST_GATE_LOG", "")
        for batch in super().__iter__():
            while gate and os.path.exists(gate) and os.path.exists(log):
                time.sleep(0.01)
            yield batch


def _start_gated_data(config: Mapping[str, Any]) -> tuple[TensorBatches, TensorBatches]:
    train, val = _data(config)
    return _StartGatedBatches(train.x, train.y, train.batch_size, shuffle=True), val


#: held from its first batch while ``HFSWEEP_TEST_GATE`` exists, once the sweep has started
START_GATED_TASK = hs.Task(
    name="toy", model=_model, data=_start_gated_data, defaults=dict(TASK.defaults)
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


def write_sweep_file(folder: Path, backend: str = "local") -> Path:
    """``folder/sweep.yaml``: 4 trials of TASK for 2 epochs in one float64 array of 4, into
    ``folder/run`` (the sweep the resume tests damage: a torn journal, a damaged checkpoint)."""
    sweep = folder / "sweep.yaml"
    sweep.write_text(
        f"""
task: "{Path(__file__).resolve()}:TASK"
search_space:
  lr: {{type: float, low: 1.0e-3, high: 0.5, log: true}}
  momentum: {{type: float, low: 0.0, high: 0.9}}
searcher: random
scheduler: fifo
budget: {{trials: 4, epochs: 2}}
metric: val_accuracy
mode: max
fusion: {{size: 4, device: cpu, dtype: float64}}
backend: {backend}
output: run
"""
    )
    return sweep


#: the file whose existence holds GATED_TASK's arrays after their first epoch
GATE_ENV = "HFSWEEP_TEST_GATE"


class _GatedBatches(TensorBatches):
    """Training batches whose second and later passes wait while the file named by
    ``HFSWEEP_TEST_GATE`` exists: each array trains one epoch (so its checkpoint exists), then
    holds its worker until the test opens the gate, however slowly the test polls."""

    passes = 0

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        self.passes += 1
        gate = os.environ.get(GATE_ENV, "")
        for batch in super().__iter__():
            while self.passes > 1 and gate and os.path.exists(gate):
                time.sleep(0.02)
            yield batch


def _gated_data(config: Mapping[str, Any]) -> tuple[TensorBatches, TensorBatches]:
    train, val = _data(config)
    return _GatedBatches(train.x, train.y, train.batch_size, shuffle=True), val


GATED_TASK = hs.Task(name="toy", model=_model, data=_gated_data, defaults=dict(TASK.defaults))
