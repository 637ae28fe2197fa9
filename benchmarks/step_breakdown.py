"""Where a fused training step's time goes, phase by phase: the trainer's path against the plain one.

``fusion_throughput.py`` times whole steps; this splits them. For each model and B it times, in
interleaved rounds, the phases of three steps on the same batch:

* ``plain``: the ``nn.Module`` that ``hs.fuse`` returns in a user's loop (``fusion_throughput.py``'s
  ``fused`` way): ``zero_grad``, forward, ``hs.member_losses(...).sum()``, backward,
  ``torch.optim.SGD.step``;
* ``trainer``: the trainer's step (``hfsweep/training/step.py``'s ``backward`` and ``update``, the
  arguments captured from an ``hs.ArrayTrainer`` run by ``fusion_throughput.trainer_calls``):
  forward, the task's per-member loss, backward, the optimizer's non-finite check, its update
  (``hs.optim.SGD`` with per-member learning rates), ``zero_grad`` and the schedule step, and the
  bookkeeping the trainer's loop does every step (the losses' running sum, the step timer and
  counts, the failed-member check);
* ``ideal``: one model on a B-times-larger batch (the bound), with the plain path's phases.

The trainer's non-finite check is timed as its own phase by calling what ``step`` calls
(``_nonfinite_members``) and then ``step`` with the check off: the same work in the same order.
The clock is read between phases (``time.perf_counter``, on a CPU nothing runs asynchronously;
on CUDA each phase ends with a synchronize, which adds to every phase). Also timed: each way's
whole step undivided (``step``), so the phases' sum can be checked against it. Microseconds per
step, median over rounds. Every way runs with the allocator setting of hfsweep's trainer
(``hfsweep._malloc.retain_freed_memory``, as ``fusion_throughput.py`` and ``op_times.py`` do).
Usage::

    python benchmarks/step_breakdown.py --rounds 5       # writes results/step_breakdown_cpu.md
    python benchmarks/step_breakdown.py --models tiny_mlp --sizes 1 --rounds 1 --out /tmp/sb
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
import torch.nn.functional as F
from _results import RESULTS, write_results
from fusion_throughput import MODELS, _batch, trainer_add_losses, trainer_calls

import hfsweep as hs
from hfsweep._malloc import retain_freed_memory
from hfsweep._usercode import OPTIMIZER_STEP, Phase
from hfsweep.training import step as _step

#: the phases in table order; a way has the ones it does
PHASES = (
    "zero_grad",
    "forward",
    "loss",
    "backward",
    "nonfinite_check",
    "optimizer",
    "schedule",
    "bookkeeping",
)

Timed = Callable[[dict[str, float]], None]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _clock(device: torch.device) -> Callable[[], float]:
    def now() -> float:
        _sync(device)
        return time.perf_counter()

    return now


def _loop_way(
    model: torch.nn.Module,
    loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    opt: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
) -> tuple[Timed, Callable[[], None]]:
    """A user's loop (``zero_grad``, ``model(x)``, ``loss_of(out, y)``, backward, step),
    phase by phase and whole."""
    now = _clock(x.device)

    def phases(acc: dict[str, float]) -> None:
        t0 = now()
        opt.zero_grad(set_to_none=True)
        t1 = now()
        out = model(x)
        t2 = now()
        loss = loss_of(out, y)
        t3 = now()
        loss.backward()
        t4 = now()
        opt.step()
        t5 = now()
        for name, a, b in (
            ("zero_grad", t0, t1),
            ("forward", t1, t2),
            ("loss", t2, t3),
            ("backward", t3, t4),
            ("optimizer", t4, t5),
        ):
            acc[name] = acc.get(name, 0.0) + b - a

    def whole() -> None:
        opt.zero_grad(set_to_none=True)
        loss_of(model(x), y).backward()
        opt.step()

    return phases, whole


def plain_way(
    array: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> tuple[Timed, Callable[[], None]]:
    """The plain path's step, phase by phase and whole (``fusion_throughput.py``'s ``fused``)."""
    return _loop_way(array, lambda out, t: hs.member_losses(out, t).sum(), opt, x, y)


def ideal_way(
    big: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> tuple[Timed, Callable[[], None]]:
    """One model on the B-times-larger batch, phase by phase and whole."""
    return _loop_way(big, F.cross_entropy, opt, x, y)


def trainer_way(
    backward_call: tuple[tuple[Any, ...], dict[str, Any]],
    update_call: tuple[tuple[Any, ...], dict[str, Any]],
) -> tuple[Timed, Callable[[], None]]:
    """The trainer's step, phase by phase (what ``step.backward`` and ``step.update`` do, in
    their order, and the trainer loop's per-step bookkeeping) and whole (the two calls)."""
    b_args, b_kwargs = backward_call
    u_args, u_kwargs = update_call
    task, array, x, y, smoothing, clip, *rest = b_args
    loss_fn = (rest[0] if rest else b_kwargs.get("loss")) or task.member_loss
    forward = (rest[1] if len(rest) > 1 else b_kwargs.get("forward")) or array
    opt, sched = u_args
    now = _clock(x.device)
    loss_sum = torch.zeros(len(opt.active), dtype=torch.float64, device=x.device)
    timer = _step._StepTimer(x.device, array)
    pending = [0]
    add_losses = trainer_add_losses()
    seen = [len(opt.nonfinite_members)]

    def phases(acc: dict[str, float]) -> None:
        t0 = now()
        with Phase("the forward pass"):
            out = forward(x)
        t1 = now()
        with Phase("the loss"):
            losses = loss_fn(out, y, smoothing)
        t2 = now()
        with Phase("the backward pass"):
            losses.sum().backward()
        if clip is not None:
            _step.clip_grad_norm_(array, clip)
        t3 = now()
        with Phase(OPTIMIZER_STEP):
            bad = opt._nonfinite_members(opt._inactive) if opt.isolate_nonfinite else []
            if bad:
                opt._isolate(bad, "gradient")
            t4 = now()
            isolate, opt.isolate_nonfinite = opt.isolate_nonfinite, False
            try:
                opt.step()
            finally:
                opt.isolate_nonfinite = isolate
            t5 = now()
            opt.zero_grad(set_to_none=True)
            t6 = now()
            if sched is not None:
                sched.step()
        t7 = now()
        add_losses(loss_sum, losses)
        pending[0] += 1
        failed = opt.nonfinite_members[seen[0] :]
        seen[0] = len(opt.nonfinite_members)
        timer.step()
        assert not failed
        t8 = now()
        for name, a, b in (
            ("forward", t0, t1),
            ("loss", t1, t2),
            ("backward", t2, t3),
            ("nonfinite_check", t3, t4),
            ("optimizer", t4, t5),
            ("zero_grad", t5, t6),
            ("schedule", t6, t7),
            ("bookkeeping", t7, t8),
        ):
            acc[name] = acc.get(name, 0.0) + b - a

    def whole() -> None:
        losses = _step.backward(*b_args, **b_kwargs)
        _step.update(*u_args, **u_kwargs)
        add_losses(loss_sum, losses)

    return phases, whole


def build(
    name: str, size: int, device: torch.device
) -> dict[str, tuple[Timed, Callable[[], None]]]:
    """The three ways for ``size`` members of model ``name`` on one batch."""
    spec = MODELS[name]
    torch.manual_seed(0)
    models = [spec.build().to(device) for _ in range(size)]
    x, y = _batch(name, spec.batch, device)
    array = hs.fuse(models)
    ways = {"plain": plain_way(array, torch.optim.SGD(array.parameters(), lr=0.01), x, y)}
    ways["trainer"] = trainer_way(*trainer_calls(name, models, x, y))
    big = spec.build().to(device)
    xb, yb = x.repeat(size, *([1] * (x.dim() - 1))), y.repeat(size)
    ways["ideal"] = ideal_way(big, torch.optim.SGD(big.parameters(), lr=0.01), xb, yb)
    return ways


def trace_lookup(array: hs.FusedArray, x: torch.Tensor) -> Callable[[], None]:
    """What ``array(x)`` does before it replays its trace: the call's key built from the
    array's settings, the call's tensors and the stacked state, and looked up; timed alone."""
    from hfsweep.fusion._tracing import _one_tensor_spec

    spec = _one_tensor_spec()

    def lookup() -> None:
        array._lookup_trace([x], spec, [0], [x], True, array._state())

    return lookup


def measure(
    name: str, size: int, rounds: int, iters: int, warmup: int, device: torch.device
) -> dict[str, Any]:
    """Microseconds per step of each way's phases and whole step, median over rounds."""
    ways = build(name, size, device)
    spec = MODELS[name]
    x, _ = _batch(name, spec.batch, device)
    torch.manual_seed(0)
    array = hs.fuse([spec.build().to(device) for _ in range(size)])
    array(x)  # traced
    lookup = trace_lookup(array, x)
    lookups: list[float] = []
    for phases, whole in ways.values():
        for _ in range(warmup):
            phases({})
            whole()
    per_round: dict[str, dict[str, list[float]]] = {w: {} for w in ways}
    for _ in range(rounds):
        for way, (phases, whole) in ways.items():
            acc: dict[str, float] = {}
            for _ in range(iters):
                phases(acc)
            for phase, seconds in acc.items():
                per_round[way].setdefault(phase, []).append(seconds / iters * 1e6)
            _sync(device)
            start = time.perf_counter()
            for _ in range(iters):
                whole()
            _sync(device)
            us = (time.perf_counter() - start) / iters * 1e6
            per_round[way].setdefault("step", []).append(us)
        start = time.perf_counter()
        for _ in range(iters):
            lookup()
        lookups.append((time.perf_counter() - start) / iters * 1e6)
    row: dict[str, Any] = {"model": name, "B": size, "trace_lookup_us": statistics.median(lookups)}
    for way, phases_us in per_round.items():
        for phase, values in phases_us.items():
            row[f"{way}_{phase}_us"] = statistics.median(values)
    return row


def _us(row: dict[str, Any], key: str) -> str:
    value = row.get(key)
    return "-" if value is None else f"{value:.1f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny_mlp", "medium_mlp"])
    parser.add_argument("--sizes", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=200, help="steps per way per round")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    retain_freed_memory()  # the allocator setting the trainer runs with, for every way alike
    rows = []
    for name in args.models:
        for size in args.sizes:
            row = measure(name, size, args.rounds, args.iters, args.warmup, device)
            rows.append(row)
            print(
                f"{name} B={size}: step us plain {row['plain_step_us']:.1f} "
                f"trainer {row['trainer_step_us']:.1f} ideal {row['ideal_step_us']:.1f}",
                flush=True,
            )
    cells = []
    for row in rows:
        for phase in (*PHASES, "sum of phases", "step"):
            key = "step" if phase == "step" else phase
            if phase == "sum of phases":
                vals = {
                    w: sum(row.get(f"{w}_{p}_us", 0.0) for p in PHASES)
                    for w in ("plain", "trainer", "ideal")
                }
            else:
                vals = {w: row.get(f"{w}_{key}_us") for w in ("plain", "trainer", "ideal")}
            if all(v is None for v in vals.values()):
                continue
            diff = (
                "-"
                if vals["trainer"] is None
                else f"{vals['trainer'] - (vals['plain'] or 0.0):+.1f}"
            )
            cells.append(
                [
                    row["model"],
                    str(row["B"]),
                    phase,
                    *("-" if vals[w] is None else f"{vals[w]:.1f}" for w in vals),
                    diff,
                ]
            )
        lookup = _us(row, "trace_lookup_us")
        label = "the forward's trace lookup (in forward)"
        cells.append([row["model"], str(row["B"]), label, lookup, lookup, "-", "+0.0"])
    stem = args.out or RESULTS / f"step_breakdown_{device.type}"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    write_results(
        stem,
        "step_breakdown.py",
        argv,
        device,
        "Where a fused training step's time goes: the trainer's path against the plain one",
        [
            f"- load average (1 min) at the end of the run: {load:.2f}",
            f"- {args.rounds} interleaved rounds of {args.iters} steps per way, "
            f"{args.warmup} warm-up steps; microseconds per step, median over rounds",
            "- `plain`: `hs.fuse` array, `hs.member_losses(...).sum()`, `torch.optim.SGD`; "
            "`trainer`: the trainer's `backward` and `update` (`hs.optim.SGD`, per-member "
            "learning rates), its non-finite check timed alone, and its loop's per-step "
            "bookkeeping; `ideal`: one model on a B-times-larger batch",
            "- `step`: the whole step timed undivided (no clock reads between phases); "
            "`trainer - plain`: where the trainer's step spends more",
            "- `the forward's trace lookup`: what a fused array's call does before it replays "
            "its traced forward (the call's key built from the array's settings, the call's "
            "tensors and the stacked state, and looked up), timed alone on an array of the "
            "same B, part of both paths' forward",
        ],
        ["model", "B", "phase", "plain us", "trainer us", "ideal us", "trainer - plain"],
        cells,
        rows,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
