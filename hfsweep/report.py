"""``hfsweep report RUN_DIR``: PNG plots of a finished, or partly finished, sweep.

A run directory, as ``hfsweep run`` writes it, holds

- ``sweep.json``: the resolved sweep config (``metric``, ``mode``, ``storage``, ``study_name``,
  ``budget``...);
- the Optuna study: in ``optuna.journal`` (a journal file) when ``storage`` is null, else in the
  RDB ``storage`` names;
- ``trials.csv``: one row per trial (a flat copy of the study, for spreadsheets);
- ``histories/trial-<number>.csv``: every evaluation of each finished trial
  (``step,epoch,train_loss,val_loss,<metrics>...``).

:func:`write_report` draws from the study, which carries what ``trials.csv`` does plus each
parameter's distribution (its range, log scale, categorical choices), and from ``histories/``:

1. ``history.png``: each trial's value against its number, by state, with the best value so far;
2. ``importance.png``: the importance of the parameters that vary, by Optuna's default evaluator;
3. ``parallel.png``: parallel coordinates of the completed trials' parameters, colored by value;
4. ``curves.png``: the metric against epoch (or step) for every trial, the best one highlighted.

A plot with nothing to draw (no trial with a value yet, too few trials for importances...) is
skipped with a logged reason rather than drawn empty, so a partly finished sweep still reports
what it has. A run directory that cannot be read raises :class:`ReportError` naming the path and
what was expected; one with nothing to draw yet (no trial finished, or none that finished has a
value or a history) raises :class:`NothingToReport`, which says how many trials exist and run. matplotlib and Optuna are imported inside the functions that use them, so that
``import hfsweep`` stays light; plots are drawn on a bare :class:`~matplotlib.figure.Figure` with an
Agg canvas, never through pyplot, so no global backend or figure state is touched.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from ._checks import is_number
from ._dburl import UnsetVariable, expand, scrub, shown

if TYPE_CHECKING:
    import optuna
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from optuna.distributions import BaseDistribution
    from optuna.trial import FrozenTrial

__all__ = ["NothingToReport", "ReportError", "write_report"]

_log = logging.getLogger("hfsweep.report")

_RUN_FIRST = "run `hfsweep run sweep.yaml` first"
_HISTORY_FILE = re.compile(r"^trial-(\d+)\.csv$")

# A finished trial's ``status`` user attr (as the engine sets it) and its plot color; trials
# without one get theirs from the Optuna state.
_STATUS_COLORS: dict[str, str] = {
    "completed": "tab:blue",
    "stopped": "tab:orange",
    "failed": "tab:red",
    "running": "tab:gray",
    "unknown": "tab:purple",
}
_STATUS_OF_STATE: dict[str, str] = {
    "COMPLETE": "completed",
    "PRUNED": "stopped",
    "FAIL": "failed",
    "RUNNING": "running",
    "WAITING": "running",
}


class ReportError(Exception):
    """A run directory that cannot be reported.

    The message names the path (the run directory, its ``sweep.json``, the journal file or the
    storage URL) and what is missing or expected there.
    """


class NothingToReport(ReportError):
    """The run directory is a sweep's, but it has nothing to draw yet: no trial has finished,
    or none of those that finished has a value or a history (all failed before evaluating).

    The message names the run directory and counts its trials by state. The CLI exits 1 on it
    (a sweep that has not got far enough), 2 on any other :class:`ReportError`.
    """


# --------------------------------------------------------------------------------------------------
# reading the run directory


@dataclass(frozen=True)
class _Sweep:
    """What the report needs from ``sweep.json``."""

    metric: str
    mode: Literal["max", "min"]
    storage: str | None
    study_name: str
    resource: Literal["epoch", "step"]  # the learning curves' x axis, from the budget's unit


def _read_sweep(run: Path) -> _Sweep:
    """``run/sweep.json``, checked for the keys the report uses."""
    if not run.exists():
        raise ReportError(f"{run}: no such run directory; {_RUN_FIRST}")
    if not run.is_dir():
        raise ReportError(
            f"{run}: not a directory; expected a sweep's run directory{_sweep_file_hint(run)}"
        )
    path = run / "sweep.json"
    if not path.is_file():
        raise ReportError(
            f"{path}: missing, so {run} is not a run directory; a run directory holds the "
            f"sweep.json that `hfsweep run` writes{_run_dirs_below(run) or f' ({_RUN_FIRST})'}"
        )
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ReportError(f"{path}: cannot be read as JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise ReportError(
            f"{path}: expected a JSON object (the resolved sweep config), got {type(raw).__name__}"
        )

    def string(key: str, what: str) -> str:
        value = raw.get(key)
        if not isinstance(value, str) or not value:
            shown = "missing" if key not in raw else f"{value!r}"
            raise ReportError(f"{path}: {key} is {shown}; expected {what}")
        return value

    metric = string("metric", "the name of the metric the sweep optimised")
    mode = raw.get("mode")
    if mode not in ("max", "min"):
        shown = "missing" if "mode" not in raw else f"{mode!r}"
        raise ReportError(f"{path}: mode is {shown}; expected 'max' or 'min'")
    storage = raw.get("storage")
    if storage is not None and not isinstance(storage, str):
        raise ReportError(f"{path}: storage is {storage!r}; expected null or an Optuna storage URL")
    study_name = string("study_name", "the Optuna study's name")
    budget = raw.get("budget")
    resource: Literal["epoch", "step"] = (
        "step" if isinstance(budget, Mapping) and budget.get("steps") is not None else "epoch"
    )
    return _Sweep(metric, "max" if mode == "max" else "min", storage, study_name, resource)


def _sweep_file_hint(path: Path) -> str:
    """For a sweep file given instead of its run directory: where its run directory is."""
    if path.suffix.lower() not in (".yaml", ".yml"):
        return ""
    output = None
    try:
        import yaml

        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
        if isinstance(raw, Mapping) and isinstance(raw.get("output"), str):
            output = Path(raw["output"]).expanduser()
    except Exception:  # any unreadable file: fall back to the default output
        output = None
    run = path.parent / (output if output is not None else Path("runs") / path.stem)
    return f"; {path} looks like a sweep file: report its run directory, `hfsweep report {run}`"


def _run_dirs_below(folder: Path) -> str:
    """For a folder holding run directories (``runs/``): name them."""
    try:
        found = sorted(p.name for p in folder.iterdir() if (p / "sweep.json").is_file())
    except OSError:
        return ""
    if not found:
        return ""
    shown = ", ".join(found[:5]) + (f" and {len(found) - 5} more" if len(found) > 5 else "")
    return f"; the run directories in it: {shown} (e.g. `hfsweep report {folder / found[0]}`)"


def _sqlite_file(url: str) -> Path | None:
    """The database file of a ``sqlite:///`` URL (None for other URLs and in-memory databases).

    Checked before loading because SQLAlchemy would create an empty database at a missing path.
    """
    prefix = "sqlite:///"
    if not url.startswith(prefix):
        return None
    rest = url[len(prefix) :].split("?", 1)[0]
    return None if rest in ("", ":memory:") else Path(rest)


def _load_study(run: Path, sweep: _Sweep) -> optuna.Study:
    """The sweep's study: from ``sweep.storage`` if set, else from ``run/optuna.journal``."""
    import optuna
    from optuna.storages import BaseStorage, JournalStorage
    from optuna.storages.journal import JournalFileBackend

    from ._journal import JournalPrefix, find_torn_tail
    from ._journal_url import is_journal, journal_file

    storage: str | BaseStorage
    if sweep.storage is None or is_journal(sweep.storage):  # a run dir's or a shared journal
        try:
            journal = (
                run / "optuna.journal" if sweep.storage is None else journal_file(sweep.storage)
            )
        except UnsetVariable as exc:
            raise ReportError(
                f"storage {sweep.storage} (from {run / 'sweep.json'}): {exc}"
            ) from None
        where = str(journal)
        # Opening a journal backend creates a missing file: check first, so a wrong directory is
        # reported instead of getting an empty study file.
        if not journal.is_file():
            raise ReportError(
                f"{journal}: missing; a sweep with storage: null keeps its Optuna study in this "
                f"journal file ({_RUN_FIRST})"
            )
        try:
            torn = find_torn_tail(journal)
            if torn is None:
                storage = JournalStorage(JournalFileBackend(str(journal)))
            else:
                # read the whole records only; the report leaves the file as it is (a sweep
                # may be resuming from it; the run directory may be read-only)
                warnings.warn(
                    f"{torn.describe(journal)}; `hfsweep run SWEEP --resume` drops it from the "
                    "file, keeping a copy",
                    stacklevel=3,
                )
                storage = JournalStorage(JournalPrefix(journal, torn.offset))
        except Exception as exc:
            raise ReportError(f"{journal}: cannot be opened as an Optuna journal ({exc})") from exc
    else:
        where = f"storage {shown(sweep.storage)!r} (from {run / 'sweep.json'})"
        try:
            storage = _unmasked(expand(sweep.storage))
        except UnsetVariable as exc:
            raise ReportError(f"{where}: {exc}") from None
        database = _sqlite_file(storage)
        if database is not None and not database.is_file():
            raise ReportError(f"{where}: the database file {database} is missing; {_RUN_FIRST}")
    try:
        return optuna.load_study(study_name=sweep.study_name, storage=storage)
    except KeyError as exc:
        try:
            names = sorted(optuna.get_all_study_names(storage))
        except Exception:
            raise ReportError(f"{where}: no study named {sweep.study_name!r}") from exc
        raise ReportError(
            f"{where}: no study named {sweep.study_name!r}; it holds {names or 'no studies'}"
            + ("" if names else f" ({_RUN_FIRST})")
        ) from exc
    except Exception as exc:
        reason = scrub(str(exc), storage) if isinstance(storage, str) else str(exc)
        hint = (
            "; sweep.json keeps the URL without its password: give it in the PGPASSWORD "
            "environment variable (or ~/.pgpass), or as ${NAME} in the sweep file's storage"
            if isinstance(storage, str) and sweep.storage and "***@" in sweep.storage
            else ""
        )
        raise ReportError(
            f"{where}: cannot load study {sweep.study_name!r} ({reason}){hint}"
        ) from exc


def _unmasked(url: str) -> str:
    """``url`` without the password ``sweep.json`` masked (``user:***@``): the database
    driver then takes it from its own places (PostgreSQL's ``PGPASSWORD``, ``~/.pgpass``)."""
    return url.replace(":***@", "@", 1)


def _float(text: object) -> float | None:
    """A CSV cell as a finite float, or None (empty, not a number, nan or inf)."""
    if not isinstance(text, str) or not text.strip():
        return None
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


@dataclass(frozen=True)
class _Curve:
    """One trial's learning curve from ``histories/trial-<number>.csv``."""

    number: int
    xs: list[float]
    ys: list[float]


def _read_history(path: Path, number: int, x: str, metric: str) -> _Curve | None:
    """The ``(x, metric)`` points of one history file, or None (logged) when it has none.

    Rows whose cells are empty or not finite (an evaluation that did not report the metric, a
    diverged trial) are left out rather than drawn as gaps or spikes.
    """
    try:
        with path.open(newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            columns = list(reader.fieldnames or [])
            if x not in columns or metric not in columns:
                _log.warning(
                    "%s: skipped in curves.png; expected columns %r and %r, found %s",
                    path,
                    x,
                    metric,
                    columns,
                )
                return None
            xs: list[float] = []
            ys: list[float] = []
            for row in reader:
                xv, yv = _float(row.get(x)), _float(row.get(metric))
                if xv is not None and yv is not None:
                    xs.append(xv)
                    ys.append(yv)
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        _log.warning("%s: skipped in curves.png; cannot be read (%s)", path, exc)
        return None
    if not xs:
        _log.info("%s: no finite %s values; skipped in curves.png", path, metric)
        return None
    return _Curve(number, xs, ys)


def _read_histories(run: Path, x: str, metric: str) -> list[_Curve]:
    """Every readable ``histories/trial-<number>.csv``, by trial number."""
    folder = run / "histories"
    if not folder.is_dir():
        return []
    found = sorted(
        (int(m.group(1)), p)
        for p in folder.iterdir()
        if (m := _HISTORY_FILE.match(p.name)) is not None and p.is_file()
    )
    curves = [_read_history(path, number, x, metric) for number, path in found]
    return [c for c in curves if c is not None]


# --------------------------------------------------------------------------------------------------
# trial helpers


def _value(trial: FrozenTrial) -> float | None:
    """The trial's finite single objective value, or None."""
    values = trial.values
    if not values or len(values) != 1 or not math.isfinite(values[0]):
        return None
    return float(values[0])


def _completed(trials: Sequence[FrozenTrial]) -> list[tuple[FrozenTrial, float]]:
    """The COMPLETE trials that have a finite value, with that value."""
    out = []
    for t in trials:
        value = _value(t)
        if t.state.name == "COMPLETE" and value is not None:
            out.append((t, value))
    return out


def _best(trials: Sequence[FrozenTrial], mode: str) -> tuple[FrozenTrial, float] | None:
    """The best COMPLETE trial and its value (the lowest number on ties), or None."""
    done = _completed(trials)
    if not done:
        return None
    if mode == "max":
        return max(done, key=lambda tv: (tv[1], -tv[0].number))
    return min(done, key=lambda tv: (tv[1], tv[0].number))


def _best_so_far(values: Sequence[float], mode: str) -> list[float]:
    """The running best of ``values`` (running max when ``mode`` is max, else running min)."""
    out: list[float] = []
    for v in values:
        best = v if not out else (max(out[-1], v) if mode == "max" else min(out[-1], v))
        out.append(best)
    return out


def _status(trial: FrozenTrial | None) -> str:
    """How a trial ended, for the learning curves: the engine's ``status`` user attr if set,
    else derived from the Optuna state; ``unknown`` for a history with no trial in the study."""
    if trial is None:
        return "unknown"
    status = trial.user_attrs.get("status")
    if isinstance(status, str) and status in _STATUS_COLORS:
        return status
    return _STATUS_OF_STATE.get(trial.state.name, "unknown")


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
# 1. optimization history


def _plot_history(
    trials: Sequence[FrozenTrial], sweep: _Sweep, title: str, path: Path
) -> Path | None:
    """Each trial's value by trial number, marked by state, and the best COMPLETE value so far.

    Pruned (stopped) trials carry their last reported value, as Optuna records them; failed and
    still running trials have none and are marked along the bottom edge instead.
    """
    from matplotlib.ticker import MaxNLocator

    complete = sorted(((t.number, v) for t, v in _completed(trials)))
    pruned = sorted(
        (t.number, v) for t in trials if t.state.name == "PRUNED" and (v := _value(t)) is not None
    )
    if not complete and not pruned:
        _log.info("history.png skipped: no trial has a value yet")
        return None
    failed = sorted(t.number for t in trials if t.state.name == "FAIL")
    running = sorted(t.number for t in trials if t.state.name in ("RUNNING", "WAITING"))

    fig = _new_figure(8.5, 4.5)
    ax = fig.subplots()
    if complete:
        ax.plot(
            [n for n, _ in complete], [v for _, v in complete], "o", color="tab:blue",
            label=f"complete ({len(complete)})",
        )  # fmt: skip
    if pruned:
        ax.plot(
            [n for n, _ in pruned], [v for _, v in pruned], "v", color="tab:orange", alpha=0.8,
            label=f"pruned ({len(pruned)}, last reported value)",
        )  # fmt: skip
    # x in data coordinates, y in axes coordinates: a rug along the bottom edge.
    for numbers, marker, color, label in (
        (failed, "x", "tab:red", f"failed ({len(failed)}, no value)"),
        (running, "|", "tab:gray", f"running ({len(running)})"),
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
# 2. parameter importance


def _varying_params(done: Sequence[tuple[FrozenTrial, float]]) -> list[str]:
    """Parameters that take two or more different values among ``done``, in first-seen order."""
    seen: dict[str, set[str]] = {}
    for t, _ in done:
        for name, value in t.params.items():
            seen.setdefault(name, set()).add(repr(value))
    return [name for name, values in seen.items() if len(values) >= 2]


def _plot_importance(study: optuna.Study, sweep: _Sweep, title: str, path: Path) -> Path | None:
    """Bars of ``optuna.importance.get_param_importances`` over the parameters that vary.

    Needs two or more COMPLETE trials and two or more varying parameters: with fewer, Optuna's
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
# 3. parallel coordinates


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
    trials: Sequence[FrozenTrial], sweep: _Sweep, title: str, path: Path
) -> Path | None:
    """One line per COMPLETE trial through its parameters' axes and its value, colored by value.

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


# --------------------------------------------------------------------------------------------------
# 4. learning curves


def _plot_curves(
    run: Path, trials: Sequence[FrozenTrial], sweep: _Sweep, title: str, path: Path
) -> Path | None:
    """The metric against epoch (step for a budget in steps) for every trial with a history,
    colored by how the trial ended, the best COMPLETE trial drawn last in black."""
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


# --------------------------------------------------------------------------------------------------
# entry point


def write_report(
    run_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str] | None = None
) -> list[Path]:
    """Draw the sweep's plots as PNG files into out_dir (default <run_dir>/report) and return their
    paths.

    The paths come in the order history, importance, parallel, curves, leaving out each plot with
    nothing to draw yet (its reason is logged at INFO on ``hfsweep.report``); the list is never
    empty (see :class:`NothingToReport`). Files of a skipped
    plot left in ``out_dir`` by an earlier report are not removed.

    Raises:
        NothingToReport: no trial has finished yet, or none of the finished ones has anything to
            draw; nothing is written.
        ReportError: ``run_dir``, its ``sweep.json`` or the study (the journal file, or the
            ``storage`` database) is missing or cannot be read; the message names the path.
    """
    run = Path(run_dir)
    sweep = _read_sweep(run)
    study = _load_study(run, sweep)
    trials = study.get_trials(deepcopy=False)
    if not any(t.state.is_finished() for t in trials):
        raise NothingToReport(f"{run}: nothing to report yet: {_trial_counts(trials)}")
    out = run / "report" if out_dir is None else Path(out_dir)
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ReportError(f"{out}: cannot create the report directory ({exc})") from exc
    title = sweep.study_name
    drawn = [
        _plot_history(trials, sweep, title, out / "history.png"),
        _plot_importance(study, sweep, title, out / "importance.png"),
        _plot_parallel(trials, sweep, title, out / "parallel.png"),
        _plot_curves(run, trials, sweep, title, out / "curves.png"),
    ]
    paths = [p for p in drawn if p is not None]
    if not paths:
        if created:
            out.rmdir()
        raise NothingToReport(
            f"{run}: nothing to report yet: {_trial_counts(trials)}; no finished trial has a "
            f"value or a history to draw (trials.csv and {run / 'sweep.log'} say why they failed)"
        )
    return paths


def _trial_counts(trials: Sequence[FrozenTrial]) -> str:
    """``3 trials: 1 failed, 2 running`` and, when none finished, what to do."""
    if not trials:
        return f"the study has no trials ({_RUN_FIRST}, or wait for it to ask for some)"
    counts: dict[str, int] = {}
    for t in trials:
        status = _STATUS_OF_STATE.get(t.state.name, t.state.name.lower())
        counts[status] = counts.get(status, 0) + 1
    text = f"{len(trials)} trial(s): " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    if not any(t.state.is_finished() for t in trials):
        text += (
            ", none finished; report again once one has (a stopped sweep goes on with "
            "`hfsweep run SWEEP --resume`)"
        )
    return text
