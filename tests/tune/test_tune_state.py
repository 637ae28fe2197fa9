"""The fused Tune sweep's driver-side logic, without a Ray cluster: packing by compatibility key,
the member budget, joint per-member decisions, telling each member once, replays after a resume,
refill, and the wrappers' checks of what users pass."""

from __future__ import annotations

import copy
import json
import math
import pickle
import sys
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ray.tune")

from _tune_toy import TASK
from hfsweep.schedulers import ASHAScheduler as HfASHA
from hfsweep.schedulers import Report
from hfsweep.schedulers._tune_format import FINISHED
from hfsweep.schedulers._tune_joint import (
    MemberController,
    MemberTrial,
    NativeDecider,
    TuneDecider,
)
from hfsweep.schedulers._tune_sweep import SweepState
from hfsweep.schedulers.tune import Fusion
from ray import tune
from ray.tune.schedulers import ASHAScheduler, HyperBandScheduler
from ray.tune.search import Searcher

from hfsweep.core._ledger_file import LedgerFile
from hfsweep.core.ledger import Ledger, decision_key
from hfsweep.core.status import Status


class ListSearcher(Searcher):
    """Hands out the configs it was given, in order; records every call."""

    def __init__(self, configs: list[dict[str, Any]]) -> None:
        super().__init__(metric="val_accuracy", mode="max")
        self.configs = list(configs)
        self.asked: list[str] = []
        self.results: list[tuple[str, int]] = []
        #: each member's last result, as on_trial_result got it
        self.last: dict[str, dict[str, Any]] = {}
        self.told: Counter[str] = Counter()
        self.outcome: dict[str, str] = {}

    def suggest(self, trial_id: str) -> dict[str, Any] | None:
        if not self.configs:
            return None
        self.asked.append(trial_id)
        return self.configs.pop(0)

    def on_trial_result(self, trial_id: str, result: dict[str, Any]) -> None:
        self.results.append((trial_id, result["training_iteration"]))
        self.last[trial_id] = dict(result)

    def on_trial_complete(
        self, trial_id: str, result: dict[str, Any] | None = None, error: bool = False
    ) -> None:
        self.told[trial_id] += 1
        if error:
            self.outcome[trial_id] = "FAIL"
        elif result is None or self.metric not in result:
            self.outcome[trial_id] = "PRUNED"
        else:
            self.outcome[trial_id] = "COMPLETE"


def _state(
    configs: list[dict[str, Any]], *, members: int, size: int, refill: bool = True
) -> tuple[SweepState, ListSearcher, dict[str, dict[str, Any]]]:
    """A sweep state over ``configs`` with a recording searcher; the answers it posts."""
    state = SweepState(TASK, members=members, array_size=size, refill=refill, uid="test")
    searcher = ListSearcher(configs)
    state.searcher = searcher
    state.configure("val_accuracy", "max")
    posted: dict[str, dict[str, Any]] = {}
    state.post = lambda token, message: posted.__setitem__(token, message)
    return state, searcher, posted


def _report(
    token: str,
    evals: list[tuple[str, int, float]],
    *,
    final: bool = False,
    ended: list[dict[str, Any]] | None = None,
    consumed: int = 0,
    queued: int = 0,
    loss: float = 0.5,
    elapsed: float | None = None,
    times: Mapping[str, float] | None = None,
    resumed: bool = False,
) -> dict[str, Any]:
    """An array report: ``(member, epoch, val_accuracy)`` per evaluated member (5 steps/epoch);
    ``elapsed`` is the array's clock, ``times`` each member's own training time."""
    payload: dict[str, Any] = {
        "token": token,
        "evaluations": [
            {
                "member": m,
                "step": 5 * epoch,
                "epoch": float(epoch),
                "metrics": {"train_loss": loss, "val_loss": loss, "val_accuracy": value},
                "final": final,
                **({"time": times[m]} if times is not None else {}),
            }
            for m, epoch, value in evals
        ],
        "ended": ended or [],
        "consumed": consumed,
        "queued": queued,
        "resumed": resumed,
    }
    if elapsed is not None:
        payload["elapsed"] = elapsed
    return {"val_accuracy": 0.0, "hfsweep": json.dumps(payload)}


def test_members_of_one_key_share_an_array_and_others_wait_for_their_own() -> None:
    configs = [{"lr": 0.1, "hidden": h} for h in (8, 16, 8, 16, 8)]
    state, searcher, _ = _state(configs, members=5, size=2, refill=False)
    first = state.suggest("A")
    assert isinstance(first, dict)
    ids = [m["id"] for m in first["hfsweep"]["members"]]
    assert ids == ["A-0", "A-2"]  # A-1 (hidden=16) is held for an array of its own key
    second = state.suggest("B")
    assert isinstance(second, dict)
    assert [m["id"] for m in second["hfsweep"]["members"]] == ["A-1", "B-0"]
    assert {state.members[m].config["hidden"] for m in ("A-1", "B-0")} == {16}
    third = state.suggest("C")  # the budget is spent: the last member starts a smaller array
    assert isinstance(third, dict)
    assert [m["id"] for m in third["hfsweep"]["members"]] == ["C-0"]
    assert state.suggest("D") is None  # arrays still run: not finished yet
    for array in ("A", "B", "C"):
        state.on_complete(array, None, error=True)
    assert state.suggest("E") == FINISHED
    assert len(searcher.asked) == 5
    assert all(n == 1 for n in searcher.told.values()) and len(searcher.told) == 5


def test_a_config_the_task_rejects_is_told_failed_at_once_and_counts_against_the_budget() -> None:
    configs = [{"lr": -1.0}, {"lr": 0.1}, {"lr": 0.2}]
    state, searcher, _ = _state(configs, members=3, size=2)
    config = state.suggest("A")
    assert isinstance(config, dict)
    assert [m["id"] for m in config["hfsweep"]["members"]] == ["A-1", "A-2"]
    assert searcher.outcome == {"A-0": "FAIL"}
    assert "lr" in (state.members["A-0"].error or "")


def test_each_member_is_told_once_and_replays_get_the_decisions_already_taken() -> None:
    configs = [{"lr": 0.01 * (i + 1)} for i in range(3)]
    state, searcher, posted = _state(configs, members=3, size=3, refill=False)
    state.decider = TuneDecider(
        ASHAScheduler(
            metric="val_accuracy", mode="max", max_t=4, grace_period=1, reduction_factor=3
        )
    )
    state.suggest("A")
    r1 = _report("t1", [("A-0", 1, 0.9), ("A-1", 1, 0.2), ("A-2", 1, 0.5)])
    assert state.on_result("A", r1) is True
    assert posted["t1"]["go"] == {"A-0": True, "A-1": False, "A-2": False}
    assert searcher.outcome == {"A-1": "PRUNED", "A-2": "PRUNED"}
    # the same report again (the scheduler wrapper, then the searcher wrapper): no effect
    assert state.on_result("A", r1) is True
    # the trainable resumed from a checkpoint and replays the evaluation with a new token
    replay = _report("t2", [("A-0", 1, 0.9), ("A-1", 1, 0.2), ("A-2", 1, 0.5)])
    state.on_result("A", {**replay, "hfsweep": replay["hfsweep"]})
    assert posted["t2"]["go"] == posted["t1"]["go"]
    final = _report("t3", [("A-0", 4, 0.95)], final=True)
    assert state.on_result("A", final) is False  # no member left: Tune stops the trial
    assert searcher.outcome["A-0"] == "COMPLETE"
    assert all(n == 1 for n in searcher.told.values())
    assert searcher.results.count(("A-0", 1)) == 1
    state.on_complete("A", final)
    assert all(n == 1 for n in searcher.told.values())


def test_a_members_clock_goes_on_from_its_last_evaluation_after_a_resume() -> None:
    """A resumed array's clock goes on from its checkpoint's time, behind the evaluation it
    replays when the work since the checkpoint is redone faster (or ahead, slower): the member's
    later times go on from the replayed evaluation's recorded time, and survive a restore."""
    state, searcher, _posted = _state([{"lr": 0.01}], members=1, size=1, refill=False)
    state.suggest("A")
    state.on_result("A", _report("t1", [("A-0", 1, 0.5)], times={"A-0": 10.0}))
    state.on_result("A", _report("t2", [("A-0", 2, 0.6)], times={"A-0": 20.0}))
    # crash; the checkpoint of epoch 1 (clock 10.0) is restored and epoch 2 is redone in 4 s
    state.on_result("A", _report("t3", [("A-0", 2, 0.6)], times={"A-0": 14.0}, resumed=True))
    state.on_result("A", _report("t4", [("A-0", 3, 0.7)], times={"A-0": 19.0}))
    assert [h["time_total_s"] for h in state.members["A-0"].history] == [10.0, 20.0, 25.0]
    assert searcher.last["A-0"]["time_this_iter_s"] == 5.0
    # a second crash back to epoch 1, the redo slower this time (12 s): still from 20.0 on
    # (the state saved and restored in between, as Tune restores an experiment)
    restored, searcher2, _ = _state([], members=1, size=1, refill=False)
    restored.load_state_dict(copy.deepcopy(state.state_dict()))
    restored.on_result("A", _report("t5", [("A-0", 2, 0.6)], times={"A-0": 22.0}, resumed=True))
    restored.on_result("A", _report("t6", [("A-0", 3, 0.7)], times={"A-0": 23.0}))  # replayed
    restored.on_result("A", _report("t7", [("A-0", 4, 0.8)], times={"A-0": 30.0}))
    assert [h["time_total_s"] for h in restored.members["A-0"].history] == [10.0, 20.0, 25.0, 32.0]
    assert searcher2.last["A-0"]["time_this_iter_s"] == 7.0
    # a resumed array whose replay the log does not know (a restore from a state older than
    # the array's checkpoint): its evaluation is new to the driver, and the clock still
    # does not go back
    restored.on_result("A", _report("t8", [("A-0", 6, 0.8)], times={"A-0": 26.0}, resumed=True))
    assert restored.members["A-0"].history[-1]["time_total_s"] == 32.0


def test_tune_schedulers_decide_jointly_whatever_the_order() -> None:
    def decide(order: list[str]) -> dict[str, bool]:
        decider = TuneDecider(
            ASHAScheduler(metric="v", mode="max", max_t=9, grace_period=1, reduction_factor=3)
        )
        values = {"a": 0.1, "b": 0.9, "c": 0.5, "d": 0.7}
        reports = [(MemberTrial(m, {}), {"v": values[m], "training_iteration": 1}) for m in order]
        return decider.decide(MemberController(t for t, _ in reports), reports, "v")

    forward = decide(["a", "b", "c", "d"])
    assert forward == decide(["d", "c", "b", "a"])
    # each member is judged after all its array-mates were recorded, by Tune's own rule (at or
    # above the 2/3 percentile of the others' values); first come, first served would have let
    # "a" go on, as the first to reach the rung
    assert forward == {"a": False, "b": True, "c": False, "d": True}


def test_nonfinite_members_fail_and_the_others_go_on() -> None:
    state, searcher, posted = _state([{"lr": 0.1}, {"lr": 1e9}], members=2, size=2)
    state.suggest("A")
    payload = json.loads(_report("t1", [("A-0", 1, 0.8)])["hfsweep"])
    payload["evaluations"].append(
        {
            "member": "A-1",
            "step": 5,
            "epoch": 1.0,
            "metrics": {"train_loss": math.inf, "val_loss": math.nan, "val_accuracy": 0.1},
            "final": False,
        }
    )
    assert state.on_result("A", {"hfsweep": json.dumps(payload)}) is True
    assert posted["t1"]["go"] == {"A-0": True, "A-1": False}
    assert searcher.outcome == {"A-1": "FAIL"}
    # a member whose gradients went non-finite between evaluations: the trainer's word
    state2, searcher2, _ = _state([{"lr": 0.1}, {"lr": 0.2}], members=2, size=2)
    state2.suggest("B")
    ended = [{"member": "B-1", "status": "failed", "steps": 3, "error": "non-finite gradients"}]
    state2.on_result("B", _report("t1", [("B-0", 1, 0.8)], ended=ended))
    assert searcher2.outcome == {"B-1": "FAIL"}
    assert state2.members["B-1"].error == "non-finite gradients"


def test_freed_slots_get_members_of_the_arrays_key_once_the_trainable_took_the_last_ones() -> None:
    configs = [{"lr": 0.1, "hidden": h} for h in (8, 8, 16, 8, 8)]
    state, _, posted = _state(configs, members=5, size=2)
    state.decider = TuneDecider(
        ASHAScheduler(
            metric="val_accuracy", mode="max", max_t=4, grace_period=1, reduction_factor=2
        )
    )
    state.suggest("A")
    state.on_result("A", _report("t1", [("A-0", 1, 0.9), ("A-1", 1, 0.1)]))
    given = posted["t1"]["given"]
    # A-1 was pruned; the held hidden=16 member is not compatible, so a new one is asked
    assert [g["id"] for g in given] == ["A-3"]
    assert state.members["A-2"].status is Status.WAITING
    # the trainable has not taken A-3 yet (consumed 0): the same member is sent again, no other
    state.on_result("A", _report("t2", [("A-0", 2, 0.9)], consumed=0))
    assert [g["id"] for g in posted["t2"]["given"]] == ["A-3"]
    state.on_result("A", _report("t3", [("A-0", 3, 0.9), ("A-3", 1, 0.8)], consumed=1))
    assert posted["t3"]["given"] == []
    assert state.arrays["A"].all_members() == ["A-0", "A-1", "A-3"]


def test_an_array_that_fails_for_good_fails_its_untold_members_and_a_stopped_one_prunes_them() -> (
    None
):
    state, searcher, _ = _state([{"lr": 0.1}, {"lr": 0.2}, {"lr": 0.3}], members=3, size=3)
    state.suggest("A")
    state.on_result("A", _report("t1", [("A-0", 1, 0.5), ("A-1", 1, 0.6), ("A-2", 1, 0.7)]))
    state.on_complete("A", None, error=True)
    assert searcher.outcome == {"A-0": "FAIL", "A-1": "FAIL", "A-2": "FAIL"}
    # an array stopped by Tune itself (a stopper) after its members were evaluated
    state2, searcher2, _ = _state([{"lr": 0.1}, {"lr": 0.2}], members=2, size=2)
    state2.suggest("B")
    last = _report("t1", [("B-0", 1, 0.5), ("B-1", 1, 0.6)])
    state2.on_complete("B", last)  # the stopping report reaches only on_trial_complete
    assert searcher2.outcome == {"B-0": "PRUNED", "B-1": "PRUNED"}
    assert searcher2.results == [("B-0", 1), ("B-1", 1)]


def _asha_state_after_one_report() -> tuple[Any, dict[str, Any]]:
    """A sweep state under ASHA with array A of two members, each reported once (A-1 stopped):
    the state and what it posted to the trainables."""
    state, _, posted = _state([{"lr": 0.1}, {"lr": 0.2}], members=2, size=2)
    state.decider = TuneDecider(
        ASHAScheduler(
            metric="val_accuracy", mode="max", max_t=4, grace_period=1, reduction_factor=2
        )
    )
    state.suggest("A")
    state.on_result("A", _report("t1", [("A-0", 1, 0.9), ("A-1", 1, 0.1)]))
    return state, posted


def test_the_state_survives_a_save_and_restore() -> None:
    state, posted = _asha_state_after_one_report()
    saved = copy.deepcopy(state.state_dict())
    restored, searcher2, posted2 = _state([], members=2, size=2)
    restored.load_state_dict(saved)
    restored.on_result("A", _report("t9", [("A-0", 1, 0.9), ("A-1", 1, 0.1)]))  # a replay
    assert posted2["t9"]["go"] == posted["t1"]["go"]
    assert not searcher2.told  # told before the save, never again
    assert restored.counts()[Status.STOPPED] == 1


def test_the_plugin_logs_its_decisions_as_the_engines_ledger_does(tmp_path: Path) -> None:
    values = {"A-0": 0.9, "A-1": 0.1, "A-2": 0.5, "A-3": 0.7}
    state, _, posted = _state([{"lr": 0.1 * (i + 1)} for i in range(4)], members=4, size=4)
    state.decider = NativeDecider(HfASHA(mode="max", max_resource=4, reduction_factor=2))
    state.suggest("A")
    state.on_result("A", _report("t1", [(m, 1, v) for m, v in values.items()]))
    ledger = Ledger(
        LedgerFile(tmp_path / "state.json", tmp_path / "state.jsonl"),
        HfASHA(mode="max", max_resource=4, reduction_factor=2),
        lambda: 0.0,
    )
    go = ledger.decide([(Report(m, 1.0, v), 5) for m, v in values.items()])  # step 5: epoch 1
    assert go == posted["t1"]["go"] and go == {"A-0": True, "A-1": False, "A-2": False, "A-3": True}
    assert ledger.decisions == state.decisions == {decision_key(m, 5): go[m] for m in values}


def test_a_member_that_completes_with_a_nonfinite_metric_fails_as_in_the_engine() -> None:
    state, searcher, _ = _state([{"lr": 0.1}, {"lr": 0.2}], members=2, size=2)
    state.suggest("A")
    state.on_result("A", _report("t1", [("A-0", 1, math.nan), ("A-1", 1, 0.5)], final=True))
    assert searcher.outcome == {"A-0": "FAIL", "A-1": "COMPLETE"}
    assert state.members["A-0"].status is Status.FAILED
    assert state.members["A-0"].error == "val_accuracy is nan"  # Status.settle's reason
    assert Status.COMPLETED.settle(math.nan, "val_accuracy") == (
        Status.FAILED,
        "val_accuracy is nan",
    )
    assert Status.COMPLETED.settle(None, "loss") == (Status.FAILED, "loss is None")
    assert Status.COMPLETED.settle(True, "loss") == (Status.FAILED, "loss is True")
    assert Status.COMPLETED.settle(0.5, "loss") == (Status.COMPLETED, None)
    assert Status.STOPPED.settle(math.inf, "loss") == (Status.STOPPED, None)
    assert Status.FAILED.settle(0.5, "loss") == (Status.FAILED, None)


def _as_format_1(saved: dict[str, Any]) -> dict[str, Any]:
    """``saved`` as hfsweep wrote it before the one status vocabulary (format 1): each member's
    Optuna state name under ``"state"``, no ``"status"``; the decision log and sizes beside the
    members, no ledger (as up to format 2)."""
    members = {}
    for mid, record in saved["members"].items():
        old = {k: v for k, v in record.items() if k != "status"}
        old["state"] = Status(record["status"]).optuna_name  # "PRUNED" for "stopped"...
        members[mid] = old
    ledger = saved.pop("ledger")
    saved.update(decisions=ledger["decisions"], sizes=ledger["sizes"])
    return {**saved, "format": "hfsweep.tune/1", "members": members}


def test_a_sweep_saved_in_the_previous_format_goes_on_after_a_restore() -> None:
    state, posted = _asha_state_after_one_report()
    old = _as_format_1(copy.deepcopy(state.state_dict()))
    assert {r["state"] for r in old["members"].values()} == {"RUNNING", "PRUNED"}
    restored, searcher2, posted2 = _state([], members=2, size=2)
    restored.load_state_dict(old)
    assert restored.members["A-0"].status is Status.RUNNING
    assert restored.members["A-1"].status is Status.STOPPED
    restored.on_result("A", _report("t9", [("A-0", 1, 0.9), ("A-1", 1, 0.1)]))  # a replay
    assert posted2["t9"]["go"] == posted["t1"]["go"] and not searcher2.told
    restored.on_result("A", _report("t10", [("A-0", 4, 0.95)], final=True))
    assert searcher2.outcome == {"A-0": "COMPLETE"}
    assert restored.members["A-0"].status is Status.COMPLETED
    assert restored.state_dict()["format"] == "hfsweep.tune/3"
    assert restored.state_dict()["members"]["A-1"]["status"] == "stopped"


def test_hfsweep_schedulers_decide_jointly_too() -> None:
    state, _, posted = _state([{"lr": 0.1}, {"lr": 0.2}, {"lr": 0.3}], members=3, size=3)
    from hfsweep.schedulers._tune_joint import NativeDecider

    state.decider = NativeDecider(
        HfASHA(mode="max", max_resource=4, grace_period=1, reduction_factor=3)
    )
    state.suggest("A")
    state.on_result("A", _report("t1", [("A-0", 1, 0.5), ("A-1", 1, 0.9), ("A-2", 1, 0.7)]))
    assert posted["t1"]["go"] == {"A-0": False, "A-1": True, "A-2": False}


def test_the_log_and_tunes_status_line_say_the_cores_status_words(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fusion = Fusion(TASK, members=3, array_size=3)
    fusion.searcher(ListSearcher([{"lr": 0.1}, {"lr": 0.2}, {"lr": 0.3}]))
    scheduler = fusion.scheduler(
        ASHAScheduler(
            metric="val_accuracy", mode="max", max_t=4, grace_period=1, reduction_factor=3
        )
    )
    state = fusion.state
    state.configure("val_accuracy", "max")
    state.post = lambda token, message: None
    state.suggest("A")
    with caplog.at_level("INFO", logger="hfsweep.tune"):
        state.on_result("A", _report("t1", [("A-0", 1, 0.9), ("A-1", 1, 0.2), ("A-2", 1, 0.5)]))
    ended = [r.getMessage() for r in caplog.records if r.getMessage().startswith("member A-")]
    assert ended == [
        "member A-1 stopped (val_accuracy=0.2)",
        "member A-2 stopped (val_accuracy=0.5)",
    ]
    assert scheduler.debug_string().endswith("members 1 running, 2 stopped")
    assert state.counts() == {"waiting": 0, "running": 1, "completed": 0, "stopped": 2, "failed": 0}


def test_users_get_errors_that_name_the_value_and_what_would_be_valid() -> None:
    with pytest.raises(ValueError, match="members=0"):
        Fusion(TASK, members=0)
    with pytest.raises(ValueError, match=r"members=100000000000000000000000\): .* to 1,000,000"):
        Fusion(TASK, members=10**23)
    with pytest.raises(ValueError, match="array_size='big'"):
        Fusion(TASK, members=4, array_size="big")
    fusion = Fusion(TASK, members=4, array_size=2)
    with pytest.raises(RuntimeError, match=r"fusion\.searcher"):
        fusion.scheduler()
    searcher = fusion.searcher(ListSearcher([]))
    with pytest.raises(TypeError, match=r"HyperBandScheduler.*ASHAScheduler"):
        fusion.scheduler(HyperBandScheduler())
    with pytest.raises(ValueError, match=r"num_samples=10.*num_samples=-1"):
        searcher.set_search_properties("val_accuracy", "max", {"lr": 0.1}, num_samples=10)
    with pytest.raises(ValueError, match="'width' is not a config key of task 'tune_toy'"):
        searcher.set_search_properties(
            "val_accuracy", "max", {"width": tune.uniform(0, 1)}, num_samples=sys.maxsize
        )


def test_member_configs_take_the_constants_of_the_param_space() -> None:
    fusion = Fusion(TASK, members=2, array_size=2)
    inner = ListSearcher([{"lr": 0.1}, {"lr": 0.2}])
    searcher = fusion.searcher(inner)
    space: Mapping[str, Any] = {"lr": tune.uniform(0.01, 0.5), "hidden": 16}
    searcher.set_search_properties("val_accuracy", "max", dict(space), num_samples=sys.maxsize)
    fusion.state.post = lambda token, message: None
    searcher._hub = object()  # no Ray here: the hub is not needed to pack
    config = searcher.suggest("A")
    assert config["lr"] == [0.1, 0.2]
    assert [m["config"] for m in config["hfsweep"]["members"]] == [
        {"hidden": 16, "lr": 0.1},
        {"hidden": 16, "lr": 0.2},
    ]


def test_the_array_size_callable_is_asked_once_per_key() -> None:
    asked: list[int] = []

    def size(config: Mapping[str, Any]) -> int:
        asked.append(config["hidden"])
        return 2

    state = SweepState(TASK, members=4, array_size=size, uid="test")
    state.searcher = ListSearcher([{"lr": 0.1, "hidden": h} for h in (8, 8, 16, 16)])
    state.configure("val_accuracy", "max")
    assert isinstance(state.suggest("A"), dict)
    assert isinstance(state.suggest("B"), dict)
    assert asked == [8, 16]


def test_a_trial_the_sweep_never_packed_is_stopped_and_nothing_is_told() -> None:
    state, searcher, posted = _state([{"lr": 0.1}], members=1, size=1)
    state.suggest("A")
    # Tuner.restore(restart_errored=True) would restart an errored array under a new id
    assert state.on_result("Z", _report("t1", [("A-0", 1, 0.5)])) is False
    assert posted["t1"] == {"go": {"A-0": False}, "given": []}
    assert not searcher.told


def test_a_report_without_the_sweeps_metric_is_refused_before_anything_is_recorded() -> None:
    state, searcher, _ = _state([{"lr": 0.1}], members=1, size=1)
    state.configure("val_f1", "max")
    state.suggest("A")
    with pytest.raises(ValueError, match=r"'val_f1' is not among .*'val_accuracy'"):
        state.on_result("A", _report("t1", [("A-0", 1, 0.5)]))
    assert state.members["A-0"].history == [] and not searcher.results


def test_the_median_stopping_rule_runs_per_member_whatever_the_order() -> None:
    from ray.tune.schedulers import MedianStoppingRule

    values = {
        "a": [0.2, 0.3, 0.3],
        "b": [0.8, 0.9, 0.9],
        "c": [0.6, 0.7, 0.7],
        "d": [0.5, 0.4, 0.1],
    }

    def run(order: list[str]) -> list[dict[str, bool]]:
        rule = MedianStoppingRule(
            time_attr="training_iteration",
            metric="v",
            mode="max",
            grace_period=2,
            min_samples_required=2,
        )
        decider = TuneDecider(rule)
        live, out = list(order), []
        for i in range(3):
            reports = [
                (MemberTrial(m, {}), {"v": values[m][i], "training_iteration": i + 1}) for m in live
            ]
            answer = decider.decide(MemberController(t for t, _ in reports), reports, "v")
            out.append(answer)
            live = [m for m in live if answer[m]]  # a stopped member never reports again
        return out

    forward = run(["a", "b", "c", "d"])
    assert forward == run(["d", "b", "a", "c"])
    assert all(forward[0].values())  # within the grace period
    assert forward[1] == {"a": False, "b": True, "c": True, "d": False}


def test_an_array_resumed_after_it_failed_for_good_is_stopped_and_no_member_joins_it() -> None:
    # Tuner.restore(resume_errored=True) resumes an array that failed past its retries under
    # its own trial id, after its members were told FAIL; it replays its last report
    state, searcher, posted = _state([{"lr": 0.01 * (i + 1)} for i in range(6)], members=6, size=3)
    state.suggest("A")
    r1 = _report("t1", [("A-0", 1, 0.5), ("A-1", 1, 0.6), ("A-2", 1, 0.7)])
    state.on_result("A", r1)
    assert posted["t1"] == {
        "go": {"A-0": True, "A-1": True, "A-2": True},
        "given": [],
        "complete": [],
    }
    state.on_complete("A", None, error=True)  # failed for good: its members are told FAIL
    assert searcher.outcome == {"A-0": "FAIL", "A-1": "FAIL", "A-2": "FAIL"}
    replay = _report("t2", [("A-0", 1, 0.5), ("A-1", 1, 0.6), ("A-2", 1, 0.7)], resumed=True)
    assert state.on_result("A", replay) is False  # Tune stops the trial
    assert posted["t2"] == {"go": {"A-0": False, "A-1": False, "A-2": False}, "given": []}
    assert state.counts()[Status.RUNNING] == 0 and state.arrays["A"].given == []
    # its last word (the stopped members, a final report) and its end change nothing
    ended = [{"member": m, "status": "stopped", "steps": 5, "error": None} for m in ("A-0",)]
    last = json.loads(_report("t3", [], ended=ended)["hfsweep"])
    state.on_result("A", {"hfsweep": json.dumps({**last, "final": True})})
    assert "t3" not in posted
    state.on_complete("A", replay)
    assert all(n == 1 for n in searcher.told.values())
    # the three members the budget has left are not lost: they start in a new array
    config = state.suggest("B")
    assert isinstance(config, dict)
    assert [m["id"] for m in config["hfsweep"]["members"]] == ["B-0", "B-1", "B-2"]
    for trial_id, token in (("B", "t4"),):
        state.on_result(
            trial_id, _report(token, [(m, 4, 0.9) for m in ("B-0", "B-1", "B-2")], final=True)
        )
    state.on_complete("B", None)
    assert state.suggest("C") == FINISHED
    assert sorted(searcher.told) == [f"{a}-{i}" for a in "AB" for i in range(3)]
    assert set(searcher.told.values()) == {1}


def test_a_member_that_joins_by_refill_gets_its_own_clock_and_grace_period() -> None:
    from ray.tune.schedulers import MedianStoppingRule

    state, searcher, posted = _state([{"lr": 0.01 * (i + 1)} for i in range(8)], members=8, size=6)
    # at its defaults: time_attr="time_total_s", grace_period=60 s, min_samples_required=3
    state.decider = TuneDecider(MedianStoppingRule(metric="val_accuracy", mode="max"))
    state.suggest("A")
    first = [f"A-{i}" for i in range(6)]
    values = [0.9, 0.85, 0.8, 0.75, 0.2, 0.1]
    state.on_result(
        "A",
        _report(
            "t1",
            [(m, 1, v) for m, v in zip(first, values, strict=True)],
            elapsed=70.0,
            times=dict.fromkeys(first, 70.0),
        ),
    )
    stopped = [m for m, go in posted["t1"]["go"].items() if not go]
    assert stopped and "A-0" not in stopped
    given = [g["id"] for g in posted["t1"]["given"]]
    assert given and given[0] == "A-6"
    # at the array's 100 s the refilled member has trained 30 s: within its grace period,
    # whatever its value against array-mates that have trained 100 s
    alive = [m for m in first if m not in stopped]
    evals = [(m, 2, 0.9) for m in alive] + [("A-6", 1, 0.5)]
    times = {**dict.fromkeys(alive, 100.0), "A-6": 30.0}
    state.on_result("A", _report("t2", evals, elapsed=100.0, times=times, consumed=len(given)))
    assert posted["t2"]["go"]["A-6"] is True
    assert searcher.last["A-6"]["time_total_s"] == 30.0
    assert searcher.last["A-6"]["time_this_iter_s"] == 30.0
    assert searcher.last["A-6"]["training_iteration"] == 1
    assert searcher.last["A-0"]["time_total_s"] == 100.0
    assert searcher.last["A-0"]["time_this_iter_s"] == 30.0
    assert searcher.last["A-0"]["training_iteration"] == 2
    assert [h["time_total_s"] for h in state.members["A-0"].history] == [70.0, 100.0]


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")
@pytest.mark.parametrize(
    ("sampler", "size"),
    [("tpe", 8), ("random", 15), ("qmc", 15), ("wrapped-tpe", 8)],
)
def test_auto_array_size_leaves_a_learning_searcher_half_the_members(
    monkeypatch: pytest.MonkeyPatch, sampler: str, size: int
) -> None:
    """The profiler says 64 (stubbed); 15 members give arrays of at most 8 when the inner
    searcher learns (TPE, also behind a ConcurrencyLimiter), all 15 when it draws blind."""
    import optuna
    from ray.tune.search import ConcurrencyLimiter
    from ray.tune.search.optuna import OptunaSearch

    from hfsweep.sizing import task as _sizing

    monkeypatch.setattr(
        _sizing,
        "profile_task",
        lambda *a, **k: type("P", (), {"chosen": 64, "reason": "stub"})(),
    )
    samplers = {
        "tpe": optuna.samplers.TPESampler(seed=0),
        "random": optuna.samplers.RandomSampler(seed=0),
        "qmc": optuna.samplers.QMCSampler(seed=0),
        "wrapped-tpe": optuna.samplers.TPESampler(seed=0),
    }
    inner: Any = OptunaSearch(
        space={"lr": optuna.distributions.FloatDistribution(1e-3, 0.5, log=True)},
        metric="val_accuracy",
        mode="max",
        sampler=samplers[sampler],
    )
    if sampler == "wrapped-tpe":
        inner = ConcurrencyLimiter(inner, max_concurrent=4)
    fusion = Fusion(TASK, members=15, array_size="auto")
    fusion.searcher(inner)
    assert fusion._profiled_size(TASK.resolve({})) == size


def test_members_stopped_at_the_budget_are_told_complete_and_the_array_ends_by_itself() -> None:
    # ASHA with max_t=2 stops every member that reaches its second epoch: told COMPLETE, so the
    # trainable keeps its weights although the trainer stopped it; a member ASHA prunes at its
    # first rung is not named
    state, searcher, posted = _state([{"lr": 0.01 * (i + 1)} for i in range(2)], members=2, size=2)
    asha = ASHAScheduler(metric="val_accuracy", mode="max", max_t=2, grace_period=1)
    state.decider = TuneDecider(asha)
    state.has_scheduler = True
    state.suggest("A")
    r1 = _report("t1", [("A-0", 1, 0.9), ("A-1", 1, 0.1)])
    assert state.on_result("A", r1)
    assert posted["t1"] == {"go": {"A-0": True, "A-1": False}, "given": [], "complete": []}
    r2 = _report("t2", [("A-0", 2, 0.95)])
    assert not state.on_result("A", r2)  # no member left to train
    assert posted["t2"] == {"go": {"A-0": False}, "given": [], "complete": ["A-0"]}
    assert searcher.outcome == {"A-0": "COMPLETE", "A-1": "PRUNED"}
    # Tune must let the trainable end by itself: its last report carries A-0's weights
    assert state.ends_by_itself("A", r2)
    ended = [{"member": "A-0", "status": "stopped", "steps": 10, "error": None}]
    word = {"token": "t3", "evaluations": [], "ended": ended, "unused": [], "final": True}
    last = {"val_accuracy": 0.95, "hfsweep": json.dumps(word)}  # the trainable's last word
    assert not state.on_result("A", last) and not state.ends_by_itself("A", last)
    assert not state.ends_by_itself("B", r2)  # a trial the sweep never packed is stopped


#: the ``hidden`` of each config :func:`_size_two` sized (a module-level function pickles by name)
_SIZED: list[int] = []


def _size_two(config: Mapping[str, Any]) -> int:
    _SIZED.append(config["hidden"])
    return 2


def test_a_key_first_met_in_a_refill_is_sized_when_the_next_array_starts_after_a_restore() -> None:
    """Refill asks that meet another key leave it unsized (sizing may profile, which the array
    waiting for its answer should not wait for); the next array sizes it, also in a state
    restored from Tune's checkpoint or unpickled with the searcher."""
    asked = _SIZED
    asked.clear()
    configs = [{"lr": lr, "hidden": h} for lr, h in ((0.1, 8), (0.2, 8), (0.1, 16), (0.2, 16))]
    state = SweepState(TASK, members=4, array_size=_size_two, uid="test")
    state.searcher = ListSearcher(configs)
    state.configure("val_accuracy", "max")
    state.decider = TuneDecider(
        ASHAScheduler(
            metric="val_accuracy", mode="max", max_t=4, grace_period=1, reduction_factor=2
        )
    )
    state.suggest("A")
    state.on_result("A", _report("t1", [("A-0", 1, 0.9), ("A-1", 1, 0.1)]))  # A-1 pruned
    assert [state.members[m].status for m in ("A-2", "A-3")] == [Status.WAITING] * 2
    assert asked == [8] and state.arrays["A"].given == []
    unpickled = pickle.loads(pickle.dumps(state))  # as Tune saves its searcher
    loaded = SweepState(TASK, members=4, array_size=_size_two, uid="other")
    loaded.searcher = ListSearcher([])
    loaded.load_state_dict(copy.deepcopy(state.state_dict()))  # as Tuner.restore loads it
    for restored in (unpickled, loaded):
        config = restored.suggest("B")
        assert isinstance(config, dict)
        assert [m["id"] for m in config["hfsweep"]["members"]] == ["A-2", "A-3"]
    assert asked == [8, 16, 16]  # once in each restored state


def test_an_unpickled_state_tells_its_own_searcher_and_scheduler() -> None:
    """Tune pickles the searcher, and the sweep state with it: the state's two ports (its
    searcher and decider) must talk to the unpickled state's Tune searcher and scheduler, not
    to the objects the state was pickled from."""
    state, _ = _asha_state_after_one_report()
    searcher = state.searcher
    unpickled = pickle.loads(pickle.dumps(state))
    assert unpickled.searcher is not searcher
    unpickled.on_result("A", _report("t2", [("A-0", 4, 0.95)], final=True))
    assert unpickled.searcher.told == Counter({"A-1": 1, "A-0": 1})
    assert unpickled.searcher.outcome["A-0"] == "COMPLETE"
    assert searcher.told == Counter({"A-1": 1})  # the original heard nothing more
    assert state.members["A-0"].status is Status.RUNNING
