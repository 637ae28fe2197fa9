"""OptunaPruner: attaching trials, steps, nan, and the study it needs."""

from __future__ import annotations

import json
import math

import optuna
import pytest
from hfsweep.schedulers import Decision, OptunaPruner, Report, make_scheduler

optuna.logging.set_verbosity(optuna.logging.ERROR)
C, S = Decision.CONTINUE, Decision.STOP
pytestmark = pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")


def study_for(sched: OptunaPruner, direction: str = "maximize") -> optuna.Study:
    return optuna.create_study(direction=direction, pruner=sched.pruner)


def test_reports_then_prunes_like_optuna() -> None:
    sched = OptunaPruner("median", max_resource=9, n_startup_trials=1)
    study = study_for(sched)
    done = study.ask()
    sched.attach("done", done)
    sched.decide([Report("done", 1, 0.8)])
    sched.decide([Report("done", 2, 0.9)])
    sched.on_trial_end("done", "completed")
    study.tell(done, 0.9)
    a, b = study.ask(), study.ask()
    sched.attach("a", a)
    sched.attach("b", b)
    assert sched.decide([Report("a", 1, 0.5), Report("b", 1, 0.85)]) == {"a": S, "b": C}
    assert a.study.trials[a.number].intermediate_values == {1: 0.5}
    assert b.study.trials[b.number].intermediate_values == {1: 0.85}


def test_steps_round_half_up_and_repeat_steps_are_reported_once() -> None:
    sched = OptunaPruner("nop", max_resource=9, steps_per_resource=4)
    assert [sched.step_of(r) for r in (0.25, 0.5, 1.0, 0.125, 0.374)] == [1, 2, 4, 1, 1]
    assert OptunaPruner("nop", max_resource=9).step_of(2.5) == 3
    study = study_for(sched)
    t = study.ask()
    sched.attach("t", t)
    sched.decide([Report("t", 0.25, 0.1)])
    sched.decide([Report("t", 0.26, 0.2)])  # step 1 again: Optuna keeps the first value
    sched.decide([Report("t", 0.5, 0.3)])
    assert study.trials[0].intermediate_values == {1: 0.1, 2: 0.3}


@pytest.mark.parametrize(("direction", "worst"), [("maximize", -math.inf), ("minimize", math.inf)])
def test_nan_is_reported_as_the_worst_value(direction: str, worst: float) -> None:
    mode = "max" if direction == "maximize" else "min"
    sched = OptunaPruner("threshold", mode=mode, max_resource=9, lower=-1.0, upper=1.0)
    study = study_for(sched, direction)
    t = study.ask()
    sched.attach("t", t)
    assert sched.decide([Report("t", 1, math.nan)]) == {"t": S}
    assert study.trials[0].intermediate_values == {1: worst}


def test_never_stops_at_the_budget() -> None:
    sched = OptunaPruner("threshold", max_resource=3, lower=0.5)
    study = study_for(sched)
    t = study.ask()
    sched.attach("t", t)
    assert sched.decide([Report("t", 3, 0.1)]) == {"t": C}


def test_attach_checks_pruner_direction_and_numbers() -> None:
    sched = OptunaPruner("median", max_resource=9)
    other = optuna.create_study(direction="maximize")  # Optuna's own default MedianPruner
    with pytest.raises(ValueError, match=r"pruner=scheduler\.pruner"):
        sched.attach("a", other.ask())
    with pytest.raises(ValueError, match="mode='max' needs a study that will maximize"):
        sched.attach("a", study_for(sched, "minimize").ask())
    study = study_for(sched)
    t0, t1 = study.ask(), study.ask()
    sched.attach("a", t0)
    with pytest.raises(ValueError, match="is Optuna trial 0, not 1"):
        sched.attach("a", t1)
    with pytest.raises(ValueError, match=r"'b' have no Optuna trial: call attach"):
        sched.decide([Report("a", 1, 0.1), Report("b", 1, 0.2)])
    with pytest.raises(TypeError, match=r"optuna\.Trial"):
        sched.attach("c", object())  # type: ignore[arg-type]
    sched.on_trial_end("a", "failed")
    with pytest.raises(ValueError, match="already ended"):
        sched.attach("a", t0)


def test_instance_and_name_forms() -> None:
    pruner = optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=3)
    sched = OptunaPruner(pruner, mode="min", max_resource=27)
    assert sched.pruner is pruner
    with pytest.raises(ValueError, match="already built"):
        OptunaPruner(pruner, max_resource=27, reduction_factor=2)
    with pytest.raises(TypeError, match="BasePruner or one of"):
        OptunaPruner(3, max_resource=27)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown Optuna pruner 'asha'; valid names: hyperband"):
        OptunaPruner("asha", max_resource=27)
    hb = make_scheduler("optuna:hyperband", mode="max", max_resource=27, reduction_factor=3)
    assert hb.pruner._max_resource == 27  # type: ignore[attr-defined]
    hb = make_scheduler("optuna:hyperband", mode="max", max_resource=3, steps_per_resource=4)
    assert hb.pruner._max_resource == 12  # type: ignore[attr-defined]
    patient = make_scheduler(
        "optuna:patient", mode="max", max_resource=9, patience=2, wrapped_pruner="median"
    )
    assert type(patient.pruner._wrapped_pruner).__name__ == "MedianPruner"  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match=r"'percentile' needs option\(s\) 'percentile'"):
        make_scheduler(
            "optuna:patient", mode="max", max_resource=9, patience=2, wrapped_pruner="percentile"
        )


def test_state_dict_round_trip() -> None:
    sched = OptunaPruner("median", max_resource=9)
    study = study_for(sched)
    t = study.ask()
    sched.attach("a", t)
    sched.decide([Report("a", 1, 0.3)])
    state = json.loads(json.dumps(sched.state_dict(), allow_nan=False))
    assert state["trials"] == {"a": 0} and state["last_step"] == {"a": 1}
    clone = OptunaPruner("median", max_resource=9)
    clone.load_state_dict(state)
    with pytest.raises(ValueError, match="call attach"):
        clone.decide([Report("a", 2, 0.4)])
    study.pruner = clone.pruner
    clone.attach("a", t)
    assert clone.decide([Report("a", 2, 0.4)]) == {"a": C}
    with pytest.raises(ValueError, match="pruner='MedianPruner' \\(here 'PercentilePruner'\\)"):
        OptunaPruner("percentile", percentile=50.0, max_resource=9).load_state_dict(state)
