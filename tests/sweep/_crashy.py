"""The toy task, except that a Ray worker training it dies once: when the file named by
``HFSWEEP_TEST_CRASH_FLAG`` exists, the Ray actor process that draws its ``CRASH_AT``-th
training batch deletes the file and exits at once, as a worker killed by the system would."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any

from torch import Tensor

import hfsweep as hs
from hfsweep.tasks import TensorBatches

from ._toy import TASK as TOY

#: the batch, counted in this process, at which a worker dies if the flag file exists
CRASH_AT = 8
_drawn = 0


class _DyingBatches(TensorBatches):
    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        global _drawn
        for batch in super().__iter__():
            _drawn += 1
            flag = os.environ.get("HFSWEEP_TEST_CRASH_FLAG", "")
            if _drawn >= CRASH_AT and flag and os.path.exists(flag) and _in_ray_actor():
                os.remove(flag)
                os._exit(1)
            yield batch


def _in_ray_actor() -> bool:
    """Whether this process is a Ray actor: the driver draws batches too (the sweep's dry run),
    and must not die."""
    import ray

    return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None


def _data(config: Mapping[str, Any]) -> tuple[TensorBatches, TensorBatches]:
    train, val = TOY.data(config)
    return _DyingBatches(train.x, train.y, train.batch_size, shuffle=True), val


TASK = hs.Task(name="crashy", model=TOY.model, data=_data, defaults=dict(TOY.defaults))
