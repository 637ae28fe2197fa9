"""The offload engine's double buffering on a CPU, with an injected transfer delay.

On a CPU the host and the device are one memory, so a transfer costs a copy; to see whether the
engine overlaps transfers with compute, each shard fetch also sleeps ``delay`` seconds in the
transfer's background thread (``CpuTransfer(delay=...)``), standing in for a slow link. A
training step (forward and backward, shard by shard; the optimizer step, on the host, is left
out) is timed with prefetch off (each shard fetched when it is needed: transfer, then compute)
and on (shard k+1 fetched while shard k computes), alternating, at delays that are a fraction
or a multiple of one shard's forward compute time (measured first, without delay).

Without prefetch a step should take about its compute plus every fetch's delay (their sum);
with prefetch about the larger of the two per shard. The table gives both, with the share of
the injected delay that prefetch hid. Gradients go back to the host without delay (the CPU
transfer's returns are plain copies).

    python benchmarks/offload_pipeline.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from _results import RESULTS, write_results
from torch import nn

import hfsweep as hs
from hfsweep.offload import CpuTransfer, OffloadedArray


def _engine(layers: int, width: int, size: int, delay: float, prefetch: bool) -> OffloadedArray:
    torch.manual_seed(0)
    models = [nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]) for _ in range(size)]
    array = hs.fuse(models, share_frozen=False)
    layer = size * (width * width + width) * 4
    return OffloadedArray(array, transfer=CpuTransfer(delay), prefetch=prefetch, shard_bytes=layer)


def _step_s(engine: OffloadedArray, x: torch.Tensor, steps: int) -> float:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine(x).square().mean().backward()
        times.append(time.perf_counter() - start)
        for p in engine.array.parameters():
            p.grad = None
    return statistics.median(times)


def _forward_s(engine: OffloadedArray, x: torch.Tensor, steps: int) -> float:
    times = []
    with torch.no_grad():
        for _ in range(steps):
            start = time.perf_counter()
            engine(x)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--size", type=int, default=4, help="array size B")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per arm and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--factors", type=float, nargs="+", default=[0.25, 0.5, 1.0, 2.0])
    parser.add_argument("--out", type=Path, default=RESULTS / "offload_pipeline_cpu")
    args = parser.parse_args(argv)
    x = torch.randn(args.batch, args.width)
    n = args.layers

    # one shard's forward compute (the no-grad forward through the engine, per shard), to set
    # the delays; measured again in every round, where the table's ratios come from
    plain = _engine(n, args.width, args.size, 0.0, True)
    assert len(plain.shards) == n
    _forward_s(plain, x, 1)
    calibrated = _forward_s(plain, x, args.steps) / n
    plain.close()
    fetches = 2 * n - 1  # every shard in forward, all but the last again in backward

    rows, cells = [], []
    for factor in args.factors:
        delay = factor * calibrated
        # arms: no delay (the compute alone), delay without prefetch, delay with prefetch
        arms = {
            "compute": _engine(n, args.width, args.size, 0.0, True),
            "off": _engine(n, args.width, args.size, delay, False),
            "on": _engine(n, args.width, args.size, delay, True),
        }
        for e in arms.values():
            _step_s(e, x, 1)  # warm-up (traces)
        times: dict[str, list[float]] = {name: [] for name in [*arms, "forward"]}
        for _ in range(args.rounds):
            times["forward"].append(_forward_s(arms["compute"], x, args.steps) / n)
            for name, e in arms.items():
                times[name].append(_step_s(e, x, args.steps))
        for e in arms.values():
            e.close()
        step0 = statistics.median(times["compute"])
        compute = statistics.median(times["forward"])  # one shard's forward, in these rounds
        off, on = statistics.median(times["off"]), statistics.median(times["on"])
        injected = fetches * delay
        # the max model: each fetch overlapped with the compute of the shard before it
        # (forward: c_f per shard; backward: the rest of the no-delay step, per shard); the
        # first fetch of the forward has nothing to hide behind
        c_b = max(step0 - n * compute, 0.0) / n
        max_model = delay + (n - 1) * max(compute, delay) + compute
        max_model += (n - 1) * max(c_b, delay) + c_b
        row = {
            "factor": factor,
            "shard_forward_ms": compute * 1e3,
            "delay_over_shard_forward": delay / compute,
            "delay_ms": delay * 1e3,
            "compute_step_ms": step0 * 1e3,
            "injected_ms": injected * 1e3,
            "sum_model_ms": (step0 + injected) * 1e3,
            "max_model_ms": max_model * 1e3,
            "prefetch_off_ms": off * 1e3,
            "prefetch_on_ms": on * 1e3,
            "on/off": on / off,
            "hidden_share": (off - on) / injected,
        }
        rows.append(row)
        cells.append(
            [
                f"{factor:g}",
                f"{compute * 1e3:.1f}",
                f"{delay / compute:.2f}",
                f"{delay * 1e3:.1f}",
                f"{step0 * 1e3:.0f}",
                f"{injected * 1e3:.0f}",
                f"{(step0 + injected) * 1e3:.0f}",
                f"{max_model * 1e3:.0f}",
                f"{off * 1e3:.0f}",
                f"{on * 1e3:.0f}",
                f"{on / off:.2f}",
                f"{(off - on) / injected:.0%}",
            ]
        )
    notes = [
        f"- model: {n} x Linear({args.width}, {args.width}), one layer per shard, B = "
        f"{args.size}, batch {args.batch}, float32; delays set to the factor times one shard's "
        f"forward as measured first ({calibrated * 1e3:.1f} ms); the shard forward column is "
        "measured again in the rounds",
        f"- a step = forward + backward through the engine ({fetches} fetches: {n} in forward, "
        f"{n - 1} in backward, the last shard stays); medians of {args.steps} steps, "
        f"{args.rounds} alternating rounds",
        f"- load average while it ran (1, 5, 15 min): {', '.join(f'{v:.1f}' for v in os.getloadavg())}"
        " (other jobs shared the cores: compute times are noisy, the injected delays are not)",
        "- no-delay step: the same engine without delay, timed in the same rounds; sum model: the step without delay plus every fetch's delay (no overlap); "
        "max model: per shard the larger of its fetch and the compute it overlaps (forward: one shard's forward; backward: the rest of the no-delay step per shard) plus the first fetch; hidden: the share of the injected delay that prefetch took off the step",
    ]
    columns = [
        "factor",
        "shard forward ms",
        "delay / shard forward",
        "delay ms",
        "no-delay step ms",
        "injected ms",
        "sum model ms",
        "max model ms",
        "prefetch off ms",
        "prefetch on ms",
        "on / off",
        "hidden",
    ]
    write_results(
        args.out,
        "offload_pipeline.py",
        argv,
        torch.device("cpu"),
        "Offload pipeline: prefetch off vs on with an injected transfer delay (CPU)",
        notes,
        columns,
        cells,
        rows,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
