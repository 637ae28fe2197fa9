"""``offload: auto`` by memory: on the CPU without a device memory limit it keeps arrays as they
are; with a ``device_memory`` that not even one member's estimated state fits, it offloads without
measuring anything (where some members fit, it measures: tests/offload/test_offload_auto.py)."""

from __future__ import annotations

import logging

import pytest
import torch
from _offload_toy import SGD, toy_task
from _same_results import assert_same, members
from torch import nn

import hfsweep as hs
from hfsweep.offload import check_offload, choose_offload, offload_budget, state_bytes


def test_state_bytes_counts_parameters_four_times_and_buffers_once() -> None:
    model = nn.Sequential(nn.Linear(3, 5), nn.BatchNorm1d(5)).double()
    params = (3 * 5 + 5 + 5 + 5) * 8
    buffers = (5 + 5) * 8 + 8  # running mean, var, num_batches_tracked (int64)
    assert state_bytes(model) == 4 * params + buffers


def test_auto_decides_by_memory() -> None:
    mode, why = choose_offload("auto", state=10**9, device="cpu")
    assert mode == "none" and "one memory" in why
    mode, why = choose_offload("auto", state=1001, device="cpu", device_memory=1000)
    assert mode == "host" and "1001 bytes exceeds the 1000 bytes" in why
    assert choose_offload("auto", state=1000, device="cpu", device_memory=1000)[0] == "none"
    assert choose_offload("host", state=1, device="cpu")[0] == "host"
    assert choose_offload("none", state=10**12, device="cpu", device_memory=1)[0] == "none"
    with pytest.raises(ValueError, match="offload must be one of 'none', 'host', 'auto', got 'on'"):
        check_offload("on")


@pytest.mark.slow
def test_the_trainer_with_auto(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    task = toy_task()
    trials = members(SGD[:2])
    reference = hs.ArrayTrainer(task, dtype=torch.float64).run(trials)
    with caplog.at_level(logging.INFO, logger="hfsweep.trainer"):
        kept = hs.ArrayTrainer(task, dtype=torch.float64, offload="auto").run(trials)
    assert any("auto keeps the array on cpu" in r.getMessage() for r in caplog.records)
    assert not any(r.getMessage().startswith("offload: host") for r in caplog.records)
    # a budget that not even B=1 fits: offload is the only way, nothing is measured
    estimate = state_bytes(task.build_model(task.resolve(SGD[0])).double())

    def no_measuring(*args: object, **kwargs: object) -> None:
        raise AssertionError("offload: auto measured where offload was the only way")

    monkeypatch.setattr("hfsweep.sizing.timing.measure_step", no_measuring)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="hfsweep.trainer"):
        spilled = hs.ArrayTrainer(
            task, dtype=torch.float64, offload="auto", device_memory=estimate - 1
        ).run(trials[1:])  # B = 1 (two members' boundary activations would not fit it)
    assert any(
        "auto spills the array to the host" in r.getMessage()
        and "not even one member fits" in r.getMessage()
        for r in caplog.records
    )
    assert any(r.getMessage().startswith("offload: host") for r in caplog.records)
    for a, c in zip(kept, reference, strict=True):
        assert_same(a, c, rng=True)
    assert_same(spilled[0], reference[1], rng=True)


def test_a_cuda_budget_is_free_memory_rounded_down_to_whole_256_mib(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Free memory that moved by a few MiB between two runs gives the same budget (and so the
    same profile cache key); the budget never exceeds what is free."""
    mib = 1 << 20
    free = [40_000 * mib + 3 * mib, 40_000 * mib + 100 * mib]

    def mem_get_info(device: object) -> tuple[int, int]:
        return free.pop(0), 80_000 * mib

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    first, second = offload_budget("cuda:0"), offload_budget("cuda:0")
    assert first == second == 39_936 * mib  # 156 x 256 MiB
    assert first is not None and first <= 40_000 * mib
    assert offload_budget("cuda:0", device_memory=12345) == 12345
    assert offload_budget("cpu") is None
