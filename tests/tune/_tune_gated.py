"""A toy task like tests/tune/_tune_toy.py's, with a gate, for a test that removes a Ray node
while arrays train: each array trains :data:`HOLD_AFTER` epochs (so Tune holds a checkpoint of
it), then, while the file named by ``HFSWEEP_TUNE_TEST_GATE`` exists, waits, after writing
``<gate>.held-<Ray node id>`` holding its Tune trial's id (which node holds which array).

Fusion loads it by path (``<this file>:TASK``), so Ray's workers need no ``PYTHONPATH``; the
variable must be set before the nodes start (their workers inherit it).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

import hfsweep as hs
from hfsweep.tasks import TensorBatches

GATE_ENV = "HFSWEEP_TUNE_TEST_GATE"
#: epochs (passes over the training data) an array trains before it waits at the gate
HOLD_AFTER = 2
#: the longest a pass waits at the gate, so that a failed test cannot hang its workers for ever
_PATIENCE_S = 240.0


def _model(config: Mapping[str, Any]) -> nn.Module:
    return nn.Sequential(nn.Linear(8, config["hidden"]), nn.Tanh(), nn.Linear(config["hidden"], 3))


def _tensors(config: Mapping[str, Any]) -> tuple[Tensor, Tensor]:
    """_tune_toy's data (this file is loaded alone, by path, so it cannot import that one)."""
    gen = torch.Generator().manual_seed(config["data_seed"])
    x = torch.randn(200, 8, generator=gen)
    y = (x[:, :3] + 0.3 * torch.randn(200, 3, generator=gen)).argmax(1)
    return x, y


class _GatedBatches(TensorBatches):
    def __init__(self, x: Tensor, y: Tensor, batch_size: int) -> None:
        super().__init__(x, y, batch_size, shuffle=True)
        self.passes = 0

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        self.passes += 1
        gate = os.environ.get(GATE_ENV, "")
        if self.passes > HOLD_AFTER and gate and os.path.exists(gate):
            _mark_held(gate)
            deadline = time.monotonic() + _PATIENCE_S
            while os.path.exists(gate) and time.monotonic() < deadline:
                time.sleep(0.02)
        return super().__iter__()


def _mark_held(gate: str) -> None:
    """``<gate>.held-<node id>``: this node's array waits at the gate; its Tune trial id inside."""
    import ray
    from ray import tune

    node = ray.get_runtime_context().get_node_id()
    with open(f"{gate}.held-{node}", "w") as f:
        f.write(tune.get_context().get_trial_id() or "")


def _data(config: Mapping[str, Any]) -> tuple[TensorBatches, TensorBatches]:
    x, y = _tensors(config)
    return _GatedBatches(x[:160], y[:160], config["batch_size"]), TensorBatches(
        x[160:], y[160:], 40, shuffle=False
    )


TASK = hs.Task(
    name="tune_gated",
    model=_model,
    data=_data,
    defaults={"hidden": 8, "batch_size": 32, "epochs": 4},
)
