"""``benchmarks/peak_breakdown.py`` runs: its smallest scale (the tiny MLP, B = 1 and 2) writes
the table and raw rows, with the peak split into its parts (they add up) and no per-member copy of
a frozen tensor (the tiny MLP has none to copy; the lora_bert run in ``benchmarks/results`` is
where a copy would show)."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def test_peak_breakdown_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    script = importlib.import_module("peak_breakdown")
    stem = tmp_path / "peak"
    assert script.main(["--model", "tiny_mlp", "--sizes", "1", "2", "--out", str(stem)]) == 0
    rows = json.loads(stem.with_suffix(".json").read_text())["rows"]
    assert [(r["way"], r["members"]) for r in rows] == [
        ("plain model", 0),
        ("fused array", 1),
        ("fused array", 2),
    ]
    for r in rows:
        made = sum(g["bytes"] for g in r["made_in_step"])
        assert r["peak_bytes"] == r["frozen_bytes"] + r["other_state_bytes"] + made > 0
        assert r["frozen_copies"] == []
    assert "| fused array | 2 |" in stem.with_suffix(".md").read_text()


@pytest.mark.slow
def test_peak_breakdown_measures_separate_processes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--processes 2``: each process reports its own peak, which is the plain model's (the
    same model and batch), and their sum is written; ``--concurrent`` reads them together."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    script = importlib.import_module("peak_breakdown")
    for extra in ([], ["--concurrent"]):
        stem = tmp_path / f"procs{len(extra)}"
        argv = ["--model", "tiny_mlp", "--sizes", "--processes", "2", *extra, "--out", str(stem)]
        assert script.main(argv) == 0
        plain, separate = json.loads(stem.with_suffix(".json").read_text())["rows"]
        assert plain["way"] == "plain model" and separate["processes"] == 2
        assert separate["peak_bytes_each"] == [plain["peak_bytes"]] * 2
        assert separate["peak_bytes_sum"] == 2 * plain["peak_bytes"]
        assert all(b > 0 for b in separate["anonymous_bytes_each"])
        assert (separate["anonymous_bytes_together"] is not None) == bool(extra)
        assert "2 separate processes" in stem.with_suffix(".md").read_text()
