"""Errors of the offload engine."""

from __future__ import annotations

__all__ = ["OffloadBudgetError", "OffloadError"]


class OffloadError(ValueError):
    """An array cannot be trained with ``offload: host`` as it is: the message names the model
    (or submodule, or value) and what would work instead."""


class OffloadBudgetError(OffloadError):
    """The bytes the engine would hold on the compute side exceed the budget it was given. The
    message says what was resident (shard state, gradients, boundary activations) and by how much
    the budget was exceeded."""
