"""Ways to compute a fused MLP's stacked Linears, forward and backward, without the engine.

Issue 21 asked how to drop the stacked Linear's Python ``autograd.Function`` while keeping the
weights' gradients in their ``[B, out, in]`` layout. This times the candidates on plain stacked
tensors (no array, no optimizer: forward, cross-entropy and backward of the tiny and medium
MLPs), in alternating rounds (each way's fastest round, and its time over ``function``'s
paired round by round):

* ``function``: the ``autograd.Function`` (``hfsweep/fusion/_graph_linear.py``), activations
  ``[B, N, features]``;
* ``features_first``: ``h_next^T = baddbmm(b.unsqueeze(-1), w, h^T)`` with autograd's own
  derivative, the output back to ``[B, N, out]`` with one ``transpose_copy`` (what the engine
  does now, ``hfsweep/fusion/_graph_features_first.py``);
* ``last_function``: features-first but the last layer through the ``autograd.Function`` (its
  output needs no copy);
* ``conv1d``: each layer a 1x1 ``conv1d`` over ``[1, B * features, N]``, the members in the
  channels (groups = B; ``convolution_backward`` computes all three gradients in one operator).

Usage::

    OMP_NUM_THREADS=1 python benchmarks/linear_variants.py  # results/linear_variants_cpu_issue21_linear
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from _results import RESULTS, write_results
from torch import Tensor

from hfsweep.fusion._graph_linear import stacked_linear
from hfsweep.testing._op_counts import OpCounter

_DIMS = {"tiny_mlp": [64, 32, 32, 10], "medium_mlp": [64, 128, 128, 10]}


def _ways(
    size: int, dims: list[int], rows: int
) -> tuple[list[Tensor], dict[str, Callable[[], Tensor]]]:
    gen = torch.Generator().manual_seed(0)
    ws = [
        torch.randn(size, o, i, generator=gen).requires_grad_() for i, o in itertools.pairwise(dims)
    ]
    bs = [torch.randn(size, o, generator=gen).requires_grad_() for o in dims[1:]]
    x = torch.randn(rows, dims[0], generator=gen)
    last = len(ws) - 1

    def function() -> Tensor:
        h = x.view(1, -1, dims[0]).expand(size, -1, -1)
        for k, (w, b) in enumerate(zip(ws, bs, strict=True)):
            h = stacked_linear(h, w, b, True)
            h = torch.relu(h) if k < last else h
        return h

    def features_first() -> Tensor:
        h = x.t().expand(size, -1, -1)
        for k, (w, b) in enumerate(zip(ws, bs, strict=True)):
            h = torch.baddbmm(b.unsqueeze(-1), w, h)
            h = torch.relu(h) if k < last else h
        return torch.transpose_copy(h, 1, 2)

    def last_function() -> Tensor:
        h = x.t().expand(size, -1, -1)
        for k, (w, b) in enumerate(zip(ws, bs, strict=True)):
            if k < last:
                h = torch.relu(torch.baddbmm(b.unsqueeze(-1), w, h))
            else:
                h = stacked_linear(h.transpose(1, 2), w, b, True)
        return h

    def conv1d() -> Tensor:
        h = x.t().unsqueeze(0)
        for k, (w, b) in enumerate(zip(ws, bs, strict=True)):
            h = F.conv1d(h, w.view(-1, w.shape[2], 1), b.view(-1), groups=1 if k == 0 else size)
            h = torch.relu(h) if k < last else h
        return h.view(size, dims[-1], rows).transpose(1, 2)

    ways = {
        "function": function,
        "features_first": features_first,
        "last_function": last_function,
        "conv1d": conv1d,
    }
    return [*ws, *bs], ways


def _step(params: list[Tensor], y: Tensor, classes: int) -> Callable[[Callable[[], Tensor]], None]:
    """One training step's forward, loss and backward through a way."""

    def step(f: Callable[[], Tensor]) -> None:
        for p in params:
            p.grad = None
        F.cross_entropy(f().reshape(-1, classes), y).backward()

    return step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", type=int, default=[8, 32])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    load_start = os.getloadavg()
    rows, cells = [], []
    for name, dims in _DIMS.items():
        for size in args.sizes:
            params, ways = _ways(size, dims, args.rows)
            y = torch.randint(0, dims[-1], (args.rows,)).repeat(size)
            ref = ways["function"]()
            for f in ways.values():
                torch.testing.assert_close(f(), ref, rtol=1e-3, atol=1e-3)

            step = _step(params, y, dims[-1])
            times: dict[str, list[float]] = {k: [] for k in ways}
            for r in range(args.rounds):
                order = list(ways.items())
                for label, f in order if r % 2 == 0 else order[::-1]:
                    start = time.perf_counter()
                    for _ in range(args.iters):
                        step(f)
                    times[label].append((time.perf_counter() - start) / args.iters)
            best = {k: min(v) for k, v in times.items()}
            # each round's time over the function's in the same round: the machine's other
            # work moves the ways of one round alike
            paired = {
                k: statistics.median(a / b for a, b in zip(v, times["function"], strict=True))
                for k, v in times.items()
            }
            ops = {}
            for label, f in ways.items():
                with OpCounter() as c:
                    step(f)
                ops[label] = c.total
            row = {"model": name, "B": size, **{f"{k} us": v * 1e6 for k, v in best.items()}}
            row.update({f"{k} paired": v for k, v in paired.items()})
            row.update({f"{k} ops": v for k, v in ops.items()})
            rows.append(row)
            cells.append(
                [name, str(size)]
                + [
                    f"{best[k] * 1e6:.0f}, {best[k] / best['function']:.2f}, {paired[k]:.2f}; {ops[k]}"
                    for k in ways
                ]
            )
            print(cells[-1], flush=True)
    load_end = os.getloadavg()
    notes = [
        f"- rows {args.rows}; {args.rounds} rounds of {args.iters} steps per way, alternating "
        "(every other round backwards); each cell: us per step at the way's fastest round, its "
        "ratio to `function`'s fastest, the median over rounds of its time over `function`'s "
        "in the same round; operators one step dispatches",
        f"- torch threads {torch.get_num_threads()}; load average at the start "
        f"{load_start[0]:.2f} {load_start[1]:.2f}, at the end {load_end[0]:.2f} {load_end[1]:.2f}",
    ]
    write_results(
        args.out or RESULTS / "linear_variants_cpu_issue21_linear",
        "linear_variants.py",
        argv,
        torch.device("cpu"),
        "A stacked MLP's Linears four ways (forward, loss, backward)",
        notes,
        ["model", "B", "function", "features_first", "last_function", "conv1d"],
        cells,
        rows,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
