"""The toy task (tests/sweep/_toy.py) with a gate in its training data, for tests that must act
while a sweep is in the middle of training (stop its database, say).

With ``HFSWEEP_TEST_GATE`` naming a folder, the :data:`GATE_AT`-th training batch the process
draws creates ``<folder>/blocked`` and waits until ``<folder>/go`` exists (at most a minute);
once ``go`` exists the data flows freely, so a resumed sweep is not held. Files, not events, so
that the gate works whether the task comes from an import or from a sweep file's path.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

import hfsweep as hs
from hfsweep.tasks import TensorBatches

from ._toy import TASK as _TOY
from ._toy import _data

#: from this training batch on (counted in the process) batches wait for ``go``: past the dry run's
#: batches and the first evaluation of the first array
GATE_AT = 8
_drawn = 0


class _GatedBatches(TensorBatches):
    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        global _drawn
        for batch in super().__iter__():
            _drawn += 1
            gate = os.environ.get("HFSWEEP_TEST_GATE")
            if gate and _drawn >= GATE_AT and not (Path(gate) / "go").exists():
                (Path(gate) / "blocked").touch()
                deadline = time.monotonic() + 60
                while not (Path(gate) / "go").exists() and time.monotonic() < deadline:
                    time.sleep(0.01)
            yield batch


def _gated_data(config: Mapping[str, Any]) -> tuple[TensorBatches, TensorBatches]:
    train, val = _data(config)
    return _GatedBatches(train.x, train.y, train.batch_size, shuffle=True), val


TASK = hs.Task(name="toy", model=_TOY.model, data=_gated_data, defaults=dict(_TOY.defaults))
