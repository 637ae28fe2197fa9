"""Experiment tracking: every trial of a sweep sent to MLflow, TensorBoard, Weights & Biases or
a callback of your own.

A sweep file's ``tracking:`` lists trackers, by name or with options::

    tracking:
      - mlflow                           # sqlite:///<run dir>/mlflow.db
      - tensorboard: {log_dir: tb}       # tb/trial-<number>/ per trial
      - wandb: {mode: offline}           # <run dir>/wandb/offline-run-*

and ``hs.sweep(..., callbacks=[...])`` adds :class:`Callback` instances. Each trial (one member
of a fused array) is one run in each tracker: its config as params, every evaluation's metrics
at its step, and at its end its :class:`~hfsweep.core.status.Status` and final value, with the
array it trained in, its number and the study recorded as tags. Trackers run on the driver,
which hears every evaluation and end from any executor (local or Ray). Their libraries are
optional extras (``pip install "hfsweep[mlflow]"``, ``[tensorboard]``, ``[wandb]``), imported
only when a sweep uses them. A tracker that raises while the sweep runs gets one
:class:`TrackingWarning` and is dropped for the rest of the run; the sweep goes on.

The sweep file's ``tracking:`` section is checked against :data:`TRACKERS` (each tracker's
options, :class:`Option`; :func:`missing` and :func:`import_problem` say what a tracker
lacks), and the sweep hands its events to one :class:`Tracking`, which calls every tracker
and callback.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ._base import Callback, SweepInfo, TrialInfo
from ._dispatch import Tracking, TrackingWarning
from ._registry import TRACKERS, Option, import_problem, missing

__all__ = [
    "TRACKERS",
    "TRACKER_NAMES",
    "Callback",
    "Option",
    "SweepInfo",
    "Tracking",
    "TrackingWarning",
    "TrialInfo",
    "import_problem",
    "make_tracker",
    "missing",
]

#: the trackers ``tracking:`` may name
TRACKER_NAMES = tuple(TRACKERS)


def make_tracker(name: str, options: Mapping[str, Any] | None = None) -> Callback:
    """The built-in tracker ``name`` (one of :data:`TRACKER_NAMES`) with ``options`` (those
    its ``tracking:`` entry takes). Raises ``ValueError`` for an unknown name."""
    opts = dict(options or {})
    if name == "mlflow":
        from ._mlflow import MLflowTracker

        return MLflowTracker(**opts)
    if name == "tensorboard":
        from ._tensorboard import TensorBoardTracker

        return TensorBoardTracker(**opts)
    if name == "wandb":
        from ._wandb import WandbTracker

        return WandbTracker(**opts)
    raise ValueError(f"unknown tracker {name!r}; valid: {', '.join(TRACKER_NAMES)}")
