"""One source of rungs for ``hfsweep run``'s elastic policy: where the trial scheduler's rung
model (``pruner``, a :class:`~hfsweep.elastic.survival.RungSurvival`) is given, each array's
horizon is measured to its rungs (every bracket's), the same rungs its expected end is
computed from; ``rungs`` given beside it must agree, and a pair that does not is refused with
an error that names both."""

from __future__ import annotations

import pytest
from _elastic_fakes import FakeClock, evals
from hfsweep.schedulers import HyperbandScheduler

from hfsweep.config.schema import ElasticConfig
from hfsweep.elastic.policy import ElasticPolicy
from hfsweep.elastic.survival import RungSurvival, from_scheduler

#: asynchronous Hyperband on 27 epochs: brackets with rungs at 1, 3, 9; 3, 9; 9; none
HYPERBAND = HyperbandScheduler(max_resource=27, reduction_factor=3)


def _model() -> RungSurvival:
    model = from_scheduler(HYPERBAND, 27)
    assert model is not None
    return model


def _policy(**given: object) -> ElasticPolicy:
    config = ElasticConfig(enabled=True, resize_every_s=0.0)
    return ElasticPolicy(config, budget=27, by="epochs", clock=FakeClock(), **given)  # type: ignore[arg-type]


def _horizons(policy: ElasticPolicy) -> list[float | None]:
    """``horizon_s`` of one array whose furthest member is at each epoch 0..27 (one epoch a
    second on one worker, measured from two reports)."""
    clock = policy.clock
    assert isinstance(clock, FakeClock)
    policy.started("run/arrays/0", "k", 2, total=1)
    out = []
    for epoch in range(28):
        clock.now = float(epoch)
        policy.reported("run/arrays/0", evals(float(epoch), members=2), live=2)
        out.append(policy._horizon_s(policy._arrays["run/arrays/0"]))
    return out


def test_the_rung_model_exposes_every_brackets_rungs_in_budget_units() -> None:
    """Hyperband's brackets together stop members at 1, 3 and 9 epochs (its last bracket has
    no rung); a rung at or past the budget is none."""
    assert _model().rungs == (1.0, 3.0, 9.0)
    assert RungSurvival(((2.0, 8.0), (4.0, 8.0)), 2.0, 8.0).rungs == (2.0, 4.0)


def test_a_policy_given_only_the_pruner_has_the_horizons_of_one_given_both() -> None:
    """The pruner alone gives the horizons that the scheduler's rungs and the pruner together
    gave (the engine passed both before), from the rung model: 1 s to rung 1 at the start, 6 s
    from epoch 3 to rung 9, none past the last rung."""
    alone = _policy(pruner=_model())
    both = _policy(pruner=_model(), rungs=(1.0, 3.0, 9.0))
    assert alone.rungs == both.rungs == (1.0, 3.0, 9.0)
    horizons = _horizons(alone)
    assert horizons == _horizons(both)
    assert horizons[0] == pytest.approx(1.0)
    assert horizons[3] == pytest.approx(6.0)
    assert horizons[9] is None and horizons[20] is None


def test_rungs_without_a_rung_model_still_give_the_horizon() -> None:
    """A caller that knows where members stop but has no rung model: ``rungs`` alone."""
    policy = _policy(rungs=(9.0, 3.0, 1.0, 3.0))
    assert policy.rungs == (1.0, 3.0, 9.0)
    assert _horizons(policy)[1] == pytest.approx(2.0)
    assert _policy().rungs == ()


def test_rungs_that_disagree_with_the_pruner_are_refused() -> None:
    """Hyperband's first bracket only (rungs 1, 3, 9 of bracket 0, say) would agree; the rungs
    of one later bracket (3, 9) do not: the error names both rung lists. A pruner for another
    budget is refused too, also when it is set on a policy later."""
    assert _policy(pruner=_model(), rungs=HYPERBAND.rung_resources(0)).rungs == (1.0, 3.0, 9.0)
    with pytest.raises(ValueError, match=r"rungs=\[3\.0, 9\.0\] disagree with the pruner's rungs"):
        _policy(pruner=_model(), rungs=HYPERBAND.rung_resources(1))
    other = RungSurvival(((1.0, 3.0, 9.0),), 3.0, 81.0)
    with pytest.raises(ValueError, match="the pruner's budget is 81 but the policy's budget is 27"):
        _policy(pruner=other)
    policy = _policy(rungs=(3.0, 9.0))
    with pytest.raises(ValueError, match="disagree"):
        policy.pruner = _model()
    assert policy.pruner is None and policy.rungs == (3.0, 9.0)


def test_the_engine_gives_the_policy_the_schedulers_rung_model_alone() -> None:
    """``hfsweep run``'s policy (``_Backend._elastic_policy``) with Hyperband: its rungs are the
    rung model's, every bracket's, and nothing else is passed that could disagree with them."""
    from types import SimpleNamespace

    from hfsweep.core._backend import _Backend

    settings = ElasticConfig(enabled=True, scaling="perfect")
    engine = SimpleNamespace(
        sc=SimpleNamespace(
            budget=SimpleNamespace(max_resource=27, resource="epochs"),
            ray=SimpleNamespace(elastic=settings, max_concurrent=None),
        ),
        scheduler=HYPERBAND,
        dir=SimpleNamespace(write_elastic=lambda totals: None),
        _queued_arrays=lambda held: 0,
        resume=False,
    )
    policy = _Backend._elastic_policy(engine)  # type: ignore[arg-type]
    assert policy.pruner == _model() and policy.rungs == (1.0, 3.0, 9.0)
    assert policy._rungs == ()
