"""The benchmark scripts run: a smoke run of each at its smallest scale.

These check that every way a script compares produces a finite, positive number and that the
results files appear; they never assert a timing (timings live in ``benchmarks/results/``).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import math
import os
import re
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _positive(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@pytest.mark.slow
def test_fusion_throughput_quick_runs(tmp_path, monkeypatch):
    """``fusion_throughput.py --quick`` on the tiny MLP, CPU, B = 1 and 2: every way (the
    concurrent processes included) and every memory figure is measured, tables and plots written."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the spawned processes inherit it
    script = importlib.import_module("fusion_throughput")
    stem = tmp_path / "fusion_throughput_test"
    argv = ["--quick", "--device", "cpu", "--models", "tiny_mlp", "--sizes", "1", "2"]
    assert script.main([*argv, "--out", str(stem)]) == 0

    data = json.loads(stem.with_suffix(".json").read_text())
    assert data["meta"]["command"].endswith(f"--out {stem}")
    rows = data["rows"]
    assert [(r["model"], r["B"], r["batch"]) for r in rows] == [
        ("tiny_mlp", 1, 64),
        ("tiny_mlp", 2, 64),
    ]
    for row in rows:
        assert "notes" not in row, row["notes"]
        for arm in ("serial", "concurrent", "fused", "trainer", "ideal", "hand"):
            assert _positive(row[arm]), (row["B"], arm, row[arm])
        for way in ("fused", "trainer"):  # the plain path and the trainer's
            for other in ("serial", "concurrent", "ideal", "hand"):
                ratios = row[f"{way}/{other} rounds"]
                assert len(ratios) == 1 and all(_positive(r) for r in ratios)
        assert row["threads per process"] >= 1 and _positive(row["window_s"])
        fused, processes = row["memory"]["fused"], row["memory"]["processes"]
        assert len(processes) == row["B"]
        for measured in (fused, *processes):
            assert _positive(measured["tensor_peak"]) and _positive(measured["rss_peak"])
            assert _positive(measured["step_s"])
        # one process holds the B members' tensors: at least as many bytes as one model's
        assert fused["tensor_peak"] >= min(p["tensor_peak"] for p in processes)

    md = stem.with_suffix(".md").read_text()
    assert "| tiny_mlp | 2 | plain |" in md and "| tiny_mlp | 2 | trainer |" in md
    assert "fused / concurrent" in md and "why below 0.9 of ideal" in md and "Peak memory" in md
    if importlib.util.find_spec("matplotlib") is not None:
        for kind in ("throughput", "memory"):
            png = stem.with_name(f"{stem.name}_{kind}.png")
            assert png.read_bytes().startswith(b"\x89PNG")


@pytest.mark.slow
def test_sweep_end_to_end_quick_runs(tmp_path, monkeypatch):
    """``sweep_end_to_end.py --quick --trials 4`` (4 trials of 2 epochs): every arm, plain
    Optuna, both Ray Tune arms and both hfsweep arms, finishes all 4 trials with a finite best
    value, and the table and JSON are written. (Runs with the Ray tests: it starts a local Ray
    of its own.) Four trials, not --quick's eight: every arm still runs its whole path (the Tune
    arms start a trial process per trial, most of this test's time on 2 CPUs)."""
    pytest.importorskip("ray")
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    # Ray's workers import the benchmark modules as `python benchmarks/...` lets them
    path = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", str(BENCHMARKS) + (os.pathsep + path if path else ""))
    script = importlib.import_module("sweep_end_to_end")
    stem = tmp_path / "sweep_end_to_end_test"
    script.main(["--quick", "--trials", "4", "--num-cpus", "2", "--out", str(stem)])

    rows = json.loads(stem.with_suffix(".json").read_text())["rows"]
    assert [r["arm"] for r in rows] == list(script.ARMS)
    for row in rows:
        assert _positive(row["wall_s"]), row
        assert sum(row["counts"].get(s, 0) for s in ("COMPLETE", "PRUNED", "FAIL")) == 4, row
        assert row["counts"].get("FAIL", 0) == 0 and _positive(row["best_value"]), row
    md = stem.with_suffix(".md").read_text()
    assert all(label in md for label in script.LABELS.values())


@pytest.mark.slow
def test_sweep_phases_accounts_for_the_whole_wall_clock(tmp_path, monkeypatch):
    """``sweep_phases.py`` on the 16-trial quick example, one round: every phase it times was
    called (its wrappers reached the functions the sweep runs), the phases' self times are
    non-negative and add up, with the rest, to the wall-clock; the wrappers are removed after."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.setenv("HFSWEEP_CACHE_DIR", str(tmp_path / "cache"))
    script = importlib.import_module("sweep_phases")
    from hfsweep.training import run as trainer

    backward = trainer.backward
    stem = tmp_path / "sweep_phases_test"
    examples = BENCHMARKS.parent / "examples"
    script.main(
        ["--sweep", str(examples / "digits_quick.yaml"), "--rounds", "1", "--out", str(stem)]
    )

    (row,) = json.loads(stem.with_suffix(".json").read_text())["rows"]
    timed = {phase for _, _, phase in script.PHASES}
    assert set(row["calls"]) == timed
    assert all(row["calls"][p] > 0 for p in row["calls"])
    # self times never count a nested phase twice: they fit in the wall-clock, with time left
    assert all(s >= 0 for s in row["phases_s"].values())  # the rest included
    assert row["counts"]["COMPLETE"] + row["counts"]["PRUNED"] == 16
    assert trainer.backward is backward  # the wrappers are gone
    assert "| wall-clock |" in stem.with_suffix(".md").read_text()
    # journal appends are counted, and the engine's holds take the lock for many at once
    events = row["events"]
    assert events["journal appends"] > 16 * 4
    assert 0 < events["acquisitions of the journal's lock"] < events["journal appends"] / 2


@pytest.mark.slow
def test_bench_bookkeeping_quick_runs(tmp_path, monkeypatch):
    """``bench_bookkeeping.py --quick`` (32 and 64 one-step trials): both arms, each in a fresh
    process, finish with a positive time, and the ratio per N is written."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    script = importlib.import_module("bench_bookkeeping")
    stem = tmp_path / "bench_bookkeeping_test"
    assert script.main(["--quick", "--out", str(stem)]) == 0
    rows = json.loads(stem.with_suffix(".json").read_text())["rows"]
    assert [r["trials"] for r in rows] == [32, 64]
    for row in rows:
        assert _positive(row["plain_s"]) and _positive(row["hfsweep_s"]), row
        assert _positive(row["hfsweep/plain"]) and "baseline_s" not in row, row
    assert "| 64 |" in stem.with_suffix(".md").read_text()


@pytest.mark.slow
@pytest.mark.timeout(900)  # four fresh processes importing torch on a shared 2-core CPU
def test_contention_runs_both_ways_quiet_and_contended(tmp_path, monkeypatch):
    """``contention.py`` on a 2-trial, 2-epoch cut of the quick example, one round, one busy
    process, the plain loop and ``hfsweep run``: each runs quiet and contended in a fresh
    process, the generator's processes are gone afterwards, and the ratios and the load
    averages are written. (``hfsweep-torch-threads`` differs from ``hfsweep`` only by an
    environment variable.)"""
    import yaml

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    script = importlib.import_module("contention")
    examples = BENCHMARKS.parent / "examples"
    sweep = yaml.safe_load((examples / "digits_quick.yaml").read_text())
    sweep.update(budget={"trials": 2, "epochs": 2}, fusion={"size": 2, "device": "cpu"})
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(sweep))
    started: list[int] = []
    popen = script.subprocess.Popen

    def recording(*args, **kwargs):
        proc = popen(*args, **kwargs)
        started.append(proc.pid)
        return proc

    monkeypatch.setattr(script.subprocess, "Popen", recording)
    stem = tmp_path / "contention_test"
    argv = ["--sweep", str(path), "--rounds", "1", "--workers", "1", "--only", "plain,hfsweep"]
    argv += ["--out", str(stem)]
    assert script.main(argv) == 0
    for pid in started:  # every process it started has ended (and was reaped)
        assert not Path(f"/proc/{pid}").exists(), pid
    data = json.loads(stem.with_suffix(".json").read_text())
    summary, runs = data["rows"][0]["summary"], data["rows"][0]["runs"]
    assert [r["arm"] for r in summary] == ["plain", "hfsweep"]
    assert sorted((r["arm"], r["condition"]) for r in runs) == [
        ("hfsweep", "contended"),
        ("hfsweep", "quiet"),
        ("plain", "contended"),
        ("plain", "quiet"),
    ]
    for run in runs:
        assert _positive(run["wall_s"]) and _positive(run["cpu_s"]), run
        assert run["load_before"] >= 0 and run["involuntary_switches"] >= 0
    for row in summary:
        assert _positive(row["contended/quiet"]), row
    md = stem.with_suffix(".md").read_text()
    assert "| contended / quiet |" in md and "load average" in md


@pytest.mark.slow
def test_contention_probe_times_the_op_every_way(tmp_path, monkeypatch):
    """``contention.py --probe-ops``: both tensor sizes at 1 and 2 threads, quiet and contended,
    each a positive time, torch's thread count set back, the table written."""
    import torch

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    script = importlib.import_module("contention")
    monkeypatch.setattr(script, "probe_ops", functools.partial(script.probe_ops, reps=5))
    threads = torch.get_num_threads()
    stem = tmp_path / "contention_ops_test"
    assert script.main(["--probe-ops", "--workers", "1", "--out", str(stem)]) == 0
    assert torch.get_num_threads() == threads
    rows = json.loads(stem.with_suffix(".json").read_text())["rows"]
    assert sorted((r["condition"], r["threads"]) for r in rows) == sorted(
        (c, t) for c in ("quiet", "contended") for t in (1, 2) for _ in range(2)
    )
    for row in rows:
        assert _positive(row["median_us"]) and _positive(row["p90_us"]), row
    assert "| median us |" in stem.with_suffix(".md").read_text()


@pytest.mark.slow
def test_before_after_compares_two_trees(tmp_path, monkeypatch):
    """``before_after.py`` runs a script in two checkouts (here the same one) alternately and
    writes each row's median timing per side and their ratio."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    script = importlib.import_module("before_after")
    root = str(BENCHMARKS.parent)
    stem = tmp_path / "ba"
    argv = ["--before", root, "--after", root, "--script", "optimizer_step.py"]
    argv += ["--field", "fused_ms", "--repeats", "1", "--out", str(stem), "--"]
    argv += ["--rounds", "1", "--iters", "2", "--models", "tiny_mlp", "--sizes", "2"]
    assert script.main(argv) == 0
    rows = json.loads(stem.with_suffix(".json").read_text())["rows"]
    assert [(r["model"], r["optimizer"], r["B"]) for r in rows] == [
        ("tiny_mlp", "SGD-momentum", 2),
        ("tiny_mlp", "AdamW", 2),
    ]
    for r in rows:
        assert _positive(r["fused_ms_before"]) and _positive(r["fused_ms_after"])
        assert _positive(r["fused_ms_ratio"])
    assert "| model |" in stem.with_suffix(".md").read_text()


@pytest.mark.slow
def test_dropout_apply_times_both_ways(tmp_path, monkeypatch):
    """``dropout_apply.py`` at its smallest scale: both ways of the transformer's fused step are
    timed (wall and CPU), and the old way saves more bytes for the backward than the new."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    script = importlib.import_module("dropout_apply")
    stem = tmp_path / "dropout_apply"
    argv = ["--models", "transformer", "--sizes", "2", "--rounds", "1", "--steps", "1"]
    assert script.main([*argv, "--out", str(stem)]) == 0
    (row,) = json.loads(stem.with_suffix(".json").read_text())["rows"]
    for key in ("mask_ms", "multiplier_ms", "cpu_mask_ms", "cpu_multiplier_ms", "ratio"):
        assert _positive(row[key]), key
    assert 0 < row["mask_saved_bytes"] < row["multiplier_saved_bytes"]


@pytest.mark.slow
def test_linear_layout_times_both_ways(tmp_path, monkeypatch):
    """``linear_layout.py`` at its smallest scale: both ways of both fused paths are timed beside
    ideal and hand, and the features-first step dispatches the 4 operators more the rewrite's
    docstring counts for a three-Linear MLP (``hfsweep/fusion/_graph_features_first.py``)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    script = importlib.import_module("linear_layout")
    stem = tmp_path / "linear_layout"
    argv = ["--models", "tiny_mlp", "--sizes", "2", "--rounds", "1", "--iters", "1"]
    assert script.main([*argv, "--warmup", "4", "--out", str(stem)]) == 0
    (row,) = json.loads(stem.with_suffix(".json").read_text())["rows"]
    for path in ("plain", "trainer"):
        for way in ("Function", "features-first"):
            assert _positive(row[f"{path}, {way} us"]), (path, way)
        assert row[f"{path}, features-first ops"] == row[f"{path}, Function ops"] + 4
    assert _positive(row["ideal us"]) and _positive(row["hand us"])


@pytest.mark.slow
def test_compile_fused_times_the_optimizer_three_ways(tmp_path, monkeypatch):
    """``compile_fused.py --optimizer`` at its smallest scale: the eager step, the compiled
    update (``opt.compile()``) and ``torch.compile(opt.step)`` are each timed, per optimizer."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    script = importlib.import_module("compile_fused")
    stem = tmp_path / "compile_fused_optimizer"
    argv = ["--optimizer", "--optimizers", "sgd", "--sizes", "2", "--rounds", "1"]
    assert script.main([*argv, "--out", str(stem)]) == 0
    (row,) = json.loads(stem.with_suffix(".json").read_text())["rows"]
    assert (row["optimizer"], row["size"]) == ("sgd", 2)
    for way in ("eager", "compile()", "torch.compile(step)"):
        assert _positive(row["seconds"][way]), way
        assert len(row["samples"][way]) == 1
    assert "| optimizer |" in stem.with_suffix(".md").read_text()


def test_resize_pause_splits_a_resize_into_its_phases(monkeypatch):
    """``resize_pause.py``'s reading of the probe's events (no Ray): a grow 1 -> 2 whose phases
    end at the slowest worker's events, and add up to the pause from rank 0's checkpoint to
    the last worker's first step."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    script = importlib.import_module("resize_pause")

    def ev(event, t, rank=None, pid=1, **kw):
        return {"event": event, "t": t, "rank": rank, "pid": pid, **kw}

    events = [
        ev("launch_start", 0.0, workers=1),
        ev("checkpoint_start", 10.0, 0),
        ev("checkpoint_end", 10.5, 0),
        ev("boundary_end", 10.6, 0, raised="ResizeRequested"),
        ev("launch_end", 11.0),
        ev("launch_start", 11.5, workers=2),
        ev("place_end", 12.0),
        ev("actor_up", 14.0, pid=2),
        ev("train_start", 14.1, 0),
        ev("train_start", 14.5, 1, pid=2),
        ev("pg_init_end", 14.6, 0),
        ev("pg_init_end", 14.7, 1, pid=2),
        ev("load_end", 15.0, 0),
        ev("load_end", 15.2, 1, pid=2),
        ev("build_end", 15.5, 0),
        ev("build_end", 16.0, 1, pid=2),
        ev("first_step", 16.1, 0),
        ev("first_step", 16.5, 1, pid=2),
    ]
    (row,) = script.resizes_of(events)
    assert (row["from"], row["to"], row["new_actors"]) == (1, 2, 1)
    assert row["total"] == pytest.approx(6.5)
    spans = [row[name] for name, _ in script.PHASES]
    assert spans == pytest.approx([0.5, 0.5, 0.5, 0.5, 2.0, 0.5, 0.2, 0.5, 0.8, 0.5])
    assert sum(spans) == pytest.approx(row["total"])


GPU_SESSION = BENCHMARKS / "gpu_session.sh"


def test_gpu_session_names_every_gpu_test_file():
    """The prepared GPU run (``benchmarks/gpu_session.sh tests``) runs every test file that has
    a ``gpu``-marked test: a new one left out would go unproven in a session lent a GPU."""
    root = BENCHMARKS.parent
    marked = {
        str(p.relative_to(root))
        for p in (root / "tests").rglob("test_*.py")
        if re.search(r"^(@pytest\.mark\.gpu|pytestmark = pytest\.mark\.gpu)", p.read_text(), re.M)
    }
    script = GPU_SESSION.read_text()
    listed = script[script.index("    tests=(\n") :].split(")", 1)[0].split()[1:]
    assert marked and marked == set(listed)


def test_gpu_session_refuses_an_unknown_mode():
    import subprocess

    done = subprocess.run(["bash", str(GPU_SESSION), "everything"], capture_output=True, text=True)
    assert done.returncode == 2
    assert "tests|bench|smoke (got 'everything')" in done.stderr


@pytest.mark.slow
def test_gpu_session_smoke_runs_every_step(tmp_path):
    """``gpu_session.sh smoke``: every step of the GPU run, at its smallest on this CPU, passes
    and lands in the archive the device tool brings back (so the commands and their flags are
    right before a GPU session spends its minutes on them)."""
    import subprocess
    import sys
    import tarfile

    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", str(GPU_SESSION), "smoke"], env=env, capture_output=True, text=True, timeout=1500
    )
    log = (tmp_path / "gpu_session.log").read_text()
    assert done.returncode == 0, log[-3000:]
    assert "every step passed" in log
    with tarfile.open(tmp_path / "gpu_session.tgz") as tar:
        names = {n.removeprefix("./") for n in tar.getnames()}
    for name in (
        "gpu_tests.xml",
        "results/fusion_throughput_cpu_tiny_mlp.json",
        "results/offload_step_cpu.json",
        "results/compile_fused_cpu.json",
    ):
        assert name in names, (name, sorted(names))
