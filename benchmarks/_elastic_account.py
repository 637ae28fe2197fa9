"""Where the accelerator-time of a simulated sweep goes (``elastic_sim.py``), and lower bounds on
its makespan under the simulator's own assumptions.

Every accelerator-second of an arm (accelerators x makespan) is one of:

- **useful**: training, counted as the seconds the same steps take the array on *one* worker
  (its one-worker step at its current size, ``step_s(members)``): the work a perfectly
  efficient cluster would still have to do;
- **parallel**: the rest of the accelerator-seconds spent training on k > 1 workers
  (``k / speedup(k) - 1`` per useful second: the modelled all-reduce and the split batch);
- **resize**: accelerator-seconds an array holds while it pauses for a resize (checkpoint and
  restart, ``resize_cost_s`` each);
- **idle**: accelerators without an array.

Each is split by phase: the **queue** (some trial has not started yet) and the **tail** (every
trial has started; ASHA's survivors finish). The bounds use only the simulator's workload and
cost model, never the allocator's choices:

- ``work``: an arm's useful seconds over the accelerators (every accelerator busy with
  one-worker arrays for the whole sweep, no resize, no idle): no schedule of *that arm's*
  trained steps is shorter. ``packed``: the same steps, every member at its model's cheapest
  per-member step (the array size with the lowest step time per member), over the
  accelerators: a bound for any packing of those steps.
- ``path``: the longest critical path of one trial that trains the full budget: its steps one
  after another at the fastest step the model allows (one member, at the worker count with the
  highest modelled rate).
- ``tail``: when the arm's last trial started, plus the larger of its tail's useful seconds
  over the accelerators and the longest remaining critical path of a trial alive then; the
  best a perfect tail could do after that arm's queue phase.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

PHASES = ("queue", "tail")
#: the arms of every run, side by side: one array per accelerator; the elastic allocator as it
#: was before issue 19's end estimate (the queue's plain count, each array's remaining budget);
#: and the allocator given the bounded queue count and the end estimate that knows ASHA's
#: rungs, as ``hfsweep run`` gives them
ARMS = ("static", "elastic-before", "elastic")
KINDS = ("useful", "parallel", "resize", "idle")


@dataclass
class Account:
    """Accelerator-seconds by kind and phase, member-steps by model, and the tail's facts."""

    seconds: dict[str, dict[str, float]] = field(
        default_factory=lambda: {p: dict.fromkeys(KINDS, 0.0) for p in PHASES}
    )
    #: member-steps trained, by model
    member_steps: dict[str, float] = field(default_factory=dict)
    #: resizes made in each phase
    resizes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PHASES, 0))
    #: when the last trial started (the queue phase's end), and the tail's critical path then
    queue_end_s: float = 0.0
    tail_path_s: float = 0.0
    #: the array that ended last (on the sweep's critical path): its resizes and the seconds
    #: they paused it
    last_array: dict[str, float] = field(default_factory=dict)

    def add(self, phase: str, kind: str, seconds: float) -> None:
        self.seconds[phase][kind] += seconds

    def total(self, kind: str | None = None, phase: str | None = None) -> float:
        """Accelerator-seconds of ``kind`` (all kinds: None) in ``phase`` (both: None)."""
        phases = PHASES if phase is None else (phase,)
        kinds = KINDS if kind is None else (kind,)
        return sum(self.seconds[p][k] for p in phases for k in kinds)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def bounds(
    account: Account,
    *,
    workers: int,
    best_member_step_s: Mapping[str, float],
    path_s: float,
) -> dict[str, float]:
    """The makespan bounds of one arm (see the module docstring), in seconds."""
    packed = sum(n * best_member_step_s[m] for m, n in account.member_steps.items())
    work = account.total("useful") / workers
    tail = account.queue_end_s + max(account.total("useful", "tail") / workers, account.tail_path_s)
    return {
        "work": work,
        "packed": packed / workers,
        "path": path_s,
        "tail": tail,
        "best": max(work, path_s),
    }


def account_rows(rows: Sequence[Mapping[str, Any]], workers: int) -> list[list[str]]:
    """Table cells: per arm at ``workers`` accelerators, the medians over seeds of the makespan,
    each kind's accelerator-hours (both phases, the tail's in brackets), when the last trial
    started, and the bounds."""
    out = []
    for arm in ARMS:
        sel = [r for r in rows if r["workers"] == workers and r["arm"] == arm]
        if not sel:
            continue
        accounts = [r["account"]["seconds"] for r in sel]
        cells = [str(workers), arm, _hours([r["makespan_s"] for r in sel], 3)]
        for kind in KINDS:
            both = _hours([sum(a[p][kind] for p in PHASES) for a in accounts], 2)
            cells.append(f"{both} ({_hours([a['tail'][kind] for a in accounts], 2)})")
        cells.append(_hours([r["account"]["queue_end_s"] for r in sel], 3))
        cells += [
            _hours([r["bounds"][b] for r in sel], 3) for b in ("work", "packed", "path", "tail")
        ]
        out.append(cells)
    return out


def phase_rows(rows: Sequence[Mapping[str, Any]], workers: int) -> list[list[str]]:
    """Table cells: per elastic arm at ``workers`` accelerators, the medians over seeds of where
    its makespan went by phase: when the last trial started (static's in brackets), the
    resizes and their accelerator-seconds in the queue and in the tail, the tail's idle and
    data-parallel accelerator-seconds, the tail's length, and the resizes and pause seconds of
    the array that ended last (the sweep's critical path)."""
    static = [r for r in rows if r["workers"] == workers and r["arm"] == "static"]
    out = []
    for arm in ARMS[1:]:
        sel = [r for r in rows if r["workers"] == workers and r["arm"] == arm]
        if not sel:
            continue

        def med(values: Sequence[float], digits: int = 0) -> str:
            return f"{statistics.median(values):,.{digits}f}"

        acc = [r["account"] for r in sel]
        out.append(
            [
                str(workers),
                arm,
                f"{med([a['queue_end_s'] for a in acc])} "
                f"({med([r['account']['queue_end_s'] for r in static])})",
                med([a["resizes"]["queue"] for a in acc]),
                med([a["seconds"]["queue"]["resize"] for a in acc]),
                med([a["resizes"]["tail"] for a in acc]),
                med([a["seconds"]["tail"]["resize"] for a in acc]),
                med([a["seconds"]["tail"]["idle"] for a in acc]),
                med([a["seconds"]["tail"]["parallel"] for a in acc]),
                med([r["makespan_s"] - r["account"]["queue_end_s"] for r in sel]),
                med([a.get("last_array", {}).get("resizes", 0) for a in acc]),
                med([a.get("last_array", {}).get("paused_s", 0.0) for a in acc]),
            ]
        )
    return out


PHASE_COLUMNS = [
    "accelerators",
    "arm",
    "last trial started s (static)",
    "queue resizes",
    "queue resize acc-s",
    "tail resizes",
    "tail resize acc-s",
    "tail idle acc-s",
    "tail parallel acc-s",
    "tail s",
    "last array's resizes",
    "last array's pauses s",
]


def _hours(seconds: Sequence[float], digits: int) -> str:
    """The median of ``seconds`` in hours."""
    return f"{max(0.0, statistics.median(seconds)) / 3600:.{digits}f}"


ACCOUNT_COLUMNS = [
    "accelerators",
    "arm",
    "makespan h",
    "useful acc-h (tail)",
    "parallel acc-h (tail)",
    "resize acc-h (tail)",
    "idle acc-h (tail)",
    "last trial started h",
    "bound: work h",
    "bound: packed h",
    "bound: path h",
    "bound: tail h",
]
