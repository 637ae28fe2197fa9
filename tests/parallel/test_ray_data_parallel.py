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


@pytest.mark.slow
def test_a_ray_worker_that_raises_surfaces_the_tasks_exception(tmp_path: Path, shared_ray) -> None:
    """Rank 1's actor raises in the task's forward: the task's exception, as on the process
    launcher (tests/parallel/test_worker_errors.py), not a wrapper."""
    pytest.importorskip("ray")
    import test_worker_errors as failing
    from ray import cloudpickle

    from hfsweep._usercode import phase_of, remote_traceback
    from hfsweep.parallel import WorkerError, train_data_parallel_ray

    shared_ray.start()
    members = [failing.hs.Member(f"m{i}", {"lr": 0.1, "seed": i, "fail_rank": 1}) for i in range(2)]
    for module in (_dp_tasks, failing):
        cloudpickle.register_pickle_by_value(module)
    try:
        with pytest.raises(failing.BadWidth) as info:
            train_data_parallel_ray(
                failing._task(),
                members,
                workers=2,
                checkpoint_dir=tmp_path / "dp",
                eval_every=3,
                timeout_s=20,
            )
    finally:
        for module in (_dp_tasks, failing):
            cloudpickle.unregister_pickle_by_value(module)
    exc = info.value
    assert str(exc) == "width 16 is not allowed on rank 1" and phase_of(exc) is not None
    assert "in forward" in (remote_traceback(exc) or "")
    assert isinstance(exc.__cause__, WorkerError)
