"""`backend: ray`: arrays trained in Ray actors on a local Ray (2 CPUs, loopback, no dashboard).

The driver keeps the searcher, scheduler and study, so with one array at a time the Ray backend
must reproduce the local backend value for value; with two at once every budgeted trial must
still end once; and a worker that dies must be replaced, its array continuing from its
checkpoint exactly.
"""

from __future__ import annotations

import os
import re
import signal
from collections import Counter
from pathlib import Path
from typing import Any

import optuna
import pytest

import hfsweep as hs

from . import _compile_marks, _crashy
from ._toy import TASK, sweep_config

ray = pytest.importorskip("ray")

# one worker runs this module under xdist (tests/conftest.py); one test runs by default, the
# others are `slow`

_FLAG = "HFSWEEP_TEST_CRASH_FLAG"
_ASHA = {"name": "asha", "options": {"grace_period": 1, "reduction_factor": 2}}


@pytest.mark.slow
def test_a_ray_started_for_a_refused_sweep_is_shut_down(tmp_path: Path) -> None:
    """Runs with no Ray up (the shared one is shut down before a test that does not use it):
    the executor starts a local Ray, finds the cluster cannot hold one array, and leaves no Ray
    behind, nor the SIGTERM handler ray.init installs: the process's handlers are as they were."""
    if ray.is_initialized():
        pytest.skip("a Ray is already running in this process")
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with pytest.raises(hs.SweepError, match=r"cannot hold one array's actor \(64 CPUs"):
        hs.sweep(
            sweep_config(tmp_path / "run", backend="ray", ray={"cpus_per_array": 64}),
            progress=False,
        )
    assert not ray.is_initialized()
    assert {s: signal.getsignal(s) for s in handlers} == handlers


@pytest.mark.slow
def test_a_restarted_array_hands_back_trials_its_checkpoint_does_not_hold(
    tmp_path: Path,
) -> None:
    from hfsweep.executors._ray import RayExecutor
    from hfsweep.training import Member

    a, b, c = (Member(f"trial-{i}", {}) for i in range(3))
    active = {m.id: m for m in (a, b, c)}
    handed_back: list[str] = []
    # no checkpoint yet: restart with the members it started with; c joined later
    start = RayExecutor._restart_members(
        str(tmp_path / "none"), [a, b], active, lambda m: handed_back.append(m.id)
    )
    assert start == [a, b] and handed_back == ["trial-2"] and set(active) == {a.id, b.id}


@pytest.fixture
def local_ray(shared_ray: Any) -> None:
    """This process's shared local Ray (tests/conftest.py: 2 CPUs, loopback, no dashboard),
    started with the crash flag's path (``HFSWEEP_TEST_CRASH_FLAG``) and tests/ on the workers'
    ``PYTHONPATH``: pytest imports this folder's modules as the package ``sweep``."""
    shared_ray.start()


def _same_trials(got: hs.SweepResult, want: hs.SweepResult) -> None:
    a = {t.number: t for t in got.study.get_trials()}
    b = {t.number: t for t in want.study.get_trials()}
    assert sorted(a) == sorted(b)
    for n, t in b.items():
        assert a[n].state == t.state, n
        assert a[n].params == t.params, n
        assert a[n].intermediate_values == pytest.approx(t.intermediate_values), n
        assert a[n].value == pytest.approx(t.value), n


def test_one_array_at_a_time_reproduces_the_local_backend(
    local_ray: None, tmp_path: Path, told: Counter[int]
) -> None:
    kw: dict[str, Any] = {"scheduler": _ASHA, "budget": {"trials": 12, "epochs": 3}}
    local = hs.sweep(sweep_config(tmp_path / "local", **kw), progress=False)
    told.clear()
    on_ray = hs.sweep(
        sweep_config(tmp_path / "ray", backend="ray", ray={"max_concurrent": 1}, **kw),
        progress=False,
    )
    _same_trials(on_ray, local)
    assert told == Counter(range(12))
    assert on_ray.best_trial is not None and on_ray.best_checkpoint is not None
    for name in ("trials.csv", "best.json", "sweep.json", "state.json", "optuna.journal"):
        assert (on_ray.run_dir / name).is_file(), name
    assert sorted(p.name for p in (on_ray.run_dir / "histories").iterdir()) == sorted(
        p.name for p in (local.run_dir / "histories").iterdir()
    )
    assert not list((on_ray.run_dir / "arrays").glob("*"))  # finished arrays are cleaned up
    assert "Ray backend: up to 1 array(s) at once" in (on_ray.run_dir / "sweep.log").read_text()


@pytest.mark.slow
def test_offloaded_arrays_on_the_ray_backend_reproduce_the_local_backend(
    local_ray: None, tmp_path: Path
) -> None:
    """``fusion.offload: host`` in Ray actors: each actor offloads its array on its own device,
    and the trials end as with the local backend without offload."""
    kw: dict[str, Any] = {"budget": {"trials": 4, "epochs": 2}}
    local = hs.sweep(sweep_config(tmp_path / "local", **kw), progress=False)
    fusion = {"size": 4, "device": "cpu", "offload": "host"}
    on_ray = hs.sweep(
        sweep_config(
            tmp_path / "ray", backend="ray", ray={"max_concurrent": 1}, fusion=fusion, **kw
        ),
        progress=False,
    )
    _same_trials(on_ray, local)
    assert "cpu (offload: host) node" in (on_ray.run_dir / "sweep.log").read_text()


@pytest.mark.slow
def test_two_arrays_at_once_end_every_budgeted_trial_once(
    local_ray: None, tmp_path: Path, told: Counter[int]
) -> None:
    result = hs.sweep(
        sweep_config(
            tmp_path / "run",
            backend="ray",
            scheduler=_ASHA,
            budget={"trials": 16, "epochs": 3},
        ),
        progress=False,
    )
    trials = result.study.get_trials()
    assert [t.number for t in trials] == list(range(16))
    assert all(t.state.is_finished() for t in trials)
    assert told == Counter(range(16))
    assert result.counts["completed"] >= 1 and result.counts["stopped"] >= 1
    arrays = {t.user_attrs["array"] for t in trials}
    assert len(arrays) >= 2
    log = (result.run_dir / "sweep.log").read_text()
    assert "Ray backend: up to 2 array(s) at once" in log
    # both arrays were training at the same time: the second started before the first ended
    assert log.index("array 1 (") < log.rindex("trial ")


@pytest.mark.slow
def test_a_dead_worker_is_replaced_and_its_array_resumes_exactly(
    local_ray: None, tmp_path: Path, told: Counter[int]
) -> None:
    kw: dict[str, Any] = {
        "task": _crashy.TASK,
        "scheduler": "fifo",
        "budget": {"trials": 8, "epochs": 3},
    }
    reference = hs.sweep(sweep_config(tmp_path / "local", **kw), progress=False)
    told.clear()
    flag = Path(os.environ[_FLAG])
    flag.write_text("")
    result = hs.sweep(
        sweep_config(tmp_path / "ray", backend="ray", ray={"max_concurrent": 1}, **kw),
        progress=False,
    )
    assert not flag.exists()  # a worker drew the batch and died
    log = (result.run_dir / "sweep.log").read_text()
    assert "died" in log and "restarting it (1 of 3 restarts)" in log
    _same_trials(result, reference)
    assert told == Counter(range(8))


@pytest.mark.slow
def test_a_worker_that_keeps_dying_ends_the_sweep_with_a_clear_error(
    local_ray: None, tmp_path: Path
) -> None:
    flag = Path(os.environ[_FLAG])
    flag.write_text("")
    config = sweep_config(
        tmp_path / "run",
        task=_crashy.TASK,
        backend="ray",
        ray={"max_failures": 0},
        budget={"trials": 4, "epochs": 3},
    )
    with pytest.raises(hs.SweepError, match=r"died 1 times \(ray.max_failures is 0\)"):
        hs.sweep(config, progress=False)
    # the trials are still running in the study: the sweep resumes from the checkpoints
    resumed = hs.sweep(config, resume=True, progress=False)
    assert resumed.counts == {"completed": 4, "stopped": 0, "failed": 0, "running": 0}


@pytest.mark.slow
def test_a_cluster_too_small_for_one_array_is_refused(local_ray: None, tmp_path: Path) -> None:
    with pytest.raises(hs.SweepError, match=r"cannot hold one array's actor \(4 CPUs"):
        hs.sweep(
            sweep_config(tmp_path / "run", backend="ray", ray={"cpus_per_array": 4}),
            progress=False,
        )


@pytest.mark.slow
def test_an_actor_ray_cannot_place_lowers_the_arrays_at_once(
    local_ray: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ray's total says two arrays fit, but other work holds one of the two CPUs."""
    from hfsweep.executors import _ray as ray_executor

    monkeypatch.setattr(ray_executor, "_PLACE_WAIT_S", 3.0)

    @ray.remote(num_cpus=1)
    class _Other:
        def ready(self) -> bool:
            return True

    other = _Other.remote()  # type: ignore[attr-defined]
    try:
        ray.get(other.ready.remote())
        result = hs.sweep(
            sweep_config(tmp_path / "run", backend="ray", budget={"trials": 8, "epochs": 2}),
            progress=False,
        )
    finally:
        ray.kill(other)
    assert result.counts == {"completed": 8, "stopped": 0, "failed": 0, "running": 0}
    assert "going on with up to 1 array(s) at once" in (result.run_dir / "sweep.log").read_text()


@pytest.mark.slow
def test_a_task_the_workers_cannot_import_is_a_clear_error(
    local_ray: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Profiling (fusion.size auto) is the first call to a worker: its failure is explained."""
    folder = tmp_path / "driver_only"
    folder.mkdir()
    (folder / "driver_only_task.py").write_text(
        "import hfsweep as hs\n"
        "from sweep._toy import TASK as TOY\n"
        "def model(config):\n"
        "    return TOY.model(config)\n"
        "TASK = hs.Task(name='local', model=model, data=TOY.data, defaults=dict(TOY.defaults))\n"
    )
    monkeypatch.syspath_prepend(str(folder))  # the driver's path only, not the workers'
    import driver_only_task  # type: ignore[import-not-found]

    with pytest.raises(hs.SweepError, match="importable on every node"):
        hs.sweep(
            sweep_config(
                tmp_path / "run",
                task=driver_only_task.TASK,
                backend="ray",
                fusion={"size": "auto", "device": "cpu"},
            ),
            progress=False,
        )


@pytest.mark.slow
def test_a_task_that_raises_in_a_worker_ends_as_on_the_local_backend(
    local_ray: None, tmp_path: Path
) -> None:
    """The trials it hit and every other unfinished one end FAIL, none RUNNING; the driver
    re-raises the task's exception with the worker's traceback, or a description of it where
    it cannot be pickled."""
    from hfsweep._usercode import remote_traceback

    from . import _broken

    cases = [
        (_broken.BATCH_16, "this model takes batches of 16, got 8", "in forward"),
        (_broken.UNPICKLABLE, "_LockedError: an error holding a lock", "in forward"),
        # the profiler's array of 4, on a worker (fusion.size: auto)
        (_broken.SMALL_ARRAYS_ONLY, "takes arrays of up to 2 members", "in _small_arrays_only"),
    ]
    for task, cause, frame in cases:
        config = sweep_config(
            tmp_path / task.name,
            task=task,
            backend="ray",
            budget={"trials": 6, "epochs": 2},
            metric="val_loss",
            mode="min",
            fusion={"size": "auto" if task is _broken.SMALL_ARRAYS_ONLY else 4, "device": "cpu"},
        )
        with pytest.raises(hs.TrainingError, match=r"raised in the (forward pass|loss)") as info:
            hs.sweep(config, progress=False)
        assert cause in str(info.value)
        assert isinstance(info.value.__cause__, RuntimeError)
        assert frame in (remote_traceback(info.value.__cause__) or "")
        storage = optuna.storages.JournalStorage(
            optuna.storages.journal.JournalFileBackend(str(tmp_path / task.name / "optuna.journal"))
        )
        trials = optuna.load_study(study_name="sweep", storage=storage).get_trials()
        assert trials and {t.state.name for t in trials} == {"FAIL"}
        assert all(cause in t.user_attrs["error"] for t in trials)


#: two offloaded arrays at once in the one actor the local Ray holds (its 2 CPUs), alternating
_ALTERNATE: dict[str, Any] = {
    "backend": "ray",
    "ray": {"cpus_per_array": 2},
    "fusion": {"size": 2, "device": "cpu", "dtype": "float64", "offload": "host", "alternate": 2},
    "scheduler": "fifo",
    "budget": {"trials": 6, "epochs": 2},
}


def _as_alone(result: hs.SweepResult, task: hs.Task) -> None:
    """Every trial of ``result`` ended as it trains alone (``hs.retrain``)."""
    for t in result.study.get_trials():
        again = hs.retrain(result.run_dir, t.number, task=task)
        assert again.matches, again.table()


@pytest.mark.slow
def test_offloaded_arrays_alternate_in_one_ray_worker_each_trial_as_alone(
    local_ray: None, tmp_path: Path, told: Counter[int]
) -> None:
    """``fusion.alternate: 2`` on the Ray backend: the cluster holds one actor, which trains two
    offloaded arrays at once, their shards alternating (the worker says how many trained at
    once), and every trial ends as it trains alone."""
    result = hs.sweep(sweep_config(tmp_path / "run", **_ALTERNATE), progress=False)
    assert result.counts == {"completed": 6, "stopped": 0, "failed": 0, "running": 0}
    assert told == Counter(range(6))
    log = (result.run_dir / "sweep.log").read_text()
    assert "up to 2 array(s) at once" in log and "up to 2 alternating in each" in log
    assert len(set(re.findall(r"trains on .* pid (\d+) ", log))) == 1  # the one actor
    assert "trained with up to 2 array(s) at once on " in log  # two arrays in one step
    _as_alone(result, TASK)


@pytest.mark.slow
def test_a_dead_worker_alternating_two_arrays_resumes_both_exactly(
    local_ray: None, tmp_path: Path, told: Counter[int]
) -> None:
    """The one actor training two alternating arrays dies: both arrays go on from their
    checkpoints on a new actor, no trial is told twice, and every trial ends as alone."""
    flag = Path(os.environ[_FLAG])
    flag.write_text("")
    config = sweep_config(tmp_path / "run", **{**_ALTERNATE, "task": _crashy.TASK})
    result = hs.sweep(config, progress=False)
    assert not flag.exists()  # a worker drew the batch and died
    log = (result.run_dir / "sweep.log").read_text()
    assert "died" in log and "restarting it (1 of 3 restarts)" in log
    assert result.counts == {"completed": 6, "stopped": 0, "failed": 0, "running": 0}
    assert told == Counter(range(6))
    _as_alone(result, _crashy.TASK)


#: a compiled sweep kept small: one array of two trials, one epoch of 5 steps, in one actor
#: (torch.compile takes tens of seconds a graph on a CPU), of the toy task whose loss marks the
#: processes that ran it compiled
_COMPILED: dict[str, Any] = {
    "task": _compile_marks.TASK,
    "backend": "ray",
    "ray": {"max_concurrent": 1},
    "scheduler": "fifo",
    "budget": {"trials": 2, "epochs": 1},
}


def _trained_on(log: str, how: str) -> list[int]:
    """The process ids of the workers the log's arrays trained on, each line ending ``how``."""
    return [int(pid) for pid in re.findall(rf"trains on .* pid (\d+) .*, {re.escape(how)}", log)]


@pytest.mark.slow
def test_compiled_arrays_on_the_ray_backend_train_each_trial_as_alone(
    local_ray: None, tmp_path: Path
) -> None:
    """``fusion.compile: true`` on the Ray backend: the worker compiles its array (its loss
    leaves the worker's mark), and every trial ends as it trains alone, uncompiled
    (``hs.retrain``: rtol 1e-4 in float32, the compiled step's tolerance)."""
    fusion = {"size": 2, "device": "cpu", "dtype": "float32", "compile": True}
    result = hs.sweep(sweep_config(tmp_path / "run", fusion=fusion, **_COMPILED), progress=False)
    assert result.counts == {"completed": 2, "stopped": 0, "failed": 0, "running": 0}
    log = (result.run_dir / "sweep.log").read_text()
    assert "cpu (compile: true) node" in log  # the worker says so
    (pid,) = _trained_on(log, "compiled (compile: true)")
    assert pid in _compile_marks.marks()
    _as_alone(result, _compile_marks.TASK)


@pytest.mark.slow
def test_compile_auto_on_the_ray_backend_trains_every_array_as_profiled(
    local_ray: None, tmp_path: Path
) -> None:
    """``fusion.compile: auto`` with ``size: auto``: the profile taken on a worker chooses, and
    each array trains as it chose. The first sweep's choice rests on timings, so it may go
    either way; the test then stores that profile as choosing B=2, compiled (it keeps only its
    B=1 and B=2 measurements), and a second sweep of 4 trials trains two arrays at once on two
    workers: the one that took the (cached) profile and one that never profiled, which trains
    compiled only if the driver hands it the choice. Every trial of both sweeps ends as it
    trains alone (rtol 1e-4 in float32)."""
    import dataclasses

    from hfsweep.profiler import ProfileCache

    cache = ProfileCache()  # the tests' own (tests/conftest.py), which the workers share
    before = cache._read()
    fusion = {"size": "auto", "device": "cpu", "dtype": "float32", "compile": "auto"}
    first = hs.sweep(sweep_config(tmp_path / "first", fusion=fusion, **_COMPILED), progress=False)
    assert first.counts["completed"] == 2
    log = (first.run_dir / "sweep.log").read_text()
    assert "cpu (compile: auto) node" in log
    assert re.search(r"trains on .*, (un)?compiled \(compile: auto, as profiled\)", log)
    _as_alone(first, _compile_marks.TASK)
    profiled = [k for k, v in cache._read().items() if v != before.get(k) and v.get("compile")]
    assert profiled  # the worker stored its choice with the profile
    for key in profiled:  # B=2 the fastest of the sizes kept, compiled there
        profile = cache.get(key)
        assert profile is not None and profile.compile is not None
        small = tuple(m for m in profile.measurements if m.size <= 2)
        forced = dataclasses.replace(profile.compile, size=2, compiled=True, reason="the test's")
        cache.put(dataclasses.replace(profile, measurements=small, compile=forced))
    budget = {"trials": 4, "epochs": 1}
    overrides = {**_COMPILED, "ray": {"max_concurrent": 2}, "budget": budget}
    second = hs.sweep(sweep_config(tmp_path / "second", fusion=fusion, **overrides), progress=False)
    assert second.counts["completed"] == 4
    log = (second.run_dir / "sweep.log").read_text()
    pids = _trained_on(log, "compiled (compile: auto, as profiled)")
    assert len(pids) == 2 and len(set(pids)) == 2, log  # two arrays at once, two workers
    assert set(pids) <= _compile_marks.marks()  # each compiled, the one that never profiled too
    _as_alone(second, _compile_marks.TASK)
