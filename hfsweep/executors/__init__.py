"""Executors: where the engine's arrays train. ``local`` (in this process, on one device) is
the default; ``ray`` trains arrays in Ray actors across a cluster (Ray is imported only then)."""

from ._errors import ExecutorError, Stopped
from .local import LocalExecutor

__all__ = ["ExecutorError", "LocalExecutor", "Stopped"]
