"""Executors: where the engine's arrays train. ``local`` (in this process, on one device) is
the default; the Ray backend (arrays spread over a cluster) is not built yet."""

from .local import LocalExecutor

__all__ = ["LocalExecutor"]
