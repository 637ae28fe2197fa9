"""Tune's ``RunConfig(stop=...)`` judged per member of a fused array, as Tune judges a trial.

Tune applies an experiment's stop criterion to each trial's results: a dict of thresholds
(``{"training_iteration": 2}``, ``{"val_accuracy": 0.9}``: the trial stops once a result's value
is at least the threshold) becomes each trial's ``stopping_criterion``; a callable
``(trial_id, result) -> bool`` or a ``tune.stopper.Stopper`` becomes the controller's stopper,
called with every result, and its ``stop_all()`` ends the whole experiment. A trial stopped so
is told to the searcher with its last result (completed) and keeps its checkpoint.

Under a Fusion a Tune trial is an array: left to Tune, the criterion would judge the array's
aggregate result (its best member's value, its count of reports) and stop every member at
once. :class:`MemberStop` takes the criterion over instead (from the searcher's search
properties, each array trial as it is added, and the controller's stopper, which it replaces by
one that never stops an array) and judges each member's own result: a member that meets it ends
``COMPLETED`` (weights kept, told with its last result), its array-mates go on, and the inner
scheduler does not see that result (as Tune consults no scheduler for a result that met the
criterion). ``stop_all()`` stops every member at its next evaluation and asks no new member.

After ``Tuner.restore`` the criterion comes back with the experiment: a dict with the sweep's
saved state (restored array trials no longer carry it), a callable or ``Stopper`` inside the
stopper that replaced it on the controller, which Tune saves with its own state.

Ray 2.x gives a scheduler no public way to reach the controller's stopper: :meth:`take_over`
reads and replaces it through the controller that ``on_trial_add`` receives
(``_tune_controller._stopper`` of Ray 2.60's ``TrialRunnerWrapper``; the tests check that
path). Where a Ray keeps it elsewhere, a warning says that a callable or ``Stopper`` would judge
whole arrays. This module imports Ray only inside :meth:`MemberStop.take_over`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from hfsweep._checks import is_number

__all__ = ["ArraysNeverStop", "MemberStop"]

_log = logging.getLogger("hfsweep.tune")


class MemberStop:
    """The experiment's stop criterion, judged per member (see the module docstring).

    ``criteria`` are the dict form's thresholds; ``stopper`` is the callable or ``Stopper``
    form (Tune's ``FunctionStopper`` around a callable), called as ``stopper(member id,
    member result)``; ``all_stopped`` is set once its ``stop_all()`` said so.
    """

    def __init__(self) -> None:
        self.criteria: dict[str, Any] = {}
        self.stopper: Any = None
        self.all_stopped = False
        #: the members the last :meth:`judge` found meeting the criterion
        self._met: set[str] = set()
        self._missing: set[str] = set()
        self._unreachable = False

    @property
    def active(self) -> bool:
        """Whether there is a criterion to judge members by."""
        return bool(self.criteria) or self.stopper is not None or self.all_stopped

    def set_criteria(self, stop: Any) -> None:
        """The dict form, as Tune hands it to searchers and schedulers (``stop`` of the
        experiment's public spec: the thresholds, or ``{}`` for the other forms)."""
        if isinstance(stop, Mapping):
            self.criteria = dict(stop)

    def take_over(self, controller: Any, trial: Any) -> None:
        """Move Tune's criterion off array trial ``trial`` and off the controller (what
        ``on_trial_add`` receives), so that Tune never stops an array for it: the trial's
        ``stopping_criterion`` joins :attr:`criteria`, and the controller's stopper becomes
        :attr:`stopper`, replaced there by one that never stops an array."""
        own = getattr(trial, "stopping_criterion", None)
        if isinstance(own, Mapping) and own:
            self.criteria.update(own)
            trial.stopping_criterion = {}
        runner = getattr(controller, "__dict__", {}).get("_tune_controller", controller)
        current = getattr(runner, "__dict__", {}).get("_stopper")
        if current is None:
            if not self._unreachable:
                self._unreachable = True
                _log.warning(
                    "hfsweep cannot reach this Ray's experiment stopper (%s has no _stopper): "
                    "a callable or Stopper in RunConfig(stop=...) would stop whole arrays; a "
                    "dict of thresholds still applies per member",
                    type(runner).__name__,
                )
            return
        if isinstance(current, ArraysNeverStop):
            # taken over already, or restored so with the experiment's state (Tune saves its
            # controller's stopper there): the experiment's stopper is the one it holds
            self.stopper = current.inner
            return
        from ray.tune.stopper import NoopStopper

        self.stopper = None if isinstance(current, NoopStopper) else current
        runner._stopper = ArraysNeverStop(self.stopper)

    def judge(self, results: Sequence[tuple[str, Mapping[str, Any]]]) -> set[str]:
        """The members among ``results`` (member id, its result) that meet the criterion
        now: each judged on its own result; all of them once ``stop_all()`` says so."""
        met: set[str] = set()
        for member, result in results:
            hit = bool(self.stopper(member, dict(result))) if self.stopper is not None else False
            if hit or self._meets(result):
                met.add(member)
        if not self.all_stopped and self.stopper is not None and self.stopper.stop_all():
            self.all_stopped = True
            _log.info("the stopper's stop_all() is true: every member stops at its next result")
        if self.all_stopped:
            met = {member for member, _ in results}
        self._met = met
        return met

    def met(self, member: object) -> bool:
        """Whether the last :meth:`judge` found ``member`` meeting the criterion."""
        return member in self._met

    def _meets(self, result: Mapping[str, Any]) -> bool:
        """Tune's rule for a dict criterion: a value at least its threshold; a key the result
        lacks is warned about once and never stops (as Tune does)."""
        for key, threshold in self.criteria.items():
            if key not in result:
                if key not in self._missing:
                    self._missing.add(key)
                    _log.warning(
                        "stop criterion %r is not in a member's result (its keys: %s); it "
                        "never stops a member",
                        key,
                        sorted(result),
                    )
                continue
            value = result[key]
            if is_number(value) and is_number(threshold) and value >= threshold:
                return True
        return False

    def __getstate__(self) -> dict[str, Any]:
        # a pickled sweep never carries the user's stopper: every fit takes the criterion
        # over again (a restored one from the saved state and the controller's stopper)
        return dict(MemberStop().__dict__)


class ArraysNeverStop:
    """What the controller calls in place of the experiment's stopper (``inner``, ``None``
    for none): it never stops an array, the plugin judges each member with ``inner``
    (:class:`MemberStop`). Tune saves it with the experiment's state, ``inner`` with it, so a
    restored experiment finds the stopper there (with the state it had at the save)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __call__(self, trial_id: str, result: Mapping[str, Any]) -> bool:
        return False

    def stop_all(self) -> bool:
        return False
