"""Packing trials into arrays: moved to :mod:`hfsweep.core.packer`, the one packer every front
door drives. :class:`Pending` and :class:`Pools` stay importable from here."""

from __future__ import annotations

from .core.packer import Pending, Pools

__all__ = ["Pending", "Pools"]
