"""The one extension point for early stopping: :class:`TrialScheduler`, and what it exchanges."""

from __future__ import annotations

import enum
import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hfsweep._checks import is_finite, is_int, is_number
from hfsweep._status import Status

__all__ = ["STATUSES", "Decision", "Report", "TrialScheduler"]

#: How a trial can end, as :meth:`TrialScheduler.on_trial_end` is told: the final members of the
#: sweep core's one status vocabulary (:class:`hfsweep.core.status.Status`), which compare equal
#: to their values ``"completed"``, ``"stopped"``, ``"failed"``.
STATUSES: tuple[Status, ...] = tuple(s for s in Status if s.final)

MODES = ("min", "max")

#: Relative tolerance when a resource is compared with a rung or budget: an evaluation every
#: ``1/3`` epoch reaches rung ``1.0`` at ``0.9999999999999999``.
RESOURCE_RTOL = 1e-9


@dataclass(frozen=True)
class Report:
    """One trial's intermediate result.

    Attributes:
        trial: the trial's id.
        resource: the trial's progress in the budget's unit (epochs by default; may be
            fractional), finite and ``>= 0``.
        value: the metric. ``nan`` is accepted and ranks as the worst value there is: below every
            number, ``-inf`` included in ``"max"`` mode (``+inf`` in ``"min"`` mode).
    """

    trial: str
    resource: float
    value: float

    def __post_init__(self) -> None:
        if not isinstance(self.trial, str):
            raise TypeError(f"Report.trial must be a str trial id, got {self.trial!r}")
        try:
            resource = float(self.resource)
            value = float(self.value)
        except (TypeError, ValueError):
            raise TypeError(
                f"Report.resource and Report.value must be real numbers, got "
                f"resource={self.resource!r}, value={self.value!r}"
            ) from None
        if not math.isfinite(resource) or resource < 0:
            raise ValueError(
                f"Report.resource must be finite and >= 0, got {self.resource!r} "
                f"(trial {self.trial!r})"
            )
        object.__setattr__(self, "resource", resource)
        object.__setattr__(self, "value", value)


class Decision(enum.Enum):
    """What a scheduler says about one reported trial."""

    CONTINUE = "continue"
    STOP = "stop"


class TrialScheduler(ABC):
    """Decides, from intermediate results, which trials go on training.

    The engine calls :meth:`decide` with every trial evaluated at one moment (all members of an
    array evaluated at one array step) and gets one :class:`Decision` per report. Decisions are
    joint: an implementation records all values of the call before it decides any of them, so
    the answer never depends on the order of the reports in the call. When a trial ends, for
    whatever reason, the engine calls :meth:`on_trial_end` once; a trial that ended never reports
    again. :meth:`state_dict` / :meth:`load_state_dict` save and restore everything a scheduler
    knows as plain JSON (no ``NaN`` or ``Infinity`` literals), so a resumed sweep decides
    exactly as an uninterrupted one.

    Args:
        mode: ``"max"`` if larger values are better, ``"min"`` if smaller ones are.
        max_resource: the full budget of a trial in the resource's unit (epochs by default). A
            report at or beyond it is never stopped: the trial ends ``completed`` by its budget.

    Subclasses implement :meth:`decide`; they call :meth:`_check_reports` first, and extend
    :meth:`_config`, :meth:`state_dict` and :meth:`load_state_dict` with what they add.
    """

    def __init__(self, *, mode: str = "max", max_resource: float) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {list(MODES)}, got {mode!r}")
        check_positive("max_resource", max_resource)
        self._mode = mode
        self._max_resource = float(max_resource)
        self._ended: dict[str, Status] = {}

    # -- public API -------------------------------------------------------------------------

    @property
    def mode(self) -> str:
        """``"max"`` or ``"min"``."""
        return self._mode

    @property
    def max_resource(self) -> float:
        """A trial's full budget in the resource's unit."""
        return self._max_resource

    @abstractmethod
    def decide(self, reports: Sequence[Report]) -> dict[str, Decision]:
        """Record ``reports`` (one per trial) and return one decision per reported trial.

        All values of the call are recorded before any decision is taken. Raises
        ``ValueError`` if a trial reports twice in one call or reports after it ended.
        """

    def replay(self, reports: Sequence[Report]) -> None:
        """Bring the scheduler to the state a :meth:`decide` of ``reports`` left it in, acting
        on nothing outside it: a resumed sweep replays the calls its ledger logged since its
        last :meth:`state_dict`. The decisions are the logged ones, so none is returned.

        The default calls :meth:`decide`, which is right for a scheduler whose state follows
        from its calls alone (every one here but :class:`OptunaPruner`, whose record lives in
        the study and which overrides this)."""
        self.decide(reports)

    def on_trial_end(self, trial: str, status: Status | str) -> None:
        """Tell the scheduler that ``trial`` ended with ``status`` (one of :data:`STATUSES`, or
        its value).

        What a trial reported stays part of the record the others are compared with: the
        values were observed, and forgetting them would change past rungs and medians after
        the fact. A trial ends once; ending it again raises ``ValueError``.
        """
        if status not in STATUSES:
            valid = [s.value for s in STATUSES]
            raise ValueError(f"status must be one of {valid}, got {status!r}")
        if trial in self._ended:
            raise ValueError(f"trial {trial!r} already ended ({self._ended[trial]})")
        self._ended[trial] = Status(status)

    def state_dict(self) -> dict[str, Any]:
        """Everything the scheduler knows, as JSON-serialisable data."""
        return {
            "type": type(self).__name__,
            "config": self._config(),
            "ended": {k: s.value for k, s in self._ended.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output into a scheduler built with the same arguments."""
        if state.get("type") != type(self).__name__:
            raise ValueError(
                f"state is of a {state.get('type')!r}, not of a {type(self).__name__!r}"
            )
        ours, theirs = self._config(), dict(state.get("config", {}))
        if ours != theirs:
            diff = sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))
            raise ValueError(
                f"{type(self).__name__} state was saved with other arguments: "
                + ", ".join(f"{k}={theirs.get(k)!r} (here {ours.get(k)!r})" for k in diff)
            )
        self._ended = {str(k): Status(v) for k, v in state["ended"].items()}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self._config().items())
        return f"{type(self).__name__}({args})"

    # -- helpers for subclasses -------------------------------------------------------------

    def _config(self) -> dict[str, Any]:
        """The constructor arguments that define the scheduler (JSON values)."""
        return {"mode": self._mode, "max_resource": self._max_resource}

    def _check_reports(self, reports: Sequence[Report]) -> list[Report]:
        """``reports`` as a list, after checking types, duplicates and ended trials."""
        out = list(reports)
        seen: set[str] = set()
        for r in out:
            if not isinstance(r, Report):
                raise TypeError(f"decide() takes Report objects, got {r!r}")
            if r.trial in seen:
                raise ValueError(f"trial {r.trial!r} reports twice in one decide() call")
            if r.trial in self._ended:
                raise ValueError(
                    f"trial {r.trial!r} reports after it ended ({self._ended[r.trial]})"
                )
            seen.add(r.trial)
        return out

    def _score(self, value: float) -> float:
        """``value`` as "larger is better"; ``nan`` becomes ``-inf``."""
        if math.isnan(value):
            return -math.inf
        return value if self._mode == "max" else -value

    def _at_budget(self, resource: float) -> bool:
        return resource >= self._max_resource * (1 - RESOURCE_RTOL)


def reached(resource: float, milestone: float) -> bool:
    """Whether ``resource`` has reached ``milestone``, up to float rounding."""
    return resource >= milestone * (1 - RESOURCE_RTOL)


def encode_float(x: float) -> float | str:
    """A float as strict JSON: non-finite values become ``"nan"``, ``"inf"``, ``"-inf"``."""
    return x if math.isfinite(x) else str(x)


def decode_float(x: float | str) -> float:
    """Inverse of :func:`encode_float`."""
    return float(x)


def check_positive(name: str, value: Any) -> float:
    """``value`` as a float, after checking it is a finite number ``> 0``."""
    if not is_number(value):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if not (is_finite(value) and value > 0):
        raise ValueError(f"{name} must be finite and > 0, got {value!r}")
    return float(value)


def check_int(name: str, value: Any, minimum: int) -> int:
    """``value``, after checking it is an ``int`` (not a bool) ``>= minimum``."""
    if not is_int(value):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if int(value) < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    return int(value)
