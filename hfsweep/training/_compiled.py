"""The task's loss compiled with ``torch.compile`` for a trainer with ``compile`` on.

The fused array compiles its own forward (and backward) through ``hs.fuse(..., compile=...)``;
the per-member loss that follows it is the task's code, compiled here on its own so that its
handful of element-wise ops and reductions become one or two kernels. A loss ``torch.compile``
cannot compile runs eagerly from its first failure on, with one ``CompileFallbackWarning``.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor

from .._compat import dynamo_graphs_compiled
from ..fusion._compile import compile_error, warn_fallback
from .task import Task, TaskError

__all__ = ["CompiledLoss"]


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
