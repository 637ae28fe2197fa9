"""Fake time for tests of code that waits or measures: the same outcome on an idle machine and
on one under load."""

from __future__ import annotations

import itertools
from collections.abc import Callable


class TickingClock:
    """A clock whose every reading is ``tick`` seconds after the one before, however long the
    machine took in between."""

    def __init__(self, tick: float) -> None:
        self.tick = tick
        self.readings = 0

    def __call__(self) -> float:
        self.readings += 1
        return self.readings * self.tick


class FakeTime:
    """A clock (:meth:`now`) that only :meth:`sleep` moves, and actions scheduled with
    :meth:`at`, run by the sleep that reaches their time: what other processes do while the
    code under test waits, in a fixed order."""

    def __init__(self) -> None:
        self.time = 0.0
        self._due: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()

    def now(self) -> float:
        return self.time

    def sleep(self, seconds: float) -> None:
        self.time = round(self.time + seconds, 9)  # sleeps of 0.01 add up to whole numbers
        while self._due and self._due[0][0] <= self.time:
            _, _, action = self._due.pop(0)
            action()

    def at(self, when: float, action: Callable[[], None]) -> None:
        """Run ``action`` once the clock reaches ``when`` (seconds)."""
        self._due.append((round(when, 9), next(self._order), action))
        self._due.sort(key=lambda d: (d[0], d[1]))
