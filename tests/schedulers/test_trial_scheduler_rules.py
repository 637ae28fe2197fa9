"""The rules of each scheduler on small hand-made cases, validation, errors and make_scheduler."""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
from collections.abc import Callable

import hfsweep.schedulers as hs_sched
import pytest
from hfsweep.schedulers import (
    SCHEDULER_NAMES,
    ASHAScheduler,
    Decision,
    FIFOScheduler,
    HyperbandScheduler,
    MedianStoppingScheduler,
    OptunaPruner,
    Report,
    TrialScheduler,
    make_scheduler,
)

C, S = Decision.CONTINUE, Decision.STOP


def decide(sched: TrialScheduler, *reports: tuple[str, float, float]) -> dict[str, Decision]:
    return sched.decide([Report(*r) for r in reports])


# -- package -----------------------------------------------------------------------------------


def test_import_stays_light() -> None:
    code = "import sys, hfsweep.schedulers; print('optuna' in sys.modules, 'ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_public_names() -> None:
    for name in hs_sched.__all__:
        assert hasattr(hs_sched, name)
    assert {"fifo", "asha", "hyperband", "median", "optuna:median"} <= set(SCHEDULER_NAMES)


# -- ASHA --------------------------------------------------------------------------------------


def test_asha_rungs() -> None:
    assert ASHAScheduler(max_resource=27).rung_resources() == (1, 3, 9)
    assert ASHAScheduler(max_resource=28).rung_resources() == (1, 3, 9, 27)
    sched = ASHAScheduler(max_resource=10, grace_period=0.5, reduction_factor=2, brackets=3)
    assert [sched.rung_resources(s) for s in range(3)] == [
        (0.5, 1, 2, 4, 8),
        (1, 2, 4, 8),
        (2, 4, 8),
    ]


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_asha_joint_call_promotes_exactly_the_best_of_rf(order: tuple[int, ...]) -> None:
    reports = [("a", 1, 0.5), ("b", 1, 0.9), ("c", 1, 0.7)]
    sched = ASHAScheduler(max_resource=9)
    assert decide(sched, *(reports[i] for i in order)) == {"a": S, "b": C, "c": S}


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_asha_ties_with_the_best_all_go_on(order: tuple[int, ...]) -> None:
    reports = [("a", 1, 0.9), ("b", 1, 0.9), ("c", 1, 0.7)]
    sched = ASHAScheduler(max_resource=9)
    assert decide(sched, *(reports[i] for i in order)) == {"a": C, "b": C, "c": S}


def test_asha_joint_differs_from_first_come_first_served() -> None:
    fcfs = ASHAScheduler(max_resource=9)
    assert decide(fcfs, ("a", 1, 0.5)) == {"a": C}  # alone at the rung: nobody to beat
    joint = ASHAScheduler(max_resource=9)
    assert decide(joint, ("a", 1, 0.5), ("b", 1, 0.9), ("c", 1, 0.7))["a"] is S


def test_asha_with_fewer_than_rf_values_a_trial_must_beat_the_rung() -> None:
    sched = ASHAScheduler(max_resource=9)
    assert decide(sched, ("a", 1, 0.5)) == {"a": C}
    assert decide(sched, ("b", 1, 0.4)) == {"b": S}  # n=2 < rf: top 1
    assert decide(sched, ("c", 1, 0.5)) == {"c": C}  # tie with the best goes on
    assert decide(sched, ("d", 1, 0.6)) == {"d": C}


def test_asha_promotes_the_top_floor_n_over_rf() -> None:
    sched = ASHAScheduler(max_resource=9)
    decide(sched, *((f"x{i}", 1, v) for i, v in enumerate([0.1, 0.2, 0.3, 0.5, 0.6])))
    # Six values: the top 2 (0.6 and 0.5) go on; 0.45 is third.
    assert decide(sched, ("y", 1, 0.45)) == {"y": S}
    sched = ASHAScheduler(max_resource=9)
    decide(sched, *((f"x{i}", 1, v) for i, v in enumerate([0.1, 0.2, 0.3, 0.4, 0.6])))
    assert decide(sched, ("y", 1, 0.45)) == {"y": C}  # second of six


def test_asha_min_mode_prefers_small_values() -> None:
    sched = ASHAScheduler(mode="min", max_resource=9)
    assert decide(sched, ("a", 1, 0.5), ("b", 1, 0.1), ("c", 1, 0.7)) == {"a": S, "b": C, "c": S}


def test_asha_decides_only_on_reaching_a_new_rung() -> None:
    sched = ASHAScheduler(max_resource=9)
    decide(sched, ("a", 1, 0.9), ("b", 1, 0.8), ("c", 1, 0.7))
    assert decide(sched, ("a", 2, 0.0)) == {"a": C}  # between rungs: no decision
    assert decide(sched, ("a", 0.5, 0.0), ("z", 0.5, -1.0)) == {"a": C, "z": C}


def test_asha_fractional_resources_reach_rungs_up_to_rounding() -> None:
    sched = ASHAScheduler(max_resource=9)
    decide(sched, ("a", 1, 0.9))
    almost_one = sum([0.1] * 10)
    assert almost_one < 1
    assert decide(sched, ("b", almost_one, 0.5)) == {"b": S}  # reaches rung 1
    assert sched.rung_records()[0] == {"a": 0.9, "b": 0.5}


def test_asha_report_jumping_rungs_is_recorded_and_judged_at_each() -> None:
    sched = ASHAScheduler(max_resource=27)
    decide(sched, ("a", 1, 0.9), ("b", 1, 0.8))
    assert decide(sched, ("c", 5, 0.85)) == {"c": S}  # promoted at 3 (alone), not at 1
    assert sched.rung_records()[:2] == [{"a": 0.9, "b": 0.8, "c": 0.85}, {"c": 0.85}]


def test_asha_never_stops_at_the_budget() -> None:
    sched = ASHAScheduler(max_resource=9)
    decide(sched, ("a", 3, 0.9))
    assert decide(sched, ("b", 9, 0.1)) == {"b": C}


def test_asha_nan_is_worst_and_never_promoted() -> None:
    for mode in ("max", "min"):
        sched = ASHAScheduler(mode=mode, max_resource=9)
        assert decide(sched, ("a", 1, math.nan)) == {"a": S}
        assert decide(sched, ("b", 1, -math.inf if mode == "max" else math.inf)) == {"b": C}
        sched = ASHAScheduler(mode=mode, max_resource=9)
        assert decide(sched, ("a", 1, math.nan), ("b", 1, 1.0), ("c", 1, 2.0))["a"] is S


def test_asha_brackets_round_robin_by_first_report_then_id() -> None:
    sched = ASHAScheduler(max_resource=9, brackets=2)
    decide(sched, ("z", 0.5, 0), ("b", 0.5, 0), ("m", 0.5, 0))  # same call: by id
    decide(sched, ("a", 0.5, 0))
    assert [sched.bracket_of(t) for t in "bmza"] == [0, 1, 0, 1]
    assert sched.bracket_of("never") is None
    # Bracket 1's first rung is 3: a trial there is not judged at 1.
    assert decide(sched, ("m", 1, -5.0), ("b", 1, 1.0)) == {"m": C, "b": C}


def test_hyperband_brackets_and_shares() -> None:
    sched = HyperbandScheduler(max_resource=9)
    assert sched.n_brackets == 3 and sched.bracket_shares == (9, 5, 3)
    assert [sched.rung_resources(s) for s in range(3)] == [(1, 3), (3,), ()]
    trials = [f"t{i:02d}" for i in range(17)]
    for t in trials:
        decide(sched, (t, 0.5, 0.0))
    brackets = [sched.bracket_of(t) for t in trials]
    assert brackets[:7] == [0, 1, 0, 2, 0, 1, 0]
    assert [brackets.count(s) for s in range(3)] == [9, 5, 3]
    # The last bracket trains to the budget: its trials are never stopped.
    last = [t for t in trials if sched.bracket_of(t) == 2]
    assert decide(sched, *((t, 8, -float(i)) for i, t in enumerate(last))) == dict.fromkeys(last, C)
    # With a budget that is not a power of rf, the last bracket keeps one rung.
    assert HyperbandScheduler(max_resource=10).rung_resources(2) == (9,)


def test_hyperband_takes_no_brackets_option() -> None:
    with pytest.raises(ValueError, match=r"unknown option\(s\) 'brackets'.*grace_period"):
        make_scheduler("hyperband", mode="max", max_resource=9, brackets=2)


# -- median stopping ---------------------------------------------------------------------------


def test_median_uses_the_others_best_up_to_t() -> None:
    sched = MedianStoppingScheduler(max_resource=9, grace_period=1, min_samples=3)
    # Others at t=2: best-so-far 0.5, 0.6 and 0.7 (x reaches 0.95 only at t=3, so 0.4 counts).
    decide(sched, ("a", 1, 0.5), ("b", 1, 0.6), ("c", 1, 0.3), ("x", 1, 0.1))
    decide(sched, ("a", 2, 0.4), ("b", 2, 0.5), ("c", 2, 0.7), ("x", 2, 0.4))
    decide(sched, ("x", 3, 0.95))
    # t=2: others' bests a 0.5, b 0.6, c 0.7, x 0.4 -> median 0.55.
    assert decide(sched, ("n", 2, 0.54)) == {"n": S}
    assert decide(sched, ("m", 2, 0.55)) == {"m": C}  # ties go on


def test_median_needs_min_samples_and_grace() -> None:
    sched = MedianStoppingScheduler(max_resource=9, grace_period=2, min_samples=2)
    decide(sched, ("a", 1, 0.9), ("b", 1, 0.9))
    assert decide(sched, ("c", 1, 0.0)) == {"c": C}  # before the grace period
    assert decide(sched, ("a", 2, 0.9)) == {"a": C}  # no other trial has reached 2
    assert decide(sched, ("b", 2, 0.9), ("c", 2, 0.0)) == {"b": C, "c": S}


def test_median_is_joint_within_a_call() -> None:
    sched = MedianStoppingScheduler(max_resource=9, min_samples=2)
    got = decide(sched, ("a", 1, 0.1), ("b", 1, 0.5), ("c", 1, 0.9))
    assert got == {"a": S, "b": C, "c": C}  # a < median(0.5, 0.9); b vs median(0.1, 0.9) = 0.5


def test_median_nan_is_worst_and_resources_must_not_decrease() -> None:
    sched = MedianStoppingScheduler(mode="min", max_resource=9, min_samples=2)
    assert decide(sched, ("a", 1, math.nan), ("b", 1, 3.0), ("c", 1, 4.0))["a"] is S
    with pytest.raises(ValueError, match="must not decrease"):
        decide(sched, ("b", 0.5, 1.0))


# -- the contract every scheduler enforces -----------------------------------------------------

EVERY = [
    lambda: FIFOScheduler(max_resource=9),
    lambda: ASHAScheduler(max_resource=9),
    lambda: HyperbandScheduler(max_resource=9),
    lambda: MedianStoppingScheduler(max_resource=9),
]


@pytest.mark.parametrize("make", EVERY)
def test_contract_errors(make: Callable[[], TrialScheduler]) -> None:
    sched = make()
    with pytest.raises(ValueError, match="reports twice"):
        decide(sched, ("a", 1, 0.1), ("a", 1, 0.2))
    assert decide(sched, ("a", 1, 0.1)) == {"a": C}
    assert decide(sched) == {}
    sched.on_trial_end("a", "stopped")
    with pytest.raises(ValueError, match="already ended"):
        sched.on_trial_end("a", "completed")
    with pytest.raises(ValueError, match="after it ended"):
        decide(sched, ("a", 2, 0.1))
    with pytest.raises(
        ValueError, match=r"status must be one of \['completed', 'stopped', 'failed'\]"
    ):
        sched.on_trial_end("b", "pruned")
    with pytest.raises(TypeError, match="Report objects"):
        sched.decide([("b", 1, 0.1)])  # type: ignore[list-item]


def test_report_validation() -> None:
    assert Report("a", 1, 2) == Report("a", 1.0, 2.0)
    assert isinstance(Report("a", 1, 2).resource, float)
    with pytest.raises(ValueError, match="finite and >= 0"):
        Report("a", -1, 0.0)
    with pytest.raises(ValueError, match="finite and >= 0"):
        Report("a", math.nan, 0.0)
    with pytest.raises(TypeError, match="str trial id"):
        Report(3, 1, 0.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="real numbers"):
        Report("a", 1, "high")  # type: ignore[arg-type]
    assert math.isnan(Report("a", 1, math.nan).value)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"mode": "maximize"}, ValueError, r"mode must be one of \['min', 'max'\], got 'maximize'"),
        ({"max_resource": 0}, ValueError, "max_resource must be finite and > 0, got 0"),
        ({"max_resource": math.inf}, ValueError, "max_resource must be finite"),
        ({"max_resource": True}, TypeError, "max_resource must be a number"),
        ({"grace_period": 9}, ValueError, r"grace_period \(9\) must be smaller than max_resource"),
        ({"grace_period": -1}, ValueError, "grace_period must be finite and > 0"),
        ({"reduction_factor": 1}, ValueError, "reduction_factor must be > 1, got 1"),
        ({"brackets": 4}, ValueError, "brackets must be between 1 and 3 .* got 4"),
        ({"brackets": 0}, ValueError, "brackets must be >= 1"),
        ({"brackets": 1.5}, TypeError, "brackets must be an int"),
    ],
)
def test_asha_validation(kwargs: dict[str, object], error: type[Exception], match: str) -> None:
    args: dict[str, object] = {"max_resource": 9, **kwargs}
    with pytest.raises(error, match=match):
        ASHAScheduler(**args)  # type: ignore[arg-type]


def test_mode_is_validated_everywhere() -> None:
    for cls in (FIFOScheduler, ASHAScheduler, HyperbandScheduler, MedianStoppingScheduler):
        with pytest.raises(ValueError, match="mode must be one of"):
            cls(mode="best", max_resource=9)
    with pytest.raises(ValueError, match="mode must be one of"):
        make_scheduler("optuna:median", mode="MAX", max_resource=9)
    with pytest.raises(ValueError, match="min_samples must be >= 1"):
        MedianStoppingScheduler(max_resource=9, min_samples=0)


# -- state -------------------------------------------------------------------------------------


def test_state_with_non_finite_values_is_strict_json() -> None:
    sched = ASHAScheduler(max_resource=9)
    decide(sched, ("a", 1, math.nan), ("b", 1, math.inf), ("c", 1, -math.inf))
    text = json.dumps(sched.state_dict(), allow_nan=False)
    clone = ASHAScheduler(max_resource=9)
    clone.load_state_dict(json.loads(text))
    records = clone.rung_records()[0]
    assert math.isnan(records["a"]) and records["b"] == math.inf and records["c"] == -math.inf


def test_load_state_dict_refuses_other_arguments_or_types() -> None:
    state = ASHAScheduler(max_resource=9).state_dict()
    with pytest.raises(ValueError, match=r"reduction_factor=3.0 \(here 2.0\)"):
        ASHAScheduler(max_resource=9, reduction_factor=2).load_state_dict(state)
    with pytest.raises(ValueError, match="not of a 'HyperbandScheduler'"):
        HyperbandScheduler(max_resource=9).load_state_dict(state)


# -- make_scheduler ----------------------------------------------------------------------------


def test_make_scheduler_builds_each_name() -> None:
    assert isinstance(make_scheduler("fifo", mode="max", max_resource=9), FIFOScheduler)
    asha = make_scheduler("asha", mode="min", max_resource=27, grace_period=3, reduction_factor=2)
    assert isinstance(asha, ASHAScheduler) and asha.rung_resources() == (3, 6, 12, 24)
    assert asha.mode == "min"
    assert isinstance(make_scheduler("hyperband", mode="max", max_resource=9), HyperbandScheduler)
    med = make_scheduler("median", mode="max", max_resource=9, min_samples=5)
    assert isinstance(med, MedianStoppingScheduler)
    opt = make_scheduler("optuna:percentile", mode="max", max_resource=9, percentile=30.0)
    assert isinstance(opt, OptunaPruner) and type(opt.pruner).__name__ == "PercentilePruner"


def test_make_scheduler_errors_name_the_bad_value_and_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown scheduler 'ashaa'; valid names: fifo, asha, "):
        make_scheduler("ashaa", mode="max", max_resource=9)
    with pytest.raises(ValueError, match=r"unknown scheduler 'optuna:foo'.*optuna:median"):
        make_scheduler("optuna:foo", mode="max", max_resource=9)
    with pytest.raises(
        ValueError,
        match=r"unknown option\(s\) 'grace' for scheduler 'asha'; valid options: grace_period, "
        r"reduction_factor, brackets",
    ):
        make_scheduler("asha", mode="max", max_resource=9, grace=1)
    with pytest.raises(ValueError, match=r"'min_samples'.*'fifo'; valid options: \(none\)"):
        make_scheduler("fifo", mode="max", max_resource=9, min_samples=1)
    with pytest.raises(
        ValueError,
        match=r"'n_startup' for scheduler 'optuna:median'.*steps_per_resource, n_startup_trials",
    ):
        make_scheduler("optuna:median", mode="max", max_resource=9, n_startup=1)
    with pytest.raises(ValueError, match=r"needs option\(s\) 'percentile'"):
        make_scheduler("optuna:percentile", mode="max", max_resource=9)
    with pytest.raises(ValueError, match=r"rejected options.*Either lower or upper"):
        make_scheduler("optuna:threshold", mode="max", max_resource=9)
    with pytest.raises(ValueError, match="rejected options"):
        make_scheduler("optuna:percentile", mode="max", max_resource=9, percentile=120.0)
