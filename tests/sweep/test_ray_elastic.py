"""`backend: ray` with `ray.elastic` on: every array trains data-parallel (tests/parallel checks
the numbers of one array) on the workers the allocator gives it, on a local Ray (2 CPUs,
loopback, no dashboard). The run must end as on the local backend, trial for trial, with
every decision of the allocator in sweep.log; a resize and a relaunch on two workers happen."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

import hfsweep as hs

from ._toy import sweep_config
from .test_ray_backend import _same_trials

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.slow  # one worker runs this module under xdist: tests/conftest.py

#: perfect scaling assumed (``scaling: perfect``): these tests are about resizing and relaying,
#: so the allocator must grow arrays whenever workers are free, whatever this CPU's profile says
#: (the modelled profiles are tested in tests/elastic/test_sweep_scaling.py)
_ELASTIC = {
    "elastic": {
        "enabled": True,
        "resize_every_s": 0,
        "max_workers_per_array": 2,
        "scaling": "perfect",
    }
}


@pytest.fixture
def local_ray(shared_ray: Any) -> None:
    """The shared local Ray of tests/conftest.py (tests/ on the workers' PYTHONPATH)."""
    shared_ray.start()


#: float64: a data-parallel step sums the workers' shares of the gradient, which equals the
#: one-worker gradient within rounding; in float32 that rounding can flip one of the 40
#: validation predictions of a trial with a large learning rate, and so its accuracy
_FUSION = {"size": 4, "device": "cpu", "dtype": "float64"}


def test_one_elastic_array_at_a_time_reproduces_the_local_backend(
    local_ray: None, tmp_path: Path, told: Counter[int]
) -> None:
    """One array at a time, as the local backend trains them: the allocator gives each array
    both workers, and the trials refilled into it train data-parallel too."""
    kw: dict[str, Any] = {"budget": {"trials": 8, "epochs": 3}, "fusion": _FUSION}
    local = hs.sweep(sweep_config(tmp_path / "local", **kw), progress=False)
    told.clear()
    ray_settings = {**_ELASTIC, "max_concurrent": 1}
    elastic = hs.sweep(
        sweep_config(tmp_path / "elastic", backend="ray", ray=ray_settings, **kw), progress=False
    )
    _same_trials(elastic, local)
    assert told == Counter(range(8))
    assert elastic.best_trial is not None and elastic.best_checkpoint is not None
    for name in ("trials.csv", "best.json", "sweep.json", "state.json", "optuna.journal"):
        assert (elastic.run_dir / name).is_file(), name
    # the allocator's wait and idle totals: in elastic.json, the result and its summary
    assert elastic.elastic is not None and elastic.elastic["workers"] == 2
    assert json.loads((elastic.run_dir / "elastic.json").read_text()) == elastic.elastic
    assert elastic.elastic["plans"] >= 1  # the array's start (its refills are not plans)
    assert "Elastic arrays: " in elastic.summary() and local.elastic is None
    assert not (local.run_dir / "elastic.json").exists()
    assert sorted(p.name for p in (elastic.run_dir / "histories").iterdir()) == sorted(
        p.name for p in (local.run_dir / "histories").iterdir()
    )
    assert not list((elastic.run_dir / "arrays").glob("*"))
    log = (elastic.run_dir / "sweep.log").read_text()
    assert "elastic [array started]: array 0: start 0->2 (a new array of 4 trials" in log
    assert "trains data-parallel on 2 worker(s)" in log
    # trials 4-7 were refilled into array 0 after 15 steps, as on the local backend
    trials = elastic.study.get_trials()
    assert {t.user_attrs["array"] for t in trials} == {0}
    assert [t.user_attrs["start_step"] for t in trials] == [0] * 4 + [15] * 4


def test_two_elastic_arrays_share_the_workers_and_resize_exactly(
    local_ray: None, tmp_path: Path, told: Counter[int]
) -> None:
    """Two arrays at once: the first starts on one worker, since the second array's trials
    queue behind it (before the queue rule it started on both and was shrunk when the second
    started, a resize for nothing), the second on the other, and each is decided again when
    the other ends; the trials end as with one pooled actor per array (the Ray backend without
    elastic), whose arrays hold the same trials."""
    kw: dict[str, Any] = {"budget": {"trials": 8, "epochs": 3}, "fusion": _FUSION}
    pooled = hs.sweep(sweep_config(tmp_path / "pooled", backend="ray", **kw), progress=False)
    told.clear()
    elastic = hs.sweep(
        sweep_config(tmp_path / "elastic", backend="ray", ray=_ELASTIC, **kw), progress=False
    )
    _same_trials(elastic, pooled)
    assert told == Counter(range(8))
    log = (elastic.run_dir / "sweep.log").read_text()
    assert "elastic [array started]: array 0: start 0->1" in log
    assert "1 worker(s) kept for the ~1 array(s) of queued trials the engine forms next" in log
    assert "shrink 2->1" not in log
    assert "elastic: 2 arrays on 2/2 workers (1 new) [array started]" in log
    # when one array ends the other is decided again: it grows back to 2 workers, or keeps 1
    # where its remaining steps no longer pay for a resize (which ends first, and how far the
    # other has got by then, is up to the scheduling; the choice itself is tested on a fake
    # clock in tests/elastic)
    ended = [line for line in log.splitlines() if "elastic [array ended]: array " in line]
    assert ended and any("grow 1->2" in line or "keep 1->1" in line for line in ended), ended


class _PauseOnce:
    """A worker policy that pauses the array's relaunch and lets it go on, on 2 workers, at the
    fifth look (the allocator's part is tested on a fake clock in tests/elastic)."""

    def __init__(self) -> None:
        self.looks = 0

    def started(
        self, folder: str, key: str, members: int, total: int, config: Any = None, **_: Any
    ) -> int:
        return 1

    def relaunch(self, folder: str, workers: int, lost: int, total: int) -> int:
        return 0

    def waiting(self, folder: str, total: int) -> int:
        self.looks += 1
        return 2 if self.looks == 5 else 0

    def reported(self, folder: str, evaluations: Any, live: int) -> None:
        pass

    def ended(self, folder: str, total: int) -> None:
        pass

    def admits(self) -> int | None:
        return None


def test_a_paused_elastic_array_gives_its_workers_back_and_resumes_exactly(
    local_ray: None, tmp_path: Path
) -> None:
    """Paused at its first evaluation boundary (a resize to 0 workers), the array's actors and
    placement group are given back while the driver waits; it resumes from that checkpoint on
    two workers and its members end as on one worker without a pause."""
    from hfsweep.executors import _elastic
    from hfsweep.executors.base import ArrayHooks
    from hfsweep.parallel import request_resize
    from hfsweep.training.results import Member, MemberResult

    from ._toy import TASK

    members = [
        Member(f"trial-{i}", {"lr": lr, "momentum": 0.5, "data_seed": 0, "seed": i})
        for i, lr in enumerate([0.05, 0.3])
    ]
    alone = {r.id: r for r in hs.ArrayTrainer(TASK, dtype=torch.float64).run(members)}
    folder = tmp_path / "arrays" / "0"
    steps: list[int] = []
    free: list[float] = []  # the local Ray's CPUs free while the array is paused
    finished: list[MemberResult] = []

    def report(evaluations: Any) -> dict[str, bool]:
        steps.append(evaluations[0].step)
        if len(steps) == 1:
            request_resize(folder, 0)
        return {}

    policy = _PauseOnce()

    def total() -> int:
        if policy.looks >= 1:  # paused: its actors and placement group were given back
            free.append(ray.available_resources().get("CPU", 0.0))
        return 2

    _elastic.run_elastic_array(
        TASK,
        str(folder),
        members,
        ArrayHooks(report=report, refill=lambda: None, on_finish=finished.append),
        resume=False,
        policy=policy,
        total=total,
        closed=lambda: False,
        bundle={"CPU": 1.0},
        threads=1,
        options={"dtype": torch.float64, "keep_states": False, "final_states": "completed"},
    )
    assert steps == [5, 10, 15] and policy.looks == 5
    assert max(free) == 2.0  # the array held none of the local Ray's 2 CPUs while paused
    for result in finished:
        want = alone[result.id]
        assert result.steps == want.steps == 15
        for got, ref in zip(result.history, want.history, strict=True):
            for name in ref:
                assert got[name] == pytest.approx(ref[name], rel=1e-9, abs=1e-12), name
    assert sorted(r.id for r in finished) == ["trial-0", "trial-1"]


def test_a_node_lost_under_an_elastic_sweep_shrinks_its_array_which_goes_on_exactly(
    tmp_path: Path, told: Counter[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`hfsweep run`'s engine with elastic arrays on a three-node Ray cluster on 127.0.0.1 (a
    head without CPUs, two worker nodes of one CPU): the array trains on a worker on each node,
    holds after its first epoch (its checkpoint written), and one node is removed under it. The
    lost worker shrinks the array, which goes on on the other node from that checkpoint; every
    trial ends once, no evaluation is reported twice, and the trials end as on the local
    backend (float64)."""
    from _ray_cluster import loopback_cluster

    from ._toy import GATE_ENV, GATED_TASK
    from .test_ray_cluster import _log, _Sweep, _wait, _workers_import_tests

    kw: dict[str, Any] = {
        "task": GATED_TASK,
        "budget": {"trials": 4, "epochs": 3},
        "fusion": _FUSION,
    }
    gate = tmp_path / "gate"
    monkeypatch.setenv(GATE_ENV, str(gate))  # absent: the local run is not held
    local = hs.sweep(sweep_config(tmp_path / "local", **kw), progress=False)
    told.clear()
    _workers_import_tests(monkeypatch)
    monkeypatch.setenv("RAY_DEDUP_LOGS", "0")
    gate.write_text("")
    run = tmp_path / "elastic"
    with loopback_cluster() as cluster:
        address = cluster.address
        settings = {**_ELASTIC, "address": address, "max_concurrent": 1}
        sweep = _Sweep(sweep_config(run, backend="ray", ray=settings, **kw), monkeypatch)
        sweep.start()
        try:
            _wait(
                "the array's checkpoint, on 2 workers",
                lambda: (
                    (run / "arrays" / "0" / "array.pt").exists()
                    and "trains data-parallel on 2 worker(s)" in _log(run)
                ),
                sweep.is_alive,
            )
            lost = sorted(cluster.worker_nodes, key=lambda n: n.node_id)[0]
            cluster.remove_node(lost)
            _wait("the lost worker", lambda: "workers lost; going on" in _log(run), sweep.is_alive)
        finally:
            gate.unlink(missing_ok=True)
        result = sweep.result()
    assert result.counts == {"completed": 4, "stopped": 0, "failed": 0, "running": 0}
    assert told == Counter(range(4))
    _same_trials(result, local)
    log = _log(run)
    # on 127.0.0.1, not rewritten to another address of this machine, driver included
    assert (
        f"connected to the cluster at {address} (3 nodes; this driver on 127.0.0.1, "
        "loopback)" in log
    )
    assert "elastic [array started]: array 0: start 0->2" in log
    assert "1 of 2 workers lost; going on with 1 from the last checkpoint" in log
    assert "1 worker(s) lost]: array 0: " in log
    assert log.count("workers lost") == 1


def test_a_compiled_elastic_array_trains_each_trial_as_alone(
    local_ray: None, tmp_path: Path
) -> None:
    """``fusion.compile: true`` with ``ray.elastic``: the array trains data-parallel on both
    workers, each compiling its step (both workers' processes ran the loss compiled: its mark,
    tests/sweep/_compile_marks.py), and every trial ends as it trains alone, on one worker and
    uncompiled (``hs.retrain``; float64, for the reason of ``_FUSION``)."""
    from . import _compile_marks
    from .test_ray_backend import _as_alone

    before = _compile_marks.marks()
    result = hs.sweep(
        sweep_config(
            tmp_path / "run",
            task=_compile_marks.TASK,
            backend="ray",
            ray={**_ELASTIC, "max_concurrent": 1},
            fusion={**_FUSION, "size": 2, "compile": True},
            budget={"trials": 2, "epochs": 1},
        ),
        progress=False,
    )
    assert result.counts == {"completed": 2, "stopped": 0, "failed": 0, "running": 0}
    log = (result.run_dir / "sweep.log").read_text()
    assert "arrays/0 trains data-parallel, compiled (compile: true)" in log
    assert "trains data-parallel on 2 worker(s)" in log
    assert len(_compile_marks.marks() - before) == 2  # the array's two workers
    _as_alone(result, _compile_marks.TASK)
