"""`backend: ray` on a real multi-node Ray cluster on loopback: a head without CPUs and two
worker nodes of one CPU each (``ray.cluster_utils.Cluster``, every node on 127.0.0.1), so
arrays train on the worker nodes only, and nodes can be removed and added mid-sweep.

A cluster on loopback is one Ray rewrites the address of (127.0.0.1 becomes this machine's
other address, where nothing listens), so the first test is also the loopback check: the driver
must connect on 127.0.0.1, never on another address of the machine.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import optuna
import pytest
from _ray_cluster import loopback_cluster

import hfsweep as hs
from hfsweep.core.loop import _Engine

from ._killed import _default_sigint
from ._toy import GATE_ENV, GATED_TASK, sweep_config

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.slow  # one worker runs this module under xdist: tests/conftest.py

_TESTS = Path(__file__).resolve().parent.parent
_TOY = Path(__file__).resolve().parent / "_toy.py"
#: seconds a test waits for the sweep to get somewhere before it fails
_PATIENCE = 120.0


def _workers_import_tests(monkeypatch: pytest.MonkeyPatch) -> None:
    """tests/ on the ``PYTHONPATH`` of Ray's nodes started after this (and of their workers,
    which import ``sweep._toy``)."""
    path = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", str(_TESTS) + (os.pathsep + path if path else ""))


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A head node without CPUs and two worker nodes of one CPU, all on 127.0.0.1. The nodes
    start with tests/ on ``PYTHONPATH`` (their workers import ``sweep._toy``) and the gate's
    path in ``HFSWEEP_TEST_GATE``; shut down (their processes, by pid) after the test."""
    _workers_import_tests(monkeypatch)
    monkeypatch.setenv(GATE_ENV, str(tmp_path / "gate"))
    monkeypatch.setenv("RAY_DEDUP_LOGS", "0")
    with loopback_cluster() as made:
        yield made


def add_worker(cluster: Any) -> Any:
    return cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1")


def _wait(what: str, done: Callable[[], bool], alive: Callable[[], bool] = lambda: True) -> None:
    deadline = time.monotonic() + _PATIENCE
    while not done():
        if not alive():
            pytest.fail(f"the sweep ended before {what}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {_PATIENCE:g} s")
        time.sleep(0.05)


def _log(run: Path) -> str:
    try:
        return (run / "sweep.log").read_text()
    except FileNotFoundError:
        return ""


def _nodes_that_trained(log: str) -> set[str]:
    """The Ray nodes (ids) of the workers that trained an array, from the sweep's log."""
    return set(re.findall(r" trains on .* node ([0-9a-f]+)", log))


def test_a_sweep_trains_across_a_loopback_cluster(
    cluster: Any, tmp_path: Path, told: Counter[int]
) -> None:
    result = hs.sweep(
        sweep_config(
            tmp_path / "run",
            backend="ray",
            ray={"address": cluster.address},
            budget={"trials": 16, "epochs": 2},
        ),
        progress=False,
    )
    assert result.counts == {"completed": 16, "stopped": 0, "failed": 0, "running": 0}
    assert told == Counter(range(16))
    log = _log(result.run_dir)
    # on 127.0.0.1, not rewritten to another address of this machine, driver included
    assert (
        f"connected to the cluster at {cluster.address} (3 nodes; this driver on 127.0.0.1, "
        "loopback)" in log
    )
    assert _nodes_that_trained(log) == {n.node_id for n in cluster.worker_nodes}
    assert not ray.is_initialized()
    assert all(n.remaining_processes_alive() for n in cluster.list_all_nodes())


class _Sweep(threading.Thread):
    """``hs.sweep(config)`` in a thread (Ray's nodes must be started from the main thread),
    with every evaluation the engine received counted by (trial, step)."""

    def __init__(self, config: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
        super().__init__()
        self.config = config
        self.outcome: list[Any] = []
        self.reported: Counter[tuple[str, int]] = Counter()
        report = _Engine._report

        def counting_report(engine: _Engine, evaluations: Any) -> Any:
            self.reported.update((e.member, e.step) for e in evaluations)
            return report(engine, evaluations)

        monkeypatch.setattr(_Engine, "_report", counting_report)

    def run(self) -> None:
        try:
            self.outcome.append(hs.sweep(self.config, progress=False))
        except BaseException as exc:
            self.outcome.append(exc)

    def result(self) -> hs.SweepResult:
        self.join()
        if isinstance(self.outcome[0], BaseException):
            raise self.outcome[0]
        assert self.reported and max(self.reported.values()) == 1  # none evaluated twice
        result: hs.SweepResult = self.outcome[0]
        return result


def _gated_sweep(run: Path, address: str, monkeypatch: pytest.MonkeyPatch) -> _Sweep:
    """24 trials of GATED_TASK in arrays of 4 on the cluster, started with the gate closed:
    returned once both arrays have trained an epoch (their checkpoints exist) and wait."""
    Path(os.environ[GATE_ENV]).write_text("")
    config = sweep_config(
        run,
        task=GATED_TASK,
        backend="ray",
        ray={"address": address},
        budget={"trials": 24, "epochs": 3},
    )
    sweep = _Sweep(config, monkeypatch)
    sweep.start()
    _wait(
        "checkpoint of both arrays",
        lambda: all((run / "arrays" / str(i) / "array.pt").exists() for i in (0, 1)),
        sweep.is_alive,
    )
    return sweep


def _trains_on(run: Path, node: Any) -> Callable[[], bool]:
    return lambda: node.node_id in _nodes_that_trained(_log(run))


def test_a_local_ray_started_for_the_run_listens_on_loopback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ray would move a node asked for on 127.0.0.1 to this machine's other address."""
    if ray.is_initialized():
        pytest.skip("a Ray is already running in this process")
    _workers_import_tests(monkeypatch)
    result = hs.sweep(
        sweep_config(tmp_path / "run", backend="ray", budget={"trials": 4, "epochs": 1}),
        progress=False,
    )
    assert result.counts["completed"] == 4
    assert re.search(r"started a local Ray on 127\.0\.0\.1:\d+\n", _log(result.run_dir))
    assert not ray.is_initialized()


def test_a_lost_node_s_array_continues_at_once_on_a_worker_that_becomes_idle(
    cluster: Any, tmp_path: Path, told: Counter[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both arrays wait at the gate; node B is removed; its array restarts from its checkpoint
    on node A's worker as soon as A's array is done, without waiting out a reservation that
    cannot be placed (A's worker holds the only CPU left)."""
    run = tmp_path / "run"
    sweep = _gated_sweep(run, cluster.address, monkeypatch)
    try:
        cluster.remove_node(sorted(cluster.worker_nodes, key=lambda n: n.node_id)[0])
        _wait("restart", lambda: "restarting it (1 of" in _log(run), sweep.is_alive)
    finally:
        Path(os.environ[GATE_ENV]).unlink()
    result = sweep.result()
    assert result.counts == {"completed": 24, "stopped": 0, "failed": 0, "running": 0}
    assert told == Counter(range(24))
    log = _log(run)
    assert log.count("died") == 1 and "restarting it (1 of 3 restarts)" in log
    assert "could not place" not in log  # no reservation waited out its time
    (survivor,) = cluster.worker_nodes
    assert _nodes_that_trained(log.split("restarting it")[1]) == {survivor.node_id}


def test_a_node_that_joins_after_a_loss_trains_arrays_again(
    cluster: Any, tmp_path: Path, told: Counter[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Node B is removed while both arrays wait at the gate; its array's reservation cannot be
    placed in time, so the sweep goes on with one array at once; a node that joins then takes
    the waiting array, which continues from its checkpoint there."""
    from hfsweep.executors import _ray as ray_executor

    monkeypatch.setattr(ray_executor, "_PLACE_WAIT_S", 2.0)
    run = tmp_path / "run"
    sweep = _gated_sweep(run, cluster.address, monkeypatch)
    try:
        cluster.remove_node(sorted(cluster.worker_nodes, key=lambda n: n.node_id)[0])
        _wait("restart", lambda: "restarting it (1 of" in _log(run), sweep.is_alive)
        time.sleep(3.0)  # longer than a reservation may wait
        added = add_worker(cluster)
        _wait("array on the node that joined", _trains_on(run, added), sweep.is_alive)
    finally:
        Path(os.environ[GATE_ENV]).unlink()
    result = sweep.result()
    assert result.counts == {"completed": 24, "stopped": 0, "failed": 0, "running": 0}
    assert told == Counter(range(24))
    assert _log(run).count("died") == 1


#: the Ctrl-C tests' budget: two arrays of 4, so that with two at once both are waiting for a node
_CTRL_C_TRIALS = 8


def _write_sweep(folder: Path, address: str, at_once: int) -> Path:
    sweep = folder / "sweep.yaml"
    sweep.write_text(
        f"""
task: "{_TOY}:GATED_TASK"
search_space:
  lr: {{type: float, low: 1.0e-3, high: 0.5, log: true}}
  momentum: {{type: float, low: 0.0, high: 0.9}}
searcher: random
scheduler: fifo
budget: {{trials: {_CTRL_C_TRIALS}, epochs: 3}}
metric: val_accuracy
mode: max
fusion: {{size: 4, device: cpu}}
backend: ray
ray: {{address: "{address}", max_concurrent: {at_once}}}
output: run
"""
    )
    return sweep


def _run(sweep: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "hfsweep.cli", "run", str(sweep), "--quiet", *extra],
        cwd=sweep.parent,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "HFSWEEP_CACHE_DIR": str(sweep.parent)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_default_sigint,
    )


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs POSIX signals")
@pytest.mark.parametrize("at_once", [1, 2], ids=["one-array-at-once", "two-arrays-at-once"])
def test_ctrl_c_with_every_worker_node_gone_ends_the_run_and_resume_finishes(
    cluster: Any, tmp_path: Path, at_once: int
) -> None:
    """One array at once trains in the driver's main thread, two in threads of their own:
    either way the arrays wait for a node to place a worker on when Ctrl-C comes."""
    run = tmp_path / "run"
    gate = Path(os.environ[GATE_ENV])
    gate.write_text("")
    sweep = _write_sweep(tmp_path, cluster.address, at_once)
    proc = _run(sweep)
    try:
        arrays = run / "arrays"
        _wait(
            "checkpoints of the first arrays",
            lambda: all((arrays / str(i) / "array.pt").exists() for i in range(at_once)),
            lambda: proc.poll() is None,
        )
        for node in list(cluster.worker_nodes):
            cluster.remove_node(node)
        _wait("restarts", lambda: _log(run).count("died") == at_once, lambda: proc.poll() is None)
        time.sleep(2.0)  # the arrays wait for a node to place a worker on
        proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err
    assert "interrupted" in err and "--resume" in err

    gate.unlink()
    add_worker(cluster)
    resumed = _run(sweep, "--resume")
    try:
        _out, err = resumed.communicate(timeout=300)
    finally:
        if resumed.poll() is None:
            resumed.kill()
            resumed.communicate()
    assert resumed.returncode == 0, err
    storage = optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(run / "optuna.journal"))
    )
    trials = optuna.load_study(study_name="sweep", storage=storage).get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE"] * _CTRL_C_TRIALS
    # each trial told once over both runs (the study refuses a second tell anyway)
    ends = re.findall(r"hfsweep\.sweep: trial (\d+) complete", _log(run))
    assert Counter(ends) == Counter({str(n): 1 for n in range(_CTRL_C_TRIALS)})
    assert len(re.findall(r"array \d \([^)]*\): resuming with 4 trials", _log(run))) == at_once
