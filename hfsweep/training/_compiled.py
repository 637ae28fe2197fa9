"""The task's loss compiled with ``torch.compile`` for a trainer with ``compile`` on.

The fused array compiles its own forward (and backward) through ``hs.fuse(..., compile=...)``;
the per-member loss that follows it is the task's code, compiled here on its own so that its
handful of element-wise ops and reductions become one or two kernels. A loss ``torch.compile``
cannot compile runs eagerly from its first failure on, with one ``CompileFallbackWarning``.
:func:`log_compiled` says at each array's end whether its fused step ran compiled.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from torch import Tensor

from .._compat import dynamo_graphs_compiled
from ..fusion import compile_error, warn_fallback
from .task import Task, TaskError

__all__ = ["CompiledLoss", "log_compiled"]

_log = logging.getLogger("hfsweep.trainer")


class CompiledLoss:
    """``task.member_loss`` compiled in ``mode`` (static shapes), or eager after a failure."""

    def __init__(self, task: Task, mode: str) -> None:
        self._task = task
        self._compiled: Any = torch.compile(task.member_loss, mode=mode, dynamic=False)
        self._ran = False  #: the compiled loss has run once: a later error is the data's
        #: seconds the first calls of each compiled shape took (compiling: step timers leave
        #: them out, as they leave out the array's tracing and compiling)
        self.seconds = 0.0

    def __call__(self, outputs: Tensor, target: Tensor, smoothing: Tensor | None) -> Tensor:
        if self._compiled is None:
            return self._task.member_loss(outputs, target, smoothing)
        start = time.perf_counter()
        frames = dynamo_graphs_compiled()
        try:
            losses: Tensor = self._compiled(outputs, target, smoothing)
        except (TaskError, torch.OutOfMemoryError):
            raise
        except Exception as exc:
            if self._ran:
                raise
            warn_fallback(
                f"torch.compile failed on task {self._task.name!r}'s loss ({compile_error(exc)}); "
                "the loss runs uncompiled",
                stacklevel=3,
            )
            self._compiled = None
            return self._task.member_loss(outputs, target, smoothing)
        self._ran = True
        if (
            dynamo_graphs_compiled() != frames
        ):  # this call compiled (a new shape): not a step's time
            self.seconds += time.perf_counter() - start
        return losses


def log_compiled(array: Any, seconds: float) -> None:
    """Say in the log whether the array's fused step ran compiled (``compile`` on), and what
    tracing and compiling cost it: a fallback is warned of once, so that a later reader of
    ``sweep.log`` knows what each array ran."""
    traces = [*array._traces.values(), *(array._shared_traces or {}).values()]
    compiled = sum(1 for t in traces if getattr(t, "plain", None) is not None)
    if compiled:
        _log.info(
            "the array's fused step ran compiled (%d call signature(s)); tracing and compiling "
            "took %.1f s, left out of the step times",
            compiled,
            seconds,
        )
    else:
        _log.info(
            "compile is on but no call signature of the array ran compiled (the "
            "CompileFallbackWarning says why)"
        )
