"""The benchmarks that say why a fused step is below the ideal bound compare like with like.

``benchmarks/stacked_products.py`` times the MLPs' products three ways: they must compute the
same numbers, or its table compares different work. ``benchmarks/op_times.py`` sorts a step's
operators into classes whose sum is the step: every operator lands in exactly one class, and a
smoke run writes every way's figures. No timing is asserted.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from types import ModuleType

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> tuple[ModuleType, ModuleType]:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module("stacked_products"), importlib.import_module("op_times")


@pytest.mark.parametrize("shared", [True, False])
def test_the_products_compute_the_same_numbers_each_way(
    bench: tuple[ModuleType, ModuleType], shared: bool
) -> None:
    products, _ = bench
    size, rows, inp, out = 3, 5, 4, 6
    ways = products._layer_ways(size, rows, inp, out, shared=shared)
    forward = ways["batched forward"]()  # [B, N, out]
    grad_w = ways["batched weight gradient"]()  # [B, out, in]
    assert forward.shape == (size, rows, out) and grad_w.shape == (size, out, inp)
    if shared:
        one = ways["one product forward"]().view(rows, size, out).transpose(0, 1)
        torch.testing.assert_close(one, forward)
        one_w = ways["one product weight gradient"]().view(size, out, inp)
        torch.testing.assert_close(one_w, grad_w)
    else:
        assert ways["batched input gradient"]().shape == (size, rows, inp)
    # ideal's product is one member's on B times the rows: the shapes of the same work
    assert ways["ideal forward"]().shape == (size * rows, out)
    assert ways["ideal weight gradient"]().shape == (out, inp)


def test_every_operator_lands_in_one_class(bench: tuple[ModuleType, ModuleType]) -> None:
    _, times = bench
    cases = {
        "aten::bmm": "products",
        "aten::addmm": "products",
        "aten::convolution_backward": "convolutions",
        "aten::max_pool2d_with_indices_backward": "pooling",
        "aten::threshold_backward": "activations",
        "aten::_log_softmax_backward_data": "the loss",
        "aten::_foreach_addcmul_": "optimizer update",
        "aten::copy_": "layout copies",
        "aten::transpose": "views",
        "aten::empty_strided": "allocations",
        "BaddbmmBackward0": "autograd engine",
        "autograd::engine::evaluate_function: AddmmBackward0": "autograd engine",
        "_StackedLinearBackward": "Python autograd.Function",
        "Optimizer.step#SGD.step": "profiler ranges",
        "aten::something_new": "other operators",
    }
    for name, start in cases.items():
        assert times.op_class(name).startswith(start), (name, times.op_class(name))


def test_a_smoke_run_writes_every_way(
    bench: tuple[ModuleType, ModuleType], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, times = bench
    retained: list[int] = []  # the trainer's allocator setting, not made in this test process
    monkeypatch.setattr(times, "retain_freed_memory", lambda: retained.append(1) or True)
    stem = tmp_path / "op_times"
    argv = ["--models", "tiny_mlp", "--sizes", "2", "--steps", "2", "--warmup", "1"]
    assert times.main([*argv, "--out", str(stem)]) == 0
    assert retained == [1]  # every way runs with the allocator setting the trainer runs with
    (row,) = json.loads(stem.with_suffix(".json").read_text())["rows"]
    for way in times.WAYS:  # the MLP has a hand-written version
        classes = row[way]
        assert classes["steps compared"] >= 1
        assert classes[times.FAULTS] >= 0  # a count per step, outside the step's sum
        parts = [v for k, v in classes.items() if k not in ("step", "steps compared", times.FAULTS)]
        assert all(v >= 0 for v in parts)
        assert classes["step"] == pytest.approx(sum(parts))
        assert classes[times.OUTSIDE] > 0
    # the engine's stacked Linear is an autograd.Function; the ideal model has none
    assert row["fused"]["Python autograd.Function code (forward, backward)"] > 0
    assert "| tiny_mlp | 2 | step |" in stem.with_suffix(".md").read_text()


def test_allocator_as_left_skips_the_trainers_setting(
    bench: tuple[ModuleType, ModuleType], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, times = bench
    retained: list[int] = []
    monkeypatch.setattr(times, "retain_freed_memory", lambda: retained.append(1) or True)
    argv = ["--models", "tiny_mlp", "--sizes", "2", "--steps", "2", "--warmup", "1"]
    stem = tmp_path / "as_left"
    assert times.main([*argv, "--allocator-as-left", "--out", str(stem)]) == 0
    assert retained == []
    assert "--allocator-as-left" in stem.with_suffix(".md").read_text()
