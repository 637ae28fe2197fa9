"""Horizontal fusion: B models of one architecture as one module with ``[B, ...]`` state.

Users import :func:`fuse`, :class:`FusedArray` and :func:`member_losses` from
:mod:`hfsweep`. The other names are what hfsweep's trainer, offload engine, profiler and
executors share of the fusion: the ``compile`` setting (:func:`check_compile`,
:func:`mode_for`, :func:`compile_error`, :func:`warn_fallback`), which calls and layers draw
random numbers (:func:`is_random_call`, :func:`draws_functionally`) and an array's stacked
tensors (:class:`StackedSlot`).
"""

from ._array import FusedArray
from ._compile import CompileFallbackWarning, check_compile, compile_error, mode_for, warn_fallback
from ._fuse import fuse
from ._losses import member_losses
from ._random import draws_functionally, is_random_call
from ._state import StackedSlot

__all__ = [
    "CompileFallbackWarning",
    "FusedArray",
    "StackedSlot",
    "check_compile",
    "compile_error",
    "draws_functionally",
    "fuse",
    "is_random_call",
    "member_losses",
    "mode_for",
    "warn_fallback",
]
