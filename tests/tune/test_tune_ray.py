"""The Ray Tune plugin end to end on a local Ray instance (2 CPUs).

One sweep: OptunaSearch + ASHAScheduler wrapped by a Fusion over 16 members of a toy task whose
training data raises once mid-run (the first array to reach its third epoch crashes and is
retried from its checkpoint, ``FailureConfig(max_failures=1)``), and whose first member has a
learning rate that diverges. A second sweep is interrupted (SIGINT, as Ctrl+C) and finished with
``Tuner.restore``. Every member must reach the inner searcher's ``on_trial_complete`` exactly
once, each of its evaluations ``on_trial_result`` exactly once.
"""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.tune.search.optuna")

import _tune_toy  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _tune_lifecycle import final_study  # noqa: E402
from hfsweep.schedulers.tune import (  # noqa: E402
    Fusion,
    TunedMember,
    best_member,
    member_history,
    member_results,
    sweep_state,
    tuned_members,
)
from ray import cloudpickle, tune  # noqa: E402
from ray.tune.schedulers import ASHAScheduler  # noqa: E402
from ray.tune.search.optuna import OptunaSearch  # noqa: E402

import hfsweep as hs  # noqa: E402
from hfsweep.core.status import Status  # noqa: E402

pytestmark = [
    # three Tune experiments on a local Ray (about 40 s on 2 cores): the shared one runs by
    # default, the others are `slow`
    # under xdist one worker runs this module, with the other Ray tests: tests/conftest.py
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning"),
]

#: on_trial_complete calls per sweep label and member id, and on_trial_result calls per
#: (member id, training_iteration), in this (the driver's) process, across restores
TOLD: dict[str, Counter[str]] = {}
REPORTED: dict[str, Counter[tuple[str, int]]] = {}


class CountingOptuna(OptunaSearch):
    """OptunaSearch that counts what it is told (the counts outlive a restore)."""

    def __init__(self, label: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.label = label
        TOLD.setdefault(label, Counter())
        REPORTED.setdefault(label, Counter())

    def on_trial_result(self, trial_id: str, result: dict[str, Any]) -> None:
        REPORTED[self.label][trial_id, result["training_iteration"]] += 1
        super().on_trial_result(trial_id, result)

    def on_trial_complete(
        self, trial_id: str, result: dict[str, Any] | None = None, error: bool = False
    ) -> None:
        TOLD[self.label][trial_id] += 1
        super().on_trial_complete(trial_id, result, error)


class InterruptOnce(tune.Callback):
    """Sends this process SIGINT (Ctrl+C) after ``after`` array results, once per ``marker``."""

    def __init__(self, after: int, marker: str) -> None:
        self.after = after
        self.marker = marker
        self.seen = 0

    def on_trial_result(
        self, iteration: int, trials: Any, trial: Any, result: Any, **info: Any
    ) -> None:
        self.seen += 1
        if self.seen >= self.after and not os.path.exists(self.marker):
            Path(self.marker).write_text("interrupted")
            os.kill(os.getpid(), signal.SIGINT)


SPACE = {"lr": tune.loguniform(1e-3, 0.5), "momentum": tune.uniform(0.0, 0.9), "hidden": 8}


@pytest.fixture(scope="module")
def ray_local(shared_ray: Any) -> Iterator[Path]:
    """This process's shared local Ray (tests/conftest.py: loopback, 2 CPUs, no dashboard),
    started with ``HFSWEEP_TUNE_TEST_CRASH_DIR`` set: the folder where CRASH_TASK's marker goes."""
    shared_ray.start()
    crash_dir = Path(os.environ[_tune_toy.CRASH_DIR_ENV])
    cloudpickle.register_pickle_by_value(_tune_toy)  # workers cannot import tests/tune/
    try:
        yield crash_dir
    finally:
        cloudpickle.unregister_pickle_by_value(_tune_toy)


def _tuner(
    fusion: Fusion,
    searcher: OptunaSearch,
    scheduler: Any,
    storage: Path,
    name: str,
    max_concurrent_trials: int | None = None,
    **run: Any,
) -> tune.Tuner:
    return tune.Tuner(
        fusion.trainable,
        param_space=dict(SPACE),
        tune_config=tune.TuneConfig(
            metric="val_accuracy",
            mode="max",
            num_samples=-1,
            reuse_actors=True,
            max_concurrent_trials=max_concurrent_trials,
            search_alg=fusion.searcher(searcher),
            scheduler=fusion.scheduler(scheduler),
        ),
        run_config=tune.RunConfig(storage_path=str(storage), name=name, verbose=0, **run),
    )


def _hub_alive(name: str, wait_s: float = 10.0) -> bool:
    """Whether the named hub actor is still there (a killed actor's name goes within
    ``wait_s``)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            ray.get_actor(name)
        except ValueError:
            return False
        if time.monotonic() > deadline:
            return True
        time.sleep(0.1)


def _assert_told_once(label: str, experiment: str, n: int) -> None:
    table = member_results(experiment)
    assert len(table) == n
    # the core's status words (as state.json's), and Optuna's names of them in "state"
    assert set(table["status"]) <= {"completed", "stopped", "failed"}, table["status"].tolist()
    assert [Status(s).optuna_name for s in table["status"]] == list(table["state"])
    assert sorted(TOLD[label]) == sorted(table["member"])
    assert set(TOLD[label].values()) == {1}, TOLD[label]
    assert set(REPORTED[label].values()) == {1}, REPORTED[label]
    study, by_member = final_study(experiment)
    assert sorted(by_member) == sorted(table["member"])
    assert len(study.trials) == n
    states = {m: study.trials[t.number].state.name for m, t in by_member.items()}
    assert states == dict(zip(table["member"], table["state"], strict=True))


@pytest.fixture(scope="module")
def sweep(ray_local: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """16 members of the crash-once toy task, arrays of 4, OptunaSearch (TPE) + ASHA, one retry
    per array; the first member asked has a learning rate that diverges."""
    fusion = Fusion(_tune_toy.CRASH_TASK, members=16, array_size=4)
    searcher = CountingOptuna("sweep", seed=0, points_to_evaluate=[{"lr": 1e38, "momentum": 0.5}])
    scheduler = ASHAScheduler(max_t=4, grace_period=1, reduction_factor=2)
    storage = tmp_path_factory.mktemp("tune")
    (ray_local / "crashed").unlink(missing_ok=True)  # the first array to reach epoch 3 crashes
    tuner = _tuner(
        fusion,
        searcher,
        scheduler,
        storage,
        "sweep",
        failure_config=tune.FailureConfig(max_failures=1),
    )
    results = tuner.fit()
    return {"results": results, "fusion": fusion, "searcher": searcher, "crashed": ray_local}


def test_the_optuna_study_ends_with_exactly_the_members_each_told_once(
    sweep: dict[str, Any],
) -> None:
    results = sweep["results"]
    assert not results.errors
    _assert_told_once("sweep", results.experiment_path, 16)
    study = sweep["searcher"]._ot_study  # the live inner searcher agrees with the saved one
    assert len(study.trials) == 16
    counts = Counter(t.state.name for t in study.trials)
    assert counts["COMPLETE"] >= 1 and counts["PRUNED"] >= 1, counts
    assert len(results) == len(sweep["fusion"].state.arrays)  # one Tune trial per array


def test_a_nonfinite_member_is_told_failed_while_the_others_go_on(sweep: dict[str, Any]) -> None:
    table = member_results(sweep["results"])
    diverged = table[table["config/lr"] == 1e38]
    assert len(diverged) == 1 and diverged["status"].item() == Status.FAILED
    mates = table[(table["array"] == diverged["array"].item()) & (table["config/lr"] != 1e38)]
    assert len(mates) >= 1 and (mates["status"] != Status.FAILED).all()
    assert (mates["evaluations"] >= 1).all()


def test_members_train_inside_the_plugin_exactly_as_alone(sweep: dict[str, Any]) -> None:
    state = sweep["fusion"].state
    table = member_results(sweep["results"]).set_index("member")
    started = [m for a in state.arrays.values() for m in a.members]  # not joined by refill
    chosen = [m for m in started if table.loc[m, "status"] in ("completed", "stopped")][:3]
    assert chosen
    trainer = hs.ArrayTrainer(_tune_toy.TASK)  # the sweep's model and data, without the crash
    for member in chosen:
        config = state.members[member].config
        alone = trainer.run([hs.Member(member, config)])[0]
        inside = table.loc[member, "history"]
        assert 1 <= len(inside) <= len(alone.history)
        for got, want in zip(inside, alone.history, strict=False):
            assert got["step"] == want["step"]
            for key in ("train_loss", "val_loss", "val_accuracy"):
                torch.testing.assert_close(got[key], want[key], rtol=1e-4, atol=1e-6)


def test_member_tables_and_the_best_member(sweep: dict[str, Any]) -> None:
    results = sweep["results"]
    table = member_results(results)
    assert {"member", "array", "status", "state", "value", "config/lr", "history"} <= set(
        table.columns
    )
    live = member_results(sweep["fusion"])  # the live state agrees with the saved one
    columns = ["member", "array", "status", "state", "evaluations"]
    assert live[columns].equals(table[columns])
    long = member_history(results)
    assert len(long) == table["evaluations"].sum()
    assert {"member", "training_iteration", "epoch", "val_accuracy"} <= set(long.columns)
    best = best_member(results)
    done = table[table["status"] == "completed"]
    assert best.status is Status.COMPLETED and best.state == "COMPLETE"
    assert best.value == done["value"].max()
    assert best.config == sweep["fusion"].state.members[best.id].config


def _assert_weights_give_the_recorded_metrics(member: TunedMember) -> None:
    """``member``'s saved weights, loaded into a fresh model of the task, give the validation
    loss and accuracy its last evaluation recorded (plain PyTorch on the toy's validation data)."""
    model = member.load_model(_tune_toy.TASK)
    x, y = _tune_toy._tensors(_tune_toy.TASK.resolve(member.config))
    model.eval()
    with torch.no_grad():
        out = model(x[160:])
    last = member.history[-1]
    torch.testing.assert_close(
        F.cross_entropy(out, y[160:]).item(), last["val_loss"], rtol=1e-5, atol=1e-6
    )
    accuracy = (out.argmax(1) == y[160:]).double().mean().item()
    torch.testing.assert_close(accuracy, last["val_accuracy"], rtol=1e-7, atol=1e-12)


def test_the_best_members_weights_load_into_the_tasks_model_and_give_its_metrics(
    sweep: dict[str, Any],
) -> None:
    results = sweep["results"]
    best = best_member(results)
    assert best.checkpoint is not None
    with best.checkpoint.as_directory() as folder:  # the documented layout, read by hand
        raw = torch.load(Path(folder) / "weights" / f"{best.id}.pt", weights_only=True)
    model = _tune_toy.TASK.build_model(_tune_toy.TASK.resolve(best.config))
    model.load_state_dict(raw)
    assert {k: v.dtype for k, v in raw.items()} == {
        k: v.dtype for k, v in model.state_dict().items()
    }
    _assert_weights_give_the_recorded_metrics(best)
    # the experiment directory gives the same member with the same weights
    again = best_member(results.experiment_path)
    assert again == best
    for key, value in again.state_dict().items():
        assert torch.equal(value, raw[key])
    # the checkpoint Tune picks for the best array holds the weights of its completed members
    array = results.get_best_result().checkpoint
    assert array is not None
    done = {m.id for m in tuned_members(results) if m.status is Status.COMPLETED}
    with array.as_directory() as folder:
        held = {p.stem for p in (Path(folder) / "weights").glob("*.pt")}
    table = member_results(results)
    in_best = set(table[table["array"] == results.get_best_result().metrics["trial_id"]]["member"])
    assert held == done & in_best


def test_every_completed_member_has_its_weights_and_no_other_does(sweep: dict[str, Any]) -> None:
    members = tuned_members(sweep["results"])
    for m in members:
        complete = m.status is Status.COMPLETED
        assert (m.checkpoint is not None) == complete, (m.id, m.status)
        if complete:  # the crashed and retried array's members too
            _assert_weights_give_the_recorded_metrics(m)
        else:
            with pytest.raises(ValueError, match="only completed members"):
                m.state_dict()
    # a live Fusion knows no Tune results: it says where the weights are
    live = best_member(sweep["fusion"])
    assert live.checkpoint is None
    with pytest.raises(ValueError, match="pass the ResultGrid or the experiment directory"):
        live.state_dict()


@pytest.mark.slow
def test_an_interrupted_experiment_restored_tells_every_member_exactly_once(
    ray_local: Path, tmp_path: Path
) -> None:
    fusion = Fusion(_tune_toy.TASK, members=16, array_size=4)
    searcher = CountingOptuna("restore", seed=1)
    scheduler = ASHAScheduler(max_t=4, grace_period=1, reduction_factor=2)
    interrupt = InterruptOnce(after=4, marker=str(tmp_path / "interrupted"))
    tuner = _tuner(
        fusion,
        searcher,
        scheduler,
        tmp_path,
        "restore",
        callbacks=[interrupt],
        max_concurrent_trials=1,  # one array at a time: Tune wraps the searcher's limiter
    )
    first = tuner.fit()
    path = first.experiment_path
    before = member_results(path)
    assert (tmp_path / "interrupted").exists()
    assert not set(before["status"]) <= {"completed", "stopped", "failed"}  # it was unfinished

    restored = tune.Tuner.restore(path, trainable=fusion.trainable)
    results = restored.fit()
    assert not results.errors
    _assert_told_once("restore", path, 16)
    arrays = sweep_state(path)["arrays"].values()
    assert sum(a["replayed"] for a in arrays) >= 1  # resumed arrays replayed their last report
    # the restored run's searcher is a new object; the Fusion follows its state in this process
    columns = ["member", "array", "status", "evaluations", "value"]
    assert member_results(fusion)[columns].equals(member_results(results)[columns])
    assert fusion.state.counts()[Status.RUNNING] == fusion.state.counts()[Status.WAITING] == 0
    assert best_member(fusion) == best_member(results) == best_member(first)
    _assert_weights_give_the_recorded_metrics(best_member(path))  # weights across the restore
    assert not _hub_alive(fusion.state.hub_name)  # ended with the restored experiment


def test_the_hub_actor_ends_with_the_experiment(sweep: dict[str, Any]) -> None:
    assert not _hub_alive(sweep["fusion"].state.hub_name)


def test_each_members_clock_is_its_own_and_goes_on_through_the_retry(
    sweep: dict[str, Any],
) -> None:
    state = sweep["fusion"].state
    resumed = [a for a in state.arrays.values() if a.resumes]
    assert resumed  # the crashed array's members' clocks went on from its checkpoint
    for rec in state.members.values():
        clock = [h["time_total_s"] for h in rec.history]
        assert all(t >= 0 for t in clock) and clock == sorted(clock), (rec.id, clock)


def test_a_crashed_array_is_retried_from_its_checkpoint_and_no_member_is_told_twice(
    sweep: dict[str, Any],
) -> None:
    assert (sweep["crashed"] / "crashed").exists()  # an array did crash
    results = sweep["results"]
    assert not results.errors  # and its retry finished it
    arrays = sweep["fusion"].state.arrays.values()
    assert sum(a.resumes for a in arrays) == 1  # the retry went on from the array's checkpoint
    assert sum(a.replayed for a in arrays) >= 1  # and replayed the evaluations since then
    table = member_results(results)
    for history in table["history"]:  # replayed evaluations were not recorded again
        assert [h["training_iteration"] for h in history] == list(range(1, len(history) + 1))
    assert set(REPORTED["sweep"].values()) == {1}
    assert set(TOLD["sweep"].values()) == {1}
