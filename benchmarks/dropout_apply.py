"""What keeping a 1-byte dropout mask for the backward costs in time: the fused step, both ways.

    python benchmarks/dropout_apply.py [--models transformer lora_bert] [--sizes 8 16]
        [--rounds R] [--steps S] [--out STEM]

A fused array's dropout multiplies its input by the member's multiplier (0 or ``1 / (1 - p)``
per element) through ``hfsweep::dropout_apply``, whose autograd formula keeps a ``bool`` mask and
one scale per member and rebuilds the multiplier in the backward. Before, the product was
``input * multiplier``, and autograd kept the float multiplier itself. This times one training
step (forward, per-member losses, backward, ``torch.optim.SGD``) of the same fused array both
ways in one process:

- ``mask``: the array as it is;
- ``multiplier``: the array with every call site of the op (fused dropout layers, functional
  dropout, attention dropout) given ``torch.mul`` instead, the code before the change; its
  trace is recorded with that in place, so its replays run the old graph.

The two arrays are built from the same models and alternate step for step in every round (the
ways then meet the machine's load alike); the median over rounds of each way's mean step time is
reported, with the ratio mask / multiplier per round (its median and range). Also per way: the
bytes autograd saves in one step (``saved_tensors_hooks``, distinct storages). Models come from
``fusion_throughput.py`` (``transformer``: dropout 0.1 after attention and in the feed-forward;
``lora_bert``: peft's ``lora_dropout`` 0.1 and BERT's own hidden and attention dropout 0.1).
Writes ``results/dropout_apply_cpu.{md,json}``, or ``STEM.{md,json}`` with ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from _results import RESULTS, write_results
from fusion_throughput import MODELS, _batch
from torch import Tensor

import hfsweep as hs
from hfsweep._malloc import retain_freed_memory

_MIB = 2**20
WAYS = ("mask", "multiplier")
#: the modules that call the op by name: with ``torch.mul`` there, the code before the change
_CALL_SITES = ("hfsweep.nn._dropout", "hfsweep.nn._attention", "hfsweep.fusion._random")


@contextlib.contextmanager
def _old_product() -> Iterator[None]:
    """Every call site of ``apply_multiplier`` multiplies with ``torch.mul`` instead."""
    with contextlib.ExitStack() as stack:
        for name in _CALL_SITES:
            stack.enter_context(mock.patch(f"{name}.apply_multiplier", torch.mul))
        yield


def _way(way: str) -> contextlib.AbstractContextManager[None]:
    return _old_product() if way == "multiplier" else contextlib.nullcontext()


def _step(array: hs.FusedArray, x: Tensor, y: Tensor) -> Callable[[], None]:
    opt = torch.optim.SGD(array.parameters(), lr=0.01)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        hs.member_losses(array(x), y).sum().backward()
        opt.step()

    return step


def _saved_bytes(step: Callable[[], None], array: hs.FusedArray) -> int:
    """Bytes of the distinct storages autograd saves in one step (parameters left out)."""
    params = {p.untyped_storage().data_ptr() for p in array.parameters()}
    storages: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(storages.values())


def measure(model: str, size: int, rounds: int, steps: int) -> dict[str, Any]:
    """One row: both ways on one fused array of ``size`` members of ``model``."""
    spec = MODELS[model]
    torch.manual_seed(0)
    models = [spec.build() for _ in range(size)]
    x, y = _batch(model, spec.batch, torch.device("cpu"))
    arrays = {w: hs.fuse(models) for w in WAYS}
    for i in range(size):
        for a in arrays.values():
            a.manual_seed(i, 100 + i)
    step = {w: _step(a, x, y) for w, a in arrays.items()}
    saved = {}
    for w in WAYS:
        with _way(w):  # the first calls trace (each way's graph holds its own product)
            for _ in range(3):
                step[w]()
            saved[w] = _saved_bytes(step[w], arrays[w])
    wall: dict[str, list[float]] = {w: [] for w in WAYS}
    cpu: dict[str, list[float]] = {w: [] for w in WAYS}
    for _ in range(rounds):
        spent = dict.fromkeys(WAYS, 0.0)
        busy = dict.fromkeys(WAYS, 0.0)
        for _ in range(steps):
            for w in WAYS:
                with _way(w):
                    start, start_cpu = time.perf_counter(), time.thread_time()
                    step[w]()
                    busy[w] += time.thread_time() - start_cpu
                    spent[w] += time.perf_counter() - start
        for w in WAYS:
            wall[w].append(spent[w] / steps)
            cpu[w].append(busy[w] / steps)
    row: dict[str, Any] = {"model": model, "B": size, "batch": spec.batch}
    for kind, times in (("", wall), ("cpu_", cpu)):
        ratios = [m / o for m, o in zip(times["mask"], times["multiplier"], strict=True)]
        row.update({f"{kind}{w}_ms": statistics.median(times[w]) * 1e3 for w in WAYS})
        row.update(
            {
                f"{kind}ratio": statistics.median(ratios),
                f"{kind}ratio_low": min(ratios),
                f"{kind}ratio_high": max(ratios),
            }
        )
    row.update({f"{w}_saved_bytes": saved[w] for w in WAYS})
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["transformer", "lora_bert"])
    parser.add_argument("--sizes", nargs="+", type=int, default=[8, 16])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5, help="steps per way per round")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: the CPU time is one thread's)"
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    for name in args.models:
        if name not in MODELS:
            parser.error(f"--models {name!r} is not one of {sorted(MODELS)}")
    warnings.filterwarnings("ignore")
    retain_freed_memory()  # as the trainer and fusion_throughput.py run
    rows = []
    for name in args.models:
        for size in args.sizes:
            row = measure(name, size, args.rounds, args.steps)
            rows.append(row)
            print(
                f"{name} B={size}: wall mask {row['mask_ms']:.1f} ms, multiplier "
                f"{row['multiplier_ms']:.1f} ms, ratio {row['ratio']:.3f} "
                f"({row['ratio_low']:.3f}-{row['ratio_high']:.3f}); CPU mask "
                f"{row['cpu_mask_ms']:.1f} ms, multiplier {row['cpu_multiplier_ms']:.1f} ms, "
                f"ratio {row['cpu_ratio']:.3f} ({row['cpu_ratio_low']:.3f}-"
                f"{row['cpu_ratio_high']:.3f}); saved {row['mask_saved_bytes'] / _MIB:.1f} vs "
                f"{row['multiplier_saved_bytes'] / _MIB:.1f} MiB",
                flush=True,
            )
    write_results(
        args.out or RESULTS / "dropout_apply_cpu",
        "dropout_apply.py",
        argv,
        torch.device("cpu"),
        "Dropout with a 1-byte mask saved for the backward: the fused step against the float "
        "multiplier saved",
        [
            f"- one training step (forward, per-member losses, backward, SGD) of one fused array, "
            f"the two ways alternating step for step; median over {args.rounds} rounds of each "
            f"way's mean over {args.steps} steps; ratio: mask / multiplier per round, median "
            f"(range); {args.threads} torch thread(s). Wall: `time.perf_counter`; CPU: "
            "`time.thread_time` of the thread that runs the step (with one torch thread, all "
            "of the step's work; on a shared machine it does not count the time other "
            "processes held the core)",
            "- `mask`: `hfsweep::dropout_apply` (autograd keeps a bool mask and a scale per "
            "member); `multiplier`: `torch.mul` at every call site (autograd keeps the float "
            "multiplier), the code before the change; saved: bytes autograd saves in one step, "
            "distinct storages, parameters left out",
        ],
        [
            "model",
            "B",
            "batch",
            "wall ms: mask",
            "multiplier",
            "mask / multiplier",
            "CPU ms: mask",
            "multiplier",
            "mask / multiplier",
            "saved MiB, mask",
            "saved MiB, multiplier",
        ],
        [
            [
                r["model"],
                str(r["B"]),
                str(r["batch"]),
                f"{r['mask_ms']:.1f}",
                f"{r['multiplier_ms']:.1f}",
                f"{r['ratio']:.3f} ({r['ratio_low']:.3f}-{r['ratio_high']:.3f})",
                f"{r['cpu_mask_ms']:.1f}",
                f"{r['cpu_multiplier_ms']:.1f}",
                f"{r['cpu_ratio']:.3f} ({r['cpu_ratio_low']:.3f}-{r['cpu_ratio_high']:.3f})",
                f"{r['mask_saved_bytes'] / _MIB:.1f}",
                f"{r['multiplier_saved_bytes'] / _MIB:.1f}",
            ]
            for r in rows
        ],
        rows,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
