"""Moving tensors between host storage and the compute side: :class:`Transfer` and its two
implementations.

A transfer is started (:meth:`Transfer.fetch`) and waited for later (:meth:`Fetch.wait`), so the
engine can start copying the next shard in while the current one computes (double buffering).

- :class:`CpuTransfer`: host and compute side are one memory, so a transfer is a copy. An
  optional ``delay`` (seconds per fetch) is spent in a background thread before the copy, to
  stand in for a slow link: the pipeline's overlap can then be seen and measured on a CPU
  (``benchmarks/offload_pipeline.py``). PyTorch ops release the GIL, so compute in the calling
  thread runs while the background thread sleeps or copies. The thread takes urgent fetches
  (``fetch(..., urgent=True)``) before the others not yet started, each class in the order
  started; a copy under way is not interrupted (a priority on the link: several arrays
  alternated give the compute-bound one's fetches the link first, see ``_alternate.py``).
- :class:`CudaTransfer`: pinned host memory, ``non_blocking`` copies issued on a side stream, and
  an event per fetch that the compute stream waits on (``record_stream`` keeps the caching
  allocator from reusing a copy's memory before the compute stream is done with it). Its
  copies run on one stream in the order issued: ``urgent`` is accepted and has no effect.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import torch
from torch import Tensor

__all__ = ["CpuTransfer", "CudaTransfer", "Fetch", "Transfer", "default_transfer"]


class Fetch(ABC):
    """A transfer under way; :meth:`wait` returns its tensors once they can be used."""

    @abstractmethod
    def wait(self) -> list[Tensor]:
        """The copied tensors, ready for the compute stream."""

    def ready(self) -> bool:
        """Whether :meth:`wait` would return without waiting on the copy (a scheduler of
        several arrays gives the turn to one whose next shard is in; ``True`` where a
        transfer cannot tell)."""
        return True

    def started(self) -> bool:
        """Whether the copy is under way or done (``True`` where a transfer cannot tell):
        one not started may still be passed by an urgent one."""
        return True


class _Done(Fetch):
    def __init__(self, tensors: list[Tensor]) -> None:
        self._tensors = tensors

    def wait(self) -> list[Tensor]:
        return self._tensors


class _Threaded(Fetch):
    def __init__(self, future: Future[list[Tensor]]) -> None:
        self._future = future

    def wait(self) -> list[Tensor]:
        return self._future.result()

    def ready(self) -> bool:
        return self._future.done()

    def started(self) -> bool:
        return self._future.running() or self._future.done()


class Transfer(ABC):
    """Copies between host storage and the compute device ``device``."""

    device: torch.device
    #: whether :meth:`fetch`'s ``urgent`` reorders the copies (an urgent fetch passes those
    #: not started); where it does not, the copies run in the order issued
    reorders: bool = False

    @abstractmethod
    def fetch(self, tensors: Sequence[Tensor], urgent: bool = False) -> Fetch:
        """Start copying host ``tensors`` to the compute side (new tensors); ``urgent``: ahead
        of the fetches not urgent that have not started, where the transfer can reorder."""

    @abstractmethod
    def to_host(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        """Copies of compute-side ``tensors`` in host storage, complete when this returns."""

    def host_storage(self, t: Tensor) -> Tensor:
        """``t`` as host storage keeps it (pinned where that makes copies asynchronous)."""
        return t

    def close(self) -> None:  # noqa: B027 - a transfer with nothing to release keeps this one
        """Release what the transfer holds (threads, streams)."""


class CpuTransfer(Transfer):
    """Host and compute side are both the CPU: a transfer is a copy. ``delay`` seconds are
    spent per :meth:`fetch` in a background thread before it copies (0: copy at once, in the
    calling thread). The thread takes urgent fetches before the others not yet started.
    Returns to the host are copies without delay."""

    reorders = True

    def __init__(self, delay: float = 0.0) -> None:
        if isinstance(delay, bool) or not isinstance(delay, int | float) or not delay >= 0:
            raise ValueError(f"delay must be a number of seconds >= 0, got {delay!r}")
        self.device = torch.device("cpu")
        self.delay = float(delay)
        self._link: _Link | None = None
        self._lock = threading.Lock()

    def fetch(self, tensors: Sequence[Tensor], urgent: bool = False) -> Fetch:
        items = list(tensors)
        if self.delay == 0:
            return _Done(_copies(items))
        with self._lock:
            if self._link is None:
                self._link = _Link()
            return _Threaded(self._link.submit(_after(self.delay, lambda: _copies(items)), urgent))

    def to_host(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        return _copies(list(tensors))

    def close(self) -> None:
        with self._lock:
            if self._link is not None:
                self._link.shutdown()
                self._link = None


_Job = tuple[Future[list[Tensor]], Callable[[], list[Tensor]]]


class _Link:
    """One background thread running jobs one at a time: the urgent ones before the others
    queued, each class first in, first out; a job under way runs to its end. (A thread pool
    of one worker would run them in the order submitted only.)"""

    def __init__(self) -> None:
        self._queues: tuple[deque[_Job], deque[_Job]] = (deque(), deque())  # urgent, other
        self._more = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._serve, name="hfsweep-offload", daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], list[Tensor]], urgent: bool) -> Future[list[Tensor]]:
        """Queue ``job`` (urgent: ahead of the others not started); its future."""
        future: Future[list[Tensor]] = Future()
        with self._more:
            self._queues[0 if urgent else 1].append((future, job))
            self._more.notify()
        return future

    def _serve(self) -> None:
        while True:
            with self._more:
                while not any(self._queues) and not self._closing:
                    self._more.wait()
                queue = next((q for q in self._queues if q), None)
                if queue is None:  # closing, nothing left
                    return
                future, job = queue.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(job())
            except BaseException as error:  # handed to whoever waits on the fetch
                future.set_exception(error)

    def shutdown(self) -> None:
        """Run what is queued, then stop the thread (as a pool's ``shutdown(wait=True)``)."""
        with self._more:
            self._closing = True
            self._more.notify()
        self._thread.join()


def _copies(tensors: list[Tensor]) -> list[Tensor]:
    with torch.no_grad():
        return [t.detach().clone() for t in tensors]


def _after(delay: float, job: Callable[[], list[Tensor]]) -> Callable[[], list[Tensor]]:
    def run() -> list[Tensor]:
        time.sleep(delay)
        return job()

    return run


class _CudaFetch(Fetch):
    def __init__(self, tensors: list[Tensor], done: torch.cuda.Event, device: torch.device) -> None:
        self._tensors = tensors
        self._done = done
        self._device = device

    def wait(self) -> list[Tensor]:
        current = torch.cuda.current_stream(self._device)
        current.wait_event(self._done)
        for t in self._tensors:
            t.record_stream(current)  # freed later: not reused before the compute stream is done
        return self._tensors

    def ready(self) -> bool:
        return bool(self._done.query())


class CudaTransfer(Transfer):
    """Host storage pinned, copies on a side stream of ``device`` with ``non_blocking=True``,
    one event per fetch for the compute stream to wait on."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"CudaTransfer needs a CUDA device, got {self.device}")
        self.stream = torch.cuda.Stream(self.device)

    def fetch(self, tensors: Sequence[Tensor], urgent: bool = False) -> Fetch:
        with torch.no_grad(), torch.cuda.stream(self.stream):
            out = [t.detach().to(self.device, non_blocking=True) for t in tensors]
            done = torch.cuda.Event()
            done.record(self.stream)
        return _CudaFetch(out, done, self.device)

    def to_host(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        computed = torch.cuda.current_stream(self.device).record_event()
        with torch.no_grad(), torch.cuda.stream(self.stream):
            self.stream.wait_event(computed)
            out = []
            for t in tensors:
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t, non_blocking=True)
                t.record_stream(self.stream)
                out.append(host)
            done = torch.cuda.Event()
            done.record(self.stream)
        done.synchronize()
        return out

    def host_storage(self, t: Tensor) -> Tensor:
        return t if t.is_pinned() else t.pin_memory()

    def close(self) -> None:
        self.stream.synchronize()


def default_transfer(device: torch.device | str) -> Transfer:
    """:class:`CudaTransfer` for a CUDA device, else :class:`CpuTransfer` without delay."""
    device = torch.device(device)
    if device.type == "cuda":
        return CudaTransfer(device)
    if device.type != "cpu":
        raise ValueError(f"offload supports cpu and cuda devices, got {device}")
    return CpuTransfer()
