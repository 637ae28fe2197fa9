"""Horizontal fusion: B models of one architecture as one module with ``[B, ...]`` state."""

from ._array import FusedArray
from ._compile import CompileFallbackWarning
from ._fuse import fuse
from ._losses import member_losses

__all__ = ["CompileFallbackWarning", "FusedArray", "fuse", "member_losses"]
