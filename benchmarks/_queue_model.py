"""The queue model of ``offload_alternate.py``: ``AlternatingArrays.step`` replayed on one
clock, with the link as one first-in-first-out queue of fetches and the compute as one thread.

It replays what the engine and the schedules do, turn by turn (``hfsweep/offload/_engine.py``,
``_alternate.py``): an array's forward starts its first ``depth`` fetches before its first
turn and one more at each turn (the shard ``depth`` ahead), waits on its shard's fetch, then
computes it; its backward's first shard is kept from the forward, and each backward turn
starts the fetches down to ``depth`` shards ahead. A fetch starts once the link is free and
the compute thread has asked for it, and takes ``delay``; the compute waits on it, then takes
the shard's compute time. ``lockstep``: the arrays in turn, one shard each, every forward
before any backward. ``shifted``: array ``i + 1`` joins the turns at the end of the round in
which array ``i`` entered its backward. ``ready``: every step started at once, each turn to the
first array after the last one taken whose next shard is in, else to the one whose fetch
started first. Copies, losses and the scheduler's own time are left out: the model is what the
order of the turns and the fetches costs, not a prediction of overheads.

``urgent`` (the arrays, by index, whose fetches are urgent) makes the link a two-class queue
instead: when it is free it takes the urgent fetch asked for first among those asked for by
then, else the other fetch asked for first; a copy under way is not interrupted. It models a
priority on the link for the compute-bound array's fetches (the transfer-bound one's are
held back while the other's wait), so that the transfer-bound array's extra fetches fill the
link's gaps instead of queueing ahead of the other's next one. Without it (no urgent array)
the link is the first-in-first-out queue, as before. Under ``ready``, where no array's next
shard is in, the turn goes to the one whose fetch is in first (on the FIFO link: the one
started first, as the engine picks).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Collection, Generator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["queue_model"]


@dataclass
class _Fetch:
    """One fetch: the time it is asked for, its class, its number in the order asked, and
    the time it is in (``None`` until the link has started it)."""

    asked: float
    urgent: bool
    number: int
    done: float | None = None


@dataclass
class _Clock:
    """The compute thread's time and the link: the time it is next free, the fetches asked
    for and not yet started, how many were asked for; ``delay`` per fetch."""

    delay: float
    now: float = 0.0
    link: float = 0.0
    queue: list[_Fetch] = field(default_factory=list)
    asked: int = 0

    def fetch(self, urgent: bool) -> _Fetch:
        """Ask the link for a fetch now (it starts when the link takes it)."""
        self.asked += 1
        f = _Fetch(self.now, urgent, self.asked)
        self.queue.append(f)
        return f

    def _start_next(self, before: float | None = None) -> bool:
        """Start the fetch the link takes next, if it takes one before ``before`` (decisions
        at or after the compute thread's time may still meet fetches asked for later, so
        they wait); whether it started one."""
        if not self.queue:
            return False
        at = max(self.link, min(f.asked for f in self.queue))
        if before is not None and at >= before:
            return False
        taken = min(
            (f for f in self.queue if f.asked <= at), key=lambda f: (not f.urgent, f.number)
        )
        self.queue.remove(taken)
        taken.done = at + self.delay
        self.link = taken.done
        return True

    def settle(self) -> None:
        """Start every fetch the link takes before now (what ``ready`` may look at)."""
        while self._start_next(self.now):
            pass

    def wait(self, f: _Fetch) -> float:
        """The time ``f`` is in. The compute thread waits on it and asks for nothing
        meanwhile, so the link's choices until ``f`` starts are final."""
        while f.done is None:
            self._start_next()
        return f.done

    def first_in(self, fetches: Sequence[_Fetch]) -> _Fetch:
        """Of ``fetches`` (each waited on by an array), the one in first: the link runs
        until one of them starts (nothing else is asked for while the compute waits)."""
        while all(f.done is None for f in fetches):
            self._start_next()
        return min((f for f in fetches if f.done is not None), key=lambda f: f.done or 0.0)


@dataclass
class _Array:
    """One array's state in the model: the fetch its next shard waits on (the backward's
    first shard, kept from the forward, as one in at time 0), and whether it is in its
    backward."""

    waiting: _Fetch | None = None
    backward: bool = False
    steps: Generator[None, None, None] | None = field(default=None, repr=False)


def _steps(
    state: _Array,
    clock: _Clock,
    n: int,
    depth: int,
    urgent: bool,
    forward: float,
    backward: float,
) -> Generator[None, None, None]:
    """One array's step, yielding before each shard as the engine's steps do."""
    pending = [clock.fetch(urgent) for _ in range(min(depth, n))]
    following = len(pending)
    for _ in range(n):
        state.waiting = pending[0]
        yield
        state.waiting = None
        f = pending.pop(0)
        if following < n:
            pending.append(clock.fetch(urgent))
            following += 1
        clock.now = max(clock.now, clock.wait(f)) + forward
    state.backward = True
    kept = [_Fetch(0.0, urgent, 0, 0.0)]  # the last shard, kept from the forward: in
    following = n - 2
    for k in reversed(range(n)):
        state.waiting = kept[0] if kept else None
        yield
        state.waiting = None
        g = kept.pop(0)
        while following >= 0 and following >= k - depth:
            kept.append(clock.fetch(urgent))
            following -= 1
        clock.now = max(clock.now, clock.wait(g)) + backward


def queue_model(
    schedule: str,
    n: int,
    delay: float,
    computes: Sequence[tuple[float, float]],
    depths: Sequence[int] | None = None,
    urgent: Collection[int] = (),
) -> float:
    """The step's time (seconds) for arrays of ``n`` shards whose forward and backward shard
    computes are ``computes`` (one pair per array, in the schedule's order), each fetch
    ``delay``, each array fetching ``depths`` shards ahead (default one), under ``schedule``
    (``lockstep``, ``shifted`` or ``ready``), the fetches of the arrays ``urgent`` (indices
    into ``computes``) ahead of the others' on the link (none: one FIFO queue)."""
    clock = _Clock(delay)
    depths = list(depths) if depths is not None else [1] * len(computes)
    arrays = [_Array() for _ in computes]
    for i, (a, depth, (f, b)) in enumerate(zip(arrays, depths, computes, strict=True)):
        a.steps = _steps(a, clock, n, depth, i in urgent, f, b)
    running = list(range(len(arrays)))

    def advance(i: int) -> None:
        steps = arrays[i].steps
        assert steps is not None
        try:
            next(steps)
        except StopIteration:
            running.remove(i)

    if schedule == "lockstep":
        while running:
            all_back = all(arrays[i].backward for i in running)
            for i in list(running):
                if all_back or not arrays[i].backward:  # every forward before any backward
                    advance(i)
    elif schedule == "shifted":
        running[:] = [0]
        started = 1
        while running:
            for i in list(running):
                advance(i)
            while started < len(arrays) and arrays[started - 1].backward:
                running.append(started)
                started += 1
    elif schedule == "ready":
        for i in list(running):
            advance(i)
        last = -1
        while running:
            after = [i for i in running if i > last] + [i for i in running if i <= last]
            clock.settle()
            waiting = [(i, w) for i in after if (w := arrays[i].waiting) is not None]
            pick = next((i for i, w in waiting if w.done is not None and w.done <= clock.now), None)
            if pick is None and waiting:
                first = clock.first_in([w for _, w in waiting])
                pick = next(i for i, w in waiting if w is first)
            elif pick is None:
                pick = after[0]
            last = pick
            advance(pick)
    else:
        raise ValueError(f"schedule must be lockstep, shifted or ready, got {schedule!r}")
    return clock.now


def _replay(path: Path, n: int = 6) -> list[str]:
    """The queue model on the rows of an ``offload_alternate.py`` result of arrays of ``n``
    shards (6: the benchmark's default, what the committed results ran) (its delays and
    per-array forward and backward computes): per row the max model, the lockstep on the
    FIFO link, and ``ready`` at depths 1,1 and 3,1 with b's fetches urgent, as lines of
    text (each time in ms and over the lockstep's)."""
    lines = [
        "factor | max model | lockstep | ready, b urgent | ready 3,1, b urgent (ms, / lockstep)"
    ]
    for row in json.loads(path.read_text())["rows"]:
        delay = row["delay_ms"] / 1e3
        fa, fb = row["forward_a_ms"] / 1e3, row["forward_b_ms"] / 1e3
        ba = max(row["compute_a_ms"] / 1e3 - fa, 0.0)
        bb = max(row["compute_b_ms"] / 1e3 - fb, 0.0)
        per = [(fa / n, ba / n), (fb / n, bb / n)]
        lock = queue_model("lockstep", n, delay, per)
        ready = queue_model("ready", n, delay, per, urgent={1})
        deep = queue_model("ready", n, delay, per, (3, 1), urgent={1})
        lines.append(
            f"{row['factor']:g} | {row['max_model_ms']:.0f} | {lock * 1e3:.0f} | "
            f"{ready * 1e3:.0f} ({ready / lock:.3f}) | {deep * 1e3:.0f} ({deep / lock:.3f})"
        )
    return lines


if __name__ == "__main__":
    # python benchmarks/_queue_model.py benchmarks/results/offload_alternate_cpu.json
    print("\n".join(_replay(Path(sys.argv[1]))))
