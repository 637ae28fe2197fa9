"""The trainer and ``hfsweep run`` with ``offload: host`` on a fine-tuning task (a frozen backbone,
the same in every trial, and trained heads): the offloaded array keeps the backbone once
(``share_frozen``, the default), and every member trains exactly as without offload."""

from __future__ import annotations

import csv
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from _offload_toy import SGD, FrozenNet, frozen_task
from _same_results import assert_same, members

import hfsweep as hs
from hfsweep.cli import main
from hfsweep.offload import OffloadError, fit_size, frozen_bytes, state_bytes
from hfsweep.sizing.model import Measurement
from hfsweep.sizing.offloading import profile_offload

#: SGD's members, one epoch each
ONE_EPOCH = [{**c, "epochs": 1} for c in SGD]
#: a budget whose shard limit (a quarter) holds the backbone's widest layer once, not 3 times
BUDGET = 4 * 20_000


def _layer_bytes() -> int:
    layer = FrozenNet(0.0).double().backbone[2]  # Linear(48, 48): 18,816 bytes in float64
    return sum(p.numel() * p.element_size() for p in layer.parameters())


def test_an_offloaded_fine_tuning_array_keeps_its_backbone_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert _layer_bytes() <= BUDGET // 4 < 3 * _layer_bytes()
    task = frozen_task()
    plain = hs.ArrayTrainer(task, dtype=torch.float64).run(members(ONE_EPOCH))
    with caplog.at_level(logging.INFO, logger="hfsweep.trainer"):
        off = hs.ArrayTrainer(task, dtype=torch.float64, offload="host", device_memory=BUDGET).run(
            members(ONE_EPOCH)
        )
    shards = [r.args for r in caplog.records if r.getMessage().startswith("offload: host")]
    assert shards and shards[0][0] >= 3 and shards[0][2] == 6  # the backbone's 6 tensors
    assert [r.status for r in plain] == ["completed"] * 3
    for a, b in zip(off, plain, strict=True):
        assert_same(a, b, rng=True)
    # per-member copies of the backbone cannot be cut into shards within that budget
    unshared = hs.ArrayTrainer(
        task, dtype=torch.float64, offload="host", device_memory=BUDGET, share_frozen=False
    )
    with pytest.raises(OffloadError, match="over the shard limit"):
        unshared.run(members(ONE_EPOCH))


def test_auto_counts_the_frozen_backbone_once() -> None:
    """``offload: auto``'s estimate with ``share_frozen``: the backbone once for the array, a
    head per member. A budget below one member's unshared state but above the backbone and
    two heads: without sharing nothing is measured (offloaded: not one member fits), with
    sharing two members are estimated to fit, and what fits is measured."""
    model = FrozenNet(0.0).double()
    backbone = sum(p.numel() * p.element_size() for p in model.backbone.parameters())
    head = sum(p.numel() * p.element_size() for p in model.head.parameters())
    assert frozen_bytes(model) == backbone
    assert state_bytes(model, share_frozen=True) == 4 * head
    assert state_bytes(model) == 4 * (backbone + head)
    budget = backbone + 2 * 4 * head + 5
    assert fit_size(4 * head, budget, backbone) == 2
    calls: list[tuple[int, bool]] = []

    def measure(n: int, offloaded: bool) -> Measurement:
        calls.append((n, offloaded))
        return Measurement(size=n, samples_per_s=100.0 * (1 + offloaded), peak_bytes=0, step_s=1.0)

    task = frozen_task()
    kwargs: dict[str, Any] = {"device_memory": budget, "dtype": torch.float64, "measure": measure}
    unshared = profile_offload(task, SGD[0], 3, share_frozen=False, **kwargs)
    assert (unshared.mode, unshared.fit_size, calls) == ("host", 0, [])
    shared = profile_offload(task, SGD[0], 3, **kwargs)
    assert (shared.mode, shared.fit_size) == ("host", 2)
    assert sorted(calls) == [(1, False), (2, False), (3, True)]


TASK_FILE = """
import sys
sys.path.insert(0, {tests!r})
from _offload_toy import frozen_task
TASK = frozen_task()
"""


def _run(folder: Path, offload: str) -> list[dict[str, str]]:
    task = folder / "frozen_task.py"
    task.write_text(TASK_FILE.format(tests=str(Path(__file__).parent)), encoding="utf-8")
    sweep = folder / f"{offload}.yaml"
    data = {
        "task": f"{task}:TASK",
        "search_space": "sgd_momentum",
        "searcher": {"name": "random"},
        "budget": {"trials": 3, "epochs": 1},
        "metric": "val_accuracy",
        "mode": "max",
        "seed": 3,
        "fusion": {"size": 3, "device": "cpu", "dtype": "float64", "offload": offload},
        "output": str(folder / f"run_{offload}"),
    }
    sweep.write_text(yaml.safe_dump(data), encoding="utf-8")
    assert main(["run", str(sweep), "--quiet"]) == 0
    with (folder / f"run_{offload}" / "trials.csv").open(newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_hfsweep_run_offloads_a_fine_tuning_sweep_with_its_backbone_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    plain = _run(tmp_path, "none")
    with caplog.at_level(logging.INFO, logger="hfsweep.trainer"):
        offloaded = _run(tmp_path, "host")
    logged = [r.args for r in caplog.records if r.getMessage().startswith("offload: host")]
    assert logged and all(args[2] == 6 for args in logged)  # share_frozen: the default
    assert len(plain) == len(offloaded) == 3
    for a, b in zip(plain, offloaded, strict=True):
        assert a["state"] == b["state"] == "COMPLETE"
        assert float(b["value"]) == pytest.approx(float(a["value"]), rel=1e-7)
