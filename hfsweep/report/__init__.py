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

import os
from pathlib import Path

# One job a module: _read (sweep.json and the study, opened without writing), _histories (the
# learning curves' files), _trials (values, the best trial, how each ended), _plots and _parallel
# (the four figures), _errors (the exceptions); this module draws them into the report directory.
from ._errors import NothingToReport, ReportError
from ._parallel import _plot_parallel
from ._plots import _plot_curves, _plot_history, _plot_importance
from ._read import SweepRecord, load_study, read_sweep
from ._trials import _trial_counts

__all__ = [
    "NothingToReport",
    "ReportError",
    "SweepRecord",
    "load_study",
    "read_sweep",
    "write_report",
]


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
    sweep = read_sweep(run)
    study = load_study(run, sweep)
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
