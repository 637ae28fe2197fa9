"""The MLPs' fused step with the stacked Linear's ``autograd.Function`` against features-first.

Issue 21: a run of fused Linears from the input used to be one Python ``autograd.Function`` per
layer (``hfsweep/fusion/_graph_linear.py``: its backward computes the weight's gradient in the
stacked weight's layout); it is now computed features-first with autograd's own products
(``hfsweep/fusion/_graph_features_first.py``). This times both in one process, in alternating
rounds, through both fused paths of ``fusion_throughput.py`` (``plain``: the array in a user's
loop with ``torch.optim.SGD``; ``trainer``: ``hs.ArrayTrainer``'s step), beside the ideal
bound (one model on a B-times-larger batch) and the hand-written ``baddbmm`` MLP: the old way's
arrays are built and traced with the rewrite switched off (``_graph_features_first._ENABLED``),
the new way's with it on, from the same models and batch. Per way: the median over rounds of
a round's mean step time (and the range), the operators one step dispatches, and fused / ideal
per path. Usage::

    OMP_NUM_THREADS=1 python benchmarks/linear_layout.py   # results/linear_layout_cpu_issue21_linear
    python benchmarks/linear_layout.py --models tiny_mlp --sizes 2 --rounds 1 --iters 2 --out /tmp/ll
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _results import RESULTS, write_results
from fusion_throughput import make_steps

from hfsweep._malloc import retain_freed_memory
from hfsweep.fusion import _graph_features_first
from hfsweep.testing._op_counts import OpCounter

#: the ways timed, in the order of each round: (label, way of make_steps, rewrite on)
_WAYS = (
    ("plain, Function", "fused", False),
    ("plain, features-first", "fused", True),
    ("trainer, Function", "trainer", False),
    ("trainer, features-first", "trainer", True),
    ("ideal", "ideal", True),
    ("hand", "hand", True),
)


def _steps(name: str, size: int, batch: int, warmup: int) -> dict[str, Callable[[], None]]:
    """Each way's step, its arrays traced with the rewrite off or on as :data:`_WAYS` says."""
    steps: dict[str, Callable[[], None]] = {}
    for enabled in (False, True):
        _graph_features_first._ENABLED = enabled
        try:
            made = make_steps(name, size, batch, torch.device("cpu"))
            for label, way, on in _WAYS:
                if on == enabled and way in made:
                    for _ in range(warmup):  # traced here, with this setting
                        made[way]()
                    steps[label] = made[way]
        finally:
            _graph_features_first._ENABLED = True
    return steps


def _ops(step: Callable[[], None]) -> int:
    with OpCounter() as c:
        step()
    return c.total


def measure(
    name: str, size: int, batch: int, rounds: int, iters: int, warmup: int
) -> dict[str, Any]:
    steps = _steps(name, size, batch, warmup)
    times: dict[str, list[float]] = {label: [] for label in steps}
    order = list(steps.items())
    for r in range(rounds):  # every other round backwards: no way always runs first
        for label, step in order if r % 2 == 0 else order[::-1]:
            start = time.perf_counter()
            for _ in range(iters):
                step()
            times[label].append((time.perf_counter() - start) / iters * 1e6)
    row: dict[str, Any] = {"model": name, "B": size, "batch": batch}
    for label, ts in times.items():
        row[f"{label} us"] = statistics.median(ts)
        row[f"{label} min us"] = min(ts)
        row[f"{label} range"] = [min(ts), max(ts)]
        row[f"{label} ops"] = _ops(steps[label])
    ideal = row["ideal us"]
    for path in ("plain", "trainer"):
        old, new = f"{path}, Function", f"{path}, features-first"
        # each round's new / old, the two timed next to each other: the machine's other work
        # moves both alike, so the paired ratios scatter less than either way's times
        paired = [n / o for n, o in zip(times[new], times[old], strict=True)]
        row[f"{path}: new / old paired"] = statistics.median(paired)
        row[f"{path}: new / old paired range"] = [min(paired), max(paired)]
        row[f"{path}: new / old time"] = row[f"{new} us"] / row[f"{old} us"]
        row[f"{path}: new / old min"] = row[f"{new} min us"] / row[f"{old} min us"]
        row[f"{path}: fused / ideal before"] = ideal / row[f"{old} us"]
        row[f"{path}: fused / ideal now"] = ideal / row[f"{new} us"]
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny_mlp", "medium_mlp"])
    parser.add_argument("--sizes", nargs="+", type=int, default=[8, 32])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--iters", type=int, default=100, help="steps per way per round")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    retain_freed_memory()  # the allocator setting the trainer runs with, for every way alike
    load_start = os.getloadavg()
    rows = []
    for name in args.models:
        for size in args.sizes:
            row = measure(name, size, args.batch, args.rounds, args.iters, args.warmup)
            rows.append(row)
            print(
                name,
                size,
                {k: round(v, 3) for k, v in row.items() if k.endswith(("paired", "now", "min"))},
                flush=True,
            )
    load_end = os.getloadavg()
    columns = [
        "model",
        "B",
        "path",
        "Function us (range)",
        "features-first us (range)",
        "new / old: paired (range)",
        "new / old: medians, minima",
        "ops old -> new",
        "ideal us",
        "fused / ideal before",
        "fused / ideal now",
        "hand / ideal",
    ]
    cells = []
    for r in rows:
        for path in ("plain", "trainer"):
            old, new = f"{path}, Function", f"{path}, features-first"

            def fmt(label: str, r: dict[str, Any] = r) -> str:
                lo, hi = r[f"{label} range"]
                return f"{r[f'{label} us']:.0f} ({lo:.0f}-{hi:.0f})"

            cells.append(
                [
                    r["model"],
                    str(r["B"]),
                    path,
                    fmt(old),
                    fmt(new),
                    "{:.2f} ({:.2f}-{:.2f})".format(
                        r[f"{path}: new / old paired"], *r[f"{path}: new / old paired range"]
                    ),
                    f"{r[f'{path}: new / old time']:.2f}, {r[f'{path}: new / old min']:.2f}",
                    f"{r[f'{old} ops']} -> {r[f'{new} ops']}",
                    f"{r['ideal us']:.0f}",
                    f"{r[f'{path}: fused / ideal before']:.2f}",
                    f"{r[f'{path}: fused / ideal now']:.2f}",
                    f"{r['ideal us'] / r['hand us']:.2f}" if "hand us" in r else "-",
                ]
            )
    notes = [
        f"- {args.rounds} rounds, each way {args.iters} steps a round in the order "
        + ", ".join(label for label, _, _ in _WAYS)
        + " (every other round backwards); us per step: median of the rounds' means (range); "
        "new / old paired: the median (range) over rounds of the round's new / old, timed next "
        "to each other; ops: operators one step "
        "dispatches (TorchDispatchMode); fused / ideal: ideal's median step time over the "
        "path's (samples per second the other way round)",
        f"- torch threads {torch.get_num_threads()}; load average at the start "
        f"{load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f}, at the end "
        f"{load_end[0]:.2f} {load_end[1]:.2f} {load_end[2]:.2f}",
    ]
    write_results(
        args.out or RESULTS / "linear_layout_cpu_issue21_linear",
        "linear_layout.py",
        argv,
        torch.device("cpu"),
        "The MLPs' fused step: the stacked Linear's autograd.Function against features-first",
        notes,
        columns,
        cells,
        rows,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
