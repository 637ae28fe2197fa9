"""The offload benchmarks run at their smallest scale and write their tables:
``benchmarks/offload_pipeline.py`` (every arm gives a finite, positive time),
``benchmarks/offload_auto.py`` (both rates measured, a choice made), ``offload_shared.py`` and
``offload_blocks.py`` (the bytes they report), ``offload_alternate.py`` and
``offload_together.py`` (every arm timed), ``offload_step.py`` (both steps timed, the same
training); no timing is asserted."""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _run(name: str, argv: list[str], tmp_path: Path, monkeypatch) -> tuple[list[dict], Path]:
    """Run ``benchmarks/<name>.py`` with ``argv`` writing into ``tmp_path``; its JSON rows and
    the stem its tables were written to."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    script = importlib.import_module(name)
    stem = tmp_path / f"{name}_test"
    assert script.main([*argv, "--out", str(stem)]) == 0
    return json.loads(stem.with_suffix(".json").read_text())["rows"], stem


@pytest.mark.slow
def test_offload_pipeline_quick_runs(tmp_path, monkeypatch) -> None:
    argv = ["--layers", "3", "--width", "16", "--size", "2", "--batch", "8", "--steps", "1"]
    (row,), stem = _run(
        "offload_pipeline", [*argv, "--rounds", "1", "--factors", "1"], tmp_path, monkeypatch
    )
    for key in ("compute_step_ms", "prefetch_off_ms", "prefetch_on_ms", "max_model_ms"):
        assert math.isfinite(row[key]) and row[key] > 0, key
    assert "| 1 |" in stem.with_suffix(".md").read_text()


@pytest.mark.slow
def test_offload_auto_quick_runs(tmp_path, monkeypatch) -> None:
    """``benchmarks/offload_auto.py`` at its smallest: both ways measured, a choice made."""
    argv = ["--size", "2", "--fits", "1", "--seconds", "0.05"]
    (row,), stem = _run("offload_auto", argv, tmp_path, monkeypatch)
    assert row["fit_size"] == 1 and row["mode"] in ("host", "split")
    for key in ("offloaded_rate", "split_rate"):
        assert math.isfinite(row[key]) and row[key] > 0, key
    assert f"| {row['budget_bytes']} | 1 |" in stem.with_suffix(".md").read_text()


@pytest.mark.slow
def test_offload_shared_quick_runs(tmp_path, monkeypatch) -> None:
    """``benchmarks/offload_shared.py`` at its smallest: every way timed; the backbone kept once
    is copied in once per step (B - 1 backbones fewer than its per-member copies)."""
    argv = ["--layers", "2", "--width", "16", "--size", "3", "--batch", "4", "--steps", "1"]
    found, _ = _run("offload_shared", [*argv, "--rounds", "1"], tmp_path, monkeypatch)
    rows = {r["way"]: r for r in found}
    for row in rows.values():
        assert math.isfinite(row["step_ms"]) and row["step_ms"] > 0
    once, copies = rows["offloaded, backbone once"], rows["offloaded, B backbones"]
    backbone = 2 * (16 * 16 + 16) * 4
    assert copies["fetched_bytes_per_step"] - once["fetched_bytes_per_step"] == 2 * backbone
    assert copies["state_bytes"] - once["state_bytes"] == 2 * backbone


@pytest.mark.slow
def test_offload_blocks_quick_runs(tmp_path, monkeypatch) -> None:
    """``benchmarks/offload_blocks.py`` at its smallest: every way timed; cut between its
    blocks, the largest shard is smaller than the graph cut's encoder shard."""
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    argv = ["--layers", "2", "--width", "16", "--vocab", "50", "--size", "2", "--batch", "2"]
    found, _ = _run(
        "offload_blocks", [*argv, "--steps", "1", "--rounds", "1"], tmp_path, monkeypatch
    )
    rows = {r["way"]: r for r in found}
    for row in rows.values():
        assert math.isfinite(row["step_ms"]) and row["step_ms"] > 0
    graph = rows["offloaded, encoder one layer call (graph cut)"]
    units = rows["offloaded, between blocks, one unit per shard"]
    grouped = rows["offloaded, between blocks, grouped"]
    # embeddings, 2 layers, pooler, dropout, classifier
    assert (graph["shards"], units["shards"]) == (2, 6)
    assert units["largest_shard_bytes"] < graph["largest_shard_bytes"]
    assert grouped["shards"] < units["shards"]
    assert grouped["fetches_per_step"] < units["fetches_per_step"]
    # the same tensors copied in, fewer times: the backward fetches what its calls need
    assert grouped["fetched_bytes_per_step"] == units["fetched_bytes_per_step"]


@pytest.mark.slow
def test_offload_alternate_quick_runs(tmp_path, monkeypatch) -> None:
    """``benchmarks/offload_alternate.py`` at its smallest: every arm (the lockstep, shifted
    and ready schedules among them, the ready one also with a deeper prefetch) gives a
    finite, positive time, and the models are written beside them."""
    argv = ["--layers", "2", "--width", "16", "--size", "2", "--batch-b", "32", "--steps", "1"]
    argv += ["--rounds", "1", "--factors", "1"]
    (row,), stem = _run("offload_alternate", argv, tmp_path, monkeypatch)
    keys = ["compute_a_ms", "alone_sum_ms", "lockstep_ms", "max_model_ms"]
    keys += ["shifted_b_first_ms", "shifted_phase_model_b_first_ms", "turn_model_lockstep_ms"]
    keys += ["ready_ms", "ready_3,1_ms", "ready_2,2/max_model"]
    assert set(row["queue_model_ms"]) == {
        "lockstep",
        "shifted b first",
        "ready",
        "ready 3,1",
        "ready 2,2",
    }
    assert all(math.isfinite(v) and v > 0 for v in row["queue_model_ms"].values())
    for key in keys:
        assert math.isfinite(row[key]) and row[key] > 0, key
    assert "| 1 |" in stem.with_suffix(".md").read_text()


@pytest.mark.slow
def test_offload_alternate_urgent_arms_run(tmp_path, monkeypatch) -> None:
    """``--urgent``: each ready arm timed again with b's fetches urgent, its queue model on
    the two-class link beside it; finite, positive times."""
    argv = ["--layers", "2", "--width", "16", "--size", "2", "--batch-b", "32", "--steps", "1"]
    argv += ["--rounds", "1", "--factors", "1", "--depths", "3,1", "--urgent"]
    (row,), _ = _run("offload_alternate", argv, tmp_path, monkeypatch)
    assert {"ready b urgent", "ready 3,1 b urgent"} <= set(row["queue_model_ms"])
    for key in ["ready_b_urgent_ms", "ready_3,1_b_urgent_ms", "ready_3,1_b_urgent/lockstep"]:
        assert math.isfinite(row[key]) and row[key] > 0, key


@pytest.mark.slow
def test_offload_together_quick_runs(tmp_path, monkeypatch) -> None:
    argv = ["--layers", "3", "--width", "32", "--size", "2", "--batch-a", "4", "--batch-b", "64"]
    argv += ["--steps", "2", "--rounds", "1", "--factors", "1", "--schedules", "lockstep", "ready"]
    (row,), stem = _run("offload_together", argv, tmp_path, monkeypatch)
    keys = ("compute_a_ms", "transfer_a_ms", "one_after_another_ms", "together_ms")
    for key in (*keys, "together_ready_ms"):
        assert math.isfinite(row[key]) and row[key] > 0, key
    assert row["transfer_a_ms"] == pytest.approx(row["transfer_b_ms"])  # one model, one link
    assert "| 1 |" in stem.with_suffix(".md").read_text()


@pytest.mark.slow
def test_offload_step_quick_runs(tmp_path, monkeypatch) -> None:
    """``benchmarks/offload_step.py`` at its smallest: both steps timed for both optimizers,
    the device step copying the optimizer state in and back, both arms trained alike."""
    argv = ["--layers", "2", "--width", "32", "--size", "2", "--batch", "4", "--steps", "1"]
    rows, stem = _run("offload_step", [*argv, "--rounds", "1"], tmp_path, monkeypatch)
    assert [(r["optimizer"], r["step"]) for r in rows] == [
        ("adamw", "host"),
        ("adamw", "device"),
        ("sgd", "host"),
        ("sgd", "device"),
    ]
    for host, device in (rows[:2], rows[2:]):
        for row in (host, device):
            assert math.isfinite(row["step_ms"]) and row["step_ms"] > 0
            assert row["max_param_diff_host_vs_device"] <= 1e-6
        assert device["fetched_bytes_per_step"] > host["fetched_bytes_per_step"]
    assert stem.with_suffix(".md").exists()
