"""Training throughput of B models: one after another, as one fused array, and the ideal bound.

For each model and array size B this measures member-samples per second (B x batch / step time)
of one full training step (forward, backward, SGD update) done three ways, side by side in one run:

* ``serial``: B independent models, each with its own ``torch.optim.SGD``, stepped one after another
  (what a sweep does when it runs one trial at a time on the device);
* ``fused``: ``hs.fuse`` of the same B models, per-member losses summed, one SGD over the stacked
  parameters (the same update as B separate SGDs with one learning rate);
* ``ideal``: one model trained on a batch B times larger, the same arithmetic with no fusion
  overhead at all; fused can approach but not beat it;
* ``hand`` (MLPs only): the same B MLPs written by hand as one ``baddbmm`` per layer over stacked
  weights, the HFTA-style implementation the engine is meant to match without being written.

Rounds interleave the three ways and the median round is reported, so a slow moment of the machine
hits all of them alike. Usage::

    python benchmarks/fusion_throughput.py                 # CPU, writes benchmarks/results/
    python benchmarks/fusion_throughput.py --device cuda
    python benchmarks/fusion_throughput.py --models tiny_mlp --sizes 1 32 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from _results import RESULTS, write_results
from torch import nn

import hfsweep as hs


def tiny_mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10)
    )


def medium_mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10)
    )


class SmallCNN(nn.Module):
    """LeNet-style CNN on 1x28x28 inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 5)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 4 * 4, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = x.flatten(1)
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "tiny_mlp": (tiny_mlp, (64,)),
    "medium_mlp": (medium_mlp, (64,)),
    "small_cnn": (SmallCNN, (1, 28, 28)),
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(step: Callable[[], None], iters: int, device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        step()
    _sync(device)
    return (time.perf_counter() - start) / iters


def make_steps(
    name: str, size: int, batch: int, device: torch.device
) -> dict[str, Callable[[], None]]:
    build, shape = MODELS[name]
    torch.manual_seed(0)
    models = [build().to(device) for _ in range(size)]
    x = torch.randn(batch, *shape, device=device)
    y = torch.randint(0, 10, (batch,), device=device)

    opts = [torch.optim.SGD(m.parameters(), lr=0.01) for m in models]

    def serial() -> None:
        for m, o in zip(models, opts, strict=True):
            o.zero_grad(set_to_none=True)
            F.cross_entropy(m(x), y).backward()
            o.step()

    array = hs.fuse(models)
    fused_opt = torch.optim.SGD(array.parameters(), lr=0.01)

    def fused() -> None:
        fused_opt.zero_grad(set_to_none=True)
        hs.member_losses(array(x), y).sum().backward()
        fused_opt.step()

    big = build().to(device)
    big_opt = torch.optim.SGD(big.parameters(), lr=0.01)
    xb = x.repeat(size, *([1] * len(shape)))
    yb = y.repeat(size)

    def ideal() -> None:
        big_opt.zero_grad(set_to_none=True)
        F.cross_entropy(big(xb), yb).backward()
        big_opt.step()

    steps = {"serial": serial, "fused": fused, "ideal": ideal}
    if isinstance(models[0], nn.Sequential):
        steps["hand"] = _hand_written(models, x, y)
    return steps


def _hand_written(models: list[nn.Module], x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    """One baddbmm per Linear over stacked weights, ReLU between, per-member mean losses."""
    linears = [[m for m in model if isinstance(m, nn.Linear)] for model in models]
    weights = [
        torch.stack([ls[k].weight.detach() for ls in linears]).requires_grad_()
        for k in range(len(linears[0]))
    ]
    biases = [
        torch.stack([ls[k].bias.detach() for ls in linears]).requires_grad_()
        for k in range(len(linears[0]))
    ]
    opt = torch.optim.SGD([*weights, *biases], lr=0.01)
    size, batch = len(models), x.shape[0]

    def hand() -> None:
        opt.zero_grad(set_to_none=True)
        h = x.expand(size, *x.shape)
        for k, (w, b) in enumerate(zip(weights, biases, strict=True)):
            h = torch.baddbmm(b.unsqueeze(1), h, w.transpose(1, 2))
            if k < len(weights) - 1:
                h = h.relu()
        losses = F.cross_entropy(h.flatten(0, 1), y.repeat(size), reduction="none")
        losses.view(size, batch).mean(1).sum().backward()
        opt.step()

    return hand


def measure(
    name: str, size: int, batch: int, device: torch.device, rounds: int, min_time: float
) -> dict[str, float | list[float]]:
    """Median member-samples/s of each way, and per-round ratios (fused/serial, fused/ideal)."""
    steps = make_steps(name, size, batch, device)
    iters = {}
    for way, step in steps.items():
        for _ in range(3):
            step()  # warm-up: traces, allocator, thread pools
        t = _time(step, 1, device)
        iters[way] = max(1, int(min_time / max(t, 1e-6)))
    samples: dict[str, list[float]] = {way: [] for way in steps}
    for _ in range(rounds):
        for way, step in steps.items():
            samples[way].append(_time(step, iters[way], device))
    result: dict[str, float | list[float]] = {
        way: size * batch / statistics.median(ts) for way, ts in samples.items()
    }
    result["fused/serial rounds"] = [
        s / f for s, f in zip(samples["serial"], samples["fused"], strict=True)
    ]
    result["fused/ideal rounds"] = [
        i / f for i, f in zip(samples["ideal"], samples["fused"], strict=True)
    ]
    if "hand" in samples:
        result["hand"] = size * batch / statistics.median(samples["hand"])
        result["fused/hand rounds"] = [
            h / f for h, f in zip(samples["hand"], samples["fused"], strict=True)
        ]
    return result


def _ratio(row: dict, key: str) -> str:
    rounds = row.get(f"{key} rounds")
    if rounds is None:
        return "-"
    return f"{statistics.median(rounds):.2f} ({min(rounds):.2f}-{max(rounds):.2f})"


def _rate(row: dict, key: str) -> str:
    return f"{row[key]:.0f}" if key in row else "-"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--sizes", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--min-time", type=float, default=0.2, help="seconds per timed round")
    parser.add_argument("--out", type=Path, default=None, help="results file stem")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    rows = []
    print(
        f"{'model':12s} {'B':>3s} {'serial':>10s} {'fused':>10s} {'ideal':>10s} {'hand':>10s} "
        f"{'fused/serial':>18s} {'fused/ideal':>18s} {'fused/hand':>18s}",
        flush=True,
    )
    for name in args.models:
        for size in args.sizes:
            r = measure(name, size, args.batch, device, args.rounds, args.min_time)
            row = {"model": name, "B": size, **r}
            rows.append(row)
            print(
                f"{name:12s} {size:3d} {r['serial']:10.0f} {r['fused']:10.0f} {r['ideal']:10.0f} "
                f"{_rate(row, 'hand'):>10s} {_ratio(row, 'fused/serial'):>18s} "
                f"{_ratio(row, 'fused/ideal'):>18s} {_ratio(row, 'fused/hand'):>18s}",
                flush=True,
            )
    write_results(
        args.out or RESULTS / f"fusion_throughput_{device.type}",
        "fusion_throughput.py",
        argv,
        device,
        "Training throughput: serial vs fused vs ideal batching",
        [
            f"- one step = forward + backward + SGD update, batch {args.batch} per member; "
            f"median of {args.rounds} interleaved rounds",
            "",
            "Member-samples/s, median over rounds (higher is better). `hand` is the MLPs written",
            "by hand as one `baddbmm` per layer (what the engine must match without being",
            "written). The ratios are the median of the per-round ratios, with their range across",
            "rounds in parentheses: that range is how much this machine's speed moved while the",
            "ways ran side by side.",
        ],
        [
            "model",
            "B",
            "serial",
            "fused",
            "ideal",
            "hand",
            "fused / serial",
            "fused / ideal",
            "fused / hand",
        ],
        [
            [
                row["model"],
                str(row["B"]),
                f"{row['serial']:.0f}",
                f"{row['fused']:.0f}",
                f"{row['ideal']:.0f}",
                _rate(row, "hand"),
                _ratio(row, "fused/serial"),
                _ratio(row, "fused/ideal"),
                _ratio(row, "fused/hand"),
            ]
            for row in rows
        ],
        rows,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
