"""What the offload benchmarks share: transfers (CPU or CUDA) that count the bytes they copy
and their fetches, and the median time of a few training steps."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hfsweep.offload import CpuTransfer, CudaTransfer, Fetch


class _CountsBytes:
    """Adds up the bytes a transfer copies to the compute side and back, and its fetches (put
    before the transfer class among the bases)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.fetched = 0
        self.fetches = 0
        self.returned = 0

    def fetch(self, tensors: Sequence[torch.Tensor], urgent: bool = False) -> Fetch:
        self.fetched += sum(t.numel() * t.element_size() for t in tensors)
        self.fetches += 1
        return super().fetch(tensors, urgent)  # type: ignore[misc]

    def to_host(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        self.returned += sum(t.numel() * t.element_size() for t in tensors)
        return super().to_host(tensors)  # type: ignore[misc]


class Counting(_CountsBytes, CpuTransfer):
    """A CPU transfer that counts what it copies (see :class:`_CountsBytes`)."""


class CountingCuda(_CountsBytes, CudaTransfer):
    """The CUDA transfer (pinned host storage, a side stream) counting what it copies."""


def counting_transfer(device: torch.device) -> Counting | CountingCuda:
    """The transfer an offloaded array uses on ``device`` by default, counting its bytes."""
    return CountingCuda(device) if device.type == "cuda" else Counting()


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (on a GPU a call returns once its kernels are queued)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_step(step: Callable[[], None], steps: int) -> float:
    """The median seconds of ``steps`` calls of ``step``."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
