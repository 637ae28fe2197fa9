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
import json
import statistics
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import torch
from fusion_throughput import MODELS, RESULTS, _sync, machine

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

    def timed(fn: Callable[[], None]) -> float:
        _sync(device)
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        _sync(device)
        return (time.perf_counter() - start) / iters

    for fn in (step_separate, step_fused):
        for _ in range(5):
            fn()
    sep, fus = [], []
    for _ in range(rounds):
        sep.append(timed(step_separate))
        fus.append(timed(step_fused))
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
    stem = args.out or RESULTS / f"optimizer_step_{device.type}"
    command = "python benchmarks/optimizer_step.py " + " ".join(argv or sys.argv[1:])
    meta = {
        "machine": machine(device),
        "torch": torch.__version__,
        "hfsweep": hs.__version__,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "command": command.strip(),
    }
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    lines = [
        "# Optimizer step: one fused optimizer vs B torch.optim optimizers (foreach)",
        "",
        f"- machine: {meta['machine']}",
        f"- torch {meta['torch']}, hfsweep {meta['hfsweep']}, {meta['date']}",
        f"- command: `{meta['command']}`",
        f"- median of {args.rounds} interleaved rounds of {args.iters} steps; per-member learning "
        "rates; speed-up range across rounds in parentheses",
        "",
        "| model | optimizer | B | B separate (ms) | fused (ms) | speed-up |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['model']} | {row['optimizer']} | {row['B']} | "
            f"{row['separate_ms']:.3f} | {row['fused_ms']:.3f} | {row['speedup']} |"
        )
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {stem.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
