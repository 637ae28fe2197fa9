"""What the offload benchmarks share: a CPU transfer that counts the bytes it copies in and its
fetches, and the median time of a few training steps."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch

from hfsweep.offload import CpuTransfer, Fetch


class Counting(CpuTransfer):
    """A CPU transfer that adds up the bytes it copies to the compute side and counts its
    fetches."""

    def __init__(self) -> None:
        super().__init__()
        self.fetched = 0
        self.fetches = 0

    def fetch(self, tensors: Sequence[torch.Tensor], urgent: bool = False) -> Fetch:
        self.fetched += sum(t.numel() * t.element_size() for t in tensors)
        self.fetches += 1
        return super().fetch(tensors, urgent)


def median_step(step: Callable[[], None], steps: int) -> float:
    """The median seconds of ``steps`` calls of ``step``."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
