"""A smoke run of ``benchmarks/elastic_sim.py`` at a tiny scale: both arms end every trial, the
figures are finite and positive, the static arm never resizes, and a run is deterministic."""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path

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


def test_the_simulator_runs_both_arms(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    sim = importlib.import_module("elastic_sim")
    profiles = tmp_path / "profiles.json"
    profiles.write_text(json.dumps(PROFILES))
    kw = dict(
        workers=4,
        trials=40,
        mix={"small": 0.5, "large": 0.5},
        steps_per_epoch=10,
        max_epochs=9,
        profiles=profiles,
        resize_every_s=1.0,
        resize_cost_s=0.1,
    )
    static = sim.simulate(elastic=False, **kw)
    elastic = sim.simulate(elastic=True, **kw)
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
        "--profiles",
        str(profiles),
        "--out",
        str(out),
    ]
    assert sim.main(argv) == 0
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [r["arm"] for r in rows] == ["static", "elastic"]
