"""How many intra-op threads an array trains with on the CPU: the cores nobody else is using.

torch runs an operation on several threads once its tensors pass a grain size (32,768 elements
for elementwise ops); its OpenMP build (GNU libgomp) ends each such operation at a barrier
where every thread waits for the slowest, spinning first. A fused array's tensors are B times a
model's, so nearly every operation of its step runs on every thread, where the same model
trained alone stays under the grain size and runs on one. On a CPU that other processes also
want, one of the array's threads is regularly off its core when the operation ends, and the
others wait (and spin) until the scheduler gives it a turn again: each operation costs a
scheduler time slice instead of microseconds. Measured on the project's 2-core CPU with two
busy processes beside it (``benchmarks/contention.py``): one quick sweep took several times
as long with torch's two threads as with one, and ran through tens of thousands of involuntary
context switches, while the unfused plain loop barely noticed.

:func:`training_threads` therefore trains an array with at most as many threads as cores are
idle: the cores of the process's affinity (``os.sched_getaffinity``) less the threads of other
processes ready to run now (``procs_running`` in ``/proc/stat`` less this process's own running
threads), at least one, and never more than torch's setting when the run started (which is
where ``OMP_NUM_THREADS`` or a user's ``torch.set_num_threads`` show). :meth:`Threads.revisit`
decides again at every evaluation boundary, since other load comes and goes during a sweep.
When the run ends, torch's setting is set back.

``HFSWEEP_CPU_THREADS=torch`` leaves torch's thread count alone (the whole affinity, whatever
the load); ``HFSWEEP_CPU_THREADS=N`` trains with N threads; the default is ``auto``.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

__all__ = ["ENV", "Threads", "choose_threads", "others_running", "training_threads"]

_log = logging.getLogger("hfsweep")

#: the environment variable: ``auto`` (default), ``torch`` or a positive integer
ENV = "HFSWEEP_CPU_THREADS"

_lock = threading.Lock()
#: runs inside :func:`training_threads` now, and torch's setting from before the first
_open = 0
_before = 0


def _cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _procs_running(stat: Path = Path("/proc/stat")) -> int | None:
    """Threads ready to run on the whole machine now (Linux), ``None`` where unknown."""
    try:
        for line in stat.read_text().splitlines():
            if line.startswith("procs_running "):
                return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def _own_running(tasks: Path = Path("/proc/self/task")) -> int:
    """This process's threads ready to run now (at least one: the caller)."""
    running = 0
    try:
        for task in tasks.iterdir():
            try:
                stat = (task / "stat").read_text()
            except OSError:
                continue
            if stat[stat.rindex(")") + 2 :].startswith("R"):
                running += 1
    except OSError:
        return 1
    return max(1, running)


def others_running() -> int | None:
    """Threads of other processes ready to run now: the machine's less this process's;
    ``None`` where the machine does not say (not Linux)."""
    total = _procs_running()
    if total is None:
        return None
    return max(0, total - _own_running())


def choose_threads(ceiling: int, cores: int, others: int | None) -> int:
    """Intra-op threads for a step: the ``cores`` that ``others`` (threads of other processes
    ready to run) leave idle, at least 1, at most ``ceiling`` (torch's own setting)."""
    if others is None:
        return max(1, ceiling)
    return max(1, min(ceiling, cores - others))


def _setting() -> str | int:
    raw = os.environ.get(ENV, "auto").strip().lower()
    if raw in ("auto", "torch", ""):
        return raw or "auto"
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(
            f"{ENV}={os.environ[ENV]!r} (environment): give 'auto' (threads from the idle "
            "cores), 'torch' (torch's own setting) or a positive integer"
        )
    return value


class Threads:
    """The thread count of one array's run; :meth:`revisit` at every evaluation boundary."""

    def __init__(
        self,
        setting: str | int,
        ceiling: int,
        others: Callable[[], int | None] | None = None,
    ) -> None:
        self.setting, self.ceiling, self._others = setting, ceiling, others
        #: the count chosen last (``0`` before the first)
        self.current = 0
        self.revisit()

    def revisit(self) -> int:
        """Choose the thread count for the steps until the next boundary and set it in torch
        (from this thread, the one that trains: OpenMP keeps the count per thread)."""
        if self.setting == "torch":
            return torch.get_num_threads()
        if isinstance(self.setting, int):
            threads = self.setting
        else:
            others = self._others if self._others is not None else others_running
            threads = choose_threads(self.ceiling, _cores(), others())
        if threads != self.current:
            if self.current:
                _log.debug("intra-op threads %d -> %d (idle cores)", self.current, threads)
            torch.set_num_threads(threads)
            self.current = threads
        return threads


@contextmanager
def training_threads(others: Callable[[], int | None] | None = None) -> Iterator[Threads]:
    """Train the block's array with :class:`Threads` (see the module docstring); torch's thread
    count from before the first open block is set back when the last one ends."""
    global _open, _before
    setting = _setting()
    with _lock:
        if _open == 0:
            _before = torch.get_num_threads()
        _open += 1
        ceiling = _before
    try:
        yield Threads(setting, ceiling, others)
    finally:
        with _lock:
            _open -= 1
            if _open == 0 and setting != "torch":
                torch.set_num_threads(_before)
