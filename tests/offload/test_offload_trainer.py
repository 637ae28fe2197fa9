"""The array trainer with ``offload="host"``: every member trains exactly as with
``offload="none"`` (float64; SGD with momentum, AdamW, schedules, clipping, label smoothing,
BatchNorm, per-member dropout), a non-finite member fails alone, checkpoints resume, an
out-of-memory error splits the array as without offload."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from _offload_toy import ADAMW, SGD, toy_task
from _same_results import assert_same, members

import hfsweep as hs
from hfsweep.offload import OffloadError


@pytest.mark.slow
@pytest.mark.parametrize("configs", [SGD, ADAMW], ids=["sgd-momentum-cosine", "adamw-step"])
def test_offloaded_members_train_as_without_offload(
    configs: list[dict[str, Any]], caplog: pytest.LogCaptureFixture
) -> None:
    task = toy_task()
    plain = hs.ArrayTrainer(task, dtype=torch.float64).run(members(configs))
    with caplog.at_level(logging.INFO, logger="hfsweep.trainer"):
        off = hs.ArrayTrainer(task, dtype=torch.float64, offload="host").run(members(configs))
    # the engine ran: the model was cut into shards (Linear+BN | Tanh+Linear | ... )
    shards = [r.args[0] for r in caplog.records if r.getMessage().startswith("offload: host")]
    assert shards and shards[0] >= 3
    assert [r.status for r in plain] == ["completed"] * 3
    for a, b in zip(off, plain, strict=True):
        assert_same(a, b, rng=True)


def test_a_budget_is_kept_and_results_do_not_change() -> None:
    """With a device memory budget the engine cuts finer and still trains the same."""
    task = toy_task()
    plain = hs.ArrayTrainer(task, dtype=torch.float64).run(members(SGD))
    off = hs.ArrayTrainer(task, dtype=torch.float64, offload="host", device_memory=64 * 1024).run(
        members(SGD)
    )
    for a, b in zip(off, plain, strict=True):
        assert_same(a, b, rng=True)


def test_a_budget_too_small_for_one_layer_is_refused() -> None:
    trainer = hs.ArrayTrainer(toy_task(), dtype=torch.float64, offload="host", device_memory=1024)
    with pytest.raises(OffloadError, match="shard limit"):
        trainer.run(members(SGD))


@pytest.mark.slow
def test_a_nonfinite_member_fails_alone_under_offload() -> None:
    task = toy_task()
    with_bad = [SGD[0], {**SGD[1], "lr": 1e300}, SGD[2]]
    plain = hs.ArrayTrainer(task).run(members(with_bad))
    off = hs.ArrayTrainer(task, offload="host").run(members(with_bad))
    assert [r.status for r in off] == ["completed", "failed", "completed"]
    assert [r.status for r in plain] == [r.status for r in off]
    assert off[1].steps == plain[1].steps
    for i in (0, 2):
        assert off[i].history == plain[i].history  # float32, bit for bit


@pytest.mark.slow
def test_resume_under_offload_equals_an_uninterrupted_run(tmp_path) -> None:
    task = toy_task()
    reference = hs.ArrayTrainer(task, dtype=torch.float64).run(members(SGD))
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
        trainer.run(members(SGD), report=report)
    resumed = hs.ArrayTrainer(
        task, dtype=torch.float64, offload="host", checkpoint_dir=tmp_path, eval_every=2
    ).run(members(SGD), resume=True)
    again = hs.ArrayTrainer(task, dtype=torch.float64, eval_every=2).run(members(SGD))
    for a, b in zip(resumed, again, strict=True):
        assert_same(a, b, rng=True)
    assert [r.steps for r in reference] == [r.steps for r in again]


def test_offload_arguments_are_checked() -> None:
    with pytest.raises(
        ValueError,
        match=r"ArrayTrainer\(offload=...\) must be one of 'none', 'host', 'auto', got 'gpu'",
    ):
        hs.ArrayTrainer(toy_task(), offload="gpu")
    with pytest.raises(ValueError, match="device_memory must be a number of bytes"):
        hs.ArrayTrainer(toy_task(), device_memory=-5)


@pytest.mark.slow
def test_out_of_memory_under_offload_splits_and_loses_nothing(monkeypatch, tmp_path) -> None:
    """An out-of-memory error in an offloaded step splits the array as without offload; every
    member ends as in an uninterrupted run without offload."""
    from hfsweep.offload import OffloadedArray

    task = toy_task()
    reference = hs.ArrayTrainer(task, dtype=torch.float64).run(members(SGD))
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
    ).run(members(SGD))
    assert calls["n"] > 3
    for a, b in zip(results, reference, strict=True):
        assert_same(a, b, rng=True)
