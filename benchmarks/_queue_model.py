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
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass, field

__all__ = ["queue_model"]


@dataclass
class _Clock:
    """The compute thread's time, the time the link is next free, the fetches' count."""

    now: float = 0.0
    link: float = 0.0
    started: int = 0


@dataclass
class _Array:
    """One array's state in the model: the fetch its next shard waits on (its start number
    and the time it is in), and whether it is in its backward."""

    waiting: tuple[int, float] | None = None
    backward: bool = False
    steps: Generator[None, None, None] | None = field(default=None, repr=False)


def _fetch(clock: _Clock, delay: float) -> tuple[int, float]:
    start = max(clock.link, clock.now)
    clock.link = start + delay
    clock.started += 1
    return clock.started, clock.link


def _steps(
    state: _Array, clock: _Clock, n: int, depth: int, delay: float, forward: float, backward: float
) -> Generator[None, None, None]:
    """One array's step, yielding before each shard as the engine's steps do."""
    pending = [_fetch(clock, delay) for _ in range(min(depth, n))]
    following = len(pending)
    for _ in range(n):
        state.waiting = pending[0]
        yield
        state.waiting = None
        done = pending.pop(0)[1]
        if following < n:
            pending.append(_fetch(clock, delay))
            following += 1
        clock.now = max(clock.now, done) + forward
    state.backward = True
    pending = [(0, 0.0)]  # the last shard, kept from the forward
    following = n - 2
    for k in reversed(range(n)):
        state.waiting = pending[0] if pending else None
        yield
        state.waiting = None
        done = pending.pop(0)[1]
        while following >= 0 and following >= k - depth:
            pending.append(_fetch(clock, delay))
            following -= 1
        clock.now = max(clock.now, done) + backward


def queue_model(
    schedule: str,
    n: int,
    delay: float,
    computes: Sequence[tuple[float, float]],
    depths: Sequence[int] | None = None,
) -> float:
    """The step's time (seconds) for arrays of ``n`` shards whose forward and backward shard
    computes are ``computes`` (one pair per array, in the schedule's order), each fetch
    ``delay``, each array fetching ``depths`` shards ahead (default one), under ``schedule``
    (``lockstep``, ``shifted`` or ``ready``)."""
    clock = _Clock()
    depths = list(depths) if depths is not None else [1] * len(computes)
    arrays = [_Array() for _ in computes]
    for a, depth, (f, b) in zip(arrays, depths, computes, strict=True):
        a.steps = _steps(a, clock, n, depth, delay, f, b)
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
            waiting = [(i, w) for i in after if (w := arrays[i].waiting) is not None]
            pick = next((i for i, w in waiting if w[1] <= clock.now), None)
            if pick is None:
                pick = min(waiting, key=lambda iw: iw[1][0])[0] if waiting else after[0]
            last = pick
            advance(pick)
    else:
        raise ValueError(f"schedule must be lockstep, shifted or ready, got {schedule!r}")
    return clock.now
