"""Checks and formatting shared by the sizing modules: numbers validated with errors that name the
value and the valid range, and byte counts and rates written for people."""

from __future__ import annotations

import math

_MIB = 2**20
_GIB = 2**30


def _check_int(name: str, value: object, minimum: int) -> int:
    """``value`` as an int >= ``minimum``, else a ValueError naming it and the valid range."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value}")
    return value


def _check_real(name: str, value: object, *, minimum: float = 0.0, strict: bool = False) -> float:
    """``value`` as a finite float >= ``minimum`` (> with ``strict``), else a ValueError."""
    bound = f"> {minimum:g}" if strict else f">= {minimum:g}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")
    number = float(value)
    if not math.isfinite(number) or number < minimum or (strict and number == minimum):
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")
    return number


def _check_knee(knee: object) -> float:
    if isinstance(knee, bool) or not isinstance(knee, (int, float)) or not 0.0 < knee <= 1.0:
        raise ValueError(f"knee must be a number in (0, 1], got {knee!r}")
    return float(knee)


def _check_budget(budget_bytes: object) -> float:
    return _check_real("budget_bytes", budget_bytes, strict=True)


def _fmt_bytes(n: float) -> str:
    """Bytes in GiB from 1 GiB up, else in MiB."""
    if abs(n) >= _GIB:
        return f"{n / _GIB:.2f} GiB"
    return f"{n / _MIB:.1f} MiB"


def _fmt_rate(x: float) -> str:
    return f"{x:,.1f}"
