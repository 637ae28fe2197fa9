"""A smoke run of ``benchmarks/elastic_sim.py`` at a tiny scale: both arms end every trial, the
figures are finite and positive, the static arm never resizes, and a run is deterministic."""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

PROFILES = {
    "allreduce": {"latency_s": 2e-4, "bandwidth_bytes_per_s": 7e8, "source": "test"},
    "tasks": [
        {
            "task": "small",
            "batch_size": 64,
            "gradient_bytes_per_member": 40_000,
            "sizes": {"1": 0.002, "2": 0.0025, "4": 0.003},
        },
        {
            "task": "large",
            "batch_size": 64,
            "gradient_bytes_per_member": 80_000,
            "sizes": {"1": 0.06, "2": 0.125},
        },
    ],
}


def _both_arms(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: int, trials: int
) -> tuple[Any, dict[str, Any], Any, Any]:
    """The simulator module, its keyword arguments (the tiny profiles above, 9 epochs of 10
    steps, resizes of 0.1 s at most every 1 s) and the static and elastic arms' results."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    sim = importlib.import_module("elastic_sim")
    profiles = tmp_path / "profiles.json"
    profiles.write_text(json.dumps(PROFILES))
    kw: dict[str, Any] = dict(
        workers=workers,
        trials=trials,
        mix={"small": 0.5, "large": 0.5},
        steps_per_epoch=10,
        max_epochs=9,
        profiles=profiles,
        resize_every_s=1.0,
        resize_cost_s=0.1,
    )
    return sim, kw, sim.simulate(elastic=False, **kw), sim.simulate(elastic=True, **kw)


def test_the_simulator_runs_both_arms(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sim, kw, static, elastic = _both_arms(tmp_path, monkeypatch, workers=4, trials=40)
    profiles = kw["profiles"]
    for r in (static, elastic):
        assert r.trials_ended == 40
        assert math.isfinite(r.makespan_s) and r.makespan_s > 0
        assert 0 < r.best_time_s <= r.makespan_s and r.idle_worker_s >= 0
    assert static.resizes == 0 and static.decisions == 0
    assert elastic.decisions > 0
    assert sim.simulate(elastic=True, **kw) == elastic  # deterministic

    out = tmp_path / "sim"
    argv = [
        "--workers",
        "4",
        "--trials",
        "20",
        "--mix",
        "small=1,large=1",
        "--steps-per-epoch",
        "5",
        "--max-epochs",
        "3",
        "--seeds",
        "0",
        "1",
        "--profiles",
        str(profiles),
        "--out",
        str(out),
    ]
    assert sim.main(argv) == 0
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [(r["seed"], r["arm"]) for r in rows] == [
        (seed, arm) for seed in (0, 1) for arm in ("static", "elastic-before", "elastic")
    ]
    md = out.with_suffix(".md").read_text()
    assert "## Where the accelerator-time goes, and the bounds" in md
    assert "| 4 | elastic |" in md and "| 4 | elastic-before |" in md and "bound: tail h" in md


def test_the_accounting_adds_up_and_the_bounds_hold(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every accelerator-second is booked once (useful + parallel + resize + idle = accelerators
    x makespan, in both phases), static has no data-parallel or resize time, and no arm beats
    the work, packed or path bounds."""
    _, _, static, elastic = _both_arms(tmp_path, monkeypatch, workers=6, trials=60)
    for r in (static, elastic):
        spent = r.account.total()
        assert spent == pytest.approx(6 * r.makespan_s, rel=1e-9)
        assert r.account.total("idle") == pytest.approx(r.idle_worker_s, rel=1e-9)
        assert r.account.total("useful") > 0
        assert 0 < r.account.queue_end_s < r.makespan_s
        for bound in ("work", "packed", "path"):
            assert 0 < r.bounds[bound] <= r.makespan_s * (1 + 1e-9), bound
        assert r.bounds["packed"] <= r.bounds["work"] * (1 + 1e-9)
        assert r.bounds["tail"] <= r.makespan_s * (1 + 1e-9)
        assert sum(r.account.member_steps.values()) > 0
    assert static.account.total("parallel") == pytest.approx(0.0, abs=1e-6)
    assert static.account.total("resize") == 0.0
    assert elastic.resizes == sum(elastic.account.resizes.values()) > 0
    last = elastic.account.last_array  # the array that ended last: its resizes and pauses
    assert last["paused_s"] == pytest.approx(0.1 * last["resizes"])
    assert static.account.last_array == {"resizes": 0, "paused_s": 0.0}
    # each resize pauses its array 0.1 s on at least one worker
    assert elastic.account.total("resize") >= 0.1 * elastic.resizes * (1 - 1e-9)
    assert elastic.account.total("parallel") > 0


def test_the_elastic_arm_forms_arrays_as_the_engine_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As ``hfsweep run``: the packer forms one array at a time and the allocator is handed
    only that formed array (a pool of one array, named after it), never a choice among every
    waiting trial's model; while it waits, no other array is formed."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    sim = importlib.import_module("elastic_sim")
    seen: list[list[Any]] = []
    decide = sim.Allocator.decide

    def spy(self: Any, arrays: Any, waiting: Any, total: int, **kw: Any) -> Any:
        seen.append(list(waiting))
        return decide(self, arrays, waiting, total, **kw)

    monkeypatch.setattr(sim.Allocator, "decide", spy)
    _, _, _, elastic = _both_arms(tmp_path, monkeypatch, workers=4, trials=40)
    assert elastic.trials_ended == 40
    offered = [pool for pools in seen for pool in pools]
    assert offered, "formed arrays were offered to the allocator"
    assert all(len(pools) <= 1 for pools in seen)
    assert all(pool.arrays == 1 and str(pool.name).startswith("a") for pool in offered)


def test_told_the_queue_the_elastic_arm_makes_no_resize_before_the_last_trial_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the trials queued behind the formed array counted (as ``hfsweep run`` counts them),
    every array starts on one worker while trials queue, so no resize happens before the last
    trial starts; the allocator told nothing of the queue (``queue_seen=False``, before) grew
    and shrank arrays then."""
    sim, kw, _, elastic = _both_arms(tmp_path, monkeypatch, workers=6, trials=60)
    before = sim.simulate(elastic=True, queue_seen=False, **kw)
    assert elastic.account.resizes["queue"] == 0
    assert before.account.resizes["queue"] > 0
    assert elastic.account.total("resize", "queue") == 0.0
