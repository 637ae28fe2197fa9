"""The dry run counts a model's size on the meta device before building it; a task that keeps
what it builds (a pretrained base in ``functools.lru_cache``, the usual way to load it once)
would then keep meta tensors, and every real build after would fail blaming the model. It is
refused, saying what happened and what to do; a cache that builds on a device of its own passes."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import hfsweep as hs
from hfsweep.config import ConfigError, parse_sweep
from hfsweep.core._dryrun import dry_run

from ._toy import _data


def _task(base: Any) -> hs.Task:
    def model(config: Mapping[str, Any]) -> nn.Module:
        return nn.Sequential(base(), nn.Tanh(), nn.Linear(8, 3))

    return hs.Task(name="cached_base", model=model, data=_data, defaults={"batch_size": 32})


def _sweep(task: hs.Task, tmp_path: Path) -> Any:
    return parse_sweep(
        {
            "task": task,
            "search_space": {"lr": {"type": "float", "low": 1e-3, "high": 0.1}},
            "budget": {"trials": 2, "epochs": 1},
            "metric": "val_loss",
            "mode": "min",
            "fusion": {"size": 2, "device": "cpu"},
            "output": str(tmp_path / "run"),
        }
    )


def test_a_task_caching_its_base_model_is_refused_saying_why(tmp_path: Path) -> None:
    @functools.lru_cache(maxsize=1)
    def base() -> nn.Module:  # built where it is first called, then shared
        return nn.Linear(8, 8)

    with pytest.raises(ConfigError) as info:
        dry_run(_sweep(_task(base), tmp_path))
    message = str(info.value)
    assert "keeps tensors from one call to the next" in message
    assert "functools.lru_cache" in message and "meta device" in message
    assert "with torch.device('cpu')" in message


def test_a_cache_that_builds_on_its_own_device_passes(tmp_path: Path) -> None:
    @functools.lru_cache(maxsize=1)
    def base() -> nn.Module:
        with torch.device("cpu"):  # as the message above advises
            return nn.Linear(8, 8)

    dry_run(_sweep(_task(base), tmp_path))
    assert not any(p.is_meta for p in base().parameters())
