"""Two offloaded arrays stepped together with their shards alternating, against each stepped
alone with prefetch, with an injected transfer delay (CPU).

As in ``offload_pipeline.py``, every shard fetch sleeps ``delay`` seconds in the transfer's
background thread, standing in for a slow link. Array *a* trains on a small batch, so its
shards wait on their fetches (transfer-bound); array *b*, the same architecture on a large
batch, waits on its compute (compute-bound). Alone with prefetch, each hides what it can of
its own fetches: its step takes about the sum over its shards of the larger of fetch and
compute, so the two steps one after another take about a's transfers plus b's compute.
Alternated (``hfsweep.offload.AlternatingArrays``: one transfer thread, one ledger, a's shard k
computing while b's is copied in and the other way round), the two together should take about
the larger of the sum of both arrays' transfers and the sum of both arrays' computes.

Each round times, alternating: a and b without delay (their computes), a and b alone with
the delay and prefetch, and the two alternated with the delay. The delay is a factor times
the delay at which the sum of transfers equals the sum of computes (measured first), where
alternation has the most to gain. A step is a forward and backward (the optimizer step, on
the host, left out).

    python benchmarks/offload_alternate.py
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
from pathlib import Path

import torch
from _offload import median_step
from _results import RESULTS, write_results
from torch import nn

import hfsweep as hs
from hfsweep.offload import AlternatingArrays, CpuTransfer, OffloadedArray


def _array(layers: int, width: int, size: int) -> hs.FusedArray:
    torch.manual_seed(0)
    models = [nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]) for _ in range(size)]
    return hs.fuse(models, share_frozen=False)


class _Alone:
    """One array offloaded on its own, one layer per shard."""

    def __init__(self, array: hs.FusedArray, delay: float, layer: int, x: torch.Tensor) -> None:
        self.array = copy.deepcopy(array)
        self.engine = OffloadedArray(self.array, transfer=CpuTransfer(delay), shard_bytes=layer)
        self.x = x

    def step(self) -> None:
        self.engine(self.x).square().mean().backward()
        for p in self.array.parameters():
            p.grad = None

    def forward(self) -> None:
        with torch.no_grad():
            self.engine(self.x)

    def close(self) -> None:
        self.engine.close()


class _Together:
    """The arrays alternated: one transfer, one ledger."""

    def __init__(
        self, arrays: list[hs.FusedArray], delay: float, layer: int, xs: list[torch.Tensor]
    ) -> None:
        self.arrays = [copy.deepcopy(a) for a in arrays]
        self.alt = AlternatingArrays(self.arrays, transfer=CpuTransfer(delay), shard_bytes=layer)
        self.xs = xs

    def step(self) -> None:
        outs = self.alt.forward(self.xs)
        self.alt.backward([o.square().mean() for o in outs])
        for a in self.arrays:
            for p in a.parameters():
                p.grad = None

    def close(self) -> None:
        self.alt.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--size", type=int, default=4, help="array size B of each array")
    parser.add_argument("--batch-a", type=int, default=8, help="array a's batch (small)")
    parser.add_argument("--batch-b", type=int, default=1024, help="array b's batch (large)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per arm and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--factors", type=float, nargs="+", default=[0.5, 0.75, 1.0, 1.5])
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's own)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "offload_alternate_cpu")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    n = args.layers
    array = _array(n, args.width, args.size)
    layer = args.size * (args.width * args.width + args.width) * 4
    xs = [torch.randn(args.batch_a, args.width), torch.randn(args.batch_b, args.width)]
    fetches = 2 * (2 * n - 1)  # per array: n in the forward, n - 1 in the backward

    # the computes, to set the delays (measured again in every round)
    plain = [_Alone(array, 0.0, layer, x) for x in xs]
    for p in plain:
        assert len(p.engine.shards) == n
        p.step()
    calibration = max(5, args.steps)  # the delays rest on it: more steps than a round's
    balanced = sum(median_step(p.step, calibration) for p in plain) / fetches
    for p in plain:
        p.close()

    load = [os.getloadavg()]
    rows, cells = [], []
    for factor in args.factors:
        delay = factor * balanced
        arms: dict[str, _Alone | _Together] = {
            "compute a": _Alone(array, 0.0, layer, xs[0]),
            "compute b": _Alone(array, 0.0, layer, xs[1]),
            "alone a": _Alone(array, delay, layer, xs[0]),
            "alone b": _Alone(array, delay, layer, xs[1]),
            "alternated": _Together([array, array], delay, layer, xs),
        }
        for arm in arms.values():
            arm.step()  # warm-up (traces)
        times: dict[str, list[float]] = {name: [] for name in [*arms, "forward a", "forward b"]}
        for _ in range(args.rounds):
            for name, arm in arms.items():
                times[name].append(median_step(arm.step, args.steps))
                if name.startswith("compute") and isinstance(arm, _Alone):
                    times[f"forward {name[-1]}"].append(median_step(arm.forward, args.steps))
        for arm in arms.values():
            arm.close()
        load.append(os.getloadavg())
        t = {name: statistics.median(v) for name, v in times.items()}
        computes = t["compute a"] + t["compute b"]
        transfers = fetches * delay
        alone = t["alone a"] + t["alone b"]
        # the arrays alternate in lockstep: both forwards, then both backwards; per phase the
        # larger of its transfers and its computes (the backward's: the step's less the
        # forward's, without an autograd graph)
        forwards = t["forward a"] + t["forward b"]
        phases = max(2 * n * delay, forwards) + max(
            2 * (n - 1) * delay, max(computes - forwards, 0.0)
        )
        row = {
            "factor": factor,
            "delay_ms": delay * 1e3,
            "compute_a_ms": t["compute a"] * 1e3,
            "compute_b_ms": t["compute b"] * 1e3,
            "sum_of_computes_ms": computes * 1e3,
            "sum_of_transfers_ms": transfers * 1e3,
            "max_model_ms": max(computes, transfers) * 1e3,
            "forward_a_ms": t["forward a"] * 1e3,
            "forward_b_ms": t["forward b"] * 1e3,
            "phase_model_ms": phases * 1e3,
            "alone_a_ms": t["alone a"] * 1e3,
            "alone_b_ms": t["alone b"] * 1e3,
            "alone_sum_ms": alone * 1e3,
            "alternated_ms": t["alternated"] * 1e3,
            "alternated/alone": t["alternated"] / alone,
            "ranges_ms": {k: [min(v) * 1e3, max(v) * 1e3] for k, v in times.items()},
        }
        rows.append(row)
        cells.append(
            [
                f"{factor:g}",
                f"{delay * 1e3:.1f}",
                f"{t['compute a'] * 1e3:.0f}",
                f"{t['compute b'] * 1e3:.0f}",
                f"{transfers * 1e3:.0f}",
                f"{max(computes, transfers) * 1e3:.0f}",
                f"{phases * 1e3:.0f}",
                f"{t['alone a'] * 1e3:.0f}",
                f"{t['alone b'] * 1e3:.0f}",
                f"{alone * 1e3:.0f}",
                f"{t['alternated'] * 1e3:.0f}",
                f"{t['alternated'] / alone:.2f}",
            ]
        )
    notes = [
        f"- two arrays of {n} x Linear({args.width}, {args.width}), one layer per shard, B = "
        f"{args.size} each, float32, {torch.get_num_threads()} torch threads; a on a batch of {args.batch_a} (transfer-bound), b on "
        f"{args.batch_b} (compute-bound)",
        f"- delay per fetch: the factor times {balanced * 1e3:.1f} ms, where the sum of both "
        f"arrays' transfers ({fetches} fetches a step together: per array {n} in the forward, "
        f"{n - 1} in the backward) equals the sum of their computes as measured first",
        "- compute a, b: each alone without delay; sum of transfers: fetches x delay; max "
        "model: the larger of the sum of transfers and the sum of computes (a + b); alone: "
        "each with the delay and prefetch, one after the other (their sum); alternated: both "
        "stepped together by AlternatingArrays with one delayed transfer",
        f"- phase model: the arrays alternate in lockstep (both forwards, then both "
        f"backwards), so per phase the larger of its transfers ({2 * n} fetches in the "
        f"forward, {2 * (n - 1)} in the backward) and its computes (the forward: each array's "
        "forward without autograd, timed in the rounds; the backward: the no-delay steps less "
        "those forwards), added up",
        f"- medians of {args.steps} steps per arm and round, {args.rounds} alternating rounds; "
        "a step is forward and backward (no optimizer step)",
        "- load average (1, 5, 15 min) before and after each factor: "
        + "; ".join(", ".join(f"{v:.1f}" for v in la) for la in load)
        + " (other jobs shared the 2 cores: compute times are noisy, the injected delays are "
        "not)",
        "- on a CPU a transfer is a copy in one memory: the delay stands in for a link",
    ]
    columns = [
        "factor",
        "delay ms",
        "compute a ms",
        "compute b ms",
        "sum of transfers ms",
        "max model ms",
        "phase model ms",
        "alone a ms",
        "alone b ms",
        "alone a + b ms",
        "alternated ms",
        "alternated / alone",
    ]
    write_results(
        args.out,
        "offload_alternate.py",
        argv,
        torch.device("cpu"),
        "Offload: two arrays' shards alternated against each alone with prefetch (CPU)",
        notes,
        columns,
        cells,
        rows,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
