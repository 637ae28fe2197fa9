"""Three of the report's plots: the optimization history, the parameter importances and the
learning curves, each on a bare Agg figure (no pyplot), each skipped with a logged reason when it
has nothing to draw."""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ..core.status import Status
from ._histories import _Curve, _read_histories
from ._read import SweepRecord
from ._trials import _STATUS_COLORS, _best, _best_so_far, _completed, _status, _value

if TYPE_CHECKING:
    import optuna
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from optuna.trial import FrozenTrial

__all__: list[str] = []

_log = logging.getLogger("hfsweep.report")


def _new_figure(width: float, height: float) -> Figure:
    """A figure on its own Agg canvas: no pyplot, so no global backend or figure registry."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _legend_outside(ax: Axes) -> None:
    """The legend to the right of the plot, where it cannot hide points."""
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, borderaxespad=0.0)


def _save(fig: Figure, path: Path) -> Path:
    """Render ``fig`` as a PNG at ``path``."""
    fig.savefig(os.fspath(path), format="png", dpi=100)
    return path


# --------------------------------------------------------------------------------------------------
# optimization history


def _plot_history(
    trials: Sequence[FrozenTrial], sweep: SweepRecord, title: str, path: Path
) -> Path | None:
    """Each trial's value by trial number, marked by status, and the best completed value so far.

    Stopped trials carry their last reported value, as Optuna records its pruned ones; failed
    and still running trials have none and are marked along the bottom edge instead.
    """
    from matplotlib.ticker import MaxNLocator

    status = {t.number: Status.of_trial_state(t.state) for t in trials}
    complete = sorted(((t.number, v) for t, v in _completed(trials)))
    stopped = sorted(
        (t.number, v)
        for t in trials
        if status[t.number] is Status.STOPPED and (v := _value(t)) is not None
    )
    if not complete and not stopped:
        _log.info("history.png skipped: no trial has a value yet")
        return None
    failed = sorted(n for n, s in status.items() if s is Status.FAILED)
    running = sorted(n for n, s in status.items() if not s.final)

    fig = _new_figure(8.5, 4.5)
    ax = fig.subplots()
    if complete:
        ax.plot(
            [n for n, _ in complete], [v for _, v in complete], "o",
            color=_STATUS_COLORS[Status.COMPLETED],
            label=f"completed ({len(complete)})",
        )  # fmt: skip
    if stopped:
        ax.plot(
            [n for n, _ in stopped], [v for _, v in stopped], "v",
            color=_STATUS_COLORS[Status.STOPPED], alpha=0.8,
            label=f"stopped ({len(stopped)}, last reported value)",
        )  # fmt: skip
    # x in data coordinates, y in axes coordinates: a rug along the bottom edge.
    for numbers, marker, color, label in (
        (failed, "x", _STATUS_COLORS[Status.FAILED], f"failed ({len(failed)}, no value)"),
        (running, "|", _STATUS_COLORS[Status.RUNNING], f"running ({len(running)})"),
    ):
        if numbers:
            ax.plot(
                numbers, [0.03] * len(numbers), marker, color=color, ls="none",
                transform=ax.get_xaxis_transform(), label=label,
            )  # fmt: skip
    if complete:
        numbers = [n for n, _ in complete]
        best = _best_so_far([v for _, v in complete], sweep.mode)
        last = max(t.number for t in trials)
        ax.plot(
            [*numbers, last], [*best, best[-1]], "-", color="tab:green", drawstyle="steps-post",
            label=f"best so far ({sweep.mode}: {best[-1]:.4g})",
        )  # fmt: skip
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("trial number")
    ax.set_ylabel(sweep.metric)
    ax.set_title(f"{title}: optimization history ({len(trials)} trials)", fontsize=10)
    _legend_outside(ax)
    return _save(fig, path)


# --------------------------------------------------------------------------------------------------
# parameter importance


def _varying_params(done: Sequence[tuple[FrozenTrial, float]]) -> list[str]:
    """Parameters that take two or more different values among ``done``, in first-seen order."""
    seen: dict[str, set[str]] = {}
    for t, _ in done:
        for name, value in t.params.items():
            seen.setdefault(name, set()).add(repr(value))
    return [name for name, values in seen.items() if len(values) >= 2]


def _plot_importance(
    study: optuna.Study, sweep: SweepRecord, title: str, path: Path
) -> Path | None:
    """Bars of ``optuna.importance.get_param_importances`` over the parameters that vary.

    Needs two or more completed trials and two or more varying parameters: with fewer, Optuna's
    evaluator returns equal or trivial importances, which a plot would present as a finding.
    """
    import optuna

    done = _completed(study.get_trials(deepcopy=False))
    if len(done) < 2:
        _log.info("importance.png skipped: %d completed trial(s); it needs 2 or more", len(done))
        return None
    params = _varying_params(done)
    if len(params) < 2:
        _log.info(
            "importance.png skipped: %s among the completed trials; it needs 2 or more",
            f"only {params[0]!r} varies" if params else "no parameter varies",
        )
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            importances = optuna.importance.get_param_importances(study, params=params)
        except Exception as exc:
            _log.info("importance.png skipped: Optuna could not compute importances (%s)", exc)
            return None
    notes = [str(w.message) for w in caught]
    for note in notes:
        _log.info("importance: %s", note)
    if any("will be equal" in note for note in notes):
        _log.info("importance.png skipped: the trials do not tell the parameters apart")
        return None

    ranked = sorted(importances.items(), key=lambda kv: kv[1])  # least important at the bottom
    fig = _new_figure(7.0, 1.2 + 0.45 * len(ranked))
    ax = fig.subplots()
    bars = ax.barh([name for name, _ in ranked], [v for _, v in ranked], color="tab:blue")
    ax.bar_label(bars, labels=[f"{v:.2f}" for _, v in ranked], padding=3, fontsize=8)
    ax.set_xlim(0, max(1.0, max(v for _, v in ranked) * 1.15))
    ax.set_xlabel(f"importance for {sweep.metric} (normalised to sum to 1)")
    ax.set_title(f"{title}: hyperparameter importance ({len(done)} completed trials)", fontsize=10)
    return _save(fig, path)


# --------------------------------------------------------------------------------------------------
# learning curves


def _plot_curves(
    run: Path, trials: Sequence[FrozenTrial], sweep: SweepRecord, title: str, path: Path
) -> Path | None:
    """The metric against epoch (step for a budget in steps) for every trial with a history,
    colored by how the trial ended, the best completed trial drawn last in black."""
    from matplotlib.ticker import MaxNLocator

    curves = _read_histories(run, sweep.resource, sweep.metric)
    if not curves:
        _log.info(
            "curves.png skipped: no history in %s with %r and %r values",
            run / "histories",
            sweep.resource,
            sweep.metric,
        )
        return None
    by_number = {t.number: t for t in trials}
    best = _best(trials, sweep.mode)
    best_number = best[0].number if best is not None else None

    fig = _new_figure(8.5, 4.5)
    ax = fig.subplots()
    counts: dict[str, int] = {}
    best_curve: _Curve | None = None
    for curve in curves:
        if curve.number == best_number:
            best_curve = curve
        status = _status(by_number.get(curve.number))
        counts[status] = counts.get(status, 0) + 1
        ax.plot(
            curve.xs, curve.ys, "-", color=_STATUS_COLORS[status], alpha=0.6, linewidth=1.0,
            marker="o" if len(curve.xs) == 1 else None, markersize=3,
        )  # fmt: skip
    for status, color in _STATUS_COLORS.items():
        if status in counts:
            ax.plot([], [], "-", color=color, label=f"{status} ({counts[status]})")
    if best_curve is not None and best is not None:
        ax.plot(
            best_curve.xs, best_curve.ys, "-", color="black", linewidth=2.5,
            marker="o" if len(best_curve.xs) == 1 else None,
            label=f"best: trial {best_curve.number} ({best[1]:.4g})",
        )  # fmt: skip
    if all(x.is_integer() for c in curves for x in c.xs):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel(sweep.resource)
    ax.set_ylabel(sweep.metric)
    ax.set_title(f"{title}: learning curves ({len(curves)} trials)", fontsize=10)
    _legend_outside(ax)
    return _save(fig, path)
