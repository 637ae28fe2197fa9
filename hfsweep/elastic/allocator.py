"""The elastic allocator: how many workers each array gets, and whether waiting trials start a
new array, re-decided whenever the set of runnable arrays changes.

The packer decides *which* trials share an array; the allocator decides *how many* workers
(accelerators, or CPU processes on a CPU cluster) each array trains on, data-parallel. It is
pure Python with a clock the caller passes in (no Ray, no training), so a fake clock drives it in
tests and in ``benchmarks/elastic_sim.py``.

**What it maximises.** As in Jayaram et al. 2020 ("Effective Elastic Scaling of Deep Learning
Workloads"), a dynamic program over arrays and worker counts picks every array's workers at once
(the paper maximises a sum of per-job speed-ups; its headline gain is mean completion time).
Here array ``i`` on ``k >= 1`` workers is worth

    value_i(k) = w_i * (2 - 1 / speedup_i(k)),   w_i = members_i * remaining_s_i

``speedup_i`` comes from its :class:`~hfsweep.profiler.ScalingProfile`, ``members_i`` is its live
trials, ``remaining_s_i`` the seconds it still needs on one worker. Up to a constant, the sum is
minus the members' remaining completion times, ``sum_i members_i * remaining_s_i /
speedup_i(k_i)``: a worker goes where it saves the most member-seconds, so arrays far from their
end get more than arrays about to finish, which is what shortens a sweep's tail (late in an ASHA
sweep the survivors with most left to train get the most workers, and finish times even out).
An array not running is worth 0, so starting a new array of waiting trials is credited with its
whole one-worker time ``w`` (at least what it would otherwise wait): while trials wait, a worker
starts them rather than growing an array, unless that array has far more member-seconds left.

**While trials queue.** The engine forms one array at a time, so the allocator also hears
how many more arrays the trials queued behind the formed ones would make (``decide(...,
queued=n)``; ``hfsweep run`` estimates it with ``Packer.queued_arrays``). While those need at
least the workers that every array's minimum leaves free, the plan maximises useful throughput
instead, ``sum_i speedup_i(k_i)``: each queued array is a candidate on ``min_workers``, so a
worker starts one rather than grow an array (``speedup(k + 1) - speedup(k) <= 1``), and a
formed array starts on its minimum rather than on workers the next array formed would take
back at a resize. In ``benchmarks/elastic_sim.py`` at 64 accelerators the member-seconds
objective, told only of the one formed array, grew many-member arrays while 2,000 trials
queued and shrank them again as arrays formed: 46 resizes before the last trial started. With
workers to spare for every queued array, the queue changes nothing.

**Bounds.** Every array gets between its ``min_workers`` and ``max_workers`` (or 0: paused) and
never more than its profile has a point for (flat beyond: no gain, so not given).

**No starvation.** Every runnable array gets at least ``min_workers`` whenever the workers
suffice for every array's minimum. When they do not (a node left), arrays are paused; a paused
array waits at most ``max_wait_s`` (measured from when it was paused): after that it is served
before any array that has not waited, taking the place of the running array that last
(re)started. New arrays are not started while an array is paused. Waiting trials are not
starved either: with no array running they start (no plan leaves every worker idle while
trials wait), and a pool that has waited ``max_wait_s`` (its ``since``) starts one array
before any running array is given more than its minimum.

**Cooldown and the cost of a resize.** A running array is resized at most once per
``resize_every_s`` (its start counts), except when it must shrink because workers left, or when
shrinking it starts waiting trials (the cooldown keeps running arrays from trading workers back
and forth; it does not hold waiting trials back). A resize pauses the array for
``resize_cost_s`` (a checkpoint and a restart), so every member of it finishes that much later:
the dynamic program charges a resize of a running array ``members * resize_cost_s``
member-seconds, a shrink as well as a grow, and a grow must also save more than
``resize_cost_s`` before the array's *horizon* (``ArrayState.horizon_s``: the seconds on one
worker to its next rung, where the trial scheduler may stop most of its members, or to its end).
In a simulated ASHA sweep (``benchmarks/elastic_sim.py``) the arrays grown just before a rung
were mostly stopped there, the pause spent for nothing.

**A resize not made yet** (``ArrayState.pending``: asked by an earlier plan; the array makes it
at its next evaluation boundary, and a later request replaces it) may be re-targeted in the tail
of a sweep (no trial waits or queues): it is out of its cooldown and charged no second pause,
so workers freed one after another before it resizes go to it in one step rather than one each
to several arrays that then cool. Before the tail the cooldown holds for it as for any array.

**Knowing the pruner.** Where the trial scheduler's rungs and reduction factor are known
(ASHA, asynchronous Hyperband: :mod:`hfsweep.elastic.survival`), each array also comes with the
one-worker seconds until its last member is expected to stop (``ArrayState.expected_s``) and
its members' expected member-seconds (``expected_member_s``), a member surviving each rung ahead
with probability ``1 / reduction_factor``. Then (a) arrays, and formed arrays of waiting trials,
are weighed by their members' expected member-seconds instead of ``members * remaining_s``
(most members of an array stop at its next rung: its remaining budget overstates what a worker
saves there); (b) a grow must save more than ``resize_cost_s`` within ``expected_s`` (instead of
before the horizon); and (c) in the tail (no trial waits or queues), the array expected to end
last on its workers is weighed at least as the heaviest array, so that freed workers go to the
critical path first. Without the estimate every rule is as before.

Every call of :meth:`Allocator.decide` returns a :class:`Plan`: one :class:`Decision` per array
and per pool of waiting trials, each with a human-readable reason, and :meth:`Plan.status` for a
progress line. The allocator also keeps the time its plans left arrays waiting and workers idle
(:meth:`Allocator.waits`, :meth:`Plan.waits`), on the same clock.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from ..sizing.scaling import ScalingProfile
from ._allocation import ArrayState, Decision, Plan, WaitingPool
from ._allocator_dp import _best, _best_of, _choices, _starts

__all__ = ["EVENTS", "Allocator", "ArrayState", "Decision", "Plan", "WaitingPool"]

#: What may trigger a decision (free text is accepted too; these are the engine's names).
EVENTS = ("array ended", "members stopped", "pool filled", "node joined", "node left", "timer")


class Allocator:
    """Decides workers per array; see the module's docstring for the objective and the rules.

    ``min_workers``/``max_workers`` bound every array (``max_workers`` ``None``: the total);
    ``resize_every_s`` is the cooldown between resizes of one array; ``resize_cost_s`` the
    seconds a resize pauses the array (charged to its members in the objective; a grow must
    save more before the array's horizon); ``max_wait_s`` the longest a paused array waits
    when workers are too few for every array's minimum.
    """

    def __init__(
        self,
        *,
        min_workers: int = 1,
        max_workers: int | None = None,
        resize_every_s: float = 60.0,
        resize_cost_s: float = 0.0,
        max_wait_s: float = 600.0,
    ) -> None:
        if min_workers < 1:
            raise ValueError(f"min_workers must be an integer >= 1, got {min_workers!r}")
        if max_workers is not None and max_workers < min_workers:
            raise ValueError(
                f"max_workers ({max_workers}) must be >= min_workers ({min_workers}) or None"
            )
        for name, value in (
            ("resize_every_s", resize_every_s),
            ("resize_cost_s", resize_cost_s),
            ("max_wait_s", max_wait_s),
        ):
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        self.min_workers = min_workers
        self.max_workers = max_workers
        self.resize_every_s = resize_every_s
        self.resize_cost_s = resize_cost_s
        self.max_wait_s = max_wait_s
        #: the last plan (its waits and idle workers count until the next)
        self.last: Plan | None = None
        #: ``(array-seconds waited, worker-seconds idle)`` before this allocator's first plan:
        #: a resumed sweep's earlier runs (``elastic.json``), which its totals go on from
        self.carried: tuple[float, float] = (0.0, 0.0)

    def decide(
        self,
        arrays: Sequence[ArrayState],
        waiting: Sequence[WaitingPool],
        total: int,
        *,
        now: float,
        event: str = "timer",
        queued: int = 0,
    ) -> Plan:
        """Workers for every array in ``arrays`` and how many new arrays each pool in
        ``waiting`` starts, given ``total`` workers in the cluster at clock time ``now``.
        ``queued`` is about how many arrays the trials queued behind ``waiting`` would form
        (the engine forms them as workers come free): while they need at least the workers
        that every array's minimum leaves free, the plan maximises useful throughput (each
        of them gets a worker before any array grows); otherwise they do not change it."""
        if queued < 0:
            raise ValueError(f"queued arrays must be >= 0, got {queued}")
        if total < 0:
            raise ValueError(f"total workers must be >= 0, got {total}")
        names = [a.name for a in arrays]
        if len(set(names)) != len(names):
            raise ValueError(
                f"array names repeat: {sorted(n for n in names if names.count(n) > 1)}"
            )
        high = total if self.max_workers is None else min(self.max_workers, total)
        low = self.min_workers
        notes: list[str] = []

        # 1. Who is served: every array if the minimums fit; else the longest-waiting first.
        served, paused = self._served(arrays, total, now, notes)
        forced = sum(a.workers for a in arrays) > total  # workers left: shrink despite cooldown

        # 2. The options per array, and the new arrays the pools could start.
        options: list[list[int]] = []
        weights: list[float] = []
        profiles: list[ScalingProfile] = []
        why_fixed: dict[str, str] = {}
        #: arrays whose grows the horizon ruled out (each a reason, should they keep)
        why_short: dict[str, str] = {}
        #: the tail (no trial waits or queues, none paused): a pending resize may be re-targeted
        tail = not queued and not paused and not any(p.arrays for p in waiting)
        #: arrays whose pending resize this plan may re-target (no cooldown, no second pause)
        retarget = {a.name for a in served if tail and a.pending and a.workers > 0}
        for a in served:
            choices = _choices(a.profile, low, high, a.workers)
            cooling = a.workers > 0 and now - a.since < self.resize_every_s
            cooling = cooling and a.name not in retarget
            if cooling and not forced:
                choices = [a.workers]
                why_fixed[a.name] = (
                    f"resized {now - a.since:.0f} s ago, cooldown {self.resize_every_s:g} s"
                )
            elif a.name in retarget:  # its pause is paid whatever count it resizes to
                pass
            elif a.workers > 0:
                kept = [k for k in choices if k <= a.workers or self._worth_growing(a, k)]
                short = any(
                    k not in kept and self._worth_growing(a, k, a.remaining_s) for k in choices
                )
                if short and a.expected_s is not None:
                    why_short[a.name] = (
                        f"a grow would not repay its {self.resize_cost_s:g} s resize within the "
                        f"~{a.expected_s:.0f} s on one worker it is expected to train (the trial "
                        f"scheduler stops most members at their next rungs; "
                        f"{a.remaining_s:.0f} s of budget left)"
                    )
                elif short and a.horizon_s is not None:
                    why_short[a.name] = (
                        f"a grow would not repay its {self.resize_cost_s:g} s resize before "
                        f"its next rung, ~{a.horizon_s:.0f} s away on one worker"
                    )
                choices = kept
            options.append(choices)
            weights.append(a.weight_s)
            profiles.append(a.profile)
        #: candidates that must start: the oldest overdue pools' first arrays, or, with no
        #: array running, the first waiting one (as many as the minimums leave room for)
        must: dict[tuple[int, int], str] = {}
        if not paused:
            room = total - low * len(served)
            order = sorted(
                range(len(waiting)),
                key=lambda j: (waiting[j].since is None, waiting[j].since or 0.0, j),
            )
            for j in order:
                pool = waiting[j]
                if pool.arrays > 0 and room >= low and pool.overdue(now, self.max_wait_s):
                    must[(j, 0)] = (
                        f"its trials waited {now - (pool.since or now):.0f} s "
                        f"(max_wait_s is {self.max_wait_s:g}): started before any array grows"
                    )
                    room -= low
            if not served and not must and room >= low:
                first = next((j for j in order if waiting[j].arrays > 0), None)
                if first is not None:
                    must[(first, 0)] = "no array is running: waiting trials always start"
            for j, pool in enumerate(waiting):
                for i in range(pool.arrays):
                    starts = _choices(pool.profile, low, high, 0)
                    options.append(starts if (j, i) in must else [0, *starts])
                    weights.append(pool.weight_s)
                    profiles.append(pool.profile)

        # 3. The dynamic program over arrays x workers. A resize pauses the array for
        # resize_cost_s: each of its members finishes that much later, so the resize is
        # charged members * resize_cost_s member-seconds (a shrink too, not only a grow).
        # A pending resize re-targeted in the tail pauses the array once, whatever its count.
        resizes = [
            (a.workers, 0.0 if a.name in retarget else a.members * self.resize_cost_s)
            for a in served
        ]
        # the arrays the queued trials would form, while they need more workers than the
        # minimums leave free: candidates at their minimum (the engine forms them as workers
        # come free). With workers to spare for all of them, none: the old objective decides.
        contended = queued * low >= total - low * len(options)
        queue = min(queued, total // low) if contended and not paused else 0
        if not queue and not paused and not any(p.arrays for p in waiting):
            self._critical_first(served, weights, notes)
        if retarget:
            notes.append(
                f"pending resize(s) of {', '.join(sorted(retarget))} may be re-targeted: "
                "the array makes one resize, to the latest count, one pause"
            )
        solve = self._solver(served, weights, profiles, total, resizes, queue)
        chosen = solve(options)
        if chosen is None:  # the cooled-down arrays alone exceed the workers: relax the cooldown
            notes.append("cooldown lifted: the arrays' current workers exceed the cluster")
            options[: len(served)] = [_choices(a.profile, low, high, a.workers) for a in served]
            why_fixed.clear()
            chosen = solve(options)
            assert chosen is not None, "the minimums were checked to fit"
        if why_fixed and len(chosen) > len(served) and 0 in chosen[len(served) :]:
            # trials wait while arrays in their cooldown hold workers: the cooldown holds back
            # grows and shrinks between running arrays, not waiting trials. Cooling arrays may
            # shrink (never grow) if that starts more new arrays.
            relaxed = list(options)
            for i, a in enumerate(served):
                if a.name in why_fixed:
                    relaxed[i] = [
                        k for k in _choices(a.profile, low, high, a.workers) if k <= a.workers
                    ]
            again = solve(relaxed)
            if again is not None and _starts(again, len(served)) > _starts(chosen, len(served)):
                chosen = again
                for a, k in zip(served, chosen, strict=False):
                    if k != a.workers:
                        why_fixed.pop(a.name, None)
                notes.append("cooldown lifted for the shrinks that start waiting trials")

        held = sum(chosen[len(options) :])
        if held:
            notes.append(
                f"{held} worker(s) kept for the ~{queued} array(s) of queued trials the engine "
                "forms next: while trials queue, a worker starts one rather than grow an array "
                "(most useful throughput)"
            )
        chosen = chosen[: len(options)]
        decisions = [
            self._explain(a, k, why_fixed.get(a.name) or why_short.get(a.name), forced, total)
            for a, k in zip(served, chosen, strict=False)
        ]
        for a, position in paused:
            decisions.append(
                Decision(
                    a.name,
                    a.key,
                    "pause" if a.workers > 0 else "keep",
                    a.workers,
                    0,
                    f"{total} workers cannot give every array its minimum of {low}; "
                    f"paused at position {position} in line, waits at most {self.max_wait_s:g} s",
                )
            )
        started: dict[int, list[int]] = {}
        at = 0
        for j, pool in enumerate(waiting):
            if paused:
                break
            for _ in range(pool.arrays):
                k = chosen[len(served) + at]
                at += 1
                if k > 0:
                    started.setdefault(j, []).append(k)
        for j, pool in enumerate(waiting):
            ks = started.get(j, [])
            for i, k in enumerate(ks):
                reason = must.get((j, i)) or (
                    f"new array of {pool.members} waiting trials on {k} worker(s): "
                    f"{pool.members} x {pool.remaining_s:.0f} s of training started saves more "
                    "member-seconds than growing a running array"
                )
                decisions.append(Decision(pool.label(i), pool.key, "start", 0, k, reason))
            if len(ks) < pool.arrays:
                name = pool.name if pool.name is not None else f"pool:{pool.key}"
                reason = self._why_wait(pool, served, chosen, paused != [], total, now)
                decisions.append(Decision(name, pool.key, "wait", 0, 0, reason))
        used = sum(d.after for d in decisions if d.action != "wait")
        left = sum(d.after == 0 for d in decisions if d.action != "wait") + sum(
            pool.arrays - len(started.get(j, [])) for j, pool in enumerate(waiting)
        )
        waited_s, idle_s = self.waits(now)
        self.last = Plan(
            tuple(decisions), total, total - used, event, now, tuple(notes), left, waited_s, idle_s
        )
        return self.last

    @property
    def timer_s(self) -> float:
        """How often a caller re-decides while trials or arrays wait, events or not:
        ``resize_every_s``, at least 1 s (a cooldown of 0 would re-plan at every look)."""
        return max(self.resize_every_s, 1.0)

    def rest(self, total: int, now: float, event: str = "array ended") -> Plan:
        """The plan with nothing to run (the last array ended, no trial waits): every one of
        ``total`` workers idle from ``now`` on, in the accounting, until the next plan."""
        waited_s, idle_s = self.waits(now)
        self.last = Plan((), total, total, event, now, (), 0, waited_s, idle_s)
        return self.last

    def waits(self, now: float) -> tuple[float, float]:
        """``(array-seconds waited, worker-seconds idle)`` from this allocator's first plan to
        ``now``, on top of :attr:`carried`: each plan's arrays without workers and idle
        workers, held until the next plan (or ``now``). The plans' view: a resize counts from
        its plan, not from the boundary where the array makes it."""
        last = self.last
        if last is None:
            return self.carried
        dt = max(0.0, now - last.now)
        return last.waited_s + last.waiting * dt, last.idle_s + last.idle * dt

    def _why_wait(
        self,
        pool: WaitingPool,
        served: Sequence[ArrayState],
        chosen: Sequence[int],
        paused: bool,
        total: int,
        now: float,
    ) -> str:
        """The reason a pool's trials wait: an array is paused, no worker is free, or the
        workers save more member-seconds in the running arrays (named, with their workers)."""
        every = f"every {self.timer_s:g} s"
        later = (
            f"re-decided when an array ends, members stop or the cluster changes, and {every}; "
            "started "
        ) + (
            "at the next of those (it waited max_wait_s)"
            if pool.overdue(now, self.max_wait_s)
            else f"at the latest once it has waited {self.max_wait_s:g} s"
        )
        if paused:
            return "an array is paused; it is served before new arrays"
        low = self.min_workers
        above = [(a.name, k) for a, k in zip(served, chosen, strict=False) if k > low]
        if not above:
            return (
                f"no free worker: the running arrays hold the {total} worker(s) at their "
                f"minimum of {low}; {later}"
            )
        where = ", ".join(f"{name} on {k}" for name, k in above)
        return (
            f"its {pool.members} trial(s) x {pool.remaining_s:.0f} s on one worker save fewer "
            f"member-seconds than the workers do in the running arrays ({where}); {later}"
        )

    def _served(
        self, arrays: Sequence[ArrayState], total: int, now: float, notes: list[str]
    ) -> tuple[list[ArrayState], list[tuple[ArrayState, int]]]:
        """(arrays that get >= min workers, [(paused array, its place in line)])."""
        fits = total // self.min_workers
        if len(arrays) <= fits:
            return list(arrays), []

        def priority(a: ArrayState) -> tuple[int, float, str]:
            if a.workers == 0 and now - a.since >= self.max_wait_s:
                return (0, a.since, a.name)  # waited its longest: first
            if a.workers > 0:
                return (1, a.since, a.name)  # running: the earliest (re)started keeps its place
            return (2, a.since, a.name)  # paused, in order of pausing

        order = sorted(arrays, key=priority)
        served, rest = order[:fits], order[fits:]
        rest.sort(key=lambda a: (a.workers == 0, a.since, a.name))
        notes.append(
            f"{total} workers for {len(arrays)} arrays at {self.min_workers} each: "
            f"{len(rest)} paused"
        )
        return served, [(a, i + 1) for i, a in enumerate(rest)]

    def _solver(
        self,
        served: Sequence[ArrayState],
        weights: Sequence[float],
        profiles: Sequence[ScalingProfile],
        total: int,
        resizes: Sequence[tuple[int, float]],
        queue: int,
    ) -> Callable[[list[list[int]]], list[int] | None]:
        """The DP over ``options`` (the served arrays', then the pools' candidates) under the
        objective the sweep's phase calls for; its choice ends with ``queue`` candidates for
        the queued trials (0 or ``min_workers`` each), which the caller drops.

        - **Trials queue for the free workers** (``queue`` > 0): the most useful throughput, ``sum_i
          speedup_i(k_i)`` one-worker seconds trained per second, each array of queued trials
          worth its ``min_workers`` and a formed one a hair more than its speed-up (both
          before any grow that gains as much): a worker added to an array trains less than
          one more array would (``speedup(k + 1) - speedup(k) <= 1``), and an array started
          on more workers than the queue leaves it is shrunk again when the next array forms,
          a resize for nothing.
        - **Otherwise** (nothing queues, or the workers suffice for every queued array): the
          members' remaining completion times (the module docstring). Where workers are to
          spare (the simulator's 512 accelerators), the longest arrays, not the work, set the
          makespan, and throughput would start them on their minimum, to grow later at a
          resize each.
        """
        low = self.min_workers

        def solve(options: list[list[int]]) -> list[int] | None:
            if queue:
                values = [
                    [
                        (0.0 if k == 0 else p.speedup(k)) + (2e-6 if i >= len(served) and k else 0)
                        for k in ks
                    ]
                    for i, (ks, p) in enumerate(zip(options, profiles, strict=True))
                ]
                extra = [[0, low]] * queue
                return _best_of(options + extra, values + [[0.0, low + 1e-6]] * queue, total)
            return _best(options, list(weights), list(profiles), total, resizes)

        return solve

    @staticmethod
    def _critical_first(
        served: Sequence[ArrayState], weights: list[float], notes: list[str]
    ) -> None:
        """In the tail of a sweep (no trial waits or queues, none paused), the running array
        expected to end last on its workers now (``expected_s / speedup``; only arrays with
        the pruner's end estimate) is the sweep's critical path: it is weighed at least as
        the heaviest array, so that freed workers go to it before any array it outweighs
        (``weights`` changed in place, the reason in ``notes``)."""
        known = [
            (a.expected_s / a.profile.speedup(a.workers), i)
            for i, a in enumerate(served)
            if a.expected_s is not None and a.workers > 0
        ]
        if len(known) < 2:
            return
        end, i = max(known)
        heaviest = max(weights[: len(served)])
        if weights[i] >= heaviest:
            return
        weights[i] = heaviest
        notes.append(
            f"{served[i].name} is expected to end last (~{end:.0f} s on its "
            f"{served[i].workers} worker(s)): weighed as the heaviest array for the free workers"
        )

    def _worth_growing(self, a: ArrayState, k: int, span: float | None = None) -> bool:
        """Whether growing ``a`` to ``k`` workers saves more than a resize costs within
        ``span`` one-worker seconds, by default before the array's horizon (its next rung, or
        its end): a grow made just before a rung that stops most of its members would pause it
        for longer than it gains."""
        span = a.payback_s if span is None else span
        saved = span / a.profile.speedup(a.workers) - span / a.profile.speedup(k)
        return saved > self.resize_cost_s

    def _explain(
        self, a: ArrayState, k: int, fixed: str | None, forced: bool, total: int
    ) -> Decision:
        p = a.profile
        if k == a.workers:
            reason = fixed or (
                f"{k} worker(s) is the best share (speed-up {p.speedup(max(k, 1)):.2f}x)"
            )
            return Decision(a.name, a.key, "keep", a.workers, k, reason)
        if a.workers == 0:
            return Decision(a.name, a.key, "start", 0, k, f"resumes on {k} worker(s) after waiting")
        left = a.remaining_s if a.expected_s is None else a.expected_s
        eta_before = left / p.speedup(a.workers)
        eta_after = left / p.speedup(k)
        done = "done" if a.expected_s is None else "expected done"
        times = f"speed-up {p.speedup(a.workers):.2f}x -> {p.speedup(k):.2f}x, " + (
            f"{done} in ~{eta_after:.0f} s instead of ~{eta_before:.0f} s"
        )
        if k > a.workers:
            return Decision(a.name, a.key, "grow", a.workers, k, f"workers were free: {times}")
        why = (
            f"workers left (the cluster has {total})" if forced else "its workers do more elsewhere"
        )
        return Decision(a.name, a.key, "shrink", a.workers, k, f"{why}: {times}")
