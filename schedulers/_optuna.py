"""Any Optuna pruner as a :class:`TrialScheduler` (optuna is imported only when one is built)."""

from __future__ import annotations

import importlib
import inspect
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from hfsweep._status import Status

from ._base import Decision, Report, TrialScheduler, check_positive

if TYPE_CHECKING:
    import optuna

__all__ = ["PRUNER_NAMES", "OptunaPruner", "pruner_options"]

#: Optuna's pruners by the names :class:`OptunaPruner` and ``make_scheduler("optuna:<name>")``
#: accept.
_PRUNER_CLASSES = {
    "hyperband": "HyperbandPruner",
    "median": "MedianPruner",
    "nop": "NopPruner",
    "patient": "PatientPruner",
    "percentile": "PercentilePruner",
    "successive_halving": "SuccessiveHalvingPruner",
    "threshold": "ThresholdPruner",
    "wilcoxon": "WilcoxonPruner",
}
PRUNER_NAMES = tuple(_PRUNER_CLASSES)

#: Pruner arguments the adapter sets itself, from its own arguments.
_SET_BY_ADAPTER = {"hyperband": ("max_resource",)}


def _pruner_class(name: str) -> type[optuna.pruners.BasePruner]:
    if name not in _PRUNER_CLASSES:
        raise ValueError(f"unknown Optuna pruner {name!r}; valid names: {', '.join(PRUNER_NAMES)}")
    module = importlib.import_module("optuna.pruners")
    cls: type[optuna.pruners.BasePruner] = getattr(module, _PRUNER_CLASSES[name])
    return cls


def pruner_options(name: str) -> dict[str, bool]:
    """The options Optuna pruner ``name`` takes, each mapped to whether it is required."""
    params = inspect.signature(_pruner_class(name)).parameters
    return {
        p.name: p.default is inspect.Parameter.empty
        for p in params.values()
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        and p.name not in _SET_BY_ADAPTER.get(name, ())
    }


def _build_pruner(name: str, options: dict[str, Any], steps: int) -> optuna.pruners.BasePruner:
    valid = pruner_options(name)
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(
            f"unknown option(s) {', '.join(map(repr, unknown))} for Optuna pruner {name!r}; "
            f"valid options: {', '.join(valid) or '(none)'}"
        )
    missing = [k for k, required in valid.items() if required and k not in options]
    if missing:
        raise ValueError(
            f"Optuna pruner {name!r} needs option(s) {', '.join(map(repr, missing))}; "
            f"valid options: {', '.join(valid)}"
        )
    options = dict(options)
    if name == "hyperband":
        options["max_resource"] = steps
    if name == "patient" and isinstance(options.get("wrapped_pruner"), str):
        options["wrapped_pruner"] = _build_pruner(options["wrapped_pruner"], {}, steps)
    try:
        return _pruner_class(name)(**options)
    except (TypeError, ValueError) as e:
        raise ValueError(f"Optuna pruner {name!r} rejected options {options!r}: {e}") from e


class OptunaPruner(TrialScheduler):
    """An Optuna pruner deciding for hfsweep's trials.

    Optuna's pruners read a trial's intermediate values from the study, so each hfsweep trial
    needs its Optuna trial: the engine calls :meth:`attach` when it asks the study for the
    trial. The study must use this adapter's pruner (``optuna.create_study(...,
    pruner=scheduler.pruner)``, or ``optuna.load_study(..., pruner=scheduler.pruner)`` on
    resume) and its direction must match ``mode``; :meth:`attach` checks both. Telling the
    study how a trial ended stays the engine's job: Optuna's median and percentile pruners
    compare with *completed* trials, so nothing is pruned until some are told complete.

    :meth:`decide` first reports every value of the call (``trial.report(value, step)``), then
    asks ``trial.should_prune()`` for each trial, best value first (ties by trial id). Optuna's
    pruners decide one trial at a time and successive halving records a trial's rung value
    when it is asked; asking best-first makes the answer independent of the order of the
    reports and never promotes a member of the call over a better one of the same call.

    **Steps.** Optuna wants integer steps: ``step = floor(resource * steps_per_resource + 0.5)``
    (with the default 1 and resources in epochs: the epoch, rounded half up). If two reports
    of one trial map to the same step, only the first is reported (Optuna keeps only one
    value per step); choose ``steps_per_resource`` so evaluations land on distinct steps (e.g.
    4 for evaluations every quarter epoch). ``nan`` is reported as the worst value, ``-inf``
    when maximising and ``+inf`` when minimising, which every Optuna pruner but Wilcoxon (it
    rejects infinities) ranks below everything. A report at or beyond ``max_resource`` is never
    stopped, whatever the pruner says.

    Args:
        pruner: an Optuna pruner, or one of :data:`PRUNER_NAMES` (``"median"``,
            ``"percentile"``, ``"successive_halving"``, ``"hyperband"``, ``"threshold"``,
            ``"patient"``, ``"wilcoxon"``, ``"nop"``) built with ``**options``. ``"hyperband"``
            gets ``max_resource`` in steps from this adapter; ``"patient"`` takes
            ``wrapped_pruner`` as a pruner or a name.
        mode: ``"max"`` or ``"min"``; must match the study's direction.
        max_resource: a trial's full budget (epochs by default).
        steps_per_resource: Optuna steps per unit of resource.
        **options: the named pruner's constructor arguments (none with a pruner instance).
    """

    def __init__(
        self,
        pruner: optuna.pruners.BasePruner | str,
        *,
        mode: str = "max",
        max_resource: float,
        steps_per_resource: float = 1,
        **options: Any,
    ) -> None:
        super().__init__(mode=mode, max_resource=max_resource)
        self._steps_per_resource = check_positive("steps_per_resource", steps_per_resource)
        if isinstance(pruner, str):
            self._pruner = _build_pruner(pruner, options, self.step_of(self._max_resource))
        else:
            from optuna.pruners import BasePruner

            if not isinstance(pruner, BasePruner):
                raise TypeError(
                    f"pruner must be an optuna.pruners.BasePruner or one of "
                    f"{', '.join(PRUNER_NAMES)}, got {pruner!r}"
                )
            if options:
                raise ValueError(
                    f"options {sorted(options)} are for building a pruner by name; "
                    f"{type(pruner).__name__} is already built"
                )
            self._pruner = pruner
        self._trials: dict[str, optuna.Trial] = {}
        self._numbers: dict[str, int] = {}
        self._last_step: dict[str, int] = {}

    @property
    def pruner(self) -> optuna.pruners.BasePruner:
        """The Optuna pruner; the study of every attached trial must use this very object."""
        return self._pruner

    def step_of(self, resource: float) -> int:
        """The Optuna step a report at ``resource`` is reported at."""
        return math.floor(resource * self._steps_per_resource + 0.5)

    def attach(self, trial_id: str, trial: optuna.Trial) -> None:
        """Pair hfsweep's ``trial_id`` with its Optuna ``trial`` (before its first report)."""
        import optuna

        if not isinstance(trial, optuna.Trial):
            raise TypeError(f"attach() takes an optuna.Trial, got {trial!r}")
        study = trial.study
        if study.pruner is not self._pruner:
            raise ValueError(
                f"trial {trial_id!r}'s study prunes with {study.pruner!r}, not with this "
                f"scheduler's pruner: create the study with pruner=scheduler.pruner"
            )
        if len(study.directions) != 1:
            raise ValueError("Optuna pruners support single-objective studies only")
        want = "maximize" if self._mode == "max" else "minimize"
        if study.direction.name.lower() != want:
            raise ValueError(
                f"mode={self._mode!r} needs a study that will {want}, got "
                f"{study.direction.name.lower()}"
            )
        if trial_id in self._ended:
            raise ValueError(f"trial {trial_id!r} already ended ({self._ended[trial_id]})")
        known = self._numbers.get(trial_id)
        if known is not None and known != trial.number:
            raise ValueError(
                f"trial {trial_id!r} is Optuna trial {known}, not {trial.number} "
                f"(it was attached before)"
            )
        self._trials[trial_id] = trial
        self._numbers[trial_id] = trial.number

    def decide(self, reports: Sequence[Report]) -> dict[str, Decision]:
        """Report every value to its Optuna trial, then ask each whether to prune."""
        reports = self._check_reports(reports)
        missing = [r.trial for r in reports if r.trial not in self._trials]
        if missing:
            raise ValueError(
                f"trial(s) {', '.join(map(repr, missing))} have no Optuna trial: "
                f"call attach(trial_id, trial) first"
            )
        worst = -math.inf if self._mode == "max" else math.inf
        for r in reports:
            step = self.step_of(r.resource)
            last = self._last_step.get(r.trial)
            if last is None or step > last:
                value = worst if math.isnan(r.value) else r.value
                self._trials[r.trial].report(value, step)
                self._last_step[r.trial] = step
        decisions: dict[str, Decision] = {}
        for r in sorted(reports, key=lambda r: (-self._score(r.value), r.trial)):
            prune = self._trials[r.trial].should_prune()
            stop = prune and not self._at_budget(r.resource)
            decisions[r.trial] = Decision.STOP if stop else Decision.CONTINUE
        return {r.trial: decisions[r.trial] for r in reports}

    def replay(self, reports: Sequence[Report]) -> None:
        """Note the steps :meth:`decide` reported ``reports`` at; the values and the pruner's
        record are in the study already (no trial need be attached)."""
        for r in self._check_reports(reports):
            step = self.step_of(r.resource)
            self._last_step[r.trial] = max(step, self._last_step.get(r.trial, step))

    def on_trial_end(self, trial: str, status: Status | str) -> None:
        """Forget ``trial``'s Optuna trial; the study keeps its record."""
        super().on_trial_end(trial, status)
        self._trials.pop(trial, None)
        self._numbers.pop(trial, None)
        self._last_step.pop(trial, None)

    def _config(self) -> dict[str, Any]:
        return {
            **super()._config(),
            "pruner": type(self._pruner).__name__,
            "steps_per_resource": self._steps_per_resource,
        }

    def state_dict(self) -> dict[str, Any]:
        """Config, ended trials, and the running trials' Optuna numbers and last steps.

        The pruners' own record lives in the study; after :meth:`load_state_dict` the engine
        attaches the running trials again (to the same Optuna trial numbers).
        """
        state = super().state_dict()
        state["trials"] = dict(self._numbers)
        state["last_step"] = dict(self._last_step)
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict`; attach the running trials again before deciding."""
        super().load_state_dict(state)
        self._numbers = {str(k): int(v) for k, v in state["trials"].items()}
        self._last_step = {str(k): int(v) for k, v in state["last_step"].items()}
        self._trials = {}
