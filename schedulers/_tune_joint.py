"""Per-member early stopping for the Ray Tune plugin, decided jointly for one array's report.

A fused array reports all members evaluated at one step together. The inner scheduler (a Tune
``TrialScheduler`` or an hfsweep :class:`~hfsweep.schedulers.TrialScheduler`) decides for each of
them, and the answer must not depend on the order the members are handed to it:

- hfsweep's schedulers are joint by construction: one :meth:`decide` call per report.
- Tune's schedulers decide first come, first served. Each member is therefore judged on a probe
  copy of the scheduler that has already recorded every other member of the report: every member
  is decided as if it were the last of its array to report (it sees all its array-mates' values at
  that rung). Afterwards the real scheduler records the whole report in member-id order. This costs
  ``B`` copies and ``B**2`` calls per report, cheap for ASHA and the median rule at array sizes of a
  few dozen.

This module imports neither Ray nor Optuna: Tune's decision strings are compared by value.
"""

from __future__ import annotations

import copy
import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

from hfsweep._checks import is_number
from hfsweep.core.status import Status

from ._base import Decision, Report, TrialScheduler

__all__ = [
    "Decider",
    "MemberController",
    "MemberTrial",
    "NativeDecider",
    "NoDecider",
    "TuneDecider",
]

#: Tune's ``TrialScheduler.STOP``; every other answer (CONTINUE, PAUSE, NOOP) lets a member go on
_TUNE_STOP = "STOP"


class MemberTrial:
    """What a Tune scheduler sees of one member: a trial id, its config, status ``RUNNING``.

    Equal and hashed by id, so a scheduler that keys its records by trial object (the median
    rule) finds them again after a probe copy or a restore; a deep copy is the object itself.
    """

    __slots__ = ("config", "trial_id")
    status = "RUNNING"

    def __init__(self, trial_id: str, config: Mapping[str, Any]) -> None:
        self.trial_id = trial_id
        self.config = dict(config)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MemberTrial) and other.trial_id == self.trial_id

    def __hash__(self) -> int:
        return hash(("hfsweep-member", self.trial_id))

    def __deepcopy__(self, memo: dict[int, Any]) -> MemberTrial:
        return self

    def __repr__(self) -> str:
        return f"MemberTrial({self.trial_id!r})"

    def __str__(self) -> str:
        return self.trial_id


class MemberController:
    """What a Tune scheduler sees as its controller: the sweep's running members are its live
    trials (the median rule asks whether any wait). Anything else a scheduler would ask a
    controller for is an error: such a scheduler cannot run per member."""

    def __init__(self, live: Sequence[MemberTrial]) -> None:
        self._live = list(live)

    def get_live_trials(self) -> list[MemberTrial]:
        """The members still training."""
        return list(self._live)

    def get_trials(self) -> list[MemberTrial]:
        """The members still training (ended ones are not kept here)."""
        return list(self._live)

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"a scheduler applied per member asked its controller for {name!r}; only "
            "get_live_trials() and get_trials() exist for members (pausing or changing trials "
            "cannot apply to one member of an array)"
        )


class Decider(ABC):
    """Runs one inner scheduler over members: joint decisions, and the end of each member."""

    @abstractmethod
    def decide(
        self, controller: Any, reports: Sequence[tuple[MemberTrial, dict[str, Any]]], metric: str
    ) -> dict[str, bool]:
        """``{member id: go on?}`` for the members of one report (their result dicts; the
        sweep's ``metric`` is the value an hfsweep scheduler ranks)."""

    @abstractmethod
    def end(
        self, controller: Any, trial: MemberTrial, status: Status, result: dict[str, Any] | None
    ) -> None:
        """Tell the scheduler that ``trial`` ended: ``COMPLETED``, ``STOPPED`` or ``FAILED``."""

    def at_budget(self, result: Mapping[str, Any]) -> bool:
        """Whether a stop at ``result`` is the scheduler's budget being reached (a member
        stopped there is told as complete, as a trial that ran to ``max_t``)."""
        return False

    @property
    def scheduler(self) -> Any:
        """The inner scheduler."""
        return None

    def describe(self) -> str:
        """The inner scheduler in words."""
        return type(self.scheduler).__name__


class NoDecider(Decider):
    """No early stopping: every member trains to its budget."""

    def decide(
        self, controller: Any, reports: Sequence[tuple[MemberTrial, dict[str, Any]]], metric: str
    ) -> dict[str, bool]:
        return {trial.trial_id: True for trial, _ in reports}

    def end(
        self, controller: Any, trial: MemberTrial, status: Status, result: dict[str, Any] | None
    ) -> None:
        return None

    def describe(self) -> str:
        return "no early stopping"


class TuneDecider(Decider):
    """A Tune ``TrialScheduler`` (ASHA, median stopping rule, FIFO) applied per member.

    A member is added to the scheduler (``on_trial_add``) at its first report; it ends with
    ``on_trial_complete`` (complete or pruned, with its last result, as Tune does for a trial it
    stopped) or ``on_trial_error`` (failed). ``PAUSE`` counts as go on: a member cannot be paused
    inside an array.
    """

    def __init__(self, scheduler: Any) -> None:
        self._scheduler = scheduler
        self._added: set[str] = set()

    @property
    def scheduler(self) -> Any:
        return self._scheduler

    def decide(
        self, controller: Any, reports: Sequence[tuple[MemberTrial, dict[str, Any]]], metric: str
    ) -> dict[str, bool]:
        ordered = sorted(reports, key=lambda r: r[0].trial_id)
        for trial, _ in ordered:
            if trial.trial_id not in self._added:
                self._scheduler.on_trial_add(controller, trial)
                self._added.add(trial.trial_id)
        decisions: dict[str, bool] = {}
        if len(ordered) == 1:  # nobody to be joint with
            trial, result = ordered[0]
            action = self._scheduler.on_trial_result(controller, trial, dict(result))
            return {trial.trial_id: action != _TUNE_STOP}
        for trial, result in ordered:
            probe = copy.deepcopy(self._scheduler)
            for other, other_result in ordered:
                if other is not trial:
                    probe.on_trial_result(controller, other, dict(other_result))
            action = probe.on_trial_result(controller, trial, dict(result))
            decisions[trial.trial_id] = action != _TUNE_STOP
        for trial, result in ordered:  # record the report on the real scheduler
            self._scheduler.on_trial_result(controller, trial, dict(result))
        self._reconcile(decisions)
        return decisions

    def _reconcile(self, decisions: Mapping[str, bool]) -> None:
        """Make what the scheduler remembers of its own decisions match the joint ones (its
        first-come-first-served answers while recording were not the ones taken). The median
        stopping rule keeps the trials it stopped and refuses to see them report again."""
        stopped = getattr(self._scheduler, "_stopped_trials", None)
        if not isinstance(stopped, set):
            return
        for trial_id, go in decisions.items():
            trial = MemberTrial(trial_id, {})
            if go:
                stopped.discard(trial)
            else:
                stopped.add(trial)

    def end(
        self, controller: Any, trial: MemberTrial, status: Status, result: dict[str, Any] | None
    ) -> None:
        if trial.trial_id not in self._added:
            return  # never reported: the scheduler does not know it
        if status is Status.FAILED or result is None:
            self._scheduler.on_trial_error(controller, trial)
        else:
            self._scheduler.on_trial_complete(controller, trial, dict(result))

    def at_budget(self, result: Mapping[str, Any]) -> bool:
        # AsyncHyperBandScheduler (ASHA) stops every trial that reaches max_t
        max_t = getattr(self._scheduler, "_max_t", None)
        attr = getattr(self._scheduler, "_time_attr", None)
        if not is_number(max_t) or not isinstance(attr, str):
            return False
        now = result.get(attr)
        return is_number(now) and now >= max_t


class NativeDecider(Decider):
    """An hfsweep :class:`~hfsweep.schedulers.TrialScheduler`, joint by construction; a
    member's resource is its epoch count (fractional with ``eval_every``)."""

    def __init__(self, scheduler: TrialScheduler) -> None:
        self._scheduler = scheduler

    @property
    def scheduler(self) -> TrialScheduler:
        return self._scheduler

    def decide(
        self, controller: Any, reports: Sequence[tuple[MemberTrial, dict[str, Any]]], metric: str
    ) -> dict[str, bool]:
        if not reports:
            return {}
        batch = [
            Report(trial.trial_id, float(result["epoch"]), _number(result.get(metric)))
            for trial, result in reports
        ]
        answer = self._scheduler.decide(batch)
        return {trial_id: d is Decision.CONTINUE for trial_id, d in answer.items()}

    def end(
        self, controller: Any, trial: MemberTrial, status: Status, result: dict[str, Any] | None
    ) -> None:
        self._scheduler.on_trial_end(trial.trial_id, status.value)

    def at_budget(self, result: Mapping[str, Any]) -> bool:
        epoch = result.get("epoch")
        return is_number(epoch) and self._scheduler._at_budget(float(epoch))


def _number(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan
