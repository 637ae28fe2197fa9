"""The public face of experiment tracking: :class:`Callback`, the hooks the sweep calls on the
driver, and the records they get (:class:`SweepInfo`, :class:`TrialInfo`).

A callback sees every trial (one member of a fused array) of the sweep: once when it starts
training in an array, at each of its evaluations, and once when it ends. The built-in trackers
(MLflow, TensorBoard, Weights & Biases) are callbacks; a callback of your own subclasses
:class:`Callback` and overrides the hooks it needs, every one of which does nothing by default.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Callback", "SweepInfo", "TrialInfo"]


@dataclass(frozen=True)
class SweepInfo:
    """The sweep a callback serves: its Optuna ``study_name``, its ``run_dir``, the ``metric``
    it optimizes and the ``mode`` (``"max"`` or ``"min"``), and whether it was ``resumed`` (a
    tracker then reopens the runs of trials that were still training)."""

    study_name: str
    run_dir: Path
    metric: str
    mode: str
    resumed: bool = False


@dataclass(frozen=True)
class TrialInfo:
    """One trial: its ``number`` in the study, the ``array`` it trains in (``None`` for a trial
    that ended before it reached one), the ``params`` its searcher sampled and its whole
    ``config`` (the fixed values, the sampled ones and the budget: what its task trained
    with)."""

    number: int
    array: int | None
    params: Mapping[str, Any] = field(default_factory=dict)
    config: Mapping[str, Any] = field(default_factory=dict)


class Callback:
    """Hooks a sweep calls on its driver, in this order: :meth:`on_sweep_start`, then per trial
    :meth:`on_trial_start`, :meth:`on_evaluation` at each evaluation and :meth:`on_trial_end`,
    and :meth:`on_sweep_end` last (also when the sweep stops on an error).

    Pass instances to ``hs.sweep(..., callbacks=[...])``. Hooks run under the sweep's lock, so
    they see one event at a time, and should be quick. A hook that raises does not stop the
    sweep: the callback gets one warning (:class:`~hfsweep.tracking.TrackingWarning`) and
    receives nothing more in this run, while the sweep and the other callbacks go on.

    Each event reaches a callback at most once per trial: after a resume, evaluations already
    decided before the interruption and trials that had ended are not announced again (a trial
    still training gets :meth:`on_trial_start` again, with ``resumed`` set in the
    :class:`SweepInfo`).
    """

    #: the name warnings use for this callback (its class name unless set)
    name: str = ""

    def on_sweep_start(self, sweep: SweepInfo) -> None:
        """The sweep starts (or resumes) in ``sweep.run_dir``."""

    def on_trial_start(self, trial: TrialInfo) -> None:
        """``trial`` starts training in array ``trial.array`` (or resumes there)."""

    def on_evaluation(
        self, trial: TrialInfo, step: int, epoch: float, metrics: Mapping[str, float]
    ) -> None:
        """``trial`` was evaluated after ``step`` optimizer steps (``epoch`` epochs, fractional
        between epoch ends): ``metrics`` are what its task reports (``val_accuracy``...)."""

    def on_trial_end(
        self, trial: TrialInfo, status: str, value: float | None, error: str | None
    ) -> None:
        """``trial`` ended. ``status`` is a :class:`hfsweep.core.status.Status` (a ``str``:
        ``"completed"``, ``"stopped"`` or ``"failed"``), ``value`` its last value of the
        sweep's metric (``None`` for a failed trial), ``error`` why it failed."""

    def on_sweep_end(self) -> None:
        """The sweep ends (or stops); release what the callback holds. Trials still training
        (a sweep stopped by an error, resumable) have had no :meth:`on_trial_end`."""

    def label(self) -> str:
        """What warnings call this callback: :attr:`name`, else its class name."""
        return self.name or type(self).__name__
