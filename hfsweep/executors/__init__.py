"""Executors: where the engine's arrays train, all implementing :class:`Executor` (see
``base.py`` for the contract a new executor follows). ``local`` (in this process, on one device)
is the default; ``ray`` trains arrays in Ray actors across a cluster (Ray is imported only when
a :class:`RayExecutor` is made)."""

from ._errors import ExecutorError, Stopped
from ._ray import RayExecutor
from .base import ArrayHooks, Executor
from .local import LocalExecutor

__all__ = ["ArrayHooks", "Executor", "ExecutorError", "LocalExecutor", "RayExecutor", "Stopped"]
