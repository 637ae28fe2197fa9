"""A data-parallel array resized on a local Ray (2 CPUs, loopback): the actors that go on are
kept across the resize (rank 0's process trains every launch), the run equals the unresized
array, and a grow asked while the array trains starts its actors before the boundary
(``hfsweep.parallel._ray._Crew``; benchmarks/resize_pause.py measures what this saves)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import _dp_tasks
import pytest
import torch
from _dp_tasks import Recorder, make_task
from test_data_parallel import _members, _reference, _same_results

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("keep", [True, False])
def test_a_resized_array_keeps_its_actors_and_equals_the_unresized_array(
    keep: bool, tmp_path: Path, shared_ray
) -> None:
    """1 -> 2 -> 1 workers at the boundaries of steps 3 and 9: the results equal the one-worker
    array's within float64 rounding; with ``keep_workers`` rank 0's hooks ran in one process
    for all three launches, without it in a new one each launch."""
    from ray import cloudpickle

    from hfsweep.parallel import train_data_parallel_ray

    shared_ray.start()
    members = _members("sgd")
    expected = _reference(members, tmp_path)
    directory = tmp_path / "dp"
    directory.mkdir()
    recorder = Recorder(str(tmp_path / "log.txt"), str(directory), {3: 2, 9: 1})
    cloudpickle.register_pickle_by_value(_dp_tasks)
    try:
        got = train_data_parallel_ray(
            make_task(),
            members,
            workers=1,
            checkpoint_dir=directory,
            report=recorder,
            on_finish=recorder.finished,
            dtype=torch.float64,
            eval_every=3,
            timeout_s=60,
            keep_workers=keep,
        )
    finally:
        cloudpickle.unregister_pickle_by_value(_dp_tasks)
    _same_results(expected, got)
    evals = [line for line in recorder.lines() if line[:2] == ["eval", "sgd0"]]
    assert [(int(line[2]), int(line[3])) for line in evals] == [(3, 1), (6, 2), (9, 2), (12, 1)]
    pids = [line[4] for line in evals]
    launches = [pids[0], pids[1], pids[3]]  # steps 3 | 6, 9 | 12
    assert len(set(launches)) == (1 if keep else 3)
    assert not (directory / "resize.json").exists()


def test_a_grow_asked_while_training_starts_its_actors_ahead(tmp_path: Path, shared_ray) -> None:
    """The crew of a 1-worker launch sees a request for 2 workers: it starts the added actor
    (a placement group of its own) at once; the launch on 2 keeps rank 0's actor and takes
    that one as rank 1; a shrink to 1 gives it back; the end gives back everything."""
    import ray
    from ray.util.placement_group import placement_group_table

    from hfsweep.parallel import request_resize
    from hfsweep.parallel._ray import _Crew

    shared_ray.start()
    crew = _Crew({"CPU": 1.0}, keep=True)
    job = SimpleNamespace(directory=tmp_path, workers=1)
    try:
        assert crew.fit(job, place_timeout_s=60) is None  # type: ignore[arg-type]
        (first,) = crew.actors
        crew.ahead(job)  # type: ignore[arg-type]
        assert crew.spare is None  # nothing asked yet
        request_resize(tmp_path, 2)
        crew.ahead(job)  # type: ignore[arg-type]
        assert crew.spare is not None
        (spare,) = crew.spare[1]
        assert ray.get(spare.rendezvous.remote())  # up (and warmed) before the grow
        job.workers = 2
        assert crew.fit(job, place_timeout_s=60) is None  # type: ignore[arg-type]
        assert crew.actors == [first, spare] and crew.spare is None
        crew.shrink(1)
        assert crew.actors == [first]
        groups = [g for _, g in placement_group_table().items() if g["state"] != "REMOVED"]
        assert len(groups) == 1
    finally:
        crew.end()
    assert crew.actors == []
    assert all(g["state"] == "REMOVED" for g in placement_group_table().values())
