"""The end estimate that knows the pruner (fake clock): an array's expected remaining time and
member-seconds under ASHA's rungs (a member survives each rung ahead with probability
1/reduction factor), and what the allocator does with it in a sweep's tail: it weighs arrays
by what their members are expected to train, makes a resize only where it pays back within the
array's expected time, and gives the array expected to end last priority for a free worker."""

from __future__ import annotations

import math

import pytest
from _elastic_fakes import FakeClock, evals, fake_policy
from hfsweep.schedulers import ASHAScheduler, FIFOScheduler, HyperbandScheduler

from hfsweep.elastic.allocator import Allocator, ArrayState
from hfsweep.elastic.survival import RungSurvival, from_scheduler
from hfsweep.profiler import ScalingProfile

#: ASHA with the simulator's settings: rungs at 1, 3 and 9 of 27 epochs, reduction factor 3
ASHA = RungSurvival(((1.0, 3.0, 9.0),), 3.0, 27.0)
GOOD = ScalingProfile("k", {1: 100.0, 2: 190.0, 4: 340.0, 8: 570.0})


def test_a_members_expected_units_weigh_each_rung_by_its_survival() -> None:
    """From the start: 1 epoch to rung 1, then 2 more with probability 1/3, 6 with 1/9 and 18
    with 1/27: 3 epochs. Just past rung 1: 2 + 6/3 + 18/9 = 6. Past the last rung: the rest
    of the budget. A rung at the member's own progress was decided already and is not
    counted again."""
    assert ASHA.member_units(0.0) == pytest.approx(3.0)
    assert ASHA.member_units(1.0) == pytest.approx(6.0)
    assert ASHA.member_units(9.0) == pytest.approx(18.0)
    assert ASHA.member_units(27.0) == 0.0


def test_an_arrays_expected_end_is_its_last_members() -> None:
    """Two members from the start: the array trains while either does, 1 - (1 - p)^2 of each
    stretch (independent members): 1 + 2 * 5/9 + 6 * 17/81 + 18 * 53/729. One member: its own
    expectation; more members: later, never past the budget."""
    two = 1 + 2 * 5 / 9 + 6 * 17 / 81 + 18 * 53 / 729
    assert ASHA.array_units([0.0, 0.0]) == pytest.approx(two)
    assert ASHA.array_units([0.0]) == pytest.approx(3.0)
    many = ASHA.array_units([0.0] * 64)
    assert two < many < 27.0
    assert ASHA.array_units([]) == 0.0


def test_brackets_are_weighed_by_their_shares() -> None:
    """A member's bracket is not known before its first report: the expectation is the
    brackets' mean by their shares of the trials."""
    model = RungSurvival(((1.0, 3.0, 9.0), (3.0, 9.0)), 3.0, 27.0, shares=(3.0, 1.0))
    plain = RungSurvival(((3.0, 9.0),), 3.0, 27.0)
    assert model.member_units(0.0) == pytest.approx(
        0.75 * ASHA.member_units(0.0) + 0.25 * plain.member_units(0.0)
    )


def test_the_model_comes_from_successive_halving_schedulers_only() -> None:
    """ASHA and asynchronous Hyperband give their rungs, shares and reduction factor; FIFO
    (and median stopping, Optuna's pruners) none: the allocator's estimate stays the budget."""
    asha = from_scheduler(ASHAScheduler(max_resource=27, reduction_factor=3), 27)
    assert asha == ASHA
    hyperband = HyperbandScheduler(max_resource=27, reduction_factor=3)
    model = from_scheduler(hyperband, 27)
    assert model is not None and len(model.brackets) == hyperband.n_brackets
    assert model.shares == tuple(float(s) for s in hyperband.bracket_shares)
    assert from_scheduler(FIFOScheduler(max_resource=27), 27) is None
    assert "rungs at 1, 3, 9 of 27" in ASHA.describe()
    with pytest.raises(ValueError, match="reduction_factor must be > 1"):
        RungSurvival(((1.0,),), 1.0, 27.0)


def _tail(knows: bool) -> list[ArrayState]:
    """The tail of an ASHA sweep on 3 workers, one free. ``a``: 4 members that just passed
    rung 3, 24 epochs of budget left at 30 s an epoch on one worker; ``b``: the 1 member left
    of its array, past the last rung, 18 epochs at 60 s. With ``knows``, each with the
    pruner's estimate: a's members are expected to train 6 + 18/3 = 12 epochs each, the array
    to end after 6 + 18 * (1 - (2/3)^4) = 20.4 epochs (612 s); b trains its 18 (1,080 s)."""
    a_exp = {"expected_s": 30.0 * ASHA.array_units([3.0] * 4)} if knows else {}
    a_mem = {"expected_member_s": 30.0 * 4 * ASHA.member_units(3.0)} if knows else {}
    b_exp = {"expected_s": 1080.0, "expected_member_s": 1080.0} if knows else {}
    return [
        ArrayState("a", "k", 4, 24 * 30.0, GOOD, 1, 0.0, 6 * 30.0, **a_exp, **a_mem),
        ArrayState("b", "k", 1, 18 * 60.0, GOOD, 1, 0.0, None, **b_exp),
    ]


def test_the_free_worker_goes_to_the_array_expected_to_end_last() -> None:
    """Told only the budget, the allocator weighs a's 4 members x 720 s over b's 1 x 1,080 s
    and grows a, a pause of its 4 members for an array ASHA is expected to halve and halve
    again. Told the pruner, a's members are expected to train 1,440 member-seconds and b,
    expected to end last (1,080 s against 612 s), is weighed as the heaviest array: b grows,
    a keeps its worker, and the plan says why."""
    alloc = Allocator(resize_every_s=0, resize_cost_s=20.0)
    before = alloc.decide(_tail(knows=False), [], 3, now=100.0, event="array ended")
    assert before.workers() == {"a": 2, "b": 1}
    plan = alloc.decide(_tail(knows=True), [], 3, now=100.0, event="array ended")
    assert plan.workers() == {"a": 1, "b": 2}
    grow = next(d for d in plan.decisions if d.array == "b")
    assert grow.action == "grow" and "expected done in ~568 s instead of ~1080 s" in grow.reason
    assert any(
        n.startswith("b is expected to end last (~1080 s on its 1 worker(s))") for n in plan.notes
    )


def test_a_resize_pays_back_within_the_expected_time_not_only_before_the_rung() -> None:
    """A one-member array one epoch (12 s) before ASHA's first rung: before its rung 8 workers
    save less than a 20 s pause (the horizon rule keeps it on 1). It is expected to train 3
    epochs (36 s), in which they save 36 - 36/5.7 = 29.7 s: it grows. With a 30 s pause the
    grow does not pay back within those 36 s either, and the reason says so."""
    young = ArrayState("a", "k", 1, 27 * 12.0, GOOD, 1, 0.0, 12.0)
    knows = ArrayState(
        "a", "k", 1, 27 * 12.0, GOOD, 1, 0.0, 12.0, expected_s=36.0, expected_member_s=36.0
    )
    assert Allocator(resize_every_s=0, resize_cost_s=20.0).decide(
        [young], [], 8, now=100.0
    ).workers() == {"a": 1}
    assert Allocator(resize_every_s=0, resize_cost_s=20.0).decide(
        [knows], [], 8, now=100.0
    ).workers() == {"a": 8}
    plan = Allocator(resize_every_s=0, resize_cost_s=30.0).decide([knows], [], 8, now=100.0)
    (keep,) = plan.decisions
    assert keep.action == "keep"
    assert keep.reason.startswith(
        "a grow would not repay its 30 s resize within the ~36 s on one worker it is expected "
        "to train"
    )


def test_the_policy_gives_the_allocator_the_pruners_estimate() -> None:
    """``hfsweep run``'s policy with the scheduler's rung model: each array's expected end and
    member-seconds from its members' progress at their last report (4 members at epoch 3 of
    10, rungs at 1, 3 and 9: 6 + 1/3 each), in the measured seconds per epoch; without it, none
    (the allocator decides as before)."""
    model = RungSurvival(((1.0, 3.0, 9.0),), 3.0, 10.0)
    seen: list[list[ArrayState]] = []
    for pruner in (model, None):
        clock, shown = FakeClock(), []
        policy = fake_policy(clock, shown, rungs=(1.0, 3.0, 9.0))
        policy.pruner = pruner
        decide = policy.allocator.decide

        def spy(arrays, *args, _decide=decide, **kw):  # type: ignore[no-untyped-def]
            seen.append(list(arrays))
            return _decide(arrays, *args, **kw)

        policy.allocator.decide = spy  # type: ignore[method-assign]
        policy.started("run/arrays/0", "k", 4, total=2)
        clock.now = 10.0
        policy.reported("run/arrays/0", evals(2.0), live=4)
        clock.now = 20.0
        policy.reported("run/arrays/0", evals(3.0), live=3)  # one stopped at rung 3
        (state,) = seen[-1]
        if pruner is None:
            assert state.expected_s is None and state.expected_member_s is None
            continue
        unit = 10.0 * state.profile.speedup(max(1, policy._arrays["run/arrays/0"].launched))
        each = 6.0 + 1.0 / 3.0
        assert state.expected_member_s == pytest.approx(3 * each * unit)
        gone = (1 - 1 / 3) ** 3
        assert state.expected_s == pytest.approx((6.0 + 1.0 * (1 - gone)) * unit)
        assert math.isfinite(state.remaining_s)
