"""``benchmarks/step_breakdown.py`` splits the trainer's step into timed phases: it must do the
work of the trainer's own ``backward`` and ``update``, in the same order, and nothing else, or
its phases would not add up to the trainer's step. Checked by training two copies, one through
the phases and one through the whole step, to the same parameters bit for bit (a smoke run of
the script's table too). Timings are never asserted."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def breakdown(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module("step_breakdown")


def test_the_phases_train_as_the_whole_trainer_step(breakdown: ModuleType) -> None:
    ft = sys.modules["fusion_throughput"]
    x, y = ft._batch("tiny_mlp", 16, torch.device("cpu"))
    arrays = []
    for whole in (False, True):
        torch.manual_seed(0)
        models = [ft.MODELS["tiny_mlp"].build() for _ in range(3)]
        backward_call, update_call = ft.trainer_calls("tiny_mlp", models, x, y)
        phases, step = breakdown.trainer_way(backward_call, update_call)
        acc: dict[str, float] = {}
        for _ in range(4):
            step() if whole else phases(acc)
        if not whole:
            assert set(acc) == set(breakdown.PHASES)
        arrays.append(backward_call[0][1])
    for p, q in zip(arrays[0].parameters(), arrays[1].parameters(), strict=True):
        assert torch.equal(p, q)


def test_a_smoke_run_writes_every_phase(
    breakdown: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    retained: list[int] = []  # the trainer's allocator setting, not made in this test process
    monkeypatch.setattr(breakdown, "retain_freed_memory", lambda: retained.append(1) or True)
    stem = tmp_path / "sb"
    argv = ["--models", "tiny_mlp", "--sizes", "2", "--rounds", "1", "--iters", "2"]
    assert breakdown.main([*argv, "--warmup", "1", "--out", str(stem)]) == 0
    assert retained == [1]  # every way runs with the allocator setting the trainer runs with
    (row,) = json.loads(stem.with_suffix(".json").read_text())["rows"]
    for way in ("plain", "trainer", "ideal"):
        assert row[f"{way}_step_us"] > 0
    assert all(row[f"trainer_{phase}_us"] > 0 for phase in breakdown.PHASES)
    assert "| tiny_mlp | 2 | nonfinite_check |" in stem.with_suffix(".md").read_text()
