"""Executors: where the engine's arrays train, all implementing :class:`Executor` (see
``base.py`` for the contract a new executor follows). ``local`` (in this process, on one device)
is the default; ``ray`` trains arrays in Ray actors across a cluster (Ray is imported only when
a :class:`RayExecutor` is made).

An :class:`AlternatingExecutor` trains several offloaded arrays on one device at once, their
shards alternating; :func:`reach` connects to a Ray cluster or raises
:class:`ClusterUnreachable`.
"""

from ._alternating import AlternatingExecutor
from ._connect import ClusterUnreachable, reach
from ._errors import ExecutorError, Stopped
from ._ray import RayExecutor
from .base import ArrayHooks, Executor
from .local import LocalExecutor

__all__ = [
    "AlternatingExecutor",
    "ArrayHooks",
    "ClusterUnreachable",
    "Executor",
    "ExecutorError",
    "LocalExecutor",
    "RayExecutor",
    "Stopped",
    "reach",
]
