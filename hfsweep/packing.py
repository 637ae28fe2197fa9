"""Packing trials into arrays: a pool of waiting trials per compatibility key.

Trials whose configs differ only in per-member values (learning rate, momentum, dropout, seed,
budget...) share a compatibility key and may train in one array; every other difference
(widths, batch size, data) needs another array. The engine asks the searcher for trials, puts
each in its key's pool, starts an array once a pool holds enough trials for its array size,
and refills an array's freed slots from the same pool.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Pending", "Pools"]


@dataclass(frozen=True)
class Pending:
    """A trial asked from the searcher, waiting for a slot: its Optuna number and config."""

    number: int
    config: Mapping[str, Any]


class Pools:
    """Waiting trials by compatibility key, first come first served within a key.

    Keys keep the order in which they first appeared, so ties between pools go to the key
    seen first.
    """

    def __init__(self) -> None:
        self._pools: OrderedDict[str, list[Pending]] = OrderedDict()

    def add(self, key: str, trial: Pending) -> None:
        """Put ``trial`` at the end of ``key``'s pool."""
        self._pools.setdefault(key, []).append(trial)

    def take(self, key: str, n: int) -> list[Pending]:
        """Remove and return up to ``n`` trials of ``key``'s pool, oldest first."""
        pool = self._pools.get(key, [])
        taken, self._pools[key] = pool[:n], pool[n:]
        return taken

    def size(self, key: str) -> int:
        """How many trials wait in ``key``'s pool."""
        return len(self._pools.get(key, []))

    def __len__(self) -> int:
        return sum(len(p) for p in self._pools.values())

    def __iter__(self) -> Iterator[Pending]:
        for pool in self._pools.values():
            yield from pool

    def full(self, capacity: Mapping[str, int]) -> str | None:
        """The first key whose pool holds at least its array size ``capacity[key]`` (keys
        without a size yet are skipped)."""
        for key, pool in self._pools.items():
            if pool and key in capacity and len(pool) >= capacity[key]:
                return key
        return None

    def pick(self, capacity: Mapping[str, int]) -> str | None:
        """The key to start an array for: a full pool if there is one, else the fullest
        (relative to its array size); ``None`` when every pool of a sized key is empty."""
        full = self.full(capacity)
        if full is not None:
            return full
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
