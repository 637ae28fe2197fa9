"""Member-level results of a fused Tune sweep: Tune's ``ResultGrid`` has one row per array.

The member table is read from the state the fused searcher saves with the experiment (the newest
file, the one Tune restores from), or from a live :class:`~hfsweep.schedulers.tune.Fusion` in
this process. After ``Tuner.restore`` pass the ``ResultGrid`` or the experiment directory: they
hold the restored run's state in any process.

A completed member's weights are in its array's newest Tune checkpoint (``weights/<member
id>.pt``, see ``_tune_trainable``); :func:`best_member` and :func:`tuned_members` give each
member that Tune ``Checkpoint`` and :meth:`TunedMember.state_dict` reads it.
"""

from __future__ import annotations

import glob
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hfsweep._checks import is_finite
from hfsweep.core.status import Status
from hfsweep.training.packed import UnsafeFileError, load_inert, unloaded_in

from ._tune_format import FORMAT_PREFIX, WEIGHTS_DIR, upgraded, weights_file

if TYPE_CHECKING:
    import pandas
    import torch
    from torch import Tensor

    from hfsweep.training.task import Task

__all__ = [
    "TunedMember",
    "best_member",
    "member_history",
    "member_results",
    "sweep_state",
    "tuned_members",
]

#: the file in a Tune experiment directory that holds the searcher wrappers' states
_STATE_GLOB = "search_gen_state-*.json"
_COLUMNS = ["member", "array", "status", "state", "value", "evaluations", "epoch", "step", "error"]


@dataclass(frozen=True)
class TunedMember:
    """One member of a fused Tune sweep: id, array (its Tune trial id), ``status`` (the sweep
    core's :class:`~hfsweep.core.status.Status`: ``completed``, ``stopped``, ``failed``, or
    ``running``/``waiting`` in an unfinished sweep; ``state`` is its Optuna name, ``COMPLETE``,
    ``PRUNED``, ``FAIL``...), its final metric ``value``, the ``config`` it was trained with and
    its evaluations (``history``).

    ``checkpoint`` is the Tune ``Checkpoint`` of its array that holds its final weights
    (``weights/<id>.pt`` in it), or ``None``: the member did not complete (pruned and failed
    members' weights are not kept), or it was read from a live ``Fusion``, which knows no Tune
    results (pass the ``ResultGrid`` or the experiment directory). Load the weights with
    :meth:`state_dict`. Two members are equal when everything but ``checkpoint`` is.
    """

    id: str
    array: str | None
    status: Status
    value: float | None
    config: dict[str, Any]
    history: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    checkpoint: Any = field(default=None, compare=False, repr=False)

    @property
    def state(self) -> str:
        """The Optuna name of :attr:`status` (``COMPLETE``, ``PRUNED``, ``FAIL``, ``RUNNING``,
        ``WAITING``), as trials.csv's ``state`` column says it."""
        return self.status.optuna_name

    def state_dict(self) -> dict[str, Tensor]:
        """The member's final weights, a ``state_dict`` of the task's model (on the CPU, in
        the sweep's dtype) that loads into a model of the task for the member's config
        (:meth:`load_model`). Read with ``torch.load(..., weights_only=True)``."""
        import torch

        if self.checkpoint is None:
            why = (
                "only completed members' weights are kept"
                if self.status is not Status.COMPLETED
                else "it was read without Tune's results (from a Fusion?): pass the ResultGrid "
                "or the experiment directory to best_member() / tuned_members()"
            )
            raise ValueError(f"member {self.id} ({self.status}) has no saved weights: {why}")
        with self.checkpoint.as_directory() as folder:
            path = Path(folder) / WEIGHTS_DIR / weights_file(self.id)
            return dict(torch.load(path, map_location="cpu", weights_only=True))

    def load_model(self, task: Task | str) -> torch.nn.Module:
        """A fresh model of ``task`` (the sweep's task, or its name) for this member's config,
        with the member's final weights loaded (:meth:`state_dict`)."""
        from hfsweep.config.entry import load_task

        loaded = load_task(task) if isinstance(task, str) else task
        model = loaded.build_model(loaded.resolve(self.config))
        model.load_state_dict(self.state_dict())
        return model


def sweep_state(source: Any) -> dict[str, Any]:
    """The saved state of a fused sweep: ``source`` is a ``ResultGrid``, an
    ``ExperimentAnalysis``, an experiment directory, a :class:`Fusion` or a
    :class:`FusedSearcher`.

    The state is in the current format (each member's ``"status"`` by value, ``"completed"``...),
    also when the file holds the previous one (Optuna names under ``"state"``); a format this
    hfsweep does not read is refused naming it. From a directory only plain data is loaded, so
    no code in the file runs (Tune pickles the searcher's state with objects of its own): the
    inner scheduler (``"decider"``) is ``None`` there, and a state whose members hold anything
    but plain data is refused with an error naming the file."""
    live = getattr(source, "state", None)
    if live is not None and hasattr(live, "state_dict"):
        return upgraded(live.state_dict())
    path = getattr(source, "experiment_path", source)
    if not isinstance(path, str | os.PathLike):
        raise TypeError(
            "member_results() takes a ResultGrid, an ExperimentAnalysis, an experiment "
            f"directory, a Fusion or a FusedSearcher; got {type(source).__name__}"
        )
    folder = os.fspath(path)
    if "://" in folder:
        raise ValueError(
            f"{folder}: member_results() reads a local experiment directory; download the "
            "experiment from its storage first"
        )
    # the newest, as Tune picks it on restore: by name (the session's timestamp); not by
    # modification time, which syncing the experiment directory rewrites
    files = sorted(glob.glob(os.path.join(folder, _STATE_GLOB)))
    if not files:
        raise FileNotFoundError(
            f"{folder}: no {_STATE_GLOB} here; is it the directory of a Tune experiment "
            "(ResultGrid.experiment_path)?"
        )
    # Tune pickles its searchers' states (with objects of its own, some by value), and
    # unpickling may run code: only plain data is loaded here, the rest left as stand-ins
    saved = load_inert(files[-1])
    for value in saved.values() if isinstance(saved, Mapping) else ():
        form = value.get("format") if isinstance(value, Mapping) else None
        if isinstance(form, str) and form.startswith(FORMAT_PREFIX):
            assert isinstance(value, Mapping)
            try:
                state = {**upgraded(value), "decider": None}  # the scheduler: Tune's, not loaded
            except ValueError as exc:
                raise ValueError(f"{files[-1]}: {exc}") from None
            unloaded = unloaded_in(state)
            if unloaded is not None:
                raise UnsafeFileError(
                    f"{files[-1]}: not loaded: the sweep's state needs {unloaded}, which "
                    "hfsweep does not load from a file (plain data only; anything else could "
                    "run code from it). If you trust the file and the type is yours (a config "
                    "value), allow it with torch.serialization.add_safe_globals([...])."
                )
            return state
    raise ValueError(
        f"{files[-1]}: the experiment's searcher is not a fused sweep's (no hfsweep state); "
        "was it run with search_alg=fusion.searcher(...)?"
    )


def tuned_members(source: Any) -> list[TunedMember]:
    """Every member of the sweep, in the order they were asked, each completed one with the
    Tune checkpoint that holds its weights (``None`` for a live ``Fusion`` source)."""
    return _members(source, checkpoints=True)


def _members(source: Any, *, checkpoints: bool) -> list[TunedMember]:
    state = sweep_state(source)
    arrays = _array_checkpoints(source) if checkpoints else {}
    out = []
    for r in state["members"].values():
        member_id, ckpt = str(r["id"]), arrays.get(str(r["array"]))
        if ckpt is not None and not _holds(ckpt, member_id):
            ckpt = None
        if ckpt is None and checkpoints and Status.parse(r["status"]) is Status.COMPLETED:
            ckpt = _earlier_checkpoint(source, member_id)
        out.append(
            TunedMember(
                id=member_id,
                array=r["array"],
                status=Status.parse(r["status"]),
                value=r["value"],
                config=dict(r["config"]),
                history=[dict(h) for h in r["history"]],
                error=r["error"],
                checkpoint=ckpt,
            )
        )
    return out


def _array_checkpoints(source: Any) -> dict[str, Any]:
    """The newest Tune checkpoint of each array trial, by trial id: from a ``ResultGrid``'s
    results, an ``ExperimentAnalysis``'s trials, or the experiment directory (read with
    ``ExperimentAnalysis``). Empty for a live ``Fusion`` or ``FusedSearcher``."""
    live = getattr(source, "state", None)
    if live is not None and hasattr(live, "state_dict"):
        return {}
    from ray.tune import ExperimentAnalysis, ResultGrid

    if isinstance(source, ResultGrid):
        found = {}
        for i in range(len(source)):
            result = source[i]
            trial_id = (result.metrics or {}).get("trial_id")
            if trial_id is not None and result.checkpoint is not None:
                found[str(trial_id)] = result.checkpoint
        return found
    if not isinstance(source, ExperimentAnalysis):
        source = ExperimentAnalysis(os.fspath(source))
    return {t.trial_id: t.checkpoint for t in source.trials if t.checkpoint is not None}


def _earlier_checkpoint(source: Any, member_id: str) -> Any:
    """The newest Tune checkpoint in the experiment directory that holds ``member_id``'s
    weights, when its array's newest one does not: after a hard kill of the driver, an array
    that Tune had not saved (or a member its replay does not train again) kept its weights only
    in the checkpoints it wrote before the kill. ``None`` for a live source or none found."""
    live = getattr(source, "state", None)
    if live is not None and hasattr(live, "state_dict"):
        return None
    folder = os.fspath(getattr(source, "experiment_path", source))
    name = glob.escape(weights_file(member_id))
    found = glob.glob(os.path.join(glob.escape(folder), "*", "checkpoint_*", WEIGHTS_DIR, name))
    if not found:
        return None
    from ray.tune import Checkpoint

    newest = max(found, key=lambda p: (os.path.basename(os.path.dirname(os.path.dirname(p))), p))
    return Checkpoint.from_directory(os.path.dirname(os.path.dirname(newest)))


def _holds(checkpoint: Any, member_id: str) -> bool:
    """Whether a (local) Tune checkpoint holds ``member_id``'s weights."""
    return os.path.isfile(os.path.join(checkpoint.path, WEIGHTS_DIR, weights_file(member_id)))


def member_results(source: Any) -> pandas.DataFrame:
    """One row per member: ``member``, ``array`` (the Tune trial id of its array), ``status``
    (``completed``, ``stopped``, ``failed``...: the words of ``hfsweep run``'s ``state.json``),
    ``state`` (its Optuna name, as in trials.csv), ``value`` (its last value of the sweep's metric), ``evaluations``, the last ``epoch`` and
    ``step``, ``error``, one ``config/<key>`` column per config key, and ``history`` (its
    evaluations, a list of dicts). See :func:`member_history` for one row per evaluation."""
    import pandas as pd

    rows = []
    for m in _members(source, checkpoints=False):
        last = m.history[-1] if m.history else {}
        row: dict[str, Any] = {
            "member": m.id,
            "array": m.array,
            "status": m.status.value,
            "state": m.state,
            "value": m.value,
            "evaluations": len(m.history),
            "epoch": last.get("epoch"),
            "step": last.get("step"),
            "error": m.error,
        }
        row.update({f"config/{k}": v for k, v in m.config.items()})
        row["history"] = m.history
        rows.append(row)
    return pd.DataFrame(rows, columns=None if rows else [*_COLUMNS, "history"])


def member_history(source: Any) -> pandas.DataFrame:
    """One row per member evaluation (long format): ``member``, ``array``, ``status`` and
    ``state`` (how the member ended, as in :func:`member_results`), ``training_iteration``,
    ``step``, ``epoch`` and the task's metrics."""
    import pandas as pd

    rows = [
        {"member": m.id, "array": m.array, "status": m.status.value, "state": m.state, **h}
        for m in _members(source, checkpoints=False)
        for h in m.history
    ]
    return pd.DataFrame(rows)


def best_member(source: Any, *, metric: str | None = None, mode: str | None = None) -> TunedMember:
    """The best completed member by its final value of ``metric`` (default: the sweep's
    metric and mode), with the Tune checkpoint that holds its weights::

        best = best_member(results)
        model = best.load_model(task)        # a fresh model of the task with its weights
        weights = best.state_dict()          # or just the weights

    Raises ``ValueError`` when no member completed."""
    state = sweep_state(source)
    metric = metric or state["metric"]
    mode = mode or state["mode"]
    if mode not in ("min", "max"):
        raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
    sign = 1.0 if mode == "max" else -1.0
    best: TunedMember | None = None
    best_score = -math.inf
    members = tuned_members(source)
    for m in members:
        if m.status is not Status.COMPLETED or not m.history:
            continue
        value = m.history[-1].get(metric)
        if not is_finite(value):
            continue
        if best is None or sign * value > best_score:
            best, best_score = m, sign * value
    if best is None:
        counts: dict[str, int] = {}
        for m in members:
            counts[m.status.value] = counts.get(m.status.value, 0) + 1
        raise ValueError(
            f"no member completed with a finite {metric!r}; members by status: {counts}"
        )
    return best
