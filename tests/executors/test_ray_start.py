"""How the Ray executor starts or joins a Ray, without starting one: ``ray.init`` is replaced."""

from __future__ import annotations

from typing import Any

import pytest
from sweep._toy import TASK

from hfsweep.config import RayConfig
from hfsweep.executors import RayExecutor
from hfsweep.settings import ArraySettings

ray = pytest.importorskip("ray")


class _Called(Exception):
    pass


def test_no_address_starts_a_ray_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """``ray.address: null`` must start a local Ray on loopback even where a cluster of
    ``ray start`` (or ``RAY_ADDRESS``) runs on the machine: ``ray.init(address=None)`` would join
    that cluster (and, given the loopback address, fail to reach it). A given address is
    checked and joined as tests/sweep/test_ray_address.py and test_ray_cluster.py show."""
    seen: dict[str, Any] = {}

    def init(**kwargs: Any) -> None:
        seen.update(kwargs)
        raise _Called

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    with pytest.raises(_Called):
        RayExecutor(
            TASK,
            arrays=ArraySettings(device="cpu"),
            settings=RayConfig(address=None),
        )
    assert seen["address"] == "local"
    assert seen["_node_ip_address"] == "127.0.0.1"
