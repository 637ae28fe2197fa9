"""What the in-process tests of the elastic executor's driver side share: Ray's queue as the
driver uses it, without Ray, and a worker policy whose report and end are ignored."""

from __future__ import annotations

import queue
from typing import Any

import pytest

ray_queue = pytest.importorskip("ray.util.queue")


class InProcessQueue:
    """Ray's queue as the elastic driver uses it, in one process."""

    def __init__(self, **_: Any) -> None:
        self.q: queue.Queue[Any] = queue.Queue()

    def put(self, item: Any) -> None:
        self.q.put(item)

    def get(self, timeout: float | None = None) -> Any:
        try:
            return self.q.get(timeout=timeout)
        except queue.Empty:
            raise ray_queue.Empty from None

    def shutdown(self, force: bool = False) -> None:
        pass


class QuietPolicy:
    """A worker policy that ignores reports and ends; a test's policy adds the decisions it
    scripts (``started``, ``relaunch``, ``waiting``)."""

    def reported(self, folder: str, evaluations: Any, live: int) -> None:
        pass

    def ended(self, folder: str, total: int) -> None:
        pass

    def admits(self) -> int | None:
        return None
