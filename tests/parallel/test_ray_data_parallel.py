"""A data-parallel array on a local Ray (2 CPUs, loopback): its two workers are actors in one
placement group; one is SIGKILLed mid-run, and the array goes on from its checkpoint on one
actor, to the end the unkilled 1-worker array reaches."""

from __future__ import annotations

from pathlib import Path

import _dp_tasks
import pytest
import torch
from _dp_tasks import Recorder, make_task
from test_data_parallel import _members, _reference, _same_results

import hfsweep as hs


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
        members = [hs.Member(m.id, {**m.config, "kill_after": 7}) for m in _members("sgd")]
        expected = _reference(members, tmp_path)
        directory = tmp_path / "dp"
        recorder = Recorder(str(tmp_path / "log.txt"), str(directory))
        got = train_data_parallel_ray(
            make_task(),
            members,
            workers=2,
            checkpoint_dir=directory,
            report=recorder,
            on_finish=recorder.finished,
            dtype=torch.float64,
            eval_every=3,
            timeout_s=30,
        )
    finally:
        cloudpickle.unregister_pickle_by_value(_dp_tasks)
    assert ray.is_initialized()
    _same_results(expected, got)
    lines = recorder.lines()
    workers = [(int(line[2]), int(line[3])) for line in lines if line[:2] == ["eval", "sgd0"]]
    assert workers == [(3, 2), (6, 2), (9, 1), (12, 1)]
    assert sorted(line[1] for line in lines if line[0] == "done") == ["sgd0", "sgd1", "sgd2"]
