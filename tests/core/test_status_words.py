"""The one status vocabulary reaches every place a user reads a trial's end: the progress line,
the end-of-sweep summary, ``SweepResult.counts``, the trial schedulers and trials.csv (whose
``state`` column stays Optuna's name, beside a ``status`` column in the core's words)."""

from __future__ import annotations

import io
import json
import pickle
import warnings

import pytest
from hfsweep.schedulers import STATUSES, FIFOScheduler

from hfsweep.core._progress import Progress
from hfsweep.core.result import StatusCounts
from hfsweep.core.status import FINAL, Status


def test_the_progress_line_says_the_status_words() -> None:
    stream = io.StringIO()
    progress = Progress(5, "val_loss", stream=stream, log_interval=0.0)
    progress.finished(Status.COMPLETED)
    progress.finished("stopped")
    progress.finished("FAIL")  # an Optuna name read from a study still counts as its status
    assert "trials 3/5 done (1 completed, 1 stopped, 1 failed)" in progress.line()
    assert "pruned" not in stream.getvalue() and "complete," not in stream.getvalue()


def _counts(**numbers: int) -> StatusCounts:
    return StatusCounts({Status(k): n for k, n in numbers.items()})


def test_counts_are_keyed_by_status_and_read_by_value() -> None:
    counts = _counts(completed=3, stopped=1, failed=0, running=2)
    assert counts == {"completed": 3, "stopped": 1, "failed": 0, "running": 2}
    assert counts["completed"] == counts[Status.COMPLETED] == counts.get("completed") == 3
    assert json.loads(json.dumps(counts)) == {
        "completed": 3,
        "stopped": 1,
        "failed": 0,
        "running": 2,
    }
    assert pickle.loads(pickle.dumps(counts)) == counts
    assert counts.get("waiting", -1) == -1 and counts.get("done") is None
    with pytest.raises(KeyError, match="done"):
        counts["done"]


def test_an_optuna_state_name_still_reads_its_count_with_a_deprecation_warning() -> None:
    counts = _counts(completed=3, stopped=1, failed=2, running=0)
    with pytest.warns(DeprecationWarning, match=r"counts\['PRUNED'\].*use counts\['stopped'\]"):
        assert counts["PRUNED"] == 1
    with pytest.warns(DeprecationWarning, match="use counts\\['completed'\\]"):
        assert counts.get("COMPLETE") == 3
    with pytest.warns(DeprecationWarning):
        assert counts.get("WAITING", 0) == 0  # a status with no entry: the default
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert counts["failed"] == 2  # the words themselves never warn


def test_the_schedulers_end_trials_with_the_core_statuses() -> None:
    assert tuple(s for s in Status if s.final) == STATUSES and set(STATUSES) == FINAL
    scheduler = FIFOScheduler(max_resource=4)
    scheduler.on_trial_end("a", Status.STOPPED)
    scheduler.on_trial_end("b", "completed")  # a value is accepted as its status
    state = scheduler.state_dict()
    assert state["ended"] == {"a": "stopped", "b": "completed"}
    assert all(type(v) is str for v in state["ended"].values())  # plain JSON
    restored = FIFOScheduler(max_resource=4)
    restored.load_state_dict(json.loads(json.dumps(state)))
    assert restored.state_dict() == state
    with pytest.raises(ValueError, match=r"status must be one of \['completed', 'stopped', "):
        scheduler.on_trial_end("c", "PRUNED")
    with pytest.raises(ValueError, match=r"trial 'a' already ended \(stopped\)"):
        scheduler.on_trial_end("a", "failed")


def test_the_schedulers_and_the_core_share_one_status_class() -> None:
    """Status lives in the leaf module ``hfsweep._status``, which the trial schedulers import
    without importing the sweep core that imports them (tests/test_import_layers.py checks
    that no cycle remains); ``hfsweep.core.status.Status`` is the same class."""
    import hfsweep.schedulers._base as base

    import hfsweep._status as leaf

    assert Status is leaf.Status is base.Status and FINAL is leaf.FINAL
