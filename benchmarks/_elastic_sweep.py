"""The event loop of ``elastic_sim.py``: the simulated workload (models, trials and arrays),
one arm of the sweep on a fake clock (:class:`Sim`), and the trials both arms see.

Kept apart from ``elastic_sim.py`` (the arms, their options and the command line) so that each
module has one job; ``elastic_sim.py`` describes what the simulation models and assumes.
"""

from __future__ import annotations

import heapq
import json
import math
import random
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from _elastic_account import Account, bounds

from hfsweep.core.packer import Packer
from hfsweep.elastic.allocator import Allocator, ArrayState, WaitingPool
from hfsweep.elastic.survival import RungSurvival
from hfsweep.profiler import (
    AllReduceCost,
    Measurement,
    ScalingProfile,
    choose_size,
    model_scaling,
    step_s_at,
)


@dataclass
class Model:
    """One kind of trial: its measured step times by array size, batch and gradient bytes."""

    name: str
    batch: int
    grad_bytes: float
    measurements: list[Measurement]
    size: int  # the profiler's chosen array size
    mean_quality: float

    def step_s(self, members: int) -> float:
        return step_s_at(self.measurements, members)


@dataclass
class Trial:
    number: int
    model: str
    quality: float
    epoch: int = 0
    ended: float | None = None
    completed: bool = False


@dataclass
class Array:
    name: str
    model: str
    members: list[Trial]
    workers: int = 0
    since: float = 0.0
    steps_left: float = 0.0
    last: float = 0.0
    busy_until: float = 0.0
    version: int = 0
    rate: float = 0.0  # steps/s
    resizes: int = 0  # and the seconds they paused it (for the account of the last array)
    paused_s: float = 0.0
    #: elastic: False while the array is formed but no plan has given it workers yet (to the
    #: allocator a pool of waiting trials, as in ``hfsweep run``), and when it was formed
    begun: bool = True
    formed: float = 0.0
    #: when its last resize was made: further resizes at the same instant are one resize (the
    #: engine's ``request_resize`` replaces a pending target; the array resizes once)
    resized_at: float = -1.0
    #: the instant of its last change of workers, and (workers, busy_until, since) before it
    instant: float = -1.0
    base: tuple[int, float, float] = (0, 0.0, 0.0)


@dataclass
class Result:
    makespan_s: float
    idle_worker_s: float
    trials_ended: int
    best_time_s: float
    best_trial: int
    resizes: int = 0
    decisions: int = 0
    log: list[str] = field(default_factory=list)
    #: where the accelerator-seconds went, and the makespan's lower bounds (_elastic_account)
    account: Account = field(default_factory=Account)
    bounds: dict[str, float] = field(default_factory=dict)


def load_models(path: Path, mix: dict[str, float]) -> tuple[dict[str, Model], AllReduceCost]:
    data = json.loads(path.read_text())
    cost = AllReduceCost.from_dict(data["allreduce"])
    models = {}
    for i, t in enumerate(data["tasks"]):
        if t["task"] not in mix:
            continue
        ms = [
            Measurement(int(s), int(s) * t["batch_size"] / step, 0, step)
            for s, step in t["sizes"].items()
        ]
        size, _ = choose_size(ms, 1e18)
        models[t["task"]] = Model(
            t["task"], t["batch_size"], t["gradient_bytes_per_member"], ms, size, 0.1 * i
        )
    missing = sorted(set(mix) - set(models))
    if missing:
        raise SystemExit(f"{path} has no profile for {missing}")
    return models, cost


class Sim:
    """One arm of the simulation; ``elastic=False`` gives every array one worker."""

    def __init__(
        self,
        trials: list[Trial],
        models: dict[str, Model],
        cost: AllReduceCost,
        *,
        workers: int,
        elastic: bool,
        steps_per_epoch: int,
        max_epochs: int,
        eta: int,
        noise: float,
        seed: int,
        allocator: Allocator,
        queue_seen: bool = True,
        bounded_queue: bool = True,
        knows_pruner: bool = True,
    ) -> None:
        self.models, self.cost, self.total = models, cost, workers
        self.elastic, self.spe, self.max_epochs, self.eta = (
            elastic,
            steps_per_epoch,
            max_epochs,
            eta,
        )
        self.noise, self.seed = noise, seed
        self.alloc = allocator
        #: whether the allocator is told the arrays the queued trials would form (as
        #: ``hfsweep run`` tells it, ``Packer.queued_arrays``); False: as before
        self.queue_seen = queue_seen
        #: whether the queue's count is ``Packer.queued_arrays``'s bounded estimate (issue 19's
        #: fix of its overcount while few trials are asked), or the plain mix's, as before
        self.bounded_queue = bounded_queue
        #: the searcher's trials not asked yet, in order; the engine's packer asks them one at
        #: a time into its pools (one per model) and forms arrays from full pools
        self.stream: deque[Trial] = deque(trials)
        self.packer: Packer[Trial] = Packer(
            ask=self.ask,
            size=lambda model, trial: self.models[model].size,
            may_ask=lambda: bool(self.stream),
            budget=len(trials),
        )
        self.trials = trials
        self.arrays: dict[str, Array] = {}
        self.heap: list[tuple[float, int, str, int]] = []
        self.now = 0.0
        self.seq = 0
        #: ASHA's rung model (rungs at 1, eta, eta**2, ... below the budget): the one source of
        #: the rungs ASHA stops members at, each array's horizon and, where the allocator is
        #: given it, its expected end, as ``hfsweep run``'s policy reads one rung model
        rungs: list[float] = []
        r = 1
        while r < max_epochs:
            rungs.append(float(r))
            r *= eta
        self.model = RungSurvival((tuple(rungs),), float(eta), float(max_epochs))
        #: the values recorded at each rung (in epochs) of the model
        self.rungs: dict[int, list[float]] = {int(r): [] for r in self.model.rungs}
        #: the end estimate that knows ASHA's rungs, as ``hfsweep run`` gives the allocator
        #: (None: the allocator is not given it, as before)
        self.survival = self.model if knows_pruner else None
        self.idle_s = 0.0
        self.account = Account()
        self.resizes = 0
        self.decisions = 0
        self.profiles: dict[tuple[str, int], ScalingProfile] = {}

    # --- the arrays' progress -------------------------------------------------------------
    def profile(self, model: str, members: int) -> ScalingProfile:
        key = (model, members)
        if key not in self.profiles:
            m = self.models[model]
            self.profiles[key] = model_scaling(
                model,
                step_s=m.step_s(members),
                members=members,
                batch_size=m.batch,
                gradient_bytes=m.grad_bytes * members,
                allreduce=self.cost,
                max_workers=self.total,
            )
        return self.profiles[key]

    def advance(self, a: Array) -> None:
        start = max(a.last, a.busy_until)
        if a.workers > 0 and self.now > start:
            a.steps_left = max(0.0, a.steps_left - (self.now - start) * a.rate)
        a.last = self.now

    def schedule(self, a: Array) -> None:
        a.version += 1
        if a.workers == 0:
            return
        m = self.models[a.model]
        p = self.profile(a.model, len(a.members))
        a.rate = p.rate(a.workers) / (len(a.members) * m.batch)
        start = max(self.now, a.busy_until)
        self.seq += 1
        heapq.heappush(self.heap, (start + a.steps_left / a.rate, self.seq, a.name, a.version))

    def set_workers(self, a: Array, k: int, cost_s: float) -> None:
        self.advance(a)
        if a.instant != self.now:  # the first change at this instant: what it changes from
            a.instant, a.base = self.now, (a.workers, a.busy_until, a.since)
        if a.workers > 0 and k != a.workers and a.resized_at != self.now:
            self.resizes += 1
            self.account.resizes[self.phase()] += 1
            a.resizes, a.paused_s = a.resizes + 1, a.paused_s + cost_s
            a.busy_until = max(a.busy_until, self.now) + cost_s
            a.resized_at = self.now
        elif a.resized_at == self.now and k == a.base[0]:
            # asked back to the workers it had before this instant: the engine's latest request
            # replaces the pending one, and the trainer drops a request for the workers it has
            self.resizes -= 1
            self.account.resizes[self.phase()] -= 1
            a.resizes, a.paused_s = a.resizes - 1, a.paused_s - cost_s
            a.busy_until, a.resized_at = a.base[1], -1.0
            a.workers, a.since = k, a.base[2]
            self.schedule(a)
            return
        a.workers, a.since = k, self.now
        self.schedule(a)

    def ask(self, array: str) -> list[tuple[str, Trial]] | None:
        """The packer asks the searcher for one trial: the next of the stream."""
        if not self.stream:
            return None
        t = self.stream.popleft()
        return [(t.model, t)]

    @property
    def waiting(self) -> bool:
        """Whether trials wait for an array: not asked yet, or in the packer's pools."""
        return bool(self.stream) or len(self.packer.pools) > 0

    def new_array(self, workers: int | None) -> Array | None:
        """A new array as ``hfsweep run``'s engine forms it, both arms: the packer asks trials
        until a model's pool holds its chosen size and takes that pool's (the fullest pool's
        once no trial is left to ask). On ``workers``; ``None`` (elastic): formed, and a pool
        of waiting trials to the allocator until a plan starts it."""
        started = self.packer.next_array()
        if started is None:
            return None
        model, members = started
        a = Array(f"a{self.seq}", model, members, steps_left=self.spe, last=self.now)
        a.formed = self.now
        self.seq += 1
        self.arrays[a.name] = a
        if workers is None:
            a.begun = False
        else:
            self.set_workers(a, workers, 0.0)
        return a

    def unstarted(self) -> bool:
        """Whether some trial has not started: waiting, or in a formed array not yet begun."""
        return self.waiting or any(not a.begun for a in self.arrays.values())

    def phase(self) -> str:
        """``queue`` while some trial has not started, then ``tail``."""
        return "queue" if self.unstarted() else "tail"

    def account_until(self, t: float) -> None:
        """Book the accelerator-seconds from ``now`` to ``t`` (nothing changes in between: every
        array's workers, pause and rate are set at events) by kind and phase."""
        dt = t - self.now
        if dt <= 0:
            return
        phase, acc = self.phase(), self.account
        acc.add(phase, "idle", self.free() * dt)
        for a in self.arrays.values():
            if a.workers == 0:
                continue
            pause = min(max(a.busy_until - self.now, 0.0), dt)
            acc.add(phase, "resize", a.workers * pause)
            steps = (dt - pause) * a.rate
            one = steps * self.models[a.model].step_s(len(a.members))
            acc.add(phase, "useful", one)
            acc.add(phase, "parallel", max(0.0, a.workers * (dt - pause) - one))  # 0 at k=1
            acc.member_steps[a.model] = acc.member_steps.get(a.model, 0.0) + steps * len(a.members)

    def fastest_step_s(self, model: str) -> float:
        """The shortest step a trial of ``model`` can take: alone in its array, on the worker
        count with the highest modelled rate (its critical path's step)."""
        p = self.profile(model, 1)
        return self.models[model].batch / max(p.points.values())

    def queue_ended(self) -> None:
        """The last trial started: note when, and the longest remaining critical path then."""
        acc = self.account
        acc.queue_end_s = self.now
        left = [
            (self.max_epochs - t.epoch) * self.spe * self.fastest_step_s(a.model)
            for a in self.arrays.values()
            for t in a.members
        ]
        acc.tail_path_s = max(left, default=0.0)

    # --- ASHA at an evaluation boundary -------------------------------------------------------
    def metric(self, t: Trial) -> float:
        # the same noise for a trial and epoch in both arms: only the order of arrival differs
        rng = random.Random(self.seed * 1_000_003 + t.number * 1009 + t.epoch)
        return t.quality + rng.gauss(0.0, self.noise / math.sqrt(t.epoch))

    def boundary(self, a: Array) -> bool:
        """One epoch of every member done: rungs, completions, refills. True if members left."""
        left = []
        for t in a.members:
            t.epoch += 1
            if t.epoch >= self.max_epochs:
                t.ended, t.completed = self.now, True
                continue
            if t.epoch in self.rungs:
                seen = self.rungs[t.epoch]
                value = self.metric(t)
                cut = (
                    sorted(seen)[int(len(seen) * (1 - 1 / self.eta))]
                    if len(seen) >= self.eta
                    else None
                )
                seen.append(value)
                if cut is not None and value < cut:
                    t.ended = self.now
                    continue
            left.append(t)
        changed = len(left) != len(a.members)
        if changed:
            left += self.packer.refill(a.model, self.models[a.model].size - len(left))
        a.members = left
        return changed

    # --- the two policies ---------------------------------------------------------------------
    def free(self) -> int:
        return self.total - sum(a.workers for a in self.arrays.values())

    def fill_static(self) -> None:
        while self.free() > 0 and self.new_array(1) is not None:
            pass

    def remaining_s(self, a: Array) -> float:
        m = self.models[a.model]
        epochs = max(self.max_epochs - t.epoch for t in a.members)
        return (epochs * self.spe - (self.spe - a.steps_left)) * m.step_s(len(a.members))

    def horizon_s(self, a: Array) -> float:
        """Seconds on one worker until the first of ``a``'s members reaches its next rung (where
        ASHA may stop it) or the budget."""
        nxt = min(
            min([r for r in self.model.rungs if r > t.epoch], default=self.max_epochs) - t.epoch
            for t in a.members
        )
        m = self.models[a.model]
        return ((nxt - 1) * self.spe + a.steps_left) * m.step_s(len(a.members))

    def expected(self, a: Array) -> tuple[float | None, float | None]:
        """``(expected_s, expected_member_s)`` of ``a`` on one worker from the rung model
        (``hfsweep.elastic.survival``), or ``(None, None)`` without it: each member's progress
        in epochs (its full epochs and the array's current one's share) and one epoch's seconds
        on one worker at the array's size."""
        if self.survival is None:
            return None, None
        frac = (self.spe - a.steps_left) / self.spe
        dones = [t.epoch + frac for t in a.members]
        unit = self.spe * self.models[a.model].step_s(len(a.members))
        member = sum(self.survival.member_units(d) for d in dones)
        return self.survival.array_units(dones) * unit, member * unit

    def allocate(self, event: str) -> None:
        """Elastic, as ``hfsweep run`` does it: a plan at ``event``; then, while no formed
        array waits for workers and the workers give one more array its minimum, the engine
        forms the next array in the packer's order (:meth:`form`) and the allocator decides
        whether it starts (``array started``); while it waits, no other array is formed."""
        self.plan(event)
        slots = self.total // self.alloc.min_workers
        while self.waiting and len(self.arrays) < slots:
            if any(not a.begun for a in self.arrays.values()):
                break  # a formed array waits for workers: the engine forms no other
            if self.new_array(None) is None:
                break
            self.plan("array started")

    def plan(self, event: str) -> None:
        """One plan of the allocator, carried out: resizes at once, formed arrays started."""
        busy = self.free() == 0 and all(a.workers <= 1 for a in self.arrays.values())
        if busy and self.unstarted():
            return  # every worker trains a one-worker array and trials wait: nothing to change
        states = [
            ArrayState(
                a.name,
                a.model,
                len(a.members),
                self.remaining_s(a),
                self.profile(a.model, len(a.members)),
                a.workers,
                a.since,
                self.horizon_s(a),
                *self.expected(a),
                # resized at this instant: a later request at the same instant replaces it
                pending=a.resized_at == self.now,
            )
            for a in self.arrays.values()
            if a.begun
        ]
        pools = [  # formed arrays waiting for their first workers, the oldest first
            WaitingPool(
                a.model,
                1,
                len(a.members),
                self.remaining_s(a),
                self.profile(a.model, len(a.members)),
                name=a.name,
                since=a.formed,
                expected_member_s=self.expected(a)[1],
            )
            for a in self.arrays.values()
            if not a.begun
        ]
        queued = (
            self.packer.queued_arrays(len(self.stream), bounded=self.bounded_queue)
            if self.queue_seen
            else 0
        )
        plan = self.alloc.decide(
            states, pools, self.total, now=self.now, event=event, queued=queued
        )
        self.decisions += 1
        after = plan.workers()
        running = [a for a in self.arrays.values() if a.begun]
        for a in running:  # shrink first, so that grows and starts find the workers
            if after.get(a.name, a.workers) < a.workers:
                self.set_workers(a, after[a.name], self.alloc.resize_cost_s)
        for a in running:
            if after.get(a.name, a.workers) > a.workers:
                self.set_workers(a, after[a.name], self.alloc.resize_cost_s)
        for a in list(self.arrays.values()):
            if not a.begun and after.get(a.name, 0) > 0:
                a.begun = True
                self.set_workers(a, after[a.name], 0.0)
        assert self.free() >= 0, "the allocator never hands out more workers than exist"

    def run(self) -> Result:
        if self.elastic:
            self.allocate("pool filled")
            timer = self.alloc.resize_every_s
            self.seq += 1
            heapq.heappush(self.heap, (timer, self.seq, "", 0))
        else:
            self.fill_static()
        queued = self.unstarted()
        if not queued:
            self.queue_ended()
        while self.heap:
            t, _, name, version = heapq.heappop(self.heap)
            if not self.arrays and not self.waiting:
                break  # only the elastic timer is left
            self.idle_s += self.free() * (t - self.now)
            self.account_until(t)
            self.now = t
            self.event(name, version)
            if queued and not self.unstarted():
                queued = False
                self.queue_ended()
        done = [t for t in self.trials if t.ended is not None]
        assert len(done) == len(self.trials), "every trial ends"
        complete = [t for t in self.trials if t.completed]
        best = max(complete, key=lambda t: t.quality)
        assert best.ended is not None
        spent = self.account.total()
        assert abs(spent - self.total * self.now) <= 1e-6 * max(1.0, spent), (spent, self.now)
        path = max(self.max_epochs * self.spe * self.fastest_step_s(t.model) for t in complete)
        best_member = {
            name: min(m.step_s(x.size) / x.size for x in m.measurements)
            for name, m in self.models.items()
        }
        return Result(
            self.now,
            self.idle_s,
            len(done),
            best.ended,
            best.number,
            self.resizes,
            self.decisions,
            account=self.account,
            bounds=bounds(
                self.account, workers=self.total, best_member_step_s=best_member, path_s=path
            ),
        )

    def event(self, name: str, version: int) -> None:
        """The elastic timer (``name`` empty), or an array's evaluation boundary."""
        if name == "":  # the elastic timer: a cooldown may have passed
            if self.arrays:
                self.allocate("timer")
                self.seq += 1
                heapq.heappush(self.heap, (self.now + self.alloc.resize_every_s, self.seq, "", 0))
            return
        a = self.arrays.get(name)
        if a is None or version != a.version:
            return
        a.steps_left, a.last = 0.0, self.now
        changed = self.boundary(a)
        a.steps_left = float(self.spe)
        if not a.members:
            del self.arrays[name]
            self.account.last_array = {"resizes": a.resizes, "paused_s": a.paused_s}
            event = "array ended"
        else:
            self.schedule(a)
            event = "members stopped" if changed else ""
        if self.elastic:
            if event:
                self.allocate(event)
        else:
            self.fill_static()


def make_trials(n: int, mix: dict[str, float], models: dict[str, Model], seed: int) -> list[Trial]:
    rng = random.Random(seed)
    names = sorted(mix)
    weights = [mix[k] for k in names]
    out = []
    for i in range(n):
        model = rng.choices(names, weights)[0]
        out.append(Trial(i, model, rng.gauss(models[model].mean_quality, 1.0)))
    return out
