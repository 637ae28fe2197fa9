"""The packer: pools of compatible trials, array sizes per key, and refill of freed slots.

Trials whose configs differ only in per-member values (learning rate, momentum, dropout, seed,
budget...) share a compatibility key and may train in one array; every other difference
(widths, batch size, data) needs another array. The packer asks a front door's searcher for
trials one at a time, puts each in its key's pool, sizes a key the first time it is met, hands
out a pool's trials as a new array once the pool holds the key's array size, and refills an
array's freed slots from the same pool.

Every front door drives this one packer: the sweep engine behind ``hs.sweep`` and ``hfsweep
run`` (items are :class:`Pending` trials of an Optuna study), and the Ray Tune plugin through
:class:`~hfsweep.core.sweep.Sweep` (items are member ids). It knows neither Optuna nor
Tune: a front door gives it three callables, one that asks one trial (:class:`Ask`), one that sizes a new key (:class:`SizeOf`), and one that says
whether more trials may be asked (the budget, a time limit, a searcher that is finished).
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

__all__ = [
    "NON_LEARNING",
    "REFILL_ASKS",
    "Ask",
    "Packer",
    "Pending",
    "Pools",
    "SizeOf",
    "learning_cap",
    "limit_for_learning",
]

#: most trials one refill asks for while looking for one of the array's key: a searcher whose
#: trials fall in other keys would otherwise be asked without end for one slot
REFILL_ASKS = 3
#: Optuna searchers whose draws do not depend on earlier results (``fusion.size: auto`` takes
#: every trial of the budget in one array if it fits)
NON_LEARNING = ("random", "grid", "qmc")

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)
T_contra = TypeVar("T_contra", contravariant=True)


@dataclass(frozen=True)
class Pending:
    """A trial asked from the searcher, waiting for a slot: its Optuna number and config."""

    number: int
    config: Mapping[str, Any]


class Pools(Generic[T]):
    """Waiting trials by compatibility key, first come first served within a key.

    Keys keep the order in which they first appeared, so ties between pools go to the key
    seen first.
    """

    def __init__(self, pools: Mapping[str, Sequence[T]] | None = None) -> None:
        self._pools: OrderedDict[str, list[T]] = OrderedDict(
            (k, list(v)) for k, v in (pools or {}).items()
        )

    def add(self, key: str, trial: T, *, first: bool = False) -> None:
        """Put ``trial`` at the end of ``key``'s pool (at its head with ``first``)."""
        pool = self._pools.setdefault(key, [])
        if first:
            pool.insert(0, trial)
        else:
            pool.append(trial)

    def take(self, key: str, n: int) -> list[T]:
        """Remove and return up to ``n`` trials of ``key``'s pool, oldest first."""
        pool = self._pools.get(key, [])
        taken, self._pools[key] = pool[:n], pool[n:]
        return taken

    def size(self, key: str) -> int:
        """How many trials wait in ``key``'s pool."""
        return len(self._pools.get(key, []))

    def unsized(self, capacity: Mapping[str, int]) -> list[tuple[str, T]]:
        """Each key with trials waiting but no array size in ``capacity`` yet, with its
        oldest trial (left in the pool), in the order the keys first appeared."""
        return [(k, pool[0]) for k, pool in self._pools.items() if pool and k not in capacity]

    def as_dict(self) -> dict[str, list[T]]:
        """Every pool as a plain list per key (a copy, to save and load back)."""
        return {k: list(v) for k, v in self._pools.items()}

    def __len__(self) -> int:
        return sum(len(p) for p in self._pools.values())

    def __iter__(self) -> Iterator[T]:
        for pool in self._pools.values():
            yield from pool

    def full(self, capacity: Mapping[str, int]) -> str | None:
        """The first key whose pool holds at least its array size ``capacity[key]`` (keys
        without a size yet are skipped)."""
        for key, pool in self._pools.items():
            if pool and key in capacity and len(pool) >= capacity[key]:
                return key
        return None

    def fullest(self, capacity: Mapping[str, int]) -> str | None:
        """The key whose pool is fullest relative to its array size (keys without a size
        are skipped); ``None`` when every pool of a sized key is empty."""
        best: str | None = None
        for key, pool in self._pools.items():
            if (
                pool
                and key in capacity
                and (
                    best is None
                    or len(pool) / capacity[key] > len(self._pools[best]) / capacity[best]
                )
            ):
                best = key
        return best

    def pick(self, capacity: Mapping[str, int]) -> str | None:
        """The key to start an array for: a full pool if there is one, else the fullest
        (relative to its array size); ``None`` when every pool of a sized key is empty."""
        full = self.full(capacity)
        return full if full is not None else self.fullest(capacity)


class Ask(Protocol[T_co]):
    """Asks the searcher for one trial, on behalf of ``array`` (the id of the new array, or of
    the array whose slot is refilled; a front door may name the trial after it).

    Returns ``None`` when no trial came (the searcher has none now, or none ever again): the
    packer then stops asking for the moment. Otherwise the trial was asked (and counted against
    the budget by the front door) and the answer lists ``(compatibility key, item)`` to pool:
    one entry, or none when the front door rejected the trial's config (it ended the trial).
    """

    def __call__(self, array: str, /) -> Sequence[tuple[str, T_co]] | None: ...


class SizeOf(Protocol[T_contra]):
    """The array size to ask for ``key``, whose first trial is ``item`` (``fusion.size``, or
    the profiler's choice for its config). The packer keeps it between 1 and the budget."""

    def __call__(self, key: str, item: T_contra, /) -> int: ...


def _always() -> bool:
    return True


class Packer(Generic[T]):
    """Pools, array sizes and refill for one sweep (see the module docstring).

    ``ask`` asks one trial, ``size`` sizes a new key, ``may_ask`` says whether another trial
    may be asked now; ``budget`` (how many trials the sweep asks in all) caps every array
    size; ``on_sized(key, size)`` hears of each new size (a front door may save it).
    """

    def __init__(
        self,
        *,
        ask: Ask[T],
        size: SizeOf[T],
        may_ask: Callable[[], bool],
        budget: int,
        on_sized: Callable[[str, int], None] | None = None,
        refill_asks: int = REFILL_ASKS,
    ) -> None:
        self._ask = ask
        self._size_of = size
        self._may_ask = may_ask
        self._on_sized = on_sized
        self.budget = budget
        self.refill_asks = refill_asks
        self.pools: Pools[T] = Pools()
        #: the array size of every key sized so far
        self.sizes: dict[str, int] = {}
        #: trials asked so far per key (the searcher's mix of keys, for :meth:`queued_arrays`)
        self.asked: Counter[str] = Counter()

    # ------------------------------------------------------------------ pooling
    def add(self, key: str, item: T, *, size_now: bool) -> None:
        """Pool ``item`` under ``key``. A key met for the first time gets its array size now,
        or, with ``size_now=False`` (sizing may need a worker the asking array's own may be
        waiting for), when the next array starts (:meth:`fill`)."""
        if size_now:
            self.size(key, item)
        self.pools.add(key, item)

    def size(self, key: str, item: T) -> int:
        """The array size of ``key``, asked (with ``item``, its first trial) if it has none."""
        if key not in self.sizes:
            size = self._size_of(key, item)
            self.sizes[key] = max(1, min(int(size), self.budget))
            if self._on_sized is not None:
                self._on_sized(key, self.sizes[key])
        return self.sizes[key]

    def requeue(self, key: str, item: T) -> None:
        """A trial handed back before it trained (its array restarted or ended without it):
        it waits at the head of its key's pool, for a refill or the next array of the key."""
        self.pools.add(key, item, first=True)

    def ask(self, array: str, *, size_now: bool) -> Sequence[tuple[str, T]] | None:
        """Ask one trial for ``array`` and pool it; the pooled ``(key, item)``, or ``None``
        when no trial came (see :class:`Ask`)."""
        asked = self._ask(array)
        if asked is None:
            return None
        for key, item in asked:
            self.add(key, item, size_now=size_now)
            self.asked[key] += 1
        return asked

    def queued_arrays(self, unasked: int, *, bounded: bool = True) -> int:
        """About how many arrays the trials not yet in an array would form: each key's pooled
        trials in arrays of its size (a key not sized yet: one array each), and ``unasked``
        trials still to ask at the mix of keys asked so far, rounded up. The elastic allocator
        starts these before it grows an array.

        The unasked trials' arrays per trial is the mean, over the ``n`` trials asked of keys
        that have an array size, of ``1 / size`` of each one's key. A key asked but not sized
        yet (its first trial came in a refill of another key's array, ``size_now=False``; it
        is sized when the next array starts) is left out of the mix: its size is not known,
        and counting it as arrays of 1, as before, made one such trial among few asked say
        that most trials left are an array each (one trial of a key of arrays of 4 and one
        not sized yet: 63 arrays for 100 trials left by the mean, 33 one standard error below
        it, where the one key known says 25). With no
        trial of a sized key asked nothing is known of the mix and each unasked trial counts
        as an array: the most arrays they could form. (A resumed sweep fills :attr:`asked`
        from its study's trials before it plans, ``_Resume._recall_mix``.)

        While few are asked that mean is noisy, and the plans that read it come just after a
        pool filled, often the pool of a key of small arrays (each trial of a key of arrays of
        1 is a whole array): in the simulator's seed 2 at 512 accelerators, 100 trials asked,
        a quarter of them of arrays of 1, said 508 arrays where the true mix makes 430, more
        than the free workers, and the allocator kept workers for a queue that never needed
        them. With ``bounded`` (the default) the estimate is one standard error below that
        mean, so that it overcounts only about one time in six: the standard error is the
        trials' spread of ``1 / size`` (with one more trial at the largest spread a value in
        (0, 1] can have, 1/2, so that a handful of alike trials does not look certain) over
        ``sqrt(n)``; and never below the arrays of the largest size seen. With a single trial
        asked (``n = 1``) there is no spread to measure: the estimate is that trial's key's
        arrays, ``ceil(unasked / size)`` (one trial of a key of arrays of 4, 100 left: 25;
        of arrays of 1: one array per trial left, since nothing asked tells of larger arrays).
        ``bounded=False`` is the mean itself, the estimate before
        (``benchmarks/elastic_sim.py``'s elastic-before arm)."""
        pools = self.pools.as_dict()
        pooled = sum(math.ceil(len(v) / self.sizes.get(k, 1)) for k, v in pools.items() if v)
        if unasked <= 0:
            return pooled
        mix = {k: n for k, n in self.asked.items() if k in self.sizes and n > 0}
        seen = sum(mix.values())
        if not seen:
            return pooled + unasked
        per = {k: 1.0 / self.sizes[k] for k in mix}
        per_trial = sum(n * per[k] for k, n in mix.items()) / seen
        if bounded and seen >= 2:
            spread = sum(n * (per[k] - per_trial) ** 2 for k, n in mix.items()) + 0.25
            error = math.sqrt(spread / (seen + 1) / seen)
            per_trial = max(per_trial - error, min(per.values()))
        return pooled + math.ceil(unasked * per_trial - 1e-9)

    # ------------------------------------------------------------------ arrays
    def fill(self, array: str = "") -> None:
        """Size the keys met in refills, then ask trials until some pool holds a full array,
        or no more may be asked, or the searcher has none now."""
        for key, first in self.pools.unsized(self.sizes):
            self.size(key, first)
        while self.pools.full(self.sizes) is None and self._may_ask():
            if self.ask(array, size_now=True) is None:
                break

    def next_array(
        self, array: str = "", *, partial: Callable[[], bool] = _always
    ) -> tuple[str, list[T]] | None:
        """The key and trials of a new array (asked as needed, see :meth:`fill`): a full pool's
        first trials, else, if ``partial()`` allows an array smaller than its size, the fullest
        pool's. ``None`` when no array can start now."""
        self.fill(array)
        key = self.pools.full(self.sizes)
        if key is None and partial():
            key = self.pools.fullest(self.sizes)
        if key is None:
            return None
        return key, self.pools.take(key, self.sizes[key])

    def refill(self, key: str, slots: int = 1, array: str = "") -> list[T]:
        """Up to ``slots`` trials of ``key`` for an array's freed slots: waiting ones first,
        then new ones, asking at most :attr:`refill_asks` trials in all (those of other keys
        wait in their pools, sized when the next array starts)."""
        taken = self.pools.take(key, slots)
        asks = 0
        while len(taken) < slots and asks < self.refill_asks and self._may_ask():
            asks += 1
            asked = self.ask(array, size_now=False)
            if asked is None:
                break
            if any(k == key for k, _ in asked):
                taken += self.pools.take(key, slots - len(taken))
        return taken


def learning_cap(budget: int, learns: bool) -> int:
    """The largest array an automatic size may choose: half the budget's trials (rounded up)
    for searchers that learn from results, so that at least half of the trials are drawn after
    the first ones have reported; the whole budget for those that do not (random, grid, qmc).
    With one array of every trial a learning searcher never sees a result before it has drawn
    them all (64 MLP trials on digits with TPE and SuccessiveHalving, mean best over 5 seeds:
    0.9733 with one array of 64, 0.9816 with 32)."""
    return max(1, math.ceil(budget / 2)) if learns else budget


def limit_for_learning(
    size: int, reason: str, *, budget: int, learns: bool, searcher: str, unit: str
) -> tuple[int, str]:
    """``size`` (chosen for ``reason``) capped at :func:`learning_cap`, the reason telling
    why when a learning searcher capped it: ``searcher`` names the searcher, ``unit`` what the
    budget counts. Never more than the budget."""
    cap = learning_cap(budget, learns)
    if size <= cap or not learns:
        return min(size, budget), reason
    return cap, (
        f"{reason}; at most half the {budget} {unit} ({cap}) so that {searcher} draws the "
        f"later {unit} knowing the first results"
    )
