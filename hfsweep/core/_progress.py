"""The live progress line of a running sweep."""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from typing import TextIO

from .status import FINAL, Status

__all__ = ["Progress"]


class Progress:
    """Counts a sweep's trials and prints one status line.

    On a terminal the line is redrawn in place at most every ``interval`` seconds; elsewhere
    (a log file, CI) a line is printed every ``log_interval`` seconds and at every array start
    and end, so the output stays short. ``enabled=False`` prints nothing.
    """

    def __init__(
        self,
        total: int,
        metric: str,
        *,
        enabled: bool = True,
        stream: TextIO | None = None,
        interval: float = 0.5,
        log_interval: float = 15.0,
    ) -> None:
        self.total = total
        self.metric = metric
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval = interval if self.tty else log_interval
        self.start = time.perf_counter()
        self.states: dict[Status, int] = {s: 0 for s in Status if s in FINAL}
        self.array: str = ""
        #: the elastic allocator's last plan (Plan.status), or ""
        self.elastic: str = ""
        self.member_steps = 0
        self.best: tuple[float, int] | None = None
        self._last = -float("inf")
        self._width = 0

    def finished(self, status: Status | str) -> None:
        """A trial ended with ``status`` (a :class:`~hfsweep.core.status.Status`, or its value:
        ``completed``, ``stopped``, ``failed``)."""
        status = Status.parse(status)
        self.states[status] = self.states.get(status, 0) + 1
        self.update()

    def set_best(self, value: float, number: int) -> None:
        """The best value so far and its trial."""
        self.best = (value, number)

    def note(self, text: str) -> None:
        """Print ``text`` on its own line (above the status line on a terminal)."""
        if not self.enabled:
            return
        if self.tty and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self._width = 0
        self.stream.write(text + "\n")
        self.stream.flush()

    def stepped(self, member_steps: int) -> None:
        """``member_steps`` more member optimizer steps were trained."""
        self.member_steps += member_steps
        self.update()

    def array_started(self, description: str) -> None:
        """An array started (or resumed): ``description`` names it in the status line."""
        self.array = description
        self.update(force=True)

    def elastic_plan(self, status: str) -> None:
        """The elastic allocator decided: ``status`` (its plan's line) joins the status line."""
        self.elastic = status
        self.update(force=True)

    def line(self) -> str:
        elapsed = time.perf_counter() - self.start
        done = sum(self.states.values())
        parts = [
            f"[{_clock(elapsed)}] trials {done}/{self.total} done ({_counted(self.states)})",
        ]
        if self.array:
            parts.append(self.array)
        if self.elastic:
            parts.append(self.elastic)
        if elapsed > 0 and self.member_steps:
            parts.append(f"{self.member_steps / elapsed:,.0f} member-steps/s")
        if self.best is not None:
            parts.append(f"best {self.metric} {self.best[0]:.4g} (trial {self.best[1]})")
        return " | ".join(parts)

    def update(self, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if not force and now - self._last < self.interval:
            return
        self._last = now
        text = self.line()
        if self.tty:
            pad = max(self._width - len(text), 0)
            self.stream.write("\r" + text + " " * pad)
            self._width = len(text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        """Print the final line and end it."""
        if not self.enabled:
            return
        self.update(force=True)
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def _counted(counts: Mapping[Status, int]) -> str:
    """``"3 completed, 1 stopped, 0 failed"``: the ended trials by status, in the status words
    (the progress line's and the end-of-sweep summary's)."""
    return ", ".join(f"{counts.get(s, 0)} {s.value}" for s in Status if s.final)


def _clock(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"
