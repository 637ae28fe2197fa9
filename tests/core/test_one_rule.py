"""Both front doors process an array's report by the core's one rule
(:func:`hfsweep.core.judging.judge`): the same scripted evaluations (two arrays, an ASHA stop, a
refill that finds nothing compatible, an evaluation reported again, a member whose loss
diverged, a NaN metric at the budget, a member missing its metric) driven through
``hfsweep run``'s engine (its executor hooks, with a scripted executor in place of the local
one) and through the Tune plugin's :class:`~hfsweep.schedulers._tune_sweep.SweepState` give
the same answers, ledger decisions and ends, and searcher calls; and both go through
:func:`~hfsweep.core.judging.judge`, so a copy of the rule in either path fails here."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from hfsweep.schedulers import ASHAScheduler
from hfsweep.schedulers._tune_joint import NativeDecider
from hfsweep.schedulers._tune_sweep import SweepState
from sweep._toy import TASK, sweep_config

import hfsweep as hs
from hfsweep.core import _backend, judging
from hfsweep.core.judging import MissingMetricError
from hfsweep.core.result import SweepError
from hfsweep.core.status import Status
from hfsweep.executors import ArrayHooks, Executor
from hfsweep.training._evaluation import endings
from hfsweep.training.results import Evaluation, MemberResult

#: the trials, in the order both searchers hand them out: two compatibility keys (hidden)
CONFIGS = [{"lr": 0.1, "hidden": 8}, {"lr": 0.2, "hidden": 8}]
CONFIGS += [{"lr": 0.1, "hidden": 16}, {"lr": 0.2, "hidden": 16}]
STEPS_PER_EPOCH, EPOCHS = 5, 3
ASHA = {"grace_period": 1, "reduction_factor": 2}


def _metrics(acc: float | None, loss: float = 0.5) -> dict[str, float]:
    metrics = {"train_loss": loss, "val_loss": 0.5}
    return metrics if acc is None else {**metrics, "val_accuracy": acc}


#: per array, its reports: (slot in the array, epoch, metrics) per evaluated member
SCRIPT: list[list[list[tuple[int, int, dict[str, float]]]]] = [
    [
        [(0, 1, _metrics(0.9)), (1, 1, _metrics(0.2))],  # ASHA stops slot 1
        [(0, 1, _metrics(0.9))],  # reported again (a resumed array's replay)
        [(0, 2, _metrics(0.95))],
        [(0, 3, _metrics(math.nan))],  # its budget, with a NaN metric: failed
    ],
    [
        [(0, 1, _metrics(0.5, loss=math.inf)), (1, 1, _metrics(0.95))],  # slot 0 diverged
        [(1, 2, _metrics(None))],  # no val_accuracy: the sweep stops, nothing recorded
    ],
]


def _evaluations(members: Sequence[str], report: list[tuple[int, int, dict[str, float]]]) -> list:
    return [
        Evaluation(members[slot], STEPS_PER_EPOCH * epoch, float(epoch), m, epoch == EPOCHS)
        for slot, epoch, m in report
    ]


class _Calls:
    """What a front door told, in the other door's terms: per report the answers, the
    searcher's evaluations heard and its ends, by trial index (asking order)."""

    def __init__(self) -> None:
        self.answers: list[dict[int, bool]] = []
        self.heard: list[tuple[int, float, float]] = []
        self.told: dict[int, Status] = {}


# ---------------------------------------------------------------------- hfsweep run's side
class _ListSearcher(hs.Searcher):
    """``hfsweep run``'s searcher: hands out CONFIGS in order, records report() and tell()."""

    def __init__(self, calls: _Calls) -> None:
        self.calls, self.configs = calls, list(CONFIGS)

    def ask(self, numbers: Sequence[int]) -> list[dict[str, Any]]:
        out, self.configs = self.configs[: len(numbers)], self.configs[len(numbers) :]
        return out

    def report(self, number: int, step: int, value: float) -> None:
        self.calls.heard.append((number, float(step), value))

    def tell(self, number: int, config: Mapping[str, Any], state: str, value: float | None) -> None:
        told = {"complete": Status.COMPLETED, "pruned": Status.STOPPED, "failed": Status.FAILED}
        assert number not in self.calls.told
        self.calls.told[number] = told[state]


class _ScriptedExecutor(Executor):
    """Plays SCRIPT through the engine's hooks as the trainer would: the hook's answers end
    members by the trainer's own rule (:func:`~hfsweep.training._evaluation.endings`), each
    end is delivered and its slot offered to a refill."""

    slots = 1  # type: ignore[assignment]

    def __init__(self, calls: _Calls) -> None:
        self.calls, self.arrays = calls, iter(SCRIPT)
        self.device = "cpu"

    def array_size(self, config: Mapping[str, Any]) -> tuple[int, str]:
        return 2, "scripted"

    def run_array(
        self, checkpoint_dir: Any, members: Any, hooks: ArrayHooks, *, resume: bool
    ) -> None:
        ids = [m.id for m in members]
        configs = {m.id: dict(m.config) for m in members}
        for report in next(self.arrays):
            evaluations = _evaluations(ids, report)
            go = hooks.report(evaluations)
            self.calls.answers.append({int(m.split("-")[1]): g for m, g in go.items()})
            due = list(range(len(evaluations)))
            for i, status, error in endings(due, evaluations, go):
                e = evaluations[i]
                history = [{"step": float(e.step), "epoch": e.epoch, **e.metrics}]
                hooks.on_finish(
                    MemberResult(e.member, configs[e.member], status, e.step, history, error=error)
                )
                assert hooks.refill() is None  # no compatible trial is left to ask

    def close(self) -> None:
        return None


def _run_door(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[_Calls, dict[str, Any]]:
    calls = _Calls()
    monkeypatch.setattr(_backend, "LocalExecutor", lambda *a, **k: _ScriptedExecutor(calls))
    config = sweep_config(
        tmp_path / "run",
        search_space={
            "lr": {"type": "float", "low": 1e-3, "high": 0.5},
            "hidden": {"type": "categorical", "choices": [8, 16]},
        },
        scheduler={"name": "asha", "options": ASHA},
        budget={"trials": len(CONFIGS), "epochs": EPOCHS},
        fusion={"size": 2, "device": "cpu"},
    )
    with pytest.raises(MissingMetricError, match=r"metric 'val_accuracy' is not among .*trial-3"):
        hs.sweep(config, progress=False, searcher=_ListSearcher(calls))
    state = json.loads((tmp_path / "run" / "state.json").read_text())
    return calls, state


# ---------------------------------------------------------------------- the Tune plugin's side
class _TuneSearcher:
    """A Tune searcher: hands out CONFIGS in order, records on_trial_result/complete."""

    def __init__(self, calls: _Calls, order: list[str]) -> None:
        self.calls, self.order, self.configs = calls, order, iter(CONFIGS)

    def suggest(self, trial_id: str) -> dict[str, Any] | None:
        config = next(self.configs, None)
        self.order += [trial_id] if config is not None else []
        return config

    def on_trial_result(self, trial_id: str, result: dict[str, Any]) -> None:
        self.calls.heard.append(
            (self.order.index(trial_id), result["epoch"], result["val_accuracy"])
        )

    def on_trial_complete(
        self, trial_id: str, result: dict[str, Any] | None = None, error: bool = False
    ) -> None:
        number = self.order.index(trial_id)
        assert number not in self.calls.told
        if error:
            self.calls.told[number] = Status.FAILED
        else:
            assert result is not None
            self.calls.told[number] = Status(result.get("hfsweep_status", "completed"))


def _tune_door() -> tuple[_Calls, SweepState, list[str]]:
    calls, order = _Calls(), []
    state = SweepState(TASK, uid="one-rule", members=len(CONFIGS), array_size=2)
    state.searcher = _TuneSearcher(calls, order)
    state.decider = NativeDecider(ASHAScheduler(mode="max", max_resource=EPOCHS, **ASHA))
    state.configure("val_accuracy", "max")
    posted: dict[str, dict[str, Any]] = {}
    state.post = lambda token, message: posted.__setitem__(token, message)
    for n, reports in enumerate(SCRIPT):
        array = state.start_array("AB"[n])
        assert array is not None
        for r, report in enumerate(reports):
            evaluations = [
                {
                    "member": e.member,
                    "step": e.step,
                    "epoch": e.epoch,
                    "metrics": e.metrics,
                    "final": e.final,
                }
                for e in _evaluations(array.members, report)
            ]
            token = f"{array.id}{r}"
            payload = {
                "token": token,
                "evaluations": evaluations,
                "consumed": len(array.given),
                "resumed": r == 1,
            }
            try:
                state.on_report(array.id, payload)
            except MissingMetricError as exc:
                assert "member A-3 reports" in str(exc)
                return calls, state, order
            calls.answers.append({order.index(m): g for m, g in posted[token]["go"].items()})
        state.on_array_end(array.id, None)
    raise AssertionError("the member missing its metric was not refused")


def test_both_front_doors_give_the_same_answers_ledger_and_searcher_calls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[str] = []
    real = judging.judge

    def counted(evaluations: Any, door: Any, *args: Any) -> judging.Judgement:
        seen.append(type(door).__name__)
        return real(evaluations, door, *args)

    # both doors call the core's rule through the module (a copy of it would not be counted)
    monkeypatch.setattr(judging, "judge", counted)
    run, saved = _run_door(tmp_path, monkeypatch)
    run_doors = list(seen)
    tune, state, order = _tune_door()
    assert run_doors == ["_StudyDoor"] * 6 and seen[6:] == ["_RecordsDoor"] * 6

    assert (
        run.answers
        == tune.answers
        == [{0: True, 1: False}, {0: True}, {0: True}, {0: True}, {2: False, 3: True}]
    )
    assert run.heard == tune.heard  # NaN metrics and diverged members never reach the searcher
    assert [n for n, _, _ in run.heard] == [0, 1, 0, 3]
    expected = {0: Status.FAILED, 1: Status.STOPPED, 2: Status.FAILED}
    assert run.told == tune.told == expected

    def run_key(key: str) -> tuple[int, str]:  # "trial-3@10" -> (3, "10")
        member, _, step = key.partition("@")
        return int(member.split("-")[1]), step

    def tune_key(key: str) -> tuple[int, str]:  # "A-3@10" -> (its asking index, "10")
        member, _, step = key.partition("@")
        return order.index(member), step

    decisions = {run_key(k): v for k, v in saved["decisions"].items()}
    assert decisions == {tune_key(k): v for k, v in state.ledger.decisions.items()}
    assert decisions == {
        (0, "5"): True,
        (1, "5"): False,
        (0, "10"): True,
        (0, "15"): True,
        (2, "5"): False,
        (3, "5"): True,
    }
    ended = {run_key(k)[0]: v for k, v in saved["ended"].items()}
    assert ended == {tune_key(k)[0]: s.value for k, s in state.ledger.ended.items()}
    assert ended == {n: s.value for n, s in expected.items()}
    assert state.members[order[0]].error == "val_accuracy is nan"
    assert state.members[order[2]].error == "non-finite loss"


def test_the_missing_metric_error_is_one_type_for_both_doors() -> None:
    assert issubclass(MissingMetricError, SweepError) and issubclass(MissingMetricError, ValueError)
