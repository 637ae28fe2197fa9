"""Exceptions raised by hfsweep."""

from __future__ import annotations

__all__ = ["FusionError"]


class FusionError(ValueError):
    """Models cannot be fused into one array, or an array was called with input it cannot take.

    The message names the submodule path (``""`` is the root model), what differs or is unsupported,
    and what would work instead. hfsweep raises this rather than build an array that would train
    differently from the models it was given.
    """
