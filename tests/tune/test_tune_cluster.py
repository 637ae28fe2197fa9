"""The Ray Tune plugin on a real multi-node Ray cluster on loopback (``ray.cluster_utils.Cluster``:
a head without CPUs and two worker nodes of one CPU each, every node on 127.0.0.1), with one
worker node removed while both arrays train.

Two arrays of four members train at once, one per worker node, and wait after their second
epoch (tests/tune/_tune_gated.py) until the test has removed the node of one of them. Tune's
``FailureConfig`` retries that array's trial on the node left, from its last checkpoint. Every
member must reach the inner searcher's ``on_trial_complete`` exactly once and each of its
evaluations ``on_trial_result`` exactly once (the retried array replays what it trained after
its checkpoint, which must not be reported again), and the retried array's members must end
exactly as they train alone.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.tune.search.optuna")

import torch  # noqa: E402
from _ray_cluster import loopback_cluster  # noqa: E402
from hfsweep.schedulers.tune import Fusion, member_results, sweep_state  # noqa: E402
from ray import tune  # noqa: E402
from ray.tune.schedulers import FIFOScheduler  # noqa: E402
from ray.tune.search.optuna import OptunaSearch  # noqa: E402

import hfsweep as hs  # noqa: E402

pytestmark = [
    pytest.mark.slow,  # a three-node cluster and a Tune experiment: about a minute on 2 cores
    pytest.mark.timeout(600),
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning"),
]

_GATED = Path(__file__).resolve().parent / "_tune_gated.py"
GATE_ENV = "HFSWEEP_TUNE_TEST_GATE"
MEMBERS = 8
#: the test's cluster, for :class:`RemoveANode`
_CLUSTER: list[Any] = []
ARRAY_SIZE = 4


class CountingOptuna(OptunaSearch):
    """OptunaSearch that counts what it is told, in this (the driver's) process."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.told: Counter[str] = Counter()
        self.reported: Counter[tuple[str, int]] = Counter()

    def on_trial_result(self, trial_id: str, result: dict[str, Any]) -> None:
        self.reported[trial_id, result["training_iteration"]] += 1
        super().on_trial_result(trial_id, result)

    def on_trial_complete(
        self, trial_id: str, result: dict[str, Any] | None = None, error: bool = False
    ) -> None:
        self.told[trial_id] += 1
        super().on_trial_complete(trial_id, result, error)


class RemoveANode(tune.Callback):
    """Once both arrays wait at the gate, each on its own worker node, and Tune holds a
    checkpoint of each, removes the node of one of them, then opens the gate. Runs in Tune's
    loop, in the driver's main thread (where Ray's cluster utilities must run)."""

    def __init__(self, gate: Path) -> None:
        self.gate = gate
        self.removed: dict[str, str] = {}  # node id -> the Tune trial (array) it held
        self.held_on: dict[str, str] = {}  # node id -> Tune trial id, as the arrays said

    def on_step_begin(self, iteration: int, trials: list[Any], **info: Any) -> None:
        if self.removed or not self.gate.exists():
            return
        held = {
            p.name.split(".held-", 1)[1]: p.read_text()
            for p in self.gate.parent.glob(self.gate.name + ".held-*")
        }
        running = [t for t in trials if t.status == "RUNNING"]
        if len(held) < 2 or len(running) < 2 or any(t.checkpoint is None for t in running):
            return
        self.held_on = held
        node_id = sorted(held)[0]
        cluster = _CLUSTER[0]  # not an attribute: Tune pickles its callbacks
        (node,) = [n for n in cluster.worker_nodes if n.node_id == node_id]
        cluster.remove_node(node)
        self.removed[node_id] = held[node_id]
        self.gate.unlink()


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A head without CPUs and two worker nodes of one CPU, all on 127.0.0.1, with this process
    connected to it; the gate's path in the nodes' environment. Shut down after the test."""
    from hfsweep.executors._connect import on_loopback

    monkeypatch.setenv(GATE_ENV, str(tmp_path / "gate"))
    monkeypatch.setenv("RAY_DEDUP_LOGS", "0")
    monkeypatch.setenv("TUNE_GLOBAL_CHECKPOINT_S", "0")
    with loopback_cluster() as made:
        with on_loopback():  # else Ray moves 127.0.0.1 to another address of the machine
            ray.init(address=made.address, log_to_driver=False)
        _CLUSTER.append(made)
        try:
            yield made
        finally:
            _CLUSTER.clear()


def test_a_removed_worker_nodes_array_is_retried_from_its_checkpoint_and_nothing_is_told_twice(
    cluster: Any, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    gate.write_text("")
    fusion = Fusion(f"{_GATED}:TASK", members=MEMBERS, array_size=ARRAY_SIZE)
    searcher = CountingOptuna(seed=0)
    remover = RemoveANode(gate)
    tuner = tune.Tuner(
        fusion.trainable,
        param_space={"lr": tune.loguniform(1e-3, 0.5), "momentum": tune.uniform(0.0, 0.9)},
        tune_config=tune.TuneConfig(
            metric="val_accuracy",
            mode="max",
            num_samples=-1,
            search_alg=fusion.searcher(searcher),
            scheduler=fusion.scheduler(FIFOScheduler()),
        ),
        run_config=tune.RunConfig(
            storage_path=str(tmp_path / "tune"),
            name="cluster",
            verbose=0,
            callbacks=[remover],
            failure_config=tune.FailureConfig(max_failures=2),
        ),
    )
    results = tuner.fit()

    # the node of one array was removed while both arrays waited, each on its own node
    assert len(remover.removed) == 1, "no node was removed"
    assert len(set(remover.held_on.values())) == 2
    assert not results.errors, results.errors
    (lost,) = remover.removed.values()

    # every member ended once, each evaluation reached the searcher once
    table = member_results(results)
    assert len(table) == MEMBERS
    assert set(table["state"]) == {"COMPLETE"}, table["state"].value_counts()
    assert sorted(searcher.told) == sorted(table["member"])
    assert set(searcher.told.values()) == {1}, searcher.told
    assert set(searcher.reported.values()) == {1}, searcher.reported
    for history in table["history"]:  # four epochs each, none recorded twice
        assert [h["training_iteration"] for h in history] == [1, 2, 3, 4]

    # the lost array went on from its checkpoint (not from scratch), the other one never stopped
    arrays = sweep_state(results.experiment_path)["arrays"]
    assert arrays[lost]["resumes"] == 1
    assert [a["resumes"] for k, a in arrays.items() if k != lost] == [0]

    # nothing lost: the retried array's members end exactly as each trains alone
    trainer = hs.ArrayTrainer(fusion.task)
    state = fusion.state
    for member in state.arrays[lost].members:
        config = state.members[member].config
        alone = trainer.run([hs.Member(member, config)])[0]
        inside = table.set_index("member").loc[member, "history"]
        assert len(inside) == len(alone.history) == 4
        for got, want in zip(inside, alone.history, strict=True):
            for key in ("train_loss", "val_loss", "val_accuracy"):
                torch.testing.assert_close(got[key], want[key], rtol=1e-4, atol=1e-6)
    assert os.environ[GATE_ENV] == str(gate)


def test_the_hub_lives_on_the_drivers_node_and_outlives_every_worker_node(cluster: Any) -> None:
    """The actor that carries the driver's answers to the arrays needs no CPU, so Ray would
    place it on any node; it must be on the driver's, or losing a worker node ends the whole
    experiment (it has no restarts: its answers would be lost). Six hubs, both worker nodes
    removed: all six still answer (unpinned, each would have had two chances in three to be on
    a removed node)."""
    from hfsweep.schedulers._tune_hub import HubLink, await_answer, connect

    links = [HubLink(f"hfsweep-test-hub-{i}") for i in range(6)]
    for i, link in enumerate(links):
        link.post(f"before-{i}", {"n": i})  # started
    for node in list(cluster.worker_nodes):
        cluster.remove_node(node)
    try:
        for i, link in enumerate(links):
            handle = connect(link.name)
            assert await_answer(handle, f"before-{i}") == {"n": i}
            link.post(f"after-{i}", {"n": -i})
            assert await_answer(handle, f"after-{i}") == {"n": -i}
    finally:
        for link in links:
            link.close()
