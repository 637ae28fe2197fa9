"""Offloaded arrays trained together by the trainer (``hs.train_together``, what ``hfsweep run``
does with ``fusion.alternate: 2``) against the same arrays trained one after the other, with an
injected transfer delay (CPU).

The engine-level benchmark (``offload_alternate.py``) times one ``AlternatingArrays`` step of
two hand-built arrays. This one times whole trainer runs: each array is an ``ArrayTrainer``
(``offload="host"``) run of B members of one MLP, with its data, per-member losses and
optimizer steps (on the host), evaluations and checkpoints off. On a CPU the host and the
device are one memory, so every shard fetch also sleeps in the transfer's background thread:
``latency + bytes / bandwidth`` (a link of a fixed bandwidth, so arrays cut into more shards
pay for their bytes, not their fetches). Array *a* trains on a small batch (its steps wait on
their fetches), array *b*, the same model, on a large one (its steps wait on its compute).

Arms, alternating in every round, each through ``train_together`` with its own transfer and
the same ``device_memory`` budget: ``one after another`` (``train_together([a])``, then
``train_together([b])``: each array alone on the device, its prefetch hiding what its own
compute allows) and ``together`` (``train_together([a, b])``: their shards alternating on one
link). The bandwidth is set from a calibration without delay so that one step's fetches of one
array take ``factor`` times the mean of the two arrays' no-delay steps, where alternating has
the most to gain near 1. Models (seconds per step of both arrays): one after another, each
array takes about the larger of its transfers and its compute, ``max(T_a, C_a) + max(T_b,
C_b)``; together, about ``max(T_a + T_b, C_a + C_b)``.

    python benchmarks/offload_together.py --rounds 3 --threads 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from _results import RESULTS, write_results
from torch import nn

import hfsweep as hs
from hfsweep.offload import SCHEDULES, CpuTransfer, Fetch
from hfsweep.offload._alternate import Schedule
from hfsweep.tasks import TensorBatches


class _Link(CpuTransfer):
    """A CPU transfer whose fetches each take ``latency + bytes / bandwidth`` seconds in its
    background thread (``bandwidth`` in bytes/s; ``inf``: the latency alone), counting the
    bytes it copied in and its fetches."""

    def __init__(self, latency: float, bandwidth: float) -> None:
        super().__init__(delay=latency)
        self.latency, self.bandwidth = latency, bandwidth
        self.fetched = 0
        self.fetches = 0

    def fetch(self, tensors: Sequence[torch.Tensor], urgent: bool = False) -> Fetch:
        size = sum(t.numel() * t.element_size() for t in tensors)
        self.fetched += size
        self.fetches += 1
        self.delay = self.latency + size / self.bandwidth  # read by this call only
        return super().fetch(tensors, urgent)


def _task(layers: int, width: int, steps: int) -> hs.Task:
    """An MLP of ``layers`` square layers on generated data, ``steps`` steps per epoch."""

    def model(config: dict[str, Any]) -> nn.Module:
        blocks: list[nn.Module] = []
        for _ in range(layers - 1):
            blocks += [nn.Linear(width, width), nn.Tanh()]
        return nn.Sequential(*blocks, nn.Linear(width, 10))

    def data(config: dict[str, Any]) -> tuple[TensorBatches, TensorBatches]:
        batch = config["batch_size"]
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(batch * steps, width, generator=gen)
        y = torch.randint(0, 10, (batch * steps,), generator=gen)
        return TensorBatches(x, y, batch, shuffle=False), TensorBatches(
            x[:8], y[:8], 8, shuffle=False
        )

    return hs.Task(
        name="offload_together", model=model, data=data, defaults={"batch_size": 8, "epochs": 1}
    )


def _members(tag: str, size: int, batch: int, epochs: int) -> list[hs.Member]:
    return [
        hs.Member(f"{tag}{i}", {"lr": 0.01, "seed": i, "batch_size": batch, "epochs": epochs})
        for i in range(size)
    ]


def _jobs(task: hs.Task, arrays: list[list[hs.Member]], memory: int) -> list[hs.ArrayJob]:
    """One job per array, each with a trainer of its own (evaluated only at its end)."""
    return [
        hs.ArrayJob(
            hs.ArrayTrainer(
                task,
                offload="host",
                device_memory=memory,
                eval_every=10**9,
                final_states="none",
            ),
            members,
        )
        for members in arrays
    ]


def _run(
    task: hs.Task,
    groups: list[list[list[hs.Member]]],
    memory: int,
    link: _Link,
    schedule: Schedule = "lockstep",
) -> float:
    """Seconds to train each group of arrays with ``train_together``, one group after the
    other, on ``link`` (reopened for each group: ``train_together`` closes it), under
    ``schedule``."""
    start = time.perf_counter()
    for arrays in groups:
        hs.train_together(_jobs(task, arrays, memory), transfer=link, schedule=schedule)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--size", type=int, default=4, help="members per array (B)")
    parser.add_argument("--batch-a", type=int, default=8, help="array a's batch (small)")
    parser.add_argument("--batch-b", type=int, default=512, help="array b's batch (large)")
    parser.add_argument("--steps", type=int, default=20, help="training steps per array")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--factors", type=float, nargs="+", default=[0.5, 1.0, 2.0])
    parser.add_argument(
        "--schedules",
        nargs="+",
        default=["lockstep"],
        choices=list(SCHEDULES),
        help="train_together's schedules timed together (lockstep always)",
    )
    parser.add_argument("--latency-ms", type=float, default=0.2, help="per fetch")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--out", type=Path, default=RESULTS / "offload_together_cpu")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    load_start = os.getloadavg()[0]
    task = _task(args.layers, args.width, args.steps)
    a = _members("a", args.size, args.batch_a, 1)
    b = _members("b", args.size, args.batch_b, 1)
    # the budget: 16 layers' stacked weights, so shards of up to 2 layers together (a
    # sixteenth over the 8 parts of two arrays) and up to 2.7 alone (over 6 parts)
    layer = args.size * (args.width * args.width + args.width) * 4
    memory = 16 * layer
    latency = args.latency_ms / 1e3
    inf = float("inf")
    steps = 2 * args.steps  # both arrays' steps

    # calibration: each array alone without a bandwidth limit (latency only), its bytes
    calib: dict[str, tuple[float, int]] = {}
    for name, members in (("a", a), ("b", b)):
        _run(task, [[members]], memory, _Link(latency, inf))  # warm-up
        link = _Link(latency, inf)
        seconds = _run(task, [[members]], memory, link)
        calib[name] = (seconds / args.steps, link.fetched // args.steps)
    mean_step = (calib["a"][0] + calib["b"][0]) / 2

    others = [f"together {s}" for s in args.schedules if s != "lockstep"]
    rows: list[dict[str, Any]] = []
    cells: list[list[str]] = []
    for factor in args.factors:
        # one array's fetches per step take factor x the mean no-delay step
        bandwidth = calib["a"][1] / (factor * mean_step)
        arms: dict[str, tuple[list[list[list[hs.Member]]], float, Schedule]] = {
            "compute": ([[a], [b]], inf, "lockstep"),
            "one after another": ([[a], [b]], bandwidth, "lockstep"),
            "together": ([[a, b]], bandwidth, "lockstep"),
            "together, no delay": ([[a, b]], inf, "lockstep"),
        }
        for schedule in args.schedules:
            if schedule != "lockstep":
                arms[f"together {schedule}"] = ([[a, b]], bandwidth, schedule)
        times: dict[str, list[float]] = {name: [] for name in arms}
        computes: dict[str, list[float]] = {"a": [], "b": []}
        for _ in range(args.rounds):
            for name in ("a", "b"):
                computes[name].append(
                    _run(task, [[a if name == "a" else b]], memory, _Link(latency, inf))
                    / args.steps
                )
            for name, (groups, limit, schedule) in arms.items():
                link = _Link(latency, limit)
                times[name].append(_run(task, groups, memory, link, schedule) / steps)
        c_a, c_b = (statistics.median(computes[n]) for n in ("a", "b"))
        t_a, t_b = calib["a"][1] / bandwidth, calib["b"][1] / bandwidth
        one, together = (statistics.median(times[n]) for n in ("one after another", "together"))
        model_one = max(t_a, c_a) + max(t_b, c_b)
        model_together = max(t_a + t_b, c_a + c_b)
        row = {
            "factor": factor,
            "bandwidth_MB_s": bandwidth / 1e6,
            "compute_a_ms": c_a * 1e3,
            "compute_b_ms": c_b * 1e3,
            "transfer_a_ms": t_a * 1e3,
            "transfer_b_ms": t_b * 1e3,
            "model_one_after_another_ms": model_one * 1e3,
            "model_together_ms": model_together * 1e3,
            **{
                f"{n.replace(' ', '_').replace(',', '')}_ms": statistics.median(times[n]) * 1e3
                for n in arms
            },
            "speedup": one / together,
            "model_speedup": model_one / model_together,
            "times_s": times,
        }
        rows.append(row)
        cells.append(
            [
                f"{factor:g}",
                f"{c_a * 1e3:.1f} / {c_b * 1e3:.1f}",
                f"{t_a * 1e3:.1f} / {t_b * 1e3:.1f}",
                f"{statistics.median(times['compute']) * 2e3:.1f}",
                f"{statistics.median(times['together, no delay']) * 2e3:.1f}",
                f"{one * 2e3:.1f} ({model_one * 1e3:.1f})",
                f"{together * 2e3:.1f} ({model_together * 1e3:.1f})",
                f"{one / together:.2f}x ({model_one / model_together:.2f}x)",
                *(
                    f"{statistics.median(times[n]) * 2e3:.1f} "
                    f"({one / statistics.median(times[n]):.2f}x)"
                    for n in others
                ),
            ]
        )
        print(cells[-1], flush=True)
    notes = [
        f"- arrays: B={args.size} members of a {args.layers}-layer MLP of width {args.width}, "
        f"{args.steps} training steps each; a on batch {args.batch_a}, b on batch "
        f"{args.batch_b}; SGD, optimizer step on the host; device_memory {memory:,} bytes "
        "(16 layers' stacked weights) shared by the arrays of an arm",
        f"- link: each fetch sleeps {args.latency_ms:g} ms + bytes / bandwidth in the "
        "transfer's thread; one array's fetches per step take `factor` x the mean of the two "
        "arrays' no-delay steps (calibrated first); medians over "
        f"{args.rounds} rounds, the arms alternating in each",
        "- ms per step of both arrays (one step of a and one of b); in brackets the model: "
        "one after another `max(T_a, C_a) + max(T_b, C_b)`, together `max(T_a + T_b, C_a + C_b)`",
        f"- load average (1 min) at the start and the end: {load_start:.1f}, "
        f"{os.getloadavg()[0]:.1f} (the machine is shared)",
        "- compute: each array alone without a bandwidth limit; no delay: together without one; "
        "together: train_together's lockstep schedule (what fusion.alternate runs), 'together "
        "ready': its ready schedule (each turn to an array whose next shard is in)",
    ]
    columns = [
        "factor",
        "C_a / C_b ms",
        "T_a / T_b ms",
        "one after another, no delay",
        "together, no delay",
        "one after another (model)",
        "together (model)",
        "together speed-up (model)",
        *(f"{n} (speed-up)" for n in others),
    ]
    write_results(
        args.out,
        Path(__file__).name,
        argv,
        torch.device("cpu"),
        "Offloaded arrays trained together (train_together) vs one after another, CPU, "
        "injected transfer delay",
        notes,
        columns,
        cells,
        rows,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
