"""Where a fused step's time goes against the ideal bound, operator class by operator class.

``fusion_throughput.py`` says how far a fused step is from one model on a B-times-larger batch;
this says where the difference is. For each model and B it profiles (``torch.profiler``, CPU)
a run of steps of each in-process way of ``fusion_throughput.make_steps``: ``ideal``, ``hand``
(the hand-written fused model, where there is one), ``fused`` (the plain path) and ``trainer``.
Every step dispatches the same operators in the same order, so each operator's self time is
taken as its *minimum* over the steps: a step that the machine's other work interrupted loses
its slow operators to the other steps, which makes the figures far steadier on a shared machine
than whole-step timings. Each operator falls in a class (:data:`CLASSES`: the products, the
convolutions, the activations, the loss, the optimizer update, layout copies, the Python code
of ``autograd.Function`` objects...); ``outside operators`` is the minimum step time less the
operators' sum: Python between them (the array's trace lookup, the traced graph's own Python,
the optimizers' bookkeeping) and the profiler's own cost per event, which every way pays per
operator it dispatches. Figures are microseconds per step under the profiler, so compare the
ways with each other, not with ``fusion_throughput.py``'s rates. Also counted per way: the minor
page faults of a step (unprofiled steps, ``getrusage``), a step's memory the system had to map
in again. Every way runs with the allocator setting hfsweep's trainer trains with
(``hfsweep._malloc.retain_freed_memory``), as in ``fusion_throughput.py``: without it, the
trainer's run that ``make_steps`` captures the trainer's step from left glibc's thresholds at
values (before issue 21's fix) under which each way's steps page-faulted their activations in,
by amounts that depended on the process's history, not on the way. Usage::

    python benchmarks/op_times.py                       # writes results/op_times_cpu.md
    python benchmarks/op_times.py --models tiny_mlp --sizes 8 --steps 20 --out /tmp/ot
    python benchmarks/op_times.py --allocator-as-left    # glibc as the trainer's run left it
"""

from __future__ import annotations

import argparse
import os
import re
import resource
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _results import RESULTS, write_results
from fusion_throughput import MODELS, make_steps
from torch.profiler import ProfilerActivity, profile, record_function

from hfsweep._malloc import retain_freed_memory

#: the ways profiled, in table order
WAYS = ("ideal", "hand", "fused", "trainer")
_STEP = "op_times.step"

#: operator classes, first match wins: (class, pattern on the profiler's event name)
CLASSES: tuple[tuple[str, str], ...] = (
    ("products (mm, bmm, addmm, baddbmm)", r"^aten::(mm|bmm|addmm|baddbmm)$"),
    ("convolutions, forward and backward", r"^aten::.*conv"),
    ("pooling, forward and backward", r"^aten::.*pool"),
    ("activations (relu and its backward)", r"^aten::(relu|clamp_min|threshold_backward)"),
    (
        "the loss (log_softmax, nll, gather, their backward)",
        r"^aten::(_log_softmax|nll_loss|gather|scatter_add|cross_entropy)",
    ),
    ("sums and means (bias gradients, the members' losses)", r"^aten::(sum|mean|div)$"),
    ("optimizer update (foreach and in-place adds)", r"^aten::(_foreach_|add_$|addcmul_$)"),
    ("layout copies (copy_, clone, contiguous)", r"^aten::(copy_|clone|contiguous|_to_copy)$"),
    (
        "views (view, transpose, expand, squeeze...)",
        r"^aten::(view|_unsafe_view|transpose|t|"
        r"expand|squeeze|unsqueeze|as_strided|flatten|reshape|permute|select|slice|detach)$",
    ),
    ("allocations (empty, zeros, ones_like...)", r"^aten::(empty|zeros|ones|new_|fill_|zero_)"),
    (
        "autograd engine, its nodes, gradient accumulation",
        r"^(autograd::|torch::autograd::|\w+Backward\d+$)",
    ),
    ("Python autograd.Function code (forward, backward)", r"^[A-Za-z_]\w*$"),
    ("profiler ranges' own code (Optimizer.step#...)", r"^Optimizer\."),
    ("other operators", r"."),
)
_COMPILED = [(name, re.compile(pattern)) for name, pattern in CLASSES]
OUTSIDE = "outside operators (Python between them, profiler)"
FAULTS = "minor page faults per step (a count, not in the step's sum)"


def op_class(name: str) -> str:
    """The class of a profiler event named ``name`` (see :data:`CLASSES`)."""
    for label, pattern in _COMPILED:
        if pattern.search(name):
            return label
    return CLASSES[-1][0]


def profile_way(step: Callable[[], None], steps: int, warmup: int) -> dict[str, float]:
    """Microseconds per step of ``step`` by operator class: each operator's minimum self time
    over ``steps`` profiled steps (after ``warmup`` unprofiled ones), and what the fastest step
    spent outside them."""
    for _ in range(warmup):
        step()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(steps):
        step()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            with record_function(_STEP):
                step()
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    marks = [e for e in events if e.name == _STEP]
    per_step: list[list[tuple[str, float]]] = [[] for _ in marks]
    k = 0
    for e in events:
        if e.name == _STEP:
            continue
        while k < len(marks) and e.time_range.start >= marks[k].time_range.end:
            k += 1
        if k < len(marks) and e.time_range.start >= marks[k].time_range.start:
            per_step[k].append((e.name, float(e.self_cpu_time_total)))
    names = [n for n, _ in per_step[0]]
    same = [s for s in per_step if [n for n, _ in s] == names]
    out: dict[str, float] = {label: 0.0 for label, _ in CLASSES}
    for i, name in enumerate(names):
        out[op_class(name)] += min(s[i][1] for s in same)
    # outside: the least, over the steps, of a step's time less its own operators' sum (the
    # machine's other work, which interrupts some steps, mostly lands in their operators)
    gaps = [
        float(m.cpu_time_total) - sum(t for _, t in s)
        for m, s in zip(marks, per_step, strict=True)
        if [n for n, _ in s] == names
    ]
    out[OUTSIDE] = max(0.0, min(gaps))
    out["step"] = sum(out.values())
    out[FAULTS] = faults / steps
    out["steps compared"] = float(len(same))
    return out


def measure(name: str, size: int, steps: int, warmup: int, device: torch.device) -> dict[str, Any]:
    """The classes' microseconds per step of every way, for ``size`` members of ``name``."""
    ways = make_steps(name, size, MODELS[name].batch, device)
    row: dict[str, Any] = {"model": name, "B": size}
    for way in WAYS:
        if way in ways:
            row[way] = profile_way(ways[way], steps, warmup)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny_mlp", "medium_mlp", "small_cnn"])
    parser.add_argument("--sizes", nargs="+", type=int, default=[8, 32])
    parser.add_argument("--steps", type=int, default=40, help="profiled steps per way")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--allocator-as-left",
        action="store_true",
        help="leave glibc's thresholds as the captured trainer run left them (as this script "
        "did before issue 21) instead of the trainer's own setting",
    )
    args = parser.parse_args(argv)
    device = torch.device("cpu")  # the profiler's CPU operators; a GPU's kernels are not read
    if not args.allocator_as_left:
        retain_freed_memory()  # the allocator setting the trainer runs with, for every way alike
    rows = []
    for name in args.models:
        for size in args.sizes:
            row = measure(name, size, args.steps, args.warmup, device)
            rows.append(row)
            print(
                f"{name} B={size}: "
                + ", ".join(f"{w} {row[w]['step']:.0f} us" for w in WAYS if w in row),
                flush=True,
            )
    labels = [label for label, _ in CLASSES] + [OUTSIDE, "step", FAULTS]
    cells = []
    for row in rows:
        for label in labels:
            values = [row[w][label] if w in row else None for w in WAYS]
            if all(v is None or abs(v) < 0.05 for v in values):
                continue
            ideal = row["ideal"][label]
            diffs = [
                "-" if v is None else f"{v - ideal:+.1f}"
                for v in values[2:]  # fused, trainer
            ]
            cells.append(
                [row["model"], str(row["B"]), label]
                + ["-" if v is None else f"{v:.1f}" for v in values]
                + diffs
            )
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    stem = args.out or RESULTS / f"op_times_{device.type}"
    write_results(
        stem,
        "op_times.py",
        argv,
        device,
        "Where a fused step's time goes against the ideal bound, by operator class",
        [
            f"- load average (1 min) at the end of the run: {load:.2f}",
            f"- {args.steps} profiled steps per way after {args.warmup} warm-up steps; each "
            "operator's self time is its minimum over the steps (the steps dispatch the same "
            "operators in the same order), summed by class; microseconds per step, under the "
            "profiler",
            "- `ideal`: one model on a B-times-larger batch; `hand`: the model written by hand "
            "as one (`_hand_written.py`); `fused`: the `hs.fuse` array in a user's loop with "
            "`torch.optim.SGD`; `trainer`: the trainer's step (`hs.optim.SGD`)",
            f"- `{OUTSIDE}`: the least, over the steps, of a step's time less its own operators' "
            "sum; `step`: the classes' sum (every operator at its fastest); the page faults "
            f"are counted over {args.steps} unprofiled steps before the profiled ones",
            "- allocator: glibc's thresholds as the captured trainer run left them "
            "(`--allocator-as-left`)"
            if args.allocator_as_left
            else "- every way runs with the allocator setting of hfsweep's trainer "
            "(`hfsweep._malloc.retain_freed_memory`)",
        ],
        ["model", "B", "class", *(f"{w} us" for w in WAYS), "fused - ideal", "trainer - ideal"],
        cells,
        rows,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
