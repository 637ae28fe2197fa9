"""Ranking the study's trials (their values, the best one, the best so far) and naming how each
ended (its status, its plot color, the counts a :class:`~hfsweep.report.NothingToReport` gives)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..core.status import Status
from ._errors import _RUN_FIRST

if TYPE_CHECKING:
    from optuna.trial import FrozenTrial

__all__: list[str] = []

# A finished trial's ``status`` user attr (as the engine sets it) and its plot color; trials
# without one get theirs from the Optuna state.
_STATUS_COLORS: dict[str, str] = {
    Status.COMPLETED: "tab:blue",
    Status.STOPPED: "tab:orange",
    Status.FAILED: "tab:red",
    Status.RUNNING: "tab:gray",
    "unknown": "tab:purple",
}


def _status_of_state(name: str) -> str:
    """The status an Optuna trial state shows as (a waiting trial as running), ``name`` in
    lower case for a state hfsweep does not use."""
    try:
        status = Status.parse(name)
    except ValueError:
        return name.lower()
    return Status.RUNNING if status is Status.WAITING else status


def _value(trial: FrozenTrial) -> float | None:
    """The trial's finite single objective value, or None."""
    values = trial.values
    if not values or len(values) != 1 or not math.isfinite(values[0]):
        return None
    return float(values[0])


def _completed(trials: Sequence[FrozenTrial]) -> list[tuple[FrozenTrial, float]]:
    """The completed trials that have a finite value, with that value."""
    out = []
    for t in trials:
        value = _value(t)
        if Status.of_trial_state(t.state) is Status.COMPLETED and value is not None:
            out.append((t, value))
    return out


def _best(trials: Sequence[FrozenTrial], mode: str) -> tuple[FrozenTrial, float] | None:
    """The best completed trial and its value (the lowest number on ties), or None."""
    done = _completed(trials)
    if not done:
        return None
    if mode == "max":
        return max(done, key=lambda tv: (tv[1], -tv[0].number))
    return min(done, key=lambda tv: (tv[1], tv[0].number))


def _best_so_far(values: Sequence[float], mode: str) -> list[float]:
    """The running best of ``values`` (running max when ``mode`` is max, else running min)."""
    out: list[float] = []
    for v in values:
        best = v if not out else (max(out[-1], v) if mode == "max" else min(out[-1], v))
        out.append(best)
    return out


def _status(trial: FrozenTrial | None) -> str:
    """How a trial ended, for the learning curves: the engine's ``status`` user attr if set,
    else derived from the Optuna state; ``unknown`` for a history with no trial in the study."""
    if trial is None:
        return "unknown"
    status = trial.user_attrs.get("status")
    if isinstance(status, str) and status in _STATUS_COLORS:
        return status
    return _status_of_state(trial.state.name)


def _trial_counts(trials: Sequence[FrozenTrial]) -> str:
    """``3 trials: 1 failed, 2 running`` and, when none finished, what to do."""
    if not trials:
        return f"the study has no trials ({_RUN_FIRST}, or wait for it to ask for some)"
    counts: dict[str, int] = {}
    for t in trials:
        status = _status_of_state(t.state.name)
        counts[status] = counts.get(status, 0) + 1
    text = f"{len(trials)} trial(s): " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    if not any(t.state.is_finished() for t in trials):
        text += (
            ", none finished; report again once one has (a stopped sweep goes on with "
            "`hfsweep run SWEEP --resume`)"
        )
    return text
