"""Member-level results of a fused Tune sweep: Tune's ``ResultGrid`` has one row per array.

The member table is read from the state the fused searcher saves with the experiment (the newest
file, the one Tune restores from), or from a live :class:`~hfsweep.schedulers.tune.Fusion` in
this process. After ``Tuner.restore`` pass the ``ResultGrid`` or the experiment directory: they
hold the restored run's state in any process.
"""

from __future__ import annotations

import glob
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hfsweep._packed import UnsafeFileError, load_inert, unloaded_in

from ._tune_state import STATE_FORMAT

if TYPE_CHECKING:
    import pandas

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
_COLUMNS = ["member", "array", "state", "value", "evaluations", "epoch", "step", "error"]


@dataclass(frozen=True)
class TunedMember:
    """One member of a fused Tune sweep: id, array (its Tune trial id), state (``COMPLETE``,
    ``PRUNED``, ``FAIL``, or ``RUNNING``/``WAITING`` in an unfinished sweep), its final metric
    ``value``, the ``config`` it was trained with and its evaluations (``history``)."""

    id: str
    array: str | None
    state: str
    value: float | None
    config: dict[str, Any]
    history: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None


def sweep_state(source: Any) -> dict[str, Any]:
    """The saved state of a fused sweep: ``source`` is a ``ResultGrid``, an
    ``ExperimentAnalysis``, an experiment directory, a :class:`Fusion` or a
    :class:`FusedSearcher`.

    From a directory only plain data is loaded, so no code in the file runs (Tune pickles the
    searcher's state with objects of its own): the inner scheduler (``"decider"``) is ``None``
    there, and a state whose members hold anything but plain data is refused with an error
    naming the file."""
    live = getattr(source, "state", None)
    if live is not None and hasattr(live, "state_dict"):
        return dict(live.state_dict())
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
        if isinstance(value, Mapping) and value.get("format") == STATE_FORMAT:
            state = {**value, "decider": None}  # the inner scheduler: Tune's, not loaded
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
    """Every member of the sweep, in the order they were asked."""
    state = sweep_state(source)
    return [
        TunedMember(
            id=str(r["id"]),
            array=r["array"],
            state=str(r["state"]),
            value=r["value"],
            config=dict(r["config"]),
            history=[dict(h) for h in r["history"]],
            error=r["error"],
        )
        for r in state["members"].values()
    ]


def member_results(source: Any) -> pandas.DataFrame:
    """One row per member: ``member``, ``array`` (the Tune trial id of its array), ``state``,
    ``value`` (its last value of the sweep's metric), ``evaluations``, the last ``epoch`` and
    ``step``, ``error``, one ``config/<key>`` column per config key, and ``history`` (its
    evaluations, a list of dicts). See :func:`member_history` for one row per evaluation."""
    import pandas as pd

    rows = []
    for m in tuned_members(source):
        last = m.history[-1] if m.history else {}
        row: dict[str, Any] = {
            "member": m.id,
            "array": m.array,
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
    """One row per member evaluation (long format): ``member``, ``array``, ``state`` (how the
    member ended), ``training_iteration``, ``step``, ``epoch`` and the task's metrics."""
    import pandas as pd

    rows = [
        {"member": m.id, "array": m.array, "state": m.state, **h}
        for m in tuned_members(source)
        for h in m.history
    ]
    return pd.DataFrame(rows)


def best_member(source: Any, *, metric: str | None = None, mode: str | None = None) -> TunedMember:
    """The best completed member by its final value of ``metric`` (default: the sweep's
    metric and mode). Raises ``ValueError`` when no member completed."""
    state = sweep_state(source)
    metric = metric or state["metric"]
    mode = mode or state["mode"]
    if mode not in ("min", "max"):
        raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
    sign = 1.0 if mode == "max" else -1.0
    best: TunedMember | None = None
    best_score = -math.inf
    for m in tuned_members(source):
        if m.state != "COMPLETE" or not m.history:
            continue
        value = m.history[-1].get(metric)
        if not isinstance(value, int | float) or not math.isfinite(value):
            continue
        if best is None or sign * value > best_score:
            best, best_score = m, sign * value
    if best is None:
        counts: dict[str, int] = {}
        for m in tuned_members(source):
            counts[m.state] = counts.get(m.state, 0) + 1
        raise ValueError(
            f"no member completed with a finite {metric!r}; members by state: {counts}"
        )
    return best
