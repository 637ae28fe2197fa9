"""Dropout masks: the cost of one call of the fused dropout op, every member's mask at once.

    python benchmarks/dropout_masks.py [--device cpu] [--rounds R] [--out STEM]

For each size (members x elements per member) three ways make the same number of scaled mask
elements (0 or ``1 / (1 - p)``), one after another in each round:

- ``op``: ``hfsweep::dropout_multiplier``, what a fused array's dropout layer calls (on the CPU,
  the 32-bit hash in NumPy ``uint32``);
- ``torch ops``: the op's definition in torch's ``int64`` ops (``dropout_mask_hash``, threshold,
  scale): the same values, as the op computes them on a GPU;
- ``bernoulli``: ``torch.bernoulli_`` of the same number of elements times the scale, what
  ``nn.Dropout`` draws for the same elements in separate models.

The median over rounds is reported. Writes ``results/dropout_masks_<device>.{md,json}``, or
``STEM.{md,json}`` with ``--out``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from _results import RESULTS, write_results

from hfsweep.nn._dropout import _keep_threshold, _scale, dropout_mask_hash

#: (members, elements per member): a small MLP's hidden layer at batch 64 for 3, 10 and 32
#: members, then larger activations
SIZES = [(3, 4096), (10, 4096), (32, 4096), (32, 16384), (8, 1 << 17), (8, 1 << 20)]
WAYS = ["op", "torch ops", "bernoulli"]


def _time(fn: Callable[[], object], device: torch.device, min_seconds: float = 0.05) -> float:
    """Seconds per call: calls repeated until ``min_seconds`` have passed."""
    fn()
    calls, start = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds:
            return elapsed / calls


def _ways(rows: int, numel: int, device: torch.device) -> dict[str, Callable[[], object]]:
    seed = torch.arange(rows, device=device) * 7919 + 3
    calls = torch.arange(rows, device=device) * 5
    p = torch.linspace(0.1, 0.5, rows, device=device)
    op = torch.ops.hfsweep.dropout_multiplier
    scale = _scale(p, torch.float32).unsqueeze(-1)
    threshold = _keep_threshold(p).unsqueeze(-1)
    keep = (1 - p).unsqueeze(-1).expand(rows, numel)
    return {
        "op": lambda: op(seed, calls, p, 0, numel, torch.float32),
        "torch ops": lambda: (dropout_mask_hash(seed, calls, 0, numel) >= threshold) * scale,
        "bernoulli": lambda: torch.bernoulli(keep) * scale,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--sizes", nargs="+", default=None, help="members x elements, e.g. 32x4096 (default: all)"
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    sizes = SIZES if args.sizes is None else [tuple(map(int, s.split("x"))) for s in args.sizes]
    rows = []
    print(f"{'members':>7s} {'elements':>9s} " + " ".join(f"{w + ' ms':>13s}" for w in WAYS))
    for members, numel in sizes:
        ways = _ways(members, numel, device)
        times: dict[str, list[float]] = {w: [] for w in WAYS}
        for _ in range(args.rounds):
            for w in WAYS:
                times[w].append(_time(ways[w], device))
        ms = {w: statistics.median(t) * 1e3 for w, t in times.items()}
        rows.append(
            {"members": members, "elements": numel, **{f"{w}_ms": v for w, v in ms.items()}}
        )
        print(f"{members:7d} {numel:9d} " + " ".join(f"{ms[w]:13.3f}" for w in WAYS), flush=True)
    write_results(
        args.out or RESULTS / f"dropout_masks_{device.type}",
        "dropout_masks.py",
        argv,
        device,
        "Dropout masks: one call of the fused op against its definition in torch ops and "
        "torch.bernoulli_",
        [
            f"- milliseconds per call, median of {args.rounds} rounds (the three ways one after "
            "another in each); float32 multipliers; `elements` is per member",
            "- `op`: `hfsweep::dropout_multiplier` (on the CPU: NumPy `uint32`); `torch ops`: "
            "its definition in torch `int64` ops, which the GPU runs; `bernoulli`: "
            "`torch.bernoulli` of the same elements times the scale",
        ],
        ["members", "elements", *(f"{w} (ms)" for w in WAYS), "torch ops / op"],
        [
            [
                str(r["members"]),
                str(r["elements"]),
                *(f"{r[f'{w}_ms']:.3f}" for w in WAYS),
                f"{r['torch ops_ms'] / r['op_ms']:.1f}x",
            ]
            for r in rows
        ],
        rows,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
