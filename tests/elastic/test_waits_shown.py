"""The time arrays wait for workers and workers idle, from the allocator's own accounting (each
plan's arrays without workers and idle workers, held until the next plan), on a fake clock:
in the plans, in the elastic policy's status line (sweep.log and the progress line) and in the
line it shows when the last array ends."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
from _elastic_fakes import FakeClock, evals, fake_policy
from test_waiting_arrays import _asha_tail

from hfsweep.core._progress import Progress
from hfsweep.core._rundir import RunDir
from hfsweep.core.result import StatusCounts, SweepResult
from hfsweep.elastic.allocator import Allocator, ArrayState, WaitingPool
from hfsweep.profiler import ScalingProfile

_FLAT = ScalingProfile("k", {1: 100.0, 2: 100.0})  # a second worker gains nothing


def test_the_allocator_sums_waiting_arrays_and_idle_workers_between_its_plans() -> None:
    allocator = Allocator(resize_every_s=0)
    a = ArrayState("a", "k", members=1, remaining_s=100.0, profile=_FLAT, workers=0)
    first = allocator.decide([a], [], 3, now=0.0, event="array started")
    assert (first.idle, first.waiting, first.waits()) == (2, 0, "")  # a gains nothing from 2
    assert allocator.waits(4.0) == (0.0, 8.0)  # 2 idle workers for 4 s, before any plan
    # a node left: 1 worker for two arrays of one member each, b paused (waits)
    a = ArrayState("a", "k", members=1, remaining_s=100.0, profile=_FLAT, workers=1, since=0.0)
    b = ArrayState("b", "k", members=1, remaining_s=100.0, profile=_FLAT, workers=0)
    second = allocator.decide([a, b], [], 1, now=10.0, event="node left")
    assert (second.idle, second.waiting) == (0, 1)
    assert (second.waited_s, second.idle_s) == (0.0, 20.0)
    # and trials wait in a pool: 1 array paused and 1 new array not started, for 15 s
    pool = WaitingPool("k", arrays=1, members=1, remaining_s=10.0, profile=_FLAT, since=25.0)
    third = allocator.decide([a, b], [pool], 1, now=25.0, event="pool filled")
    assert (third.waiting, third.waited_s, third.idle_s) == (2, 15.0, 20.0)
    fourth = allocator.decide([a, b], [pool], 1, now=35.0, event="timer")
    assert (fourth.waited_s, fourth.idle_s) == (35.0, 20.0)
    assert fourth.waits() == "arrays waited 35 s, workers idle 20 s"
    # the last array ended: every worker idle from then on
    rest = allocator.rest(2, now=40.0)
    assert (rest.idle, rest.waiting, rest.waited_s) == (2, 0, 45.0)
    assert allocator.waits(43.0) == (45.0, 26.0)


def test_the_status_line_shows_how_long_arrays_waited_and_workers_idled(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The tail of an ASHA sweep (tests/elastic/test_waiting_arrays.py): array 1 is formed at
    t = 2 s and waits while array 0 keeps both workers; at t = 42 s ASHA stops 3 of array 0's
    members and array 1 starts on the worker array 0 gives up; array 0 ends at t = 50 s (array 1
    grows to both), array 1 at t = 70 s."""
    policy, clock, shown, a, b = _asha_tail(tmp_path, caplog)
    assert shown[-1] == "elastic: 1 arrays on 2/2 workers (1 waiting) [array started]"
    clock.now = 42.0
    policy.reported(a, evals(3.0), live=1)
    assert policy.waiting(b, total=2) == 1
    assert shown[-1].endswith("[members stopped]; arrays waited 40 s, workers idle 0 s")
    clock.now = 50.0
    policy.ended(a, total=2)
    assert policy.plans[-1].workers() == {"array 1": 2}
    clock.now = 70.0
    with caplog.at_level(logging.INFO, logger="hfsweep.elastic"):
        policy.ended(b, total=2)
    assert shown[-1] == (
        "elastic: 0 arrays on 0/2 workers [array ended]; arrays waited 40 s, workers idle 0 s"
    )
    assert shown[-1] in caplog.text  # in sweep.log too
    # an array starting 5 s later finds both workers idle since the last one ended
    clock.now = 75.0
    assert policy.started(str(tmp_path / "0"), "k", 1, total=2) > 0
    assert shown[-1].endswith("; arrays waited 40 s, workers idle 10 s")
    progress = Progress(4, "val_loss", enabled=False)
    progress.elastic_plan(shown[-1])
    assert "arrays waited 40 s, workers idle 10 s" in progress.line()


def test_nothing_waited_nothing_shown(tmp_path: Path) -> None:
    clock, shown = FakeClock(), []
    policy = fake_policy(clock, shown)
    folder = tmp_path / "0"
    folder.mkdir()
    assert policy.started(str(folder), "k", 4, total=2) == 2
    clock.now = 30.0
    policy.ended(str(folder), total=2)
    assert shown == [
        "elastic: 1 arrays on 2/2 workers (1 new) [array started]",
        "elastic: 0 arrays on 0/2 workers [array ended]",
    ]


def test_the_totals_go_to_elastic_json_at_every_plan_and_into_the_summary(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The same tail: every plan rewrites the run directory's ``elastic.json`` with the totals
    so far (a driver killed mid-sweep leaves the last plan's), ``totals()`` gives them up to
    now, and the end-of-sweep summary names them."""
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    policy, clock, _, a, b = _asha_tail(tmp_path, caplog)
    policy.record = run.write_elastic
    clock.now = 42.0
    policy.reported(a, evals(3.0), live=1)  # members stopped: a plan, array 1 starts
    written = json.loads(run.elastic.read_text())
    assert written == {"arrays_waited_s": 40.0, "workers_idle_s": 0.0, "plans": 3, "workers": 2}
    clock.now = 50.0
    policy.ended(a, total=2)
    clock.now = 70.0
    policy.ended(b, total=2)  # nothing left: every worker idle from here
    clock.now = 75.0
    totals = policy.totals()
    assert totals == {"arrays_waited_s": 40.0, "workers_idle_s": 10.0, "plans": 4, "workers": 2}
    assert json.loads(run.elastic.read_text())["workers_idle_s"] == 0.0  # as of the last plan

    import optuna

    result = SweepResult(
        run.path, optuna.create_study(), "val_loss", "min", None, None, {}, {}, StatusCounts(), 75.0, 2,
        elastic=totals,
    )  # fmt: skip
    summary = result.summary()
    assert (
        "Elastic arrays: 4 allocator plans; arrays waited 40 s, workers idle 10 s (summed over "
        "arrays and over workers, as the plans left them)"
    ) in summary
    assert summary.endswith(f"Run directory: {run.path} (trials.csv, best.json, histories/, "
                            "checkpoints/, elastic.json)")  # fmt: skip


def test_a_resumed_sweep_goes_on_from_the_totals_its_earlier_runs_wrote(tmp_path: Path) -> None:
    """``elastic.json`` from the run before a ``--resume`` (40 s waited, 10 s idle, 4 plans):
    the resumed policy's status line, totals and file count on from them."""
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    run.write_elastic({"arrays_waited_s": 40.0, "workers_idle_s": 10.0, "plans": 4, "workers": 2})
    clock, shown = FakeClock(), []
    policy = fake_policy(clock, shown)
    policy.record = run.write_elastic
    earlier = run.read_elastic()
    assert earlier is not None
    policy.carry_on(earlier)
    folder = tmp_path / "0"
    folder.mkdir()
    assert policy.started(str(folder), "k", 1, total=2) == 2  # both workers: none idle
    assert shown[-1].endswith("[array started]; arrays waited 40 s, workers idle 10 s")
    clock.now = 30.0
    policy.ended(str(folder), total=2)
    clock.now = 35.0  # both workers idle for 5 s since
    assert policy.totals() == {
        "arrays_waited_s": 40.0,
        "workers_idle_s": 20.0,
        "plans": 5,  # the start's plan (the rest after the end is not a plan, as above)
        "workers": 2,
    }
    assert json.loads(run.elastic.read_text())["plans"] == 5


@pytest.mark.parametrize(
    ("earlier", "named"),
    [
        ({"arrays_waited_s": -1.0, "workers_idle_s": 0.0, "plans": 1}, "arrays_waited_s is -1.0"),
        ({"arrays_waited_s": 0.0, "workers_idle_s": "3", "plans": 1}, "workers_idle_s is '3'"),
        ({"arrays_waited_s": 0.0, "workers_idle_s": 0.0, "plans": 1.5}, "plans is 1.5"),
        ({"arrays_waited_s": 0.0, "workers_idle_s": 0.0}, "plans is None"),
    ],
)
def test_totals_that_are_not_counts_or_seconds_are_refused(
    earlier: dict[str, object], named: str
) -> None:
    policy = fake_policy(FakeClock(), [])
    with pytest.raises(ValueError, match=re.escape(named)):
        policy.carry_on(earlier)
    assert policy.totals()["plans"] == 0


def test_a_torn_elastic_json_is_named(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    assert run.read_elastic() is None  # none written: nothing to go on from
    run.elastic.write_text('{"arrays_waited_s": 4')
    with pytest.raises(ValueError, match=r"elastic\.json is not JSON"):
        run.read_elastic()
    run.elastic.write_text("[1, 2]")
    with pytest.raises(ValueError, match="holds a list, not an object"):
        run.read_elastic()


def test_the_engine_carries_the_totals_on_and_logs_a_file_it_cannot_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``hfsweep run --resume``'s side (``_Backend._carry_elastic_totals``): the earlier runs'
    totals go to the policy; a torn ``elastic.json`` is logged, naming the file, and the totals
    start from zero (they are a record of the run, not its state)."""
    from types import SimpleNamespace

    from hfsweep.core._backend import _Backend

    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    engine = SimpleNamespace(dir=run)
    run.write_elastic({"arrays_waited_s": 7.0, "workers_idle_s": 3.0, "plans": 2, "workers": 2})
    policy = fake_policy(FakeClock(), [])
    _Backend._carry_elastic_totals(engine, policy)  # type: ignore[arg-type]
    assert policy.totals() == {
        "arrays_waited_s": 7.0,
        "workers_idle_s": 3.0,
        "plans": 2,
        "workers": None,
    }
    run.elastic.write_text('{"arrays_waited_s": 7')
    policy = fake_policy(FakeClock(), [])
    with caplog.at_level(logging.WARNING, logger="hfsweep.sweep"):
        _Backend._carry_elastic_totals(engine, policy)  # type: ignore[arg-type]
    assert "elastic.json is not JSON" in caplog.text and "start from zero" in caplog.text
    assert policy.totals()["plans"] == 0
