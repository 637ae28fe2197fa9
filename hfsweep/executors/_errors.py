"""Errors an executor raises to the engine."""

from __future__ import annotations

__all__ = ["ExecutorError", "Stopped"]


class ExecutorError(RuntimeError):
    """The executor cannot go on: no resources for one array, or an array's workers kept dying.
    The engine reports it as a :class:`~hfsweep.SweepError`."""


class Stopped(Exception):
    """The executor was closed while an array was training: the sweep is stopping, and the
    array continues from its checkpoint on resume."""
