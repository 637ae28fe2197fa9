"""The two objects Tune sees: a ``Searcher`` that packs members into arrays, and a
``TrialScheduler`` that applies an inner scheduler to each member.

Both share one :class:`~._tune_sweep.SweepState` (the sweep core's state, adapted). Tune checkpoints only its searcher, so
:class:`FusedSearcher` saves that state (``get_state``) and restores it in place
(``set_state``); :class:`FusedScheduler` reads the inner scheduler from it, so after
``Tuner.restore`` both see the restored state. The inner searcher is the wrapper's ``searcher``
attribute, which is how Tune finds, saves and restores it (as for ``ConcurrencyLimiter``).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from typing import Any

from ray.tune.schedulers import (
    AsyncHyperBandScheduler,
    FIFOScheduler,
    MedianStoppingRule,
)
from ray.tune.schedulers import TrialScheduler as TuneTrialScheduler
from ray.tune.search import Searcher
from ray.tune.search.sample import Domain

from ._base import TrialScheduler
from ._tune_format import FINISHED, META
from ._tune_hub import HubLink
from ._tune_joint import NativeDecider, TuneDecider
from ._tune_journal import Journal, restore_searcher
from ._tune_sweep import SweepState
from ._tune_trainable import refusal

__all__ = ["SUPPORTED_SCHEDULERS", "FusedScheduler", "FusedSearcher"]

_log = logging.getLogger("hfsweep.tune")

#: Tune schedulers that can decide per member (they only continue or stop trials)
SUPPORTED_SCHEDULERS = (
    "FIFOScheduler",
    "AsyncHyperBandScheduler (ASHAScheduler)",
    "MedianStoppingRule",
    "any hfsweep.schedulers.TrialScheduler",
)


class FusedSearcher(Searcher):
    """Packs member configs asked from ``searcher`` into arrays, one Tune trial per array.

    Built by :meth:`hfsweep.schedulers.tune.Fusion.searcher`. Every member's intermediate results
    and its end reach ``searcher`` under the member's own id (``<array trial id>-<n>``): a
    completed member with its last result, a pruned one with its result minus the metric (which
    OptunaSearch records as PRUNED), a failed one (non-finite loss, or a config the task rejects)
    with ``error=True``. The wrapper owns the budget (``Fusion(members=...)``) and ends the
    search when it is spent and every member is told, so Tune's ``num_samples`` must be ``-1``.
    """

    def __init__(self, searcher: Searcher, state: SweepState) -> None:
        if not isinstance(searcher, Searcher):
            raise TypeError(
                f"fusion.searcher(...) wraps a ray.tune.search.Searcher (OptunaSearch, "
                f"HyperOptSearch, ...), got {type(searcher).__name__}"
            )
        super().__init__(metric=searcher.metric, mode=searcher.mode)
        self.searcher = searcher
        self._state = state
        state.searcher = searcher
        state.configure(searcher.metric, searcher.mode)
        self._hub: HubLink | None = None
        #: the array trials Tune has started and not yet ended (the hub must outlive them)
        self._active: set[str] = set()
        self._warned = False
        #: a restored experiment: Tune's trials (id -> status as restored), the arrays as
        #: Tune's save recorded them, and whether the sweep went on from its own newer save and
        #: must still agree with those trials
        self._restored_trials: dict[str, str] = {}
        self._saved_arrays: dict[str, Any] | None = None
        self._reconcile = False

    def __setstate__(self, state: dict[str, Any]) -> None:
        # a searcher an earlier hfsweep pickled (an experiment's tuner.pkl) lacks the newer parts
        fresh: dict[str, Any] = {"_restored_trials": {}, "_saved_arrays": None, "_reconcile": False}
        self.__dict__.update({**fresh, **state})

    # ------------------------------------------------------------------ configuration
    def set_search_properties(
        self, metric: str | None, mode: str | None, config: dict[str, Any], **spec: Any
    ) -> bool:
        samples = spec.get("num_samples")
        if samples is not None and samples != -1 and samples < sys.maxsize:
            raise ValueError(
                f"tune.TuneConfig(num_samples={samples}) would cap the number of arrays; the "
                f"fused searcher owns the budget (Fusion(members={self._state.budget})): set "
                "num_samples=-1"
            )
        self._state.stop.set_criteria(spec.get("stop"))
        if self._state.stop.criteria and not self._state.has_scheduler:
            raise ValueError(
                f"tune.RunConfig(stop={self._state.stop.criteria!r}) applies to each member of "
                "a fused array, which needs the Fusion's scheduler: pass "
                "tune.TuneConfig(scheduler=fusion.scheduler()) (FIFO) or "
                "fusion.scheduler(ASHAScheduler(...))"
            )
        self._state.constants, self._state.sampled = _split_space(config, self._state)
        accepted = self.searcher.set_search_properties(metric, mode, config, **spec)
        self._state.configure(metric or self.searcher.metric, mode or self.searcher.mode)
        self._metric, self._mode = self._state.metric, self._state.mode
        return bool(accepted)

    # ------------------------------------------------------------------ Tune's calls
    def suggest(self, trial_id: str) -> dict[Any, Any] | None:
        self._settle()
        self._connect()
        config = self._state.suggest(trial_id)
        if isinstance(config, str):  # Tune's Searcher.FINISHED is a string, too
            if config == FINISHED:
                self._release()
                return Searcher.FINISHED  # type: ignore[return-value]
            return None
        if config is not None:
            self._active.add(trial_id)
        return config

    def on_trial_result(self, trial_id: str, result: dict[str, Any]) -> None:
        if not self._state.has_scheduler and not self._warned:
            self._warned = True
            _log.warning(
                "the fused sweep has no FusedScheduler: members train to their budget. Pass "
                "scheduler=fusion.scheduler(ASHAScheduler(...)) to stop members early (and "
                "fusion.scheduler() for RunConfig(stop=...) to apply to each member, and for "
                "Tuner.restore after a hard kill to keep every end already told)"
            )
        _raise_refusal(result)
        self._active.add(trial_id)
        self._settle()
        self._connect()
        self._state.on_result(trial_id, result)

    def on_trial_complete(
        self, trial_id: str, result: dict[str, Any] | None = None, error: bool = False
    ) -> None:
        self._settle()
        self._state.on_complete(trial_id, result, error)
        self._active.discard(trial_id)
        if self._state.finished:
            self._release()

    def set_max_concurrency(self, max_concurrent: int) -> bool:
        return False  # a ConcurrencyLimiter around this searcher limits arrays

    # ------------------------------------------------------------------ checkpoints
    def get_state(self) -> dict[str, Any]:
        """The plugin's whole state (budget, members, arrays, pools, inner scheduler), which
        Tune saves with the experiment: the source of truth on restore."""
        return self._state.state_dict()

    def set_state(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`get_state` returned (``Tuner.restore``). The sweep's own save
        in the experiment directory, if newer, is loaded once Tune names the directory
        (:meth:`_added`)."""
        self._state.load_state_dict(state)
        self._state.journal = None
        self._hub = None  # a restored run recreates the hub under the saved name
        self._saved_arrays = {str(a): dict(r) for a, r in state["arrays"].items()}

    def _added(self, trial: Any) -> None:
        """Tune added array trial ``trial`` (a new one, or one of a restored experiment, with
        its restored status). The first names the experiment's storage, where the sweep saves
        itself before its searcher hears anything (:mod:`._tune_journal`); in a restored
        experiment, a save there newer than Tune's is loaded, with the inner searcher as it
        was then, and the sweep later brought to agree with Tune's trials (:meth:`_settle`)."""
        self._restored_trials[trial.trial_id] = str(getattr(trial, "status", ""))
        if self._state.journal is not None:
            return
        journal = Journal.of_trial(trial)
        if journal is None:
            return
        self._state.journal = journal
        saved = journal.read() if self._saved_arrays is not None else None
        if saved is not None and int(saved["saves"]) > self._state.saves:
            _log.info(
                "restoring from the fused sweep's own save %s (newer than Tune's)", journal.path
            )
            restore_searcher(self.searcher, saved["searcher"])
            self._state.resume_from(saved)
            self._reconcile = True
        else:
            self._state.save_now()

    def _settle(self) -> None:
        """Once Tune added every trial of a restored experiment, bring the sweep loaded from
        its own save to agree with them (:meth:`~._tune_sweep.SweepState.reconcile`)."""
        if not self._reconcile:
            return
        self._reconcile = False
        self._state.reconcile(self._restored_trials, self._saved_arrays or {})
        self._state.save_now()

    def save(self, checkpoint_path: str) -> None:
        raise NotImplementedError(
            "a FusedSearcher is saved by Tune with its experiment (Tuner.restore); its state "
            "is get_state()"
        )

    def _connect(self) -> None:
        if self._hub is None:
            self._hub = HubLink(self._state.hub_name)
            self._state.post = self._hub.post

    def _track(self, trial_id: str) -> None:
        """Tune started (or restored) array trial ``trial_id``: it may need the hub."""
        self._active.add(trial_id)
        self._connect()

    def _release(self) -> None:
        """End the hub once the search is finished and no array trial Tune started is left
        (``Tuner.restore(resume_errored=True)`` can resume an array after the search
        finished; it ends the hub when that array ends). A later report recreates it."""
        if self._hub is None or self._active or not self._state.finished:
            return
        hub, self._hub = self._hub, None
        self._state.post = None
        try:
            hub.close()
        except Exception as exc:  # Ray already shut down: the actor went with it
            _log.debug("ending the hub %s: %s", hub.name, exc)
        else:
            _log.info("the search is finished: hub %s ended", hub.name)

    @property
    def state(self) -> SweepState:
        """The sweep's state: members, arrays, pools. After ``Tuner.restore`` the restored
        searcher (a new object) holds the current state; see ``Fusion.state``."""
        return self._state


class FusedScheduler(FIFOScheduler):
    """Applies ``scheduler`` to each member of every array report, jointly. An array's Tune
    trial ends once no member of it is left to train: its trainable ends by itself after a last
    report (whose checkpoint holds the weights of the members that completed last); an array
    this sweep no longer trains (a restarted errored trial) is stopped.

    Built by :meth:`hfsweep.schedulers.tune.Fusion.scheduler`. ``scheduler`` is one of Tune's
    ``FIFOScheduler``, ``AsyncHyperBandScheduler`` (``ASHAScheduler``) or ``MedianStoppingRule``, or
    an hfsweep :class:`~hfsweep.schedulers.TrialScheduler`; schedulers that pause trials or
    change them (``HyperBandScheduler``, ``PopulationBasedTraining``) cannot run per member and
    are refused. A member's result has ``training_iteration`` (its evaluations so far, one per
    epoch by default), ``epoch``, ``step``, ``time_total_s`` and ``time_this_iter_s`` (its own
    training time since it joined its array, and since its previous evaluation) and the task's
    metrics, so ``ASHAScheduler(time_attr="training_iteration", max_t=epochs)`` counts epochs
    and a time-based rule gives a member that joined late its full grace period.
    """

    _supports_buffered_results = False

    def __init__(self, scheduler: Any, searcher: FusedSearcher) -> None:
        super().__init__()
        state = searcher.state
        if isinstance(scheduler, TrialScheduler):
            if state.mode is not None and scheduler.mode != state.mode:
                raise ValueError(
                    f"the hfsweep scheduler has mode={scheduler.mode!r} but the sweep has "
                    f"mode={state.mode!r}"
                )
            state.decider = NativeDecider(scheduler)
        else:
            _check_supported(scheduler)
            state.decider = TuneDecider(scheduler)
        state.has_scheduler = True
        self._searcher = searcher
        self._state = state

    @property
    def inner(self) -> Any:
        """The scheduler applied to members (the restored one after ``Tuner.restore``)."""
        return self._state.decider.scheduler

    @property
    def metric(self) -> str | None:
        """The metric the inner scheduler decides on."""
        inner = self.inner
        if isinstance(inner, TuneTrialScheduler):
            return str(inner.metric) if inner.metric is not None else None
        return self._state.metric

    def set_search_properties(self, metric: str | None, mode: str | None, **spec: Any) -> bool:
        inner = self.inner
        if isinstance(inner, TuneTrialScheduler):
            return bool(inner.set_search_properties(metric, mode, **spec))
        if mode is not None and inner.mode != mode:
            raise ValueError(
                f"tune.TuneConfig(mode={mode!r}) but the hfsweep scheduler has mode={inner.mode!r}"
            )
        return True

    def on_trial_add(self, tune_controller: Any, trial: Any) -> None:
        # RunConfig(stop=...) is judged per member: Tune must never stop an array for it
        self._state.stop.take_over(tune_controller, trial)
        # Tuner.restore adds every trial of the experiment, ended ones too: only those that
        # will run need the hub
        self._searcher._added(trial)
        if getattr(trial, "status", None) not in ("TERMINATED", "ERROR"):
            self._searcher._track(trial.trial_id)

    def on_trial_result(self, tune_controller: Any, trial: Any, result: dict[str, Any]) -> str:
        _raise_refusal(result)
        self._searcher._settle()
        self._searcher._connect()
        alive = self._state.on_result(trial.trial_id, result)
        # an array whose last members ended at this report is left to end by itself: its
        # last report carries the checkpoint with their weights
        if alive or self._state.ends_by_itself(trial.trial_id, result):
            return str(TuneTrialScheduler.CONTINUE)
        return str(TuneTrialScheduler.STOP)

    def on_trial_complete(self, tune_controller: Any, trial: Any, result: dict[str, Any]) -> None:
        return None  # members are told by the searcher's on_trial_complete

    def on_trial_error(self, tune_controller: Any, trial: Any) -> None:
        return None  # a retry replays from the checkpoint; a final failure reaches the searcher

    def on_trial_remove(self, tune_controller: Any, trial: Any) -> None:
        return None

    def debug_string(self) -> str:
        counts = self._state.counts()
        told = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
        return f"Using FusedScheduler({self._state.decider.describe()}): members {told or 'none'}"

    def save(self, checkpoint_path: str) -> None:
        return None  # the state is saved with the searcher

    def restore(self, checkpoint_path: str) -> None:
        return None


def _raise_refusal(result: Mapping[str, Any]) -> None:
    """Stop the experiment with the refusal an array trainable sent instead of training
    (``tune.with_parameters(fusion.trainable, ...)``), before any array trains."""
    message = refusal(result)
    if message is not None:
        raise ValueError(message)


def _check_supported(scheduler: Any) -> None:
    ok = isinstance(scheduler, AsyncHyperBandScheduler | MedianStoppingRule) or (
        type(scheduler) is FIFOScheduler
    )
    if not ok:
        raise TypeError(
            f"fusion.scheduler() cannot apply {type(scheduler).__name__} to each member of an "
            "array: it pauses or changes trials, which a member of a fused array cannot do. "
            f"Supported: {', '.join(SUPPORTED_SCHEDULERS)}; for Hyperband use "
            "ASHAScheduler(brackets=...) or hfsweep.schedulers.HyperbandScheduler"
        )


def _split_space(space: Mapping[str, Any], state: SweepState) -> tuple[dict[str, Any], list[str]]:
    """``(constant values, sampled keys)`` of a flat param_space, checked against the task."""
    if META in space:
        raise ValueError(f"param_space key {META!r} is reserved for hfsweep's array description")
    known = set(state.task.known_keys)
    constants: dict[str, Any] = {}
    sampled: list[str] = []
    for key, value in space.items():
        if isinstance(value, Mapping) and not isinstance(value, Domain):
            raise ValueError(
                f"param_space[{key!r}] is a nested mapping; a fused sweep's param_space is flat, "
                f"one entry per config key of task {state.task.name!r}"
            )
        if key not in known:
            raise ValueError(
                f"param_space key {key!r} is not a config key of task {state.task.name!r}; its "
                f"keys are {sorted(known)}"
            )
        if isinstance(value, Domain):
            sampled.append(key)
        else:
            constants[key] = value
    return constants, sampled
