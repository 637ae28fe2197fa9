"""The array trainer with ``offload="host"``: every member trains exactly as with
``offload="none"`` (float64; SGD with momentum, AdamW, schedules, clipping, label smoothing,
BatchNorm, per-member dropout), a non-finite member fails alone, checkpoints resume, and
``auto`` keeps an array on the CPU unless a device memory limit says it does not fit."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import pytest
import torch
from torch import nn

import hfsweep as hs
from hfsweep.offload import OffloadError
from hfsweep.tasks import TensorBatches


class Net(nn.Module):
    """A custom class around layers (not an nn.Sequential itself): offload traces its forward."""

    def __init__(self, hidden: int, dropout: float) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(12, hidden), nn.BatchNorm1d(hidden), nn.Tanh(), nn.Linear(hidden, hidden)
        )
        self.head = nn.Sequential(nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x.view(-1, 12)))


def _data(config: Mapping[str, Any]) -> tuple[TensorBatches, TensorBatches]:
    gen = torch.Generator().manual_seed(config["data_seed"])
    x = torch.randn(120, 12, generator=gen)
    y = (x @ torch.randn(12, 4, generator=gen)).argmax(1)
    b = config["batch_size"]
    return TensorBatches(x[:96], y[:96], b, shuffle=True), TensorBatches(
        x[96:], y[96:], 12, shuffle=False
    )


def _task() -> hs.Task:
    return hs.Task(
        name="offload_toy",
        model=lambda c: Net(16, float(c["dropout"] or 0.0)),
        data=_data,
        defaults={"batch_size": 24, "epochs": 2},
    )


SGD = [
    {
        "seed": i,
        "lr": 0.05 + 0.02 * i,
        "momentum": 0.3 * i,
        "weight_decay": 1e-3 * i,
        "dropout": 0.1 * i,
        "label_smoothing": 0.05 * i,
        "grad_clip": None if i % 2 else 0.5,
        "lr_schedule": "cosine",
        "eta_min": 1e-3 * i,
    }
    for i in range(3)
]
ADAMW = [
    {
        "optimizer": "adamw",
        "lr": 1e-3 * (i + 1),
        "beta1": 0.8 + 0.05 * i,
        "weight_decay": 0.01 * i,
        "lr_schedule": "step",
        "step_size": 1,
        "gamma": 0.5 + 0.1 * i,
        "seed": 10 + i,
        "dropout": 0.2,
    }
    for i in range(3)
]


def _members(configs: list[dict[str, Any]]) -> list[hs.Member]:
    return [hs.Member(f"t{i}", c) for i, c in enumerate(configs)]


def _assert_same(a: hs.MemberResult, b: hs.MemberResult) -> None:
    assert (a.status, a.steps) == (b.status, b.steps)
    assert len(a.history) == len(b.history)
    for ra, rb in zip(a.history, b.history, strict=True):
        for k in ra:
            assert ra[k] == pytest.approx(rb[k], rel=1e-7, abs=1e-12), (a.id, k)
    assert a.state is not None and b.state is not None
    for k, v in a.state["model"].items():
        torch.testing.assert_close(v, b.state["model"][k], rtol=1e-7, atol=1e-12, msg=k)
    for k, st in a.state["optimizer"]["state"].items():
        for name, v in st.items():
            torch.testing.assert_close(
                v, b.state["optimizer"]["state"][k][name], rtol=1e-7, atol=1e-12
            )
    assert a.state["rng"] == b.state["rng"]


@pytest.mark.slow
@pytest.mark.parametrize("configs", [SGD, ADAMW], ids=["sgd-momentum-cosine", "adamw-step"])
def test_offloaded_members_train_as_without_offload(
    configs: list[dict[str, Any]], caplog: pytest.LogCaptureFixture
) -> None:
    task = _task()
    plain = hs.ArrayTrainer(task, dtype=torch.float64).run(_members(configs))
    with caplog.at_level(logging.INFO, logger="hfsweep.trainer"):
        off = hs.ArrayTrainer(task, dtype=torch.float64, offload="host").run(_members(configs))
    # the engine ran: the model was cut into shards (Linear+BN | Tanh+Linear | ... )
    shards = [r.args[0] for r in caplog.records if r.getMessage().startswith("offload: host")]
    assert shards and shards[0] >= 3
    assert [r.status for r in plain] == ["completed"] * 3
    for a, b in zip(off, plain, strict=True):
        _assert_same(a, b)


def test_a_budget_is_kept_and_results_do_not_change() -> None:
    """With a device memory budget the engine cuts finer and still trains the same."""
    task = _task()
    plain = hs.ArrayTrainer(task, dtype=torch.float64).run(_members(SGD))
    off = hs.ArrayTrainer(task, dtype=torch.float64, offload="host", device_memory=64 * 1024).run(
        _members(SGD)
    )
    for a, b in zip(off, plain, strict=True):
        _assert_same(a, b)


def test_a_budget_too_small_for_one_layer_is_refused() -> None:
    trainer = hs.ArrayTrainer(_task(), dtype=torch.float64, offload="host", device_memory=1024)
    with pytest.raises(OffloadError, match="shard limit"):
        trainer.run(_members(SGD))


@pytest.mark.slow
def test_a_nonfinite_member_fails_alone_under_offload() -> None:
    task = _task()
    with_bad = [SGD[0], {**SGD[1], "lr": 1e300}, SGD[2]]
    plain = hs.ArrayTrainer(task).run(_members(with_bad))
    off = hs.ArrayTrainer(task, offload="host").run(_members(with_bad))
    assert [r.status for r in off] == ["completed", "failed", "completed"]
    assert [r.status for r in plain] == [r.status for r in off]
    assert off[1].steps == plain[1].steps
    for i in (0, 2):
        assert off[i].history == plain[i].history  # float32, bit for bit


@pytest.mark.slow
def test_resume_under_offload_equals_an_uninterrupted_run(tmp_path) -> None:
    task = _task()
    reference = hs.ArrayTrainer(task, dtype=torch.float64).run(_members(SGD))
    stop = {"n": 0}

    def report(evaluations: list[hs.Evaluation]) -> dict[str, bool]:
        stop["n"] += 1
        if stop["n"] == 1:
            raise KeyboardInterrupt  # a crash after the first evaluation's checkpoint
        return {}

    trainer = hs.ArrayTrainer(
        task, dtype=torch.float64, offload="host", checkpoint_dir=tmp_path, eval_every=2
    )
    with pytest.raises(KeyboardInterrupt):
        trainer.run(_members(SGD), report=report)
    resumed = hs.ArrayTrainer(
        task, dtype=torch.float64, offload="host", checkpoint_dir=tmp_path, eval_every=2
    ).run(_members(SGD), resume=True)
    again = hs.ArrayTrainer(task, dtype=torch.float64, eval_every=2).run(_members(SGD))
    for a, b in zip(resumed, again, strict=True):
        _assert_same(a, b)
    assert [r.steps for r in reference] == [r.steps for r in again]


def test_offload_arguments_are_checked() -> None:
    with pytest.raises(
        ValueError,
        match=r"ArrayTrainer\(offload=...\) must be one of 'none', 'host', 'auto', got 'gpu'",
    ):
        hs.ArrayTrainer(_task(), offload="gpu")
    with pytest.raises(ValueError, match="device_memory must be a number of bytes"):
        hs.ArrayTrainer(_task(), device_memory=-5)


@pytest.mark.slow
def test_out_of_memory_under_offload_splits_and_loses_nothing(monkeypatch, tmp_path) -> None:
    """An out-of-memory error in an offloaded step splits the array as without offload; every
    member ends as in an uninterrupted run without offload."""
    from hfsweep.offload import OffloadedArray

    task = _task()
    reference = hs.ArrayTrainer(task, dtype=torch.float64).run(_members(SGD))
    forward = OffloadedArray._forward
    calls = {"n": 0}

    def small_memory(self: OffloadedArray, x: torch.Tensor, keep: bool) -> torch.Tensor:
        calls["n"] += 1
        if keep and self.array.size > 2 and calls["n"] >= 3:
            raise torch.OutOfMemoryError("simulated: CUDA out of memory")
        return forward(self, x, keep)

    monkeypatch.setattr(OffloadedArray, "_forward", small_memory)
    results = hs.ArrayTrainer(
        task, dtype=torch.float64, offload="host", checkpoint_dir=tmp_path
    ).run(_members(SGD))
    assert calls["n"] > 3
    for a, b in zip(results, reference, strict=True):
        _assert_same(a, b)
