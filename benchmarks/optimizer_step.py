"""Optimizer step time: one fused hs.optim optimizer vs B separate torch.optim optimizers.

Both sides update the same B models' parameters with the same gradients; the torch side uses
its multi-tensor ``foreach`` implementation (its fastest on CPU). Each member gets its own learning
rate. Only ``step()`` is timed. Rounds interleave the two sides; the median round is reported,
with the range of the per-round speed-up. Usage::

    python benchmarks/optimizer_step.py            # writes benchmarks/results/optimizer_step_cpu.md
    python benchmarks/optimizer_step.py --device cuda
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
from _results import RESULTS, write_results
from fusion_throughput import MODELS, _time

import hfsweep as hs

OPTIMIZERS: dict[str, tuple[Callable[..., torch.optim.Optimizer], type, dict]] = {
    "SGD-momentum": (hs.optim.SGD, torch.optim.SGD, {"momentum": 0.9, "weight_decay": 1e-4}),
    "AdamW": (hs.optim.AdamW, torch.optim.AdamW, {"weight_decay": 1e-2}),
}


def measure(
    model: str, opt_name: str, size: int, device: torch.device, rounds: int, iters: int
) -> dict[str, float | list[float]]:
    build = MODELS[model][0]
    fused_cls, torch_cls, kwargs = OPTIMIZERS[opt_name]
    torch.manual_seed(0)
    models = [build().to(device) for _ in range(size)]
    lrs = [1e-3 * (1 + i / size) for i in range(size)]
    separate = [
        torch_cls(m.parameters(), lr=lr, foreach=True, **kwargs)
        for m, lr in zip(models, lrs, strict=True)
    ]
    array = hs.fuse(models)
    fused = fused_cls(array, lr=lrs, **kwargs)
    for p in [*array.parameters(), *(q for m in models for q in m.parameters())]:
        p.grad = torch.randn_like(p) * 1e-3

    def step_separate() -> None:
        for o in separate:
            o.step()

    def step_fused() -> None:
        fused.step()

    for fn in (step_separate, step_fused):
        for _ in range(5):
            fn()
    sep, fus = [], []
    for _ in range(rounds):
        sep.append(_time(step_separate, iters, device))
        fus.append(_time(step_fused, iters, device))
    return {
        "separate_ms": statistics.median(sep) * 1e3,
        "fused_ms": statistics.median(fus) * 1e3,
        "speedup_rounds": [s / f for s, f in zip(sep, fus, strict=True)],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sizes", nargs="+", type=int, default=[8, 32])
    parser.add_argument("--models", nargs="+", default=["tiny_mlp", "medium_mlp"])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    rows = []
    print(
        f"{'model':12s} {'optimizer':13s} {'B':>3s} {'separate ms':>12s} {'fused ms':>9s} "
        f"{'speed-up (range)':>20s}",
        flush=True,
    )
    for model in args.models:
        for opt_name in OPTIMIZERS:
            for size in args.sizes:
                r = measure(model, opt_name, size, device, args.rounds, args.iters)
                sp = r["speedup_rounds"]
                assert isinstance(sp, list)
                text = f"{statistics.median(sp):.1f} ({min(sp):.1f}-{max(sp):.1f})"
                rows.append(
                    {"model": model, "optimizer": opt_name, "B": size, **r, "speedup": text}
                )
                print(
                    f"{model:12s} {opt_name:13s} {size:3d} {r['separate_ms']:12.3f} "
                    f"{r['fused_ms']:9.3f} {text:>20s}",
                    flush=True,
                )
    write_results(
        args.out or RESULTS / f"optimizer_step_{device.type}",
        "optimizer_step.py",
        argv,
        device,
        "Optimizer step: one fused optimizer vs B torch.optim optimizers (foreach)",
        [
            f"- median of {args.rounds} interleaved rounds of {args.iters} steps; per-member "
            "learning rates; speed-up range across rounds in parentheses",
        ],
        ["model", "optimizer", "B", "B separate (ms)", "fused (ms)", "speed-up"],
        [
            [
                row["model"],
                row["optimizer"],
                str(row["B"]),
                f"{row['separate_ms']:.3f}",
                f"{row['fused_ms']:.3f}",
                row["speedup"],
            ]
            for row in rows
        ],
        rows,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
