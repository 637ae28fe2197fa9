"""Is a value a number of the kind asked, in the range asked? One answer for every part of hfsweep
that reads numbers a user gave (sweep files, search spaces, task configs, scheduler options,
metrics): ``True`` and ``False`` are never numbers (YAML and JSON write them where a user meant a
flag), and numpy's scalars count as the numbers they are. The messages stay with the callers,
which know what the value is and where it came from."""

from __future__ import annotations

import math
import numbers
from typing import TypeGuard

__all__ = ["in_range", "is_finite", "is_int", "is_number"]


def is_int(value: object) -> TypeGuard[int]:
    """``value`` is an integer (a Python or numpy int), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value: object) -> TypeGuard[float]:
    """``value`` is a real number (an int or float, Python or numpy; nan and infinities
    included), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_finite(value: object) -> TypeGuard[float]:
    """``value`` is a real number, not a bool, nan or an infinity."""
    return is_number(value) and math.isfinite(value)


def in_range(
    value: float,
    low: float = -math.inf,
    high: float = math.inf,
    *,
    low_open: bool = False,
    high_open: bool = False,
) -> bool:
    """``low <= value <= high``, with ``<`` at an open end; nan is in no range."""
    above = value > low if low_open else value >= low
    below = value < high if high_open else value <= high
    return above and below
