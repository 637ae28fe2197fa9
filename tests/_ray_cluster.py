"""A multi-node Ray cluster on loopback for the tests: a head without CPUs and worker nodes of
one CPU each (``ray.cluster_utils.Cluster``), every node on 127.0.0.1, so arrays and trials run
on the worker nodes only and a node can be removed mid-run."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
from _ready import SERVER_START_S, start_with_retries


@contextlib.contextmanager
def loopback_cluster(workers: int = 2) -> Iterator[Any]:
    """The cluster, started with the environment this process has now (set the nodes' variables
    before); skips the test where this process already runs a Ray. On exit this process's Ray,
    if it connected, and then every node (their processes, by pid) are shut down."""
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        pytest.skip("a Ray is already running in this process")
    started: list[Any] = []

    def start() -> Any:
        made = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 0,
                "node_ip_address": "127.0.0.1",
                "include_dashboard": False,
            },
        )
        started.append(made)
        for _ in range(workers):
            made.add_node(num_cpus=1, node_ip_address="127.0.0.1")
        made.wait_for_nodes(timeout=SERVER_START_S)  # 30 s by default: short under load
        return made

    def clean_up() -> None:
        while started:
            started.pop().shutdown()

    try:
        yield start_with_retries(f"a {workers}-worker Ray cluster on loopback", start, clean_up)
    finally:
        if ray.is_initialized():
            ray.shutdown()
        clean_up()
