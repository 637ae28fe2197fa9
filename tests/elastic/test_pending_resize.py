"""A pending resize may be re-targeted in the tail of a sweep (fake clock): an array whose
resize an earlier plan asked for and that has not made it yet (``ArrayState.pending``) resizes
once, to the latest count asked, with one pause. In the tail (no trial waits or queues) the
allocator may therefore resize it again within its cooldown, charging no second pause, so that
workers freed one after another before it resizes go to it in one step rather than one each
to several arrays that then cool. In ``benchmarks/elastic_sim.py`` at 64 accelerators, 19
arrays ended at one instant at the tail's start and the 19 plans gave 18 arrays one worker
each."""

from __future__ import annotations

from pathlib import Path

from _elastic_fakes import FakeClock, fake_policy

from hfsweep.elastic.allocator import Allocator, ArrayState, WaitingPool
from hfsweep.elastic.policy import ElasticPolicy
from hfsweep.parallel import read_resize
from hfsweep.parallel._run import RESIZE_FILE
from hfsweep.profiler import ScalingProfile

#: about a cifar_resnet trial's modelled scaling in the simulator: 1.9x at 2, 5.7x at 8
CIFAR = ScalingProfile("cifar", {1: 100.0, 2: 190.0, 4: 340.0, 8: 570.0})


def _arrays(*, pending: bool) -> list[ArrayState]:
    """The tail at t = 200 s after one array ended and its worker went to ``x`` (1 -> 2, asked
    at this instant): ``x`` (8 members, 300 s left on one worker) on 2, ``y`` (1 member, 300 s)
    on 1 worker since the start, one more worker just freed (4 in all)."""
    return [
        ArrayState("x", "cifar", 8, 300.0, CIFAR, workers=2, since=200.0, pending=pending),
        ArrayState("y", "cifar", 1, 300.0, CIFAR, workers=1, since=0.0),
    ]


def test_freed_worker_goes_to_the_pending_resize() -> None:
    """The next freed worker goes to ``x`` (2 -> 3, still one pause) instead of growing ``y``
    (1 -> 2, a pause of its own): ``x``'s 8 members gain more from it, and its resize is one."""
    alloc = Allocator(resize_every_s=60.0, resize_cost_s=20.0)
    plan = alloc.decide(_arrays(pending=True), [], 4, now=200.0, event="array ended")
    assert plan.workers() == {"x": 3, "y": 1}
    assert any("pending resize(s) of x may be re-targeted" in note for note in plan.notes)


def test_without_pending_the_cooldown_holds() -> None:
    """The same plan with ``x``'s resize already made (not pending): ``x`` is in its cooldown,
    so the freed worker grows ``y`` (as the allocator did before the rule)."""
    alloc = Allocator(resize_every_s=60.0, resize_cost_s=20.0)
    plan = alloc.decide(_arrays(pending=False), [], 4, now=200.0, event="array ended")
    assert plan.workers() == {"x": 2, "y": 2}
    (x, _) = plan.decisions
    assert x.action == "keep" and x.reason.startswith("resized 0 s ago, cooldown 60 s")


def test_not_while_trials_queue_or_wait() -> None:
    """Before the tail (trials queued, or a formed array waiting) a pending resize keeps its
    cooldown: it is never grown again (the rule is only for the workers the tail frees),
    though, as any cooling array, it may shrink for the queued or waiting trials."""
    alloc = Allocator(resize_every_s=60.0, resize_cost_s=20.0)
    queued = alloc.decide(_arrays(pending=True), [], 4, now=200.0, queued=5)
    assert queued.workers()["x"] <= 2
    pool = WaitingPool("cifar", 1, 1, 300.0, CIFAR, name="z", since=200.0)
    waiting = alloc.decide(_arrays(pending=True), [pool], 4, now=200.0)
    assert waiting.workers()["x"] <= 2
    assert not any("re-targeted" in note for note in queued.notes + waiting.notes)


def test_two_ends_at_one_instant_one_grow() -> None:
    """Two arrays end at one instant, each freeing a worker, one plan each (as the engine and
    the simulator see them): the first plan grows ``x`` 1 -> 2, the second, told that
    resize is pending, re-targets it to 3 rather than growing ``y`` as well: one resize."""
    alloc = Allocator(resize_every_s=60.0, resize_cost_s=20.0)
    x = ArrayState("x", "cifar", 8, 300.0, CIFAR, workers=1, since=0.0)
    y = ArrayState("y", "cifar", 1, 300.0, CIFAR, workers=1, since=0.0)
    first = alloc.decide([x, y], [], 3, now=200.0, event="array ended")
    assert first.workers() == {"x": 2, "y": 1}
    x2 = ArrayState("x", "cifar", 8, 300.0, CIFAR, workers=2, since=200.0, pending=True)
    second = alloc.decide([x2, y], [], 4, now=200.0, event="array ended")
    assert second.workers() == {"x": 3, "y": 1}
    assert [d.action for d in second.decisions] == ["grow", "keep"]


#: a profile like CIFAR's, in member-epochs/s
PROFILE = ScalingProfile("k", {1: 1.0, 2: 1.9, 4: 3.4, 8: 5.7})


def _policy_tail(tmp_path: Path) -> tuple[ElasticPolicy, dict[str, str]]:
    """``hfsweep run``'s policy on a fake clock (a 60 s cooldown, 3 s resizes, no rungs): arrays
    x (8 members), y, z and w (1 member each) start on one worker each of 4 at t = 0; at
    t = 100 z ends and its worker goes to x (1 -> 2, asked in x's folder)."""
    clock, shown = FakeClock(), []
    policy = fake_policy(
        clock,
        shown,
        scaling=lambda key, config, members: (PROFILE, "given"),
        resize_every_s=60.0,
        resize_cost_s=3.0,
    )
    folders = {n: str(tmp_path / n) for n in ("x", "y", "z", "w")}
    for total, (name, folder) in enumerate(folders.items(), start=1):
        Path(folder).mkdir()
        assert policy.started(folder, "k", 8 if name == "x" else 1, total=total) == 1
    clock.now = 100.0
    policy.ended(folders["z"], total=4)
    assert read_resize(folders["x"]) == 2
    return policy, folders


def test_the_policy_re_targets_a_resize_not_made_yet(tmp_path: Path) -> None:
    """w ends before x reaches its next evaluation boundary (its request still in its folder):
    the policy tells the allocator that x's resize is pending, and w's worker goes to x too
    (2 -> 3, one resize) instead of to y."""
    policy, folders = _policy_tail(tmp_path)
    policy.ended(folders["w"], total=4)
    assert policy.plans[-1].workers() == {"array x": 3, "array y": 1}
    assert read_resize(folders["x"]) == 3


def test_the_policy_after_the_resize_was_made(tmp_path: Path) -> None:
    """The same once x has made its resize (the launcher removed the request at its restart):
    x is in its cooldown and w's worker goes to y."""
    policy, folders = _policy_tail(tmp_path)
    (Path(folders["x"]) / RESIZE_FILE).unlink()
    policy.ended(folders["w"], total=4)
    assert policy.plans[-1].workers() == {"array x": 2, "array y": 2}
