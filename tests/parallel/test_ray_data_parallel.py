"""A data-parallel array on a local Ray (2 CPUs, loopback): its two workers are actors in one
placement group; one is SIGKILLed mid-run, and the array goes on from its checkpoint on one
actor, to the end the unkilled 1-worker array reaches."""

from __future__ import annotations

from pathlib import Path

import _dp_tasks
import pytest
from test_data_parallel import _killed_worker_run


@pytest.mark.slow
def test_ray_workers_in_a_placement_group_lose_one_and_end_as_one_worker(
    tmp_path: Path, shared_ray
) -> None:
    ray = pytest.importorskip("ray")
    from ray import cloudpickle

    from hfsweep.parallel import train_data_parallel_ray

    shared_ray.start()
    # the actors cannot import the tests' helper module: its task and hooks go by value
    cloudpickle.register_pickle_by_value(_dp_tasks)
    try:
        _killed_worker_run(train_data_parallel_ray, "sgd", tmp_path)
    finally:
        cloudpickle.unregister_pickle_by_value(_dp_tasks)
    assert ray.is_initialized()
