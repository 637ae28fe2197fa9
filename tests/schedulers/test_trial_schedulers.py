"""One lifecycle test over every trial scheduler, on a fake clock.

The harness plays the sweep engine: trials with synthetic, deterministic learning curves train
in arrays of K slots; every member of an array reports at each of the array's evaluations in
one ``decide()`` call; a stopped, failed or completed member frees its slot, which is refilled
with a new trial until the trial budget is spent. Arrays advance at different speeds, so
calls interleave and refilled members report next to older ones at other resources.
"""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import optuna
import pytest
from hfsweep.schedulers import (
    ASHAScheduler,
    Decision,
    OptunaPruner,
    Report,
    TrialScheduler,
    make_scheduler,
)
from hypothesis import given, settings
from hypothesis import strategies as st

optuna.logging.set_verbosity(optuna.logging.ERROR)
pytestmark = [
    pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning"),
    pytest.mark.filterwarnings("ignore:The intermediate values of the current trial"),
]

MAX_RESOURCE = 9

#: (id, make_scheduler name, options): every scheduler, and the Optuna adapter with every pruner.
CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("fifo", "fifo", {}),
    ("asha", "asha", {}),
    ("asha-rf2-grace0.5", "asha", {"grace_period": 0.5, "reduction_factor": 2}),
    ("asha-3-brackets", "asha", {"brackets": 3}),
    ("hyperband", "hyperband", {}),
    ("hyperband-rf2", "hyperband", {"reduction_factor": 2}),
    ("median", "median", {}),
    ("median-grace2-min5", "median", {"grace_period": 2, "min_samples": 5}),
    ("optuna-median", "optuna:median", {"n_startup_trials": 3}),
    ("optuna-percentile", "optuna:percentile", {"percentile": 25.0, "n_startup_trials": 3}),
    ("optuna-successive-halving", "optuna:successive_halving", {"min_resource": 1}),
    ("optuna-sh-auto", "optuna:successive_halving", {"reduction_factor": 3}),
    ("optuna-hyperband", "optuna:hyperband", {}),
    ("optuna-threshold", "optuna:threshold", {"lower": 0.1}),
    ("optuna-patient", "optuna:patient", {"wrapped_pruner": "median", "patience": 1}),
    ("optuna-wilcoxon", "optuna:wilcoxon", {}),
    ("optuna-nop", "optuna:nop", {}),
]
CASE_IDS = [c[0] for c in CASES]
#: Schedulers that must stop something in the lifecycle run (it would be vacuous otherwise).
MUST_STOP = {
    "asha",
    "asha-rf2-grace0.5",
    "asha-3-brackets",
    "hyperband",
    "hyperband-rf2",
    "median",
    "median-grace2-min5",
    "optuna-median",
    "optuna-percentile",
    "optuna-successive-halving",
    "optuna-hyperband",
    "optuna-threshold",
}


def build(case: str, mode: str) -> TrialScheduler:
    _, name, options = next(c for c in CASES if c[0] == case)
    if case == "optuna-threshold" and mode == "min":
        options = {"upper": 0.95}
    return make_scheduler(name, mode=mode, max_resource=MAX_RESOURCE, **options)


# -- the engine's side: nothing for native schedulers, a study for the Optuna adapter ---------


class NativeEngine:
    def start(self, sched: TrialScheduler, trial: str) -> None:
        pass

    def end(self, trial: str, status: str, last_value: float) -> None:
        pass

    def resume(self, sched: TrialScheduler) -> None:
        pass


class OptunaEngine:
    """Asks the study for each trial, attaches it, and tells the study how it ended."""

    def __init__(self, sched: OptunaPruner) -> None:
        direction = "maximize" if sched.mode == "max" else "minimize"
        sampler = optuna.samplers.RandomSampler(seed=0)
        self.study = optuna.create_study(
            study_name="lifecycle", direction=direction, pruner=sched.pruner, sampler=sampler
        )
        self.trials: dict[str, optuna.Trial] = {}

    def start(self, sched: TrialScheduler, trial: str) -> None:
        assert isinstance(sched, OptunaPruner)
        self.trials[trial] = t = self.study.ask()
        sched.attach(trial, t)

    def end(self, trial: str, status: str, last_value: float) -> None:
        t = self.trials.pop(trial)
        if status == "completed" and not math.isnan(last_value):
            self.study.tell(t, last_value)
        elif status == "stopped":
            self.study.tell(t, state=optuna.trial.TrialState.PRUNED)
        else:
            self.study.tell(t, state=optuna.trial.TrialState.FAIL)

    def resume(self, sched: TrialScheduler) -> None:
        """What a resumed engine does: load the study with the new pruner, attach again."""
        assert isinstance(sched, OptunaPruner)
        self.study.pruner = sched.pruner
        for trial, t in self.trials.items():
            sched.attach(trial, t)


def engine_for(sched: TrialScheduler) -> NativeEngine | OptunaEngine:
    return OptunaEngine(sched) if isinstance(sched, OptunaPruner) else NativeEngine()


# -- the harness ------------------------------------------------------------------------------


@dataclass
class Trial:
    id: str
    quality: float
    resource: float = 0.0
    last_value: float = math.nan


@dataclass
class Run:
    qualities: dict[str, float]
    calls: list[tuple[list[Report], dict[str, Decision]]] = field(default_factory=list)
    ends: dict[str, str] = field(default_factory=dict)
    end_calls: Counter[str] = field(default_factory=Counter)
    reported: set[str] = field(default_factory=set)


NAN_TRIALS = ("t005",)  # report nan from epoch 2 on
#: Trials that diverge at a resource: they end "failed" there without reporting.
FAILING_TRIALS = {"t007": 3.0, "t010": 0.5}


def curve(quality: float, t: float, mode: str) -> float:
    """A smooth learning curve; better quality is better at every t, in either mode."""
    acc = quality * (1 - math.exp(-t / 2.0))
    return acc if mode == "max" else 1.0 - acc


def run_lifecycle(
    sched: TrialScheduler,
    *,
    mode: str,
    seed: int = 0,
    n_trials: int = 36,
    array_sizes: tuple[int, ...] = (4, 3),
    speeds: tuple[int, ...] = (1, 2),
    eval_every: float = 1.0,
    resume_at: int | None = None,
    rebuild: Callable[[], TrialScheduler] | None = None,
    on_decide: Callable[[TrialScheduler, list[Report], dict[str, Decision]], None] | None = None,
) -> Run:
    """Run a sweep of ``n_trials`` trials through ``sched``; checks the contract as it goes.

    With ``resume_at``, the scheduler is replaced before that call by ``rebuild()`` loaded
    with a JSON round trip of its state, as a resumed sweep would do.
    """
    rng = random.Random(seed)
    qualities = {f"t{i:03d}": rng.uniform(0.2, 1.0) for i in range(n_trials)}
    run = Run(qualities)
    engine = engine_for(sched)
    pending = list(qualities)
    arrays: list[list[Trial | None]] = [[None] * k for k in array_sizes]

    def end(trial: Trial, status: str) -> None:
        assert trial.id not in run.ends, f"{trial.id} ended twice"
        run.ends[trial.id] = status
        run.end_calls[trial.id] += 1
        sched.on_trial_end(trial.id, status)
        engine.end(trial.id, status, trial.last_value)

    def refill() -> None:
        for slots in arrays:
            for i, slot in enumerate(slots):
                if slot is None and pending:
                    tid = pending.pop(0)
                    slots[i] = Trial(tid, qualities[tid])
                    engine.start(sched, tid)

    refill()
    clock = 0
    while any(s is not None for slots in arrays for s in slots):
        clock += 1
        for a, slots in enumerate(arrays):
            if clock % speeds[a]:
                continue
            reports = []
            for i, trial in enumerate(slots):
                if trial is None:
                    continue
                trial.resource = round(trial.resource + eval_every, 9)
                if trial.resource >= FAILING_TRIALS.get(trial.id, math.inf):
                    end(trial, "failed")
                    slots[i] = None
                    continue
                value = curve(trial.quality, trial.resource, mode)
                if trial.id in NAN_TRIALS and trial.resource >= 2:
                    value = math.nan
                trial.last_value = value
                reports.append(Report(trial.id, trial.resource, value))
            if not reports:
                refill()
                continue
            for r in reports:
                assert r.trial not in run.ends, f"{r.trial} reports after it ended"
            if resume_at is not None and len(run.calls) == resume_at:
                assert rebuild is not None
                state = json.loads(json.dumps(sched.state_dict(), allow_nan=False))
                sched = rebuild()
                sched.load_state_dict(state)
                engine.resume(sched)
            decisions = sched.decide(reports)
            assert set(decisions) == {r.trial for r in reports}
            assert all(isinstance(d, Decision) for d in decisions.values())
            run.calls.append((reports, decisions))
            run.reported.update(r.trial for r in reports)
            if on_decide is not None:
                on_decide(sched, reports, decisions)
            for i, trial in enumerate(slots):
                if trial is None or trial.id not in decisions:
                    continue
                if decisions[trial.id] is Decision.STOP:
                    end(trial, "stopped")
                    slots[i] = None
                elif trial.resource >= MAX_RESOURCE:
                    end(trial, "completed")
                    slots[i] = None
            refill()
        assert clock < 10_000
    return run


# -- an independent check of ASHA's promotion rule ---------------------------------------------


class AshaReferee:
    """Keeps its own record of every rung and checks each decision against the 1/rf quantile."""

    def __init__(self, mode: str) -> None:
        self.sign = 1.0 if mode == "max" else -1.0
        self.rungs: dict[tuple[int, float], dict[str, float]] = {}
        self.promoted_below_cutoff = 0
        self.checked = 0

    def key(self, v: float) -> float:
        return -math.inf if math.isnan(v) else self.sign * v

    def __call__(
        self, sched: TrialScheduler, reports: list[Report], decisions: dict[str, Decision]
    ) -> None:
        assert isinstance(sched, ASHAScheduler)
        crossed: dict[str, list[tuple[int, float]]] = {}
        for r in reports:
            bracket = sched.bracket_of(r.trial)
            assert bracket is not None
            crossed[r.trial] = []
            for rung in sched.rung_resources(bracket):
                record = self.rungs.setdefault((bracket, rung), {})
                if r.resource >= rung - 1e-9 and r.trial not in record:
                    record[r.trial] = r.value
                    crossed[r.trial].append((bracket, rung))
        rf = sched.reduction_factor
        for r in reports:
            expected = Decision.CONTINUE
            if r.resource < MAX_RESOURCE:
                for where in crossed[r.trial]:
                    values = sorted((self.key(v) for v in self.rungs[where].values()), reverse=True)
                    quota = max(1, int(len(values) // rf))
                    cutoff = values[quota - 1]
                    self.checked += 1
                    if math.isnan(r.value) or self.key(r.value) < cutoff:
                        expected = Decision.STOP
            if not crossed[r.trial]:
                assert decisions[r.trial] is Decision.CONTINUE, "ASHA stops only at rungs"
            assert decisions[r.trial] is expected, (r, expected, self.rungs)


# -- the lifecycle test ------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["max", "min"])
@pytest.mark.parametrize("case", CASE_IDS)
def test_lifecycle(case: str, mode: str) -> None:
    sched = build(case, mode)
    referee = AshaReferee(mode) if isinstance(sched, ASHAScheduler) else None
    eval_every = 0.5 if case == "asha-rf2-grace0.5" else 1.0
    run = run_lifecycle(sched, mode=mode, on_decide=referee, eval_every=eval_every)

    # Every trial started, ended exactly once, and on_trial_end was called once per trial.
    assert set(run.ends) == set(run.qualities)
    assert all(n == 1 for n in run.end_calls.values())
    # A trial ends completed only at the budget; stopped only when a decision said so.
    stops = {r for _, d in run.calls for r, x in d.items() if x is Decision.STOP}
    assert {t for t, s in run.ends.items() if s == "stopped"} == stops
    assert {t for t, s in run.ends.items() if s == "failed"} <= set(FAILING_TRIALS)
    assert run.ends["t010"] == "failed" and run.ends["t007"] in ("failed", "stopped")
    last = {r.trial: r.resource for reports, _ in run.calls for r in reports}
    for t, s in run.ends.items():
        if s == "completed":
            assert last[t] >= MAX_RESOURCE
    # The best trial (smooth curves keep every trial's rank at every resource) is never stopped.
    healthy = {t: q for t, q in run.qualities.items() if t not in {*NAN_TRIALS, *FAILING_TRIALS}}
    best = max(healthy, key=healthy.__getitem__)
    assert run.ends[best] == "completed"
    if case in MUST_STOP:
        assert stops, "the scheduler never stopped anything: the test would be vacuous"
    if case == "fifo" or case == "optuna-nop":
        assert not stops
    if referee is not None:
        assert referee.checked > 0
    # A trial that ended cannot report again.
    with pytest.raises(ValueError, match="after it ended"):
        sched.decide([Report(best, MAX_RESOURCE + 1, 1.0)])


@pytest.mark.parametrize("case", CASE_IDS)
def test_state_round_trip_mid_run_decides_identically(case: str) -> None:
    """A scheduler rebuilt from a JSON round trip of its state halfway goes on identically."""
    whole = run_lifecycle(build(case, "max"), mode="max", seed=1)
    half = len(whole.calls) // 2
    rebuilt: list[TrialScheduler] = []

    def rebuild() -> TrialScheduler:
        rebuilt.append(build(case, "max"))
        return rebuilt[-1]

    resumed = run_lifecycle(build(case, "max"), mode="max", seed=1, resume_at=half, rebuild=rebuild)
    assert len(rebuilt) == 1
    assert resumed.calls == whole.calls
    assert resumed.ends == whole.ends


@pytest.mark.parametrize("case", [c for c in CASE_IDS if not c.startswith("optuna")])
def test_state_dict_is_strict_json_and_restores_the_same_state(case: str) -> None:
    sched = build(case, "max")
    states: list[dict[str, Any]] = []
    run_lifecycle(sched, mode="max", on_decide=lambda s, _r, _d: states.append(s.state_dict()))
    for state in (states[len(states) // 3], states[-1], sched.state_dict()):
        text = json.dumps(state, allow_nan=False)
        clone = build(case, "max")
        clone.load_state_dict(json.loads(text))
        assert json.dumps(clone.state_dict(), allow_nan=False) == text


# -- joint decisions: the order of reports in a call never matters -----------------------------

NATIVE = ["fifo", "asha", "asha-rf2-grace0.5", "asha-3-brackets", "hyperband", "median"]

values = st.one_of(
    st.sampled_from([0.1, 0.2, 0.5, 0.5, 0.9]),  # ties are likely
    st.floats(-10, 10, allow_nan=False),
    st.sampled_from([math.nan, math.inf, -math.inf]),
)


@st.composite
def histories(draw: st.DrawFn) -> list[list[tuple[str, float, float]]]:
    """Calls of (trial, resource, value); trials join at different calls; resources grow."""
    n_trials = draw(st.integers(2, 8))
    starts = [draw(st.integers(0, 3)) for _ in range(n_trials)]
    step = draw(st.sampled_from([0.5, 1.0, 1.5, 3.0]))
    n_calls = draw(st.integers(1, 6))
    return [
        [
            (f"t{i}", min((c - starts[i] + 1) * step, MAX_RESOURCE), draw(values))
            for i in range(n_trials)
            if starts[i] <= c
        ]
        for c in range(n_calls)
    ]


@pytest.mark.parametrize("case", NATIVE)
@settings(max_examples=60, deadline=None)
@given(calls=histories(), data=st.data())
def test_decisions_do_not_depend_on_report_order(
    case: str, calls: list[list[tuple[str, float, float]]], data: st.DataObject
) -> None:
    """At every call of a random history, a twin fed the same reports shuffled agrees."""
    sched = build(case, "max")
    ended: set[str] = set()
    for call in calls:
        reports = [Report(*r) for r in call if r[0] not in ended]
        if not reports:
            continue
        shuffled = data.draw(st.permutations(reports))
        twin = build(case, "max")
        twin.load_state_dict(sched.state_dict())
        decided = sched.decide(reports)
        assert twin.decide(shuffled) == decided
        assert twin.state_dict() == sched.state_dict()
        for r in reports:
            if decided[r.trial] is Decision.STOP or r.resource >= MAX_RESOURCE:
                status = "stopped" if decided[r.trial] is Decision.STOP else "completed"
                sched.on_trial_end(r.trial, status)
                ended.add(r.trial)


@pytest.mark.parametrize("case", ["optuna-successive-halving", "optuna-median"])
def test_optuna_adapter_decisions_do_not_depend_on_report_order(case: str) -> None:
    """Same reports, every order of the last call: same decisions (a fresh study each time)."""
    import itertools

    history = [
        [("a", 1.0, 0.30), ("b", 1.0, 0.50), ("c", 1.0, 0.40)],
        [("a", 2.0, 0.35), ("b", 2.0, 0.55), ("c", 2.0, 0.45)],
    ]
    last = [("d", 1.0, 0.45), ("e", 1.0, 0.60), ("f", 1.0, 0.20), ("g", 1.0, 0.45)]
    outcomes = set()
    for order in itertools.permutations(last):
        sched = build(case, "max")
        engine = OptunaEngine(sched)  # type: ignore[arg-type]
        for t in "abcdefg":
            engine.start(sched, t)
        for call in history:
            sched.decide([Report(*r) for r in call])
        for t in "abc":  # complete them, so the median pruner has something to compare with
            sched.on_trial_end(t, "completed")
            engine.end(t, "completed", 0.5)
        decided = sched.decide([Report(*r) for r in order])
        outcomes.add(tuple(sorted((t, d.value) for t, d in decided.items())))
    assert len(outcomes) == 1
    (outcome,) = outcomes
    assert dict(outcome)["e"] == "continue"  # the best of the call always goes on
