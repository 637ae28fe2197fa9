"""``tune.RunConfig(stop=...)`` and ``tune.with_parameters`` under a Fusion, on a local Ray.

A member that meets the experiment's stop criterion ends as Tune ends a trial that meets it:
completed, with its last result and its weights, judged on its own result (its own
``training_iteration``, ``time_total_s`` and metrics), while its array-mates go on. Tune never
stops a whole array for it. ``tune.with_parameters(fusion.trainable, ...)`` is refused before
any array trains. The driver's side is tested in process (fast); each end-to-end test runs a
small Tune experiment (a few seconds: ``slow``).
"""

from __future__ import annotations

import json
import os
import signal
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.tune.search.optuna")

import _tune_toy  # noqa: E402
from hfsweep.schedulers.tune import Fusion, best_member, member_results, tuned_members  # noqa: E402
from ray import cloudpickle, tune  # noqa: E402
from ray.tune.execution.tune_controller import TrialRunnerWrapper  # noqa: E402
from ray.tune.search import Searcher  # noqa: E402
from ray.tune.search.optuna import OptunaSearch  # noqa: E402
from ray.tune.stopper import (  # noqa: E402
    FunctionStopper,
    MaximumIterationStopper,
    NoopStopper,
    Stopper,
)

from hfsweep.core.status import Status  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning"),
]

#: four members in arrays of two: in each array one learns fast, the other barely moves
POINTS = [
    {"lr": 0.5, "momentum": 0.9},
    {"lr": 1e-6, "momentum": 0.0},
    {"lr": 0.4, "momentum": 0.9},
    {"lr": 2e-6, "momentum": 0.0},
]
SPACE = {"lr": tune.loguniform(1e-6, 0.5), "momentum": tune.uniform(0.0, 0.9), "hidden": 8}
EPOCHS = _tune_toy.TASK.defaults["epochs"]


class _Searcher(Searcher):
    """Hands out ``lr`` values in order; records how each member was told to end."""

    def __init__(self, n: int) -> None:
        super().__init__(metric="val_accuracy", mode="max")
        self.lrs = [0.1 * (i + 1) for i in range(n)]
        self.outcome: dict[str, str] = {}
        self.told: Counter[str] = Counter()

    def suggest(self, trial_id: str) -> dict[str, Any] | None:
        return {"lr": self.lrs.pop(0)} if self.lrs else None

    def on_trial_complete(
        self, trial_id: str, result: dict[str, Any] | None = None, error: bool = False
    ) -> None:
        self.told[trial_id] += 1
        complete = not error and result is not None and "val_accuracy" in result
        self.outcome[trial_id] = "COMPLETE" if complete else ("FAIL" if error else "PRUNED")


class _Trial:
    """What Tune's controller hands ``on_trial_add``: an array trial with the experiment's
    ``stopping_criterion``."""

    def __init__(self, trial_id: str, stopping_criterion: dict[str, Any]) -> None:
        self.trial_id = trial_id
        self.stopping_criterion = dict(stopping_criterion)
        self.status = "PENDING"


class _Controller:
    """The part of Tune's ``TuneController`` the plugin takes the stop from: its stopper."""

    def __init__(self, stopper: Stopper) -> None:
        self._stopper = stopper


def _driver(
    stop: Any, n: int = 2
) -> tuple[Fusion, _Searcher, dict[str, dict[str, Any]], _Trial, _Controller]:
    """A Fusion's searcher and scheduler set up by Tune as ``fit()`` does for ``stop`` (the
    search properties, then the array trial "A" added), the answers it posts to trainables."""
    fusion = Fusion(_tune_toy.TASK, members=n, array_size=n, device="cpu")
    inner = _Searcher(n)
    searcher = fusion.searcher(inner)
    scheduler = fusion.scheduler()
    criteria = stop if isinstance(stop, dict) else {}
    searcher.set_search_properties("val_accuracy", "max", {"lr": 0.1}, stop=criteria)
    stopper = NoopStopper() if isinstance(stop, dict) else stop
    if callable(stop) and not isinstance(stop, Stopper):
        stopper = FunctionStopper(stop)
    searcher._connect = lambda: None  # type: ignore[method-assign]  # no hub: answers land below
    posted: dict[str, dict[str, Any]] = {}
    fusion.state.post = lambda token, message: posted.__setitem__(token, message)
    controller = _Controller(stopper)
    trial = _Trial("A", criteria)
    scheduler.on_trial_add(TrialRunnerWrapper(controller, None), trial)
    assert isinstance(searcher.suggest("A"), dict)
    return fusion, inner, posted, trial, controller


def _report(token: str, evals: list[tuple[str, int, float]]) -> dict[str, Any]:
    """An array's Tune result: ``(member, epoch, val_accuracy)`` per evaluated member."""
    payload = {
        "token": token,
        "evaluations": [
            {
                "member": m,
                "step": 5 * epoch,
                "epoch": float(epoch),
                "metrics": {"train_loss": 0.5, "val_loss": 0.5, "val_accuracy": value},
                "final": False,
                "time": float(epoch),
            }
            for m, epoch, value in evals
        ],
        "ended": [],
        "consumed": 0,
        "queued": 0,
    }
    return {"val_accuracy": max(v for _, _, v in evals), "hfsweep": json.dumps(payload)}


def test_tune_hands_the_stop_to_the_fusion_and_never_stops_an_array() -> None:
    user = IterationsThenAll(total=10)
    _, _, _, trial, controller = _driver({"training_iteration": 2})
    assert trial.stopping_criterion == {}  # Tune's check of the array's results finds none
    fusion, _, _, _, controller = _driver(user)
    assert fusion.state.stop.stopper is user
    # Tune calls the controller's stopper with the array's results: it never stops one
    never = controller._stopper
    assert never is not user
    assert not never("A", {"training_iteration": 99, "val_accuracy": 1.0})
    assert not never.stop_all()
    # Tune saves its controller's stopper with the experiment: a restored experiment's
    # controller holds the one that never stops, and the member stop finds the user's in it
    fusion.state.stop.stopper = None
    scheduler = fusion._scheduler
    assert scheduler is not None
    scheduler.on_trial_add(TrialRunnerWrapper(controller, None), _Trial("B", {}))
    assert fusion.state.stop.stopper is user and controller._stopper is never


def test_a_dict_stop_judges_each_member_on_its_own_training_iteration() -> None:
    fusion, inner, posted, _, _ = _driver({"training_iteration": 2})
    scheduler = fusion._scheduler
    assert scheduler is not None
    # A-1 joined later (its first evaluation comes with A-0's second)
    assert scheduler.on_trial_result(None, _Trial("A", {}), _report("t1", [("A-0", 1, 0.3)]))
    result = _report("t2", [("A-0", 2, 0.4), ("A-1", 1, 0.9)])
    assert scheduler.on_trial_result(None, _Trial("A", {}), result) == "CONTINUE"
    assert posted["t2"]["go"] == {"A-0": False, "A-1": True}
    assert posted["t2"]["complete"] == ["A-0"]  # the trainable keeps its weights
    assert inner.outcome == {"A-0": "COMPLETE"}
    assert fusion.state.members["A-0"].status == "completed"
    scheduler.on_trial_result(None, _Trial("A", {}), _report("t3", [("A-1", 2, 0.95)]))
    assert posted["t3"]["go"] == {"A-1": False}
    assert inner.outcome == {"A-0": "COMPLETE", "A-1": "COMPLETE"}
    assert set(inner.told.values()) == {1}


def test_a_dict_stop_is_saved_with_the_sweep_and_applies_after_a_restore() -> None:
    """Tune hands a dict stop to the searcher only when an experiment starts, and a restored
    array trial comes back without it (the plugin took it off): the saved state carries it."""
    fusion, _, _, _, _ = _driver({"training_iteration": 2})
    fusion.state.on_result("A", _report("t0", [("A-0", 1, 0.3)]))
    saved = fusion._searcher.get_state()  # type: ignore[union-attr]
    again = Fusion(_tune_toy.TASK, members=2, array_size=2, device="cpu")
    searcher = again.searcher(_Searcher(2))
    again.scheduler()
    searcher.set_state(saved)
    assert again.state.stop.criteria == {"training_iteration": 2}
    posted: dict[str, dict[str, Any]] = {}
    again.state.post = lambda token, message: posted.__setitem__(token, message)
    result = _report("t1", [("A-0", 2, 0.4), ("A-1", 1, 0.9)])
    again.state.on_result("A", result)
    assert posted["t1"]["go"] == {"A-0": False, "A-1": True}
    assert again.state.members["A-0"].status == "completed"


def test_a_metric_threshold_stops_only_the_member_that_meets_it() -> None:
    fusion, inner, posted, _, _ = _driver({"val_accuracy": 0.8})
    scheduler = fusion._scheduler
    assert scheduler is not None
    result = _report("t1", [("A-0", 1, 0.85), ("A-1", 1, 0.5)])
    assert scheduler.on_trial_result(None, _Trial("A", {}), result) == "CONTINUE"
    assert posted["t1"]["go"] == {"A-0": False, "A-1": True}
    assert inner.outcome == {"A-0": "COMPLETE"}
    assert fusion.state.members["A-0"].value == 0.85


def test_a_callable_stop_gets_each_members_id_and_result() -> None:
    calls: list[tuple[str, int]] = []

    def stop(trial_id: str, result: dict[str, Any]) -> bool:
        calls.append((trial_id, result["training_iteration"]))
        return trial_id == "A-1"

    fusion, inner, posted, _, _ = _driver(stop)
    scheduler = fusion._scheduler
    assert scheduler is not None
    result = _report("t1", [("A-0", 1, 0.5), ("A-1", 1, 0.4)])
    scheduler.on_trial_result(None, _Trial("A", {}), result)
    assert sorted(calls) == [("A-0", 1), ("A-1", 1)]
    assert posted["t1"]["go"] == {"A-0": True, "A-1": False}
    assert inner.outcome == {"A-1": "COMPLETE"}


def test_a_stoppers_stop_all_completes_every_member_and_asks_no_more() -> None:
    fusion, inner, posted, _, _ = _driver(IterationsThenAll(total=2), n=2)
    scheduler = fusion._scheduler
    assert scheduler is not None
    result = _report("t1", [("A-0", 1, 0.5), ("A-1", 1, 0.4)])
    scheduler.on_trial_result(None, _Trial("A", {}), result)
    assert posted["t1"]["go"] == {"A-0": False, "A-1": False}
    assert inner.outcome == {"A-0": "COMPLETE", "A-1": "COMPLETE"}
    assert fusion.state.inner_finished


def test_a_dict_stop_without_the_fusions_scheduler_is_refused_at_fit() -> None:
    fusion = Fusion(_tune_toy.TASK, members=2, array_size=2, device="cpu")
    searcher = fusion.searcher(_Searcher(2))
    with pytest.raises(ValueError, match=r"stop=\{'training_iteration': 2\}.*fusion.scheduler"):
        searcher.set_search_properties(
            "val_accuracy", "max", {"lr": 0.1}, stop={"training_iteration": 2}
        )


def test_the_trainable_refuses_with_parameters_and_the_driver_raises_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fusion, _, posted, _, _ = _driver({})
    config = fusion.state._array_config(fusion.state.arrays["A"])
    sent: list[dict[str, Any]] = []
    monkeypatch.setattr(tune, "report", lambda metrics, **kw: sent.append(dict(metrics)))
    # what tune.with_parameters(fusion.trainable, data=..., labels=...) calls in the worker
    fusion.trainable(config, data=[1, 2], labels=[3])  # type: ignore[call-arg]
    assert len(sent) == 1  # its only report, before building anything
    scheduler = fusion._scheduler
    assert scheduler is not None
    want = r"with_parameters\(fusion.trainable, data=\.\.\., labels=\.\.\.\).*data function"
    with pytest.raises(ValueError, match=want):
        scheduler.on_trial_result(None, _Trial("A", {}), sent[0])
    with pytest.raises(ValueError, match=want):  # the searcher, without the scheduler
        fusion._searcher.on_trial_result("A", sent[0])  # type: ignore[union-attr]
    assert not posted and not fusion.state.ledger.decisions


@pytest.fixture(scope="module")
def ray_up(shared_ray: Any) -> Iterator[None]:
    """The shared local Ray (tests/conftest.py: loopback, 2 CPUs, no dashboard)."""
    shared_ray.start()
    cloudpickle.register_pickle_by_value(_tune_toy)  # workers cannot import tests/tune/
    try:
        yield
    finally:
        cloudpickle.unregister_pickle_by_value(_tune_toy)


def _fit(
    tmp_path: Path,
    stop: Any,
    *,
    members: int = 4,
    fusion: Fusion | None = None,
    trainable: Any = None,
    one_at_a_time: bool = False,
    callbacks: list[Any] | None = None,
) -> tuple[Any, Fusion]:
    """A Tune experiment over ``members`` members of the toy task in arrays of two, FIFO."""
    fusion = fusion or Fusion(_tune_toy.TASK, members=members, array_size=2, device="cpu")
    searcher = OptunaSearch(seed=0, points_to_evaluate=[dict(p) for p in POINTS])
    tuner = tune.Tuner(
        trainable or fusion.trainable,
        param_space=dict(SPACE),
        tune_config=tune.TuneConfig(
            metric="val_accuracy",
            mode="max",
            num_samples=-1,
            max_concurrent_trials=1 if one_at_a_time else None,
            search_alg=fusion.searcher(searcher),
            scheduler=fusion.scheduler(),
        ),
        run_config=tune.RunConfig(
            storage_path=str(tmp_path), name="stop", verbose=0, stop=stop, callbacks=callbacks
        ),
    )
    return tuner.fit(), fusion


def _assert_completed_with_weights(results: Any, members: set[str]) -> None:
    by_id = {m.id: m for m in tuned_members(results)}
    for mid in members:
        m = by_id[mid]
        assert m.status is Status.COMPLETED and m.state == "COMPLETE", (mid, m.status)
        assert m.checkpoint is not None, mid
        state = m.state_dict()
        model = _tune_toy.TASK.build_model(_tune_toy.TASK.resolve(m.config))
        model.load_state_dict(state)  # the member's weights, whole


@pytest.mark.slow
def test_a_training_iteration_stop_completes_every_member_at_its_own_iteration(
    ray_up: None, tmp_path: Path
) -> None:
    results, _ = _fit(tmp_path, {"training_iteration": 2})
    assert not results.errors
    table = member_results(results)
    assert len(table) == 4
    assert set(table["status"]) == {"completed"}, table[["member", "status"]]
    assert (table["evaluations"] == 2).all()  # each member's own count, not its array's
    _assert_completed_with_weights(results, set(table["member"]))
    best = best_member(results)
    assert best.status is Status.COMPLETED and best.value == table["value"].max()
    best.load_model(_tune_toy.TASK)


@pytest.mark.slow
def test_a_metric_threshold_stops_only_the_members_that_meet_it(
    ray_up: None, tmp_path: Path
) -> None:
    threshold = 0.6
    results, _ = _fit(tmp_path, {"val_accuracy": threshold})
    assert not results.errors
    table = member_results(results).set_index("member")
    met = set()
    for member, row in table.iterrows():
        values = [h["val_accuracy"] for h in row["history"]]
        reached = [i for i, v in enumerate(values) if v >= threshold]
        assert row["status"] == "completed", (member, row["status"])
        if reached:  # it stopped at the first evaluation that met the threshold
            met.add(member)
            assert len(values) == reached[0] + 1, (member, values)
        else:  # the others trained on to their budget
            assert len(values) == EPOCHS, (member, values)
    assert met and met != set(table.index), table  # some met it, some did not
    # a member met it while an array-mate went on: the array was not stopped
    arrays = {str(a): set(g.index) for a, g in table.groupby("array")}
    assert any(ids & met and ids - met for ids in arrays.values()), (arrays, met)
    _assert_completed_with_weights(results, met)


@pytest.mark.slow
def test_a_callable_stop_is_called_with_each_members_id_and_result(
    ray_up: None, tmp_path: Path
) -> None:
    def stop(trial_id: str, result: dict[str, Any]) -> bool:
        # the second member of each array (ids end in -1, -3...) stops at its first evaluation
        return int(trial_id.rsplit("-", 1)[1]) % 2 == 1 and result["training_iteration"] >= 1

    results, _ = _fit(tmp_path, stop)
    assert not results.errors
    table = member_results(results).set_index("member")
    for member, row in table.iterrows():
        odd = int(str(member).rsplit("-", 1)[1]) % 2 == 1
        assert row["status"] == "completed"
        assert row["evaluations"] == (1 if odd else EPOCHS), (member, row["evaluations"])
    _assert_completed_with_weights(results, set(table.index))


class IterationsThenAll(Stopper):
    """Stops a member at its second evaluation; ``stop_all`` once it saw ``total`` results."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.seen: list[str] = []

    def __call__(self, trial_id: str, result: dict[str, Any]) -> bool:
        self.seen.append(trial_id)
        return bool(result["training_iteration"] >= 2)

    def stop_all(self) -> bool:
        return len(self.seen) >= self.total


@pytest.mark.slow
def test_a_stopper_judges_each_member_and_stop_all_ends_the_sweep(
    ray_up: None, tmp_path: Path
) -> None:
    results, fusion = _fit(tmp_path, IterationsThenAll(total=10**9))
    assert not results.errors
    table = member_results(results)
    assert set(table["status"]) == {"completed"} and (table["evaluations"] == 2).all(), table
    _assert_completed_with_weights(results, set(table["member"]))

    # stop_all after the first report: that array's members complete, nobody new is asked
    results, fusion = _fit(
        tmp_path / "all", IterationsThenAll(total=1), members=8, one_at_a_time=True
    )
    assert not results.errors
    table = member_results(results)
    assert len(table) < 8  # the budget was not spent
    assert set(table["status"]) == {"completed"}, table[["member", "status"]]
    assert (table["evaluations"] == 1).all(), table[["member", "evaluations"]]
    assert fusion.state.finished


@pytest.mark.slow
def test_with_parameters_is_refused_before_any_array_trains(ray_up: None, tmp_path: Path) -> None:
    fusion = Fusion(_tune_toy.TASK, members=4, array_size=2, device="cpu")
    wrapped = tune.with_parameters(fusion.trainable, data=list(range(10)))
    with pytest.raises(Exception, match=r"with_parameters\(fusion.trainable, data=\.\.\.\)") as e:
        _fit(tmp_path, None, fusion=fusion, trainable=wrapped)
    assert "Task.data(config)" in str(e.value)
    assert not fusion.state.ledger.decisions  # no member was evaluated


class _InterruptOnce(tune.Callback):
    """Sends this process SIGINT (Ctrl+C) at the first array result, once per ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def on_trial_result(self, *args: Any, **info: Any) -> None:
        if not self.marker.exists():
            self.marker.write_text("interrupted")
            os.kill(os.getpid(), signal.SIGINT)


@pytest.mark.slow
def test_a_stopper_still_judges_each_member_after_tuner_restore(
    ray_up: None, tmp_path: Path
) -> None:
    marker = tmp_path / "interrupted"
    first, fusion = _fit(
        tmp_path,
        MaximumIterationStopper(2),
        one_at_a_time=True,
        callbacks=[_InterruptOnce(marker)],
    )
    assert marker.exists()
    assert "running" in set(member_results(first.experiment_path)["status"])  # unfinished
    results = tune.Tuner.restore(first.experiment_path, trainable=fusion.trainable).fit()
    assert not results.errors
    table = member_results(results)
    assert len(table) == 4
    assert set(table["status"]) == {"completed"} and (table["evaluations"] == 2).all(), table
