"""The MLPs' matrix products three ways: B batched products, one product over B members, ideal.

The fused MLPs stay below the ideal bound on this CPU, and so does the hand-written version, so
the question is whether B small products (``bmm``) are themselves slower than the one product
the ideal does over B times the rows, and whether an exact rewrite the engine could make would
do better. For each Linear layer of ``tiny_mlp`` and ``medium_mlp`` (``fusion_throughput.py``),
batch 64 per member, this times the products of a training step:

* ``batched``: what the engine runs, one ``baddbmm`` over the stacked ``[B, out, in]`` weights
  (the shared input of the first layer expanded, not copied, to ``[B, N, in]``), and in the
  backward the weight gradient as one ``bmm`` (``grad^T @ x``) and the input's (past the first
  layer) as one ``bmm`` (``grad @ w``);
* ``one product`` (the first layer only, whose input every member shares): all members' weights
  as one ``[B * out, in]`` matrix, the forward one ``addmm`` ``[N, in] @ [in, B * out]`` and
  the weight gradient one ``mm`` ``[B * out, N] @ [N, in]``: the same numbers, one product each;
* ``ideal``: one model on the ``B * N`` rows, ``addmm`` and ``mm`` as ``nn.Linear`` runs them.

Each is timed as CPU time of this thread (``time.thread_time``, one torch thread), so what
other processes take of the core is not counted; the figure is the least of ``--rounds``
interleaved rounds. Usage::

    python benchmarks/stacked_products.py               # writes results/stacked_products_cpu.md
    python benchmarks/stacked_products.py --sizes 8 --rounds 3 --out /tmp/sp
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _results import RESULTS, write_results
from fusion_throughput import MODELS
from torch import nn

Timed = dict[str, Callable[[], Any]]


def _layer_ways(size: int, rows: int, inp: int, out: int, shared: bool) -> Timed:
    """The forward and weight-gradient products of one layer, each way."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(size, out, inp, generator=gen)
    b = torch.randn(size, out, generator=gen)
    x = torch.randn(rows, inp, generator=gen)
    xb = x.expand(size, rows, inp) if shared else torch.randn(size, rows, inp, generator=gen)
    g = torch.randn(size, rows, out, generator=gen)
    w1, b1 = w[0], b[0]
    xi, gi = xb.reshape(size * rows, inp), g.reshape(size * rows, out)
    ways: Timed = {
        "batched forward": lambda: torch.baddbmm(b.unsqueeze(1), xb, w.transpose(1, 2)),
        "batched weight gradient": lambda: torch.bmm(g.transpose(1, 2), xb),
        "ideal forward": lambda: torch.addmm(b1, xi, w1.t()),
        "ideal weight gradient": lambda: torch.mm(gi.t(), xi),
    }
    if not shared:  # the first layer's input needs no gradient
        ways["batched input gradient"] = lambda: torch.bmm(g, w)
        ways["ideal input gradient"] = lambda: torch.mm(gi, w1)
    if shared:
        flat_w, flat_b = w.reshape(size * out, inp), b.reshape(size * out)
        # the output gradient as the one product's output lays it out: [N, B * out]
        flat_g = g.transpose(0, 1).reshape(rows, size * out)
        ways["one product forward"] = lambda: torch.addmm(flat_b, x, flat_w.t())
        ways["one product weight gradient"] = lambda: torch.mm(flat_g.t(), x)
    return ways


def _time(fn: Callable[[], Any], iters: int) -> float:
    start = time.thread_time()
    for _ in range(iters):
        fn()
    return (time.thread_time() - start) / iters * 1e6


def measure(name: str, size: int, rounds: int, iters: int) -> list[dict[str, Any]]:
    """Microseconds per product of each way, for every Linear layer of model ``name``."""
    model = MODELS[name].build()
    rows = MODELS[name].batch
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    out = []
    for k, layer in enumerate(linears):
        ways = _layer_ways(size, rows, layer.in_features, layer.out_features, shared=k == 0)
        for fn in ways.values():
            fn()
        times: dict[str, list[float]] = {w: [] for w in ways}
        for _ in range(rounds):
            for way, fn in ways.items():
                times[way].append(_time(fn, iters))
        row: dict[str, Any] = {
            "model": name,
            "B": size,
            "layer": f"{k} ({layer.in_features}->{layer.out_features})",
            "shared input": k == 0,
        }
        row.update({f"{w} us": min(t) for w, t in times.items()})
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny_mlp", "medium_mlp"])
    parser.add_argument("--sizes", nargs="+", type=int, default=[8, 32])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = [
        row
        for name in args.models
        for size in args.sizes
        for row in measure(name, size, args.rounds, args.iters)
    ]
    cells = []
    for row in rows:
        for part in ("forward", "weight gradient", "input gradient"):
            if f"ideal {part} us" not in row:
                continue
            ideal = row[f"ideal {part} us"]
            batched = row[f"batched {part} us"]
            one = row.get(f"one product {part} us")
            cells.append(
                [
                    row["model"],
                    str(row["B"]),
                    row["layer"],
                    part,
                    f"{batched:.1f}",
                    "-" if one is None else f"{one:.1f}",
                    f"{ideal:.1f}",
                    f"{ideal / batched:.2f}",
                    "-" if one is None else f"{ideal / one:.2f}",
                ]
            )
        print(" | ".join(cells[-1]), flush=True)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    write_results(
        args.out or RESULTS / "stacked_products_cpu",
        "stacked_products.py",
        argv,
        torch.device("cpu"),
        "The MLPs' products: B batched products, one product over B members, ideal",
        [
            f"- load average (1 min) at the end of the run: {load:.2f}",
            f"- CPU time of this thread per product (`time.thread_time`, one torch thread), the "
            f"least of {args.rounds} interleaved rounds of {args.iters} calls; batch 64 per "
            "member",
            "- `batched`: the engine's `baddbmm` over stacked weights (the first layer's shared "
            "input expanded) and `bmm` for the weight gradient; `one product`: the first layer "
            "as one `addmm` over all members' weights and one `mm` for their gradients; "
            "`ideal`: one model's `addmm` and `mm` over B times the rows",
            "- `ideal / batched` and `ideal / one product`: above 1, the way is faster than "
            "ideal's product",
        ],
        [
            "model",
            "B",
            "layer",
            "product",
            "batched us",
            "one product us",
            "ideal us",
            "ideal / batched",
            "ideal / one product",
        ],
        cells,
        rows,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
