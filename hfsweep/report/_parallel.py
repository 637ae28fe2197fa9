"""The parallel-coordinates plot: one axis per varying parameter, spanning its distribution."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._checks import is_number
from ._plots import _new_figure, _save
from ._read import SweepRecord
from ._trials import _best, _completed

if TYPE_CHECKING:
    from optuna.distributions import BaseDistribution
    from optuna.trial import FrozenTrial

__all__: list[str] = []

_log = logging.getLogger("hfsweep.report")


@dataclass(frozen=True)
class _Axis:
    """One vertical axis of the parallel-coordinates plot: where a value sits in [0, 1].

    Numeric axes span the distribution's ``[low, high]`` (log-spaced when the distribution is
    log), so positions compare across reports of the same sweep; categorical axes space their
    ``choices`` evenly. A single-valued range sits at 0.5.
    """

    name: str
    low: float = 0.0
    high: float = 1.0
    log: bool = False
    choices: tuple[Any, ...] | None = None

    def position(self, value: Any) -> float:
        """``value`` on this axis in [0, 1]; nan when it is missing or not on the axis."""
        if self.choices is not None:
            index = next((i for i, c in enumerate(self.choices) if c == value), None)
            if index is None:
                return math.nan
            return 0.5 if len(self.choices) == 1 else index / (len(self.choices) - 1)
        if not is_number(value):
            return math.nan
        low, high, v = self.low, self.high, float(value)
        if self.log:
            if v <= 0 or low <= 0:
                return math.nan
            low, high, v = math.log(low), math.log(high), math.log(v)
        return 0.5 if high == low else (v - low) / (high - low)

    def ticks(self) -> list[tuple[float, str]]:
        """``(position, label)`` pairs: every choice, or the ends and middle of a range."""
        if self.choices is not None:
            return [(self.position(c), str(c)) for c in self.choices]
        if self.high == self.low:
            return [(0.5, f"{self.low:.3g}")]
        middle = math.sqrt(self.low * self.high) if self.log else (self.low + self.high) / 2
        return [(self.position(v), f"{v:.3g}") for v in (self.low, middle, self.high)]


def _axis_of(name: str, dists: Sequence[BaseDistribution], values: Sequence[Any]) -> _Axis:
    """One axis for a parameter, spanning every distribution it was sampled from.

    Trials of a sweep normally share one distribution per parameter; should they differ (a search
    space edited between runs on one study), numeric ranges are joined, log only if all were log,
    and categorical choices united. Mixed kinds fall back to the observed values as categories.
    """
    from optuna.distributions import (
        CategoricalDistribution,
        FloatDistribution,
        IntDistribution,
    )

    if all(isinstance(d, CategoricalDistribution) for d in dists):
        choices: list[Any] = []
        for d in dists:
            assert isinstance(d, CategoricalDistribution)
            choices.extend(c for c in d.choices if c not in choices)
        return _Axis(name, choices=tuple(choices))
    numeric = [d for d in dists if isinstance(d, (FloatDistribution, IntDistribution))]
    if len(numeric) == len(dists):
        return _Axis(
            name,
            low=float(min(d.low for d in numeric)),
            high=float(max(d.high for d in numeric)),
            log=all(d.log for d in numeric),
        )
    distinct: list[Any] = []
    for v in values:
        if v not in distinct:
            distinct.append(v)
    return _Axis(name, choices=tuple(sorted(distinct, key=str)))


def _axes(done: Sequence[tuple[FrozenTrial, float]]) -> list[_Axis]:
    """The axes of the parameters whose distributions let them vary, in first-seen order."""
    dists: dict[str, list[BaseDistribution]] = {}
    values: dict[str, list[Any]] = {}
    for t, _ in done:
        for name, dist in t.distributions.items():
            dists.setdefault(name, []).append(dist)
            values.setdefault(name, []).append(t.params[name])
    return [
        _axis_of(name, ds, values[name])
        for name, ds in dists.items()
        if not all(d.single() for d in ds)
    ]


def _plot_parallel(
    trials: Sequence[FrozenTrial], sweep: SweepRecord, title: str, path: Path
) -> Path | None:
    """One line per completed trial through its parameters' axes and its value, colored by value.

    The value is the rightmost axis, scaled to the range observed; the color map runs so that
    better trials are always the bright end (reversed for mode min), and they are drawn last, on
    top.
    """
    import matplotlib as mpl
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize

    done = _completed(trials)
    if not done:
        _log.info("parallel.png skipped: no completed trial")
        return None
    axes = _axes(done)
    if not axes:
        _log.info("parallel.png skipped: the completed trials have no varying parameter")
        return None
    values = [v for _, v in done]
    vmin, vmax = min(values), max(values)
    value_axis = _Axis(sweep.metric, low=vmin, high=vmax)
    all_axes = [*axes, value_axis]
    cmap = mpl.colormaps["viridis" if sweep.mode == "max" else "viridis_r"]
    norm = Normalize(vmin=vmin, vmax=vmax if vmax > vmin else vmin + 1.0)
    best = _best(trials, sweep.mode)
    best_number = best[0].number if best is not None else None

    fig = _new_figure(max(6.0, 1.5 * len(all_axes) + 2.0), 4.8)
    ax = fig.subplots()
    xs = list(range(len(all_axes)))
    worst_first = sorted(done, key=lambda tv: tv[1], reverse=sweep.mode == "min")
    for t, value in worst_first:
        ys = [a.position(t.params.get(a.name)) for a in axes] + [value_axis.position(value)]
        is_best = t.number == best_number
        ax.plot(
            xs, ys, "-", color=cmap(norm(value)), alpha=1.0 if is_best else 0.7,
            linewidth=2.5 if is_best else 1.0, marker="o", markersize=3,
        )  # fmt: skip
    for x, a in enumerate(all_axes):
        ax.axvline(x, color="black", linewidth=1.0, zorder=0)
        for y, label in a.ticks():
            ax.plot([x - 0.03, x], [y, y], color="black", linewidth=1.0)
            ax.text(
                x - 0.05, y, label, ha="right", va="center", fontsize=7, zorder=3,
                bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 1.0},
            )  # fmt: skip
    ax.set_xticks(xs, labels=[a.name + (" (log)" if a.log else "") for a in all_axes])
    ax.set_xlim(-0.6, len(all_axes) - 0.8)
    ax.set_ylim(-0.05, 1.05)
    ax.set_yticks([])
    for side in ("left", "right", "top"):
        ax.spines[side].set_visible(False)
    fig.colorbar(ScalarMappable(norm=norm, cmap=cmap), ax=ax, label=sweep.metric)
    best_note = f", best: trial {best_number}" if best_number is not None else ""
    ax.set_title(f"{title}: parameters of {len(done)} completed trials{best_note}", fontsize=10)
    return _save(fig, path)
