"""The fused training step eager and compiled (``hs.fuse(..., compile=True)``), against ideal.

For each model and array size B this times one full training step of three ways, side by side
in one run:

* ``eager``: ``hs.fuse`` of B models (its traced forward replayed as is), per-member losses
  (``hs.member_losses``) summed, backward, one ``hs.optim.SGD`` step over the stacked
  parameters with per-member learning rates: the trainer's step;
* ``compiled``: the same with ``hs.fuse(..., compile=True)``: the traced forward and its
  backward compiled by ``torch.compile`` (inductor); loss and optimizer step as above;
* ``ideal``: one plain model trained on a batch B times larger with ``torch.optim.SGD`` (eager):
  the same arithmetic without any fusion overhead.

Rounds interleave the three ways (each way runs enough steps for about ``--round-s`` seconds per
round) and each way's median round is reported, so a slow moment of a shared machine hits all of
them alike. Compile time is reported separately and kept out of the step times: ``compile s`` is
the compiled array's first call (dynamo, AOTAutograd and inductor compiling the forward and its
backward; ``FusedArray._compile_seconds``), ``first step s`` the whole first compiled step. Warm-up
steps of every way are not timed.

``fused / ideal`` is the ideal step's time over the fused step's (1.0: fusion costs nothing over
one model on a B-times-larger batch).

``--optimizer`` times the fused optimizer step alone instead (``hs.optim.AdamW`` and ``SGD``
over a tiny MLP's array, gradients set once): eager, ``opt.compile()`` (the update compiled, as
``compile=True`` trains) and ``torch.compile(opt.step)`` (the whole step, which dynamo breaks
where it reads the device), side by side.
Usage::

    python benchmarks/compile_fused.py                    # writes benchmarks/results/compile_fused_cpu.md
    python benchmarks/compile_fused.py --device cuda      # CUDA graphs too: results/compile_fused_cuda.md
    python benchmarks/compile_fused.py --models tiny_mlp --sizes 2 --rounds 1 --out /tmp/cf
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from _results import RESULTS, write_results
from op_counts import MODELS
from torch import Tensor

import hfsweep as hs
from hfsweep._malloc import retain_freed_memory

#: samples per batch by model (the larger models get smaller batches, so that B = 32 steps stay
#: within seconds on a 2-core CPU)
BATCH = {"tiny_mlp": 64, "medium_mlp": 64, "small_cnn": 32, "cifar_resnet": 16, "transformer": 4}
WAYS = ("eager", "compiled", "ideal")
LR = 0.01


def _batch(name: str, batch: int, device: torch.device) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(1)
    x = MODELS[name][1](batch, gen)
    y = torch.randint(0, 10, (batch,), generator=gen)
    return x.to(device), y.to(device)


def make_steps(
    name: str, size: int, batch: int, device: torch.device
) -> tuple[dict[str, Callable[[], None]], Any]:
    """One training step of each way on ``device``, and the compiled array (for its compile
    time)."""
    build = MODELS[name][0]
    torch.manual_seed(0)
    models = [build().to(device) for _ in range(size)]
    x, y = _batch(name, batch, device)
    lrs = [LR * (1 + i / size) for i in range(size)]

    def fused_step(array: hs.FusedArray) -> Callable[[], None]:
        opt = hs.optim.SGD(array, lr=lrs)

        def step() -> None:
            hs.member_losses(array(x), y).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step

    eager = hs.fuse(models)
    compiled = hs.fuse([copy.deepcopy(m) for m in models], compile=True)
    big = build().to(device)
    big_opt = torch.optim.SGD(big.parameters(), lr=LR)
    xb = x.repeat(size, *([1] * (x.dim() - 1)))
    yb = y.repeat(size)

    def ideal() -> None:
        F.cross_entropy(big(xb), yb).backward()
        big_opt.step()
        big_opt.zero_grad(set_to_none=True)

    steps = {"eager": fused_step(eager), "compiled": fused_step(compiled), "ideal": ideal}
    return steps, compiled


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(step: Callable[[], None], iters: int, device: torch.device) -> float:
    """Seconds per call of ``step`` over ``iters`` calls, the device's queue drained at both
    ends (on a GPU the calls only enqueue kernels)."""
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        step()
    _sync(device)
    return (time.perf_counter() - start) / iters


def measure(
    name: str, size: int, rounds: int, round_s: float, warmup: int, device: torch.device
) -> dict[str, Any]:
    """The median seconds per step of every way, the compile time and the first step's."""
    batch = BATCH[name]
    steps, compiled = make_steps(name, size, batch, device)
    began = time.perf_counter()
    steps["compiled"]()
    _sync(device)
    first_s = time.perf_counter() - began
    iters: dict[str, int] = {}
    for way in WAYS:
        for _ in range(warmup):
            steps[way]()
        iters[way] = max(1, round(round_s / max(_timed(steps[way], 1, device), 1e-6)))
    samples: dict[str, list[float]] = {way: [] for way in WAYS}
    for _ in range(rounds):
        for way in WAYS:
            samples[way].append(_timed(steps[way], iters[way], device))
    row: dict[str, Any] = {"model": name, "size": size, "batch": batch}
    for way in WAYS:
        row[f"{way}_s"] = statistics.median(samples[way])
        row[f"{way}_rounds"] = samples[way]
    row["compile_s"] = compiled._compile_seconds
    row["first_step_s"] = first_s
    row["compiled_traces"] = sum(
        1 for t in compiled._traces.values() if getattr(t, "plain", None) is not None
    )
    return row


def _cells(row: dict[str, Any]) -> list[str]:
    e, c, i = row["eager_s"], row["compiled_s"], row["ideal_s"]
    return [
        row["model"],
        str(row["size"]),
        str(row["batch"]),
        f"{e * 1e3:.2f}",
        f"{c * 1e3:.2f}",
        f"{e / c:.2f}x",
        f"{i * 1e3:.2f}",
        f"{i / e:.2f}",
        f"{i / c:.2f}",
        f"{row['compile_s']:.1f}",
        f"{row['first_step_s']:.1f}",
    ]


COLUMNS = [
    "model",
    "B",
    "batch",
    "eager ms/step",
    "compiled ms/step",
    "compiled speed-up",
    "ideal ms/step",
    "eager fused / ideal",
    "compiled fused / ideal",
    "compile s",
    "first step s",
]


#: the optimizers ``--optimizer`` times: (class, per-member hyperparameters of member i)
OPTIMIZERS: dict[str, tuple[Any, Callable[[int], dict[str, float]]]] = {
    "adamw": (hs.optim.AdamW, lambda i: {"lr": LR * (1 + i), "weight_decay": 0.01}),
    "sgd": (hs.optim.SGD, lambda i: {"lr": LR * (1 + i), "momentum": 0.9}),
}
OPTIMIZER_WAYS = ("eager", "compile()", "torch.compile(step)")


def optimizer_step(name: str, size: int, rounds: int, device: torch.device) -> dict[str, Any]:
    """Median seconds of one fused optimizer step (tiny MLP array of ``size``, gradients set
    once) three ways side by side: eager, ``opt.compile()`` (the update compiled, hfsweep's
    compiled path) and ``torch.compile(opt.step)`` (the whole step handed to dynamo, which
    breaks its graph where the step reads the device), with each compiled way's first two
    calls and the graph breaks of the last."""
    torch.manual_seed(0)
    models = [MODELS["tiny_mlp"][0]().to(device) for _ in range(size)]
    x, y = _batch("tiny_mlp", BATCH["tiny_mlp"], device)
    cls, member = OPTIMIZERS[name]
    arrays = [hs.fuse(copy.deepcopy(models)) for _ in OPTIMIZER_WAYS]
    per_member = [member(i) for i in range(size)]
    kwargs = {k: [h[k] for h in per_member] for k in per_member[0]}
    opts = [cls(a, **kwargs) for a in arrays]
    for a in arrays:
        hs.member_losses(a(x), y).sum().backward()
    opts[1].compile()
    torch._dynamo.utils.counters.clear()
    whole = torch.compile(opts[2].step)
    steps = {"eager": opts[0].step, "compile()": opts[1].step, "torch.compile(step)": whole}
    first: dict[str, float] = {}
    for k, step in steps.items():
        began = time.perf_counter()
        step()
        step()  # the optimizer state exists from the second step on: a recompile
        _sync(device)
        first[k] = time.perf_counter() - began
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    for step in steps.values():
        for _ in range(3):
            step()
    samples: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(rounds):
        for k, step in steps.items():
            samples[k].append(_timed(step, 50, device))
    medians = {k: statistics.median(v) for k, v in samples.items()}
    return {
        "optimizer": name,
        "size": size,
        "seconds": medians,
        "samples": samples,
        "first_two_steps_s": first,
        "graph_breaks_torch_compile_step": breaks,
    }


def _load() -> str:
    return ", ".join(f"{v:.1f}" for v in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(BATCH), choices=list(BATCH))
    parser.add_argument("--sizes", nargs="+", type=int, default=[8, 32])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--round-s", type=float, default=0.5, help="seconds per way per round")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument(
        "--out", type=Path, default=None, help="default: results/compile_fused_<device type>"
    )
    parser.add_argument("--optimizer", action="store_true", help="the optimizer step instead")
    parser.add_argument(
        "--optimizers", nargs="+", default=list(OPTIMIZERS), choices=list(OPTIMIZERS)
    )
    args = parser.parse_args(argv)
    args.device = torch.device(args.device)
    if args.out is None:
        args.out = RESULTS / f"compile_fused_{args.device.type}"
    args.load_at_start = _load()
    retain_freed_memory()  # the allocator setting hfsweep's trainer runs with
    if args.optimizer:
        rows = [
            optimizer_step(name, size, args.rounds, args.device)
            for name in args.optimizers
            for size in args.sizes
        ]
        write_results(
            args.out,
            "compile_fused.py",
            argv,
            args.device,
            "The fused optimizer step eager vs opt.compile() vs torch.compile(opt.step)",
            [
                f"- tiny MLP array ({MODELS['tiny_mlp'][2]}), per-member lr (AdamW: weight decay "
                f"0.01; SGD: momentum 0.9), gradients set once; median of {args.rounds} "
                "interleaved rounds of 50 steps per way",
                "- compile(): hfsweep's compiled update (the non-finite check, idle rows and step "
                "counts eager around it); torch.compile(step): the whole step given to dynamo",
                f"- load average (1, 5, 15 min) at the end: {_load()}",
            ],
            [
                "optimizer",
                "B",
                "eager ms/step",
                "compile() ms/step",
                "torch.compile(step) ms/step",
                "eager / compile()",
                "first two calls s: compile(), torch.compile(step)",
                "graph breaks of torch.compile(step)",
            ],
            [
                [
                    r["optimizer"],
                    str(r["size"]),
                    *(f"{r['seconds'][k] * 1e3:.3f}" for k in OPTIMIZER_WAYS),
                    f"{r['seconds']['eager'] / r['seconds']['compile()']:.2f}",
                    ", ".join(f"{r['first_two_steps_s'][k]:.1f}" for k in OPTIMIZER_WAYS[1:]),
                    str(r["graph_breaks_torch_compile_step"]),
                ]
                for r in rows
            ],
            rows,
        )
        return 0
    rows: list[dict[str, Any]] = []
    for name in args.models:
        for size in args.sizes:
            row = measure(name, size, args.rounds, args.round_s, args.warmup, args.device)
            rows.append(row)
            print(" | ".join(_cells(row)), flush=True)
            _write(args, argv, rows)  # after every row: a long run interrupted keeps its rows
    return 0


def _write(args: argparse.Namespace, argv: list[str] | None, rows: list[dict[str, Any]]) -> None:
    done = list(dict.fromkeys(r["model"] for r in rows))
    about = "; ".join(f"{n}: {MODELS[n][2]}, batch {BATCH[n]}" for n in done)
    write_results(
        args.out,
        "compile_fused.py",
        argv,
        args.device,
        "Fused training step: eager vs compiled (torch.compile, inductor) vs ideal",
        [
            f"- models: {about}",
            f"- median of {args.rounds} interleaved rounds per way (about {args.round_s} s each)",
            f"- CPUs this process may run on: {sorted(os.sched_getaffinity(0))}; load average "
            f"(1, 5, 15 min) at the start {args.load_at_start}, after the last row {_load()}",
            "- step: forward, hs.member_losses, backward, hs.optim.SGD (per-member lr); ideal: "
            "one model, batch x B, torch.optim.SGD, eager",
            "- compile s: the compiled array's first call (forward and backward compiled), "
            "left out of the step times; first step s: the whole first compiled step",
        ],
        COLUMNS,
        [_cells(r) for r in rows],
        rows,
    )


if __name__ == "__main__":
    raise SystemExit(main())
