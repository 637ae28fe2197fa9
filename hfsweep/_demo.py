"""``hfsweep demo``: B MLPs on scikit-learn's bundled digits, trained fused and one after another.

Until the sweep engine lands this is the project's main job: it shows the members training
together in one array, each with its own initialisation, learning rate and dropout probability,
reports every member's validation accuracy, and times the same training done one model at a time.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import optim as fused_optim
from .fusion import fuse, member_losses
from .tasks import digits
from .testing import MLP


@dataclass
class DemoResult:
    """What the demo measured."""

    accuracy: list[float]
    dropout: list[float]
    lr: list[float]
    trace_seconds: float
    fused_seconds: float
    serial_seconds: float
    samples: int


def _batches(n: int, batch: int, gen: torch.Generator) -> Iterator[Tensor]:
    order = torch.randperm(n, generator=gen)
    for start in range(0, n, batch):
        yield order[start : start + batch]


def _train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    loss: Callable[[Tensor, Tensor], Tensor],
    data: tuple[Tensor, Tensor],
    epochs: int,
    batch: int,
    seed: int,
) -> None:
    """Plain minibatch training; the same loop for the fused array and for one model."""
    x, y = data
    gen = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(epochs):
        for idx in _batches(len(y), batch, gen):
            opt.zero_grad(set_to_none=True)
            loss(model(x[idx]), y[idx]).backward()
            opt.step()


def _summed_member_losses(out: Tensor, y: Tensor) -> Tensor:
    return member_losses(out, y).sum()


def run_demo(
    members: int = 16,
    epochs: int = 20,
    batch: int = 64,
    lr: float = 0.05,
    seed: int = 0,
    out: Path | None = None,
    serial: bool = True,
) -> DemoResult:
    """Train ``members`` MLPs fused (and, if ``serial``, one after another) and report.

    Member i gets its own dropout probability and learning rate (``lr`` scaled by 1/4 to 4 over
    the members, log-spaced), as a small sweep would give them.
    """
    try:
        x, y, xv, yv = digits(seed, standardize=False)
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise SystemExit(f"hfsweep demo: {exc}") from exc
    dropout = [round(0.5 * i / max(members - 1, 1), 3) for i in range(members)]
    lrs = [lr * 16 ** (i / max(members - 1, 1)) / 4 for i in range(members)]
    models = []
    for i, p in enumerate(dropout):
        torch.manual_seed(seed + i)
        models.append(MLP(d_in=64, hidden=64, d_out=10, depth=2, dropout=p))
    alone = [copy.deepcopy(m) for m in models]

    array = fuse(models)
    # One-time cost: tracing the array's forward for the two batch sizes an epoch has.
    start = time.perf_counter()
    for n in {batch, len(y) % batch or batch}:
        array(x[:n])
    trace_seconds = time.perf_counter() - start
    opt = fused_optim.SGD(array, lr=lrs, momentum=0.9)
    start = time.perf_counter()
    _train(array, opt, _summed_member_losses, (x, y), epochs, batch, seed)
    fused_seconds = time.perf_counter() - start

    array.eval()
    with torch.no_grad():
        accuracy = (array(xv).argmax(-1) == yv).float().mean(-1).tolist()

    serial_seconds = float("nan")
    if serial:
        start = time.perf_counter()
        for m, member_lr in zip(alone, lrs, strict=True):
            one_opt = torch.optim.SGD(m.parameters(), lr=member_lr, momentum=0.9)
            _train(m, one_opt, F.cross_entropy, (x, y), epochs, batch, seed)
        serial_seconds = time.perf_counter() - start

    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        best = max(range(members), key=lambda i: accuracy[i])
        torch.save(array.member(best).state_dict(), out / "best_member.pt")
    return DemoResult(
        accuracy,
        dropout,
        lrs,
        trace_seconds,
        fused_seconds,
        serial_seconds,
        epochs * len(y) * members,
    )


def print_demo(result: DemoResult) -> None:
    """The demo's report: one row per member, then throughput of both ways."""
    print(f"{'member':>6}  {'lr':>8}  {'dropout p':>9}  {'val accuracy':>12}")
    rows = zip(result.lr, result.dropout, result.accuracy, strict=True)
    for i, (lr, p, acc) in enumerate(rows):
        print(f"{i:>6}  {lr:>8.4f}  {p:>9.3f}  {acc:>12.4f}")
    best = max(range(len(result.accuracy)), key=lambda i: result.accuracy[i])
    print(
        f"best member: {best} (lr={result.lr[best]:.4f}, dropout p={result.dropout[best]}, "
        f"accuracy {result.accuracy[best]:.4f})"
    )
    fused_rate = result.samples / result.fused_seconds
    print(f"tracing (once):     {result.trace_seconds:7.2f} s")
    print(f"fused array:        {result.fused_seconds:7.2f} s  {fused_rate:10.0f} member-samples/s")
    if result.serial_seconds == result.serial_seconds:  # not NaN
        serial_rate = result.samples / result.serial_seconds
        print(
            f"one after another:  {result.serial_seconds:7.2f} s  {serial_rate:10.0f} member-samples/s"
        )
        total = result.trace_seconds + result.fused_seconds
        print(
            f"speed-up: {result.serial_seconds / result.fused_seconds:.1f}x "
            f"({result.serial_seconds / total:.1f}x counting the tracing)"
        )
