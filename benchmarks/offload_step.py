"""An offloaded array's optimizer step on the host against on the device, shard by shard.

B members of an MLP, offloaded within one budget, trained with the same data by two engines
side by side, in alternating rounds: ``host`` (the gradients go back to the host after each
shard's backward, the fused optimizer steps the host tensors after the backward: what
``offload_step: host`` does) and ``device`` (each shard stepped on the compute side right after
its backward, its optimizer state fetched for it and written back with its parameters:
``offload_step: device``). Both engines are cut for the device step (the same shards). For
each: a training step's median time (forward, backward, optimizer step), the bytes copied to
the compute side and back to the host per step (a counting ``CpuTransfer``), the engine's
ledger peak, and, after the run, the largest difference between the two arms' parameters
(the same training: 0 or float rounding).

On a CPU the "device" and the host are one memory: a transfer is a copy, and the device step
runs on the same cores as the host step, so the times say what the extra copies of the
optimizer state cost here, nothing of a GPU (whose step would run on the GPU, with the state
crossing its host link); bytes and peaks are exact.

    python benchmarks/offload_step.py                  # results/offload_step_cpu.md
    python benchmarks/offload_step.py --device cuda    # on a GPU: results/offload_step_cuda.md
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
from pathlib import Path

import torch
from _offload import counting_transfer, median_step, synchronize
from _results import RESULTS, write_results
from torch import nn

import hfsweep as hs
from hfsweep.offload import OffloadedArray

_OPTIMIZERS = {
    "adamw": lambda a: hs.optim.AdamW(a, lr=[1e-3 * (i + 1) for i in range(a.size)]),
    "sgd": lambda a: hs.optim.SGD(a, lr=[0.01 * (i + 1) for i in range(a.size)], momentum=0.9),
}


class Arm:
    """One way to step: ``step()`` runs a training step of the offloaded array."""

    def __init__(
        self,
        models: list[nn.Module],
        optimizer: str,
        budget: int,
        on_device: bool,
        batch: int,
        compute: torch.device,
    ) -> None:
        #: each arm draws the same batches (its own generator, the same seed)
        self.gen = torch.Generator().manual_seed(1)
        self.batch = batch
        self.width = models[0][0].in_features
        self.compute = compute
        self.array = hs.fuse(copy.deepcopy(models))
        self.opt = _OPTIMIZERS[optimizer](self.array)
        self.transfer = counting_transfer(compute)
        # both cut for the device step, the same shards (an engine cuts the host step's with
        # no room for optimizer state): the shard limit the device step's cut would have
        limit = budget // (4 + len(self.opt.state_keys))
        self.engine = OffloadedArray(
            self.array,
            device=compute,
            transfer=self.transfer,
            budget_bytes=budget,
            shard_bytes=limit,
        )
        self.on_device = on_device
        if on_device:
            self.engine.step_on_device(self.opt)

    def step(self) -> None:
        x = torch.randn(self.batch, self.width, generator=self.gen).to(self.compute)
        y = torch.randn(self.batch, self.width, generator=self.gen).to(self.compute)
        (self.engine(x) - y).square().mean().backward()
        if not self.on_device:
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        synchronize(self.compute)  # the step's time includes its queued kernels


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--size", type=int, default=8, help="array size B")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--optimizers", nargs="+", default=["adamw", "sgd"], choices=_OPTIMIZERS)
    parser.add_argument(
        "--budget", type=int, default=None, help="bytes (default: 3 stacked layers' worth)"
    )
    parser.add_argument("--steps", type=int, default=5, help="timed steps per arm and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default="cpu", help="the compute side: cpu, cuda or cuda:N")
    parser.add_argument(
        "--out", type=Path, default=None, help="default: results/offload_step_<device type>"
    )
    args = parser.parse_args(argv)
    compute = torch.device(args.device)
    out = args.out if args.out is not None else RESULTS / f"offload_step_{compute.type}"
    torch.manual_seed(0)
    models = [
        nn.Sequential(
            *[m for _ in range(args.layers) for m in (nn.Linear(args.width, args.width), nn.Tanh())]
        )
        for _ in range(args.size)
    ]
    layer = (args.width * args.width + args.width) * 4 * args.size
    budget = args.budget if args.budget is not None else 3 * layer * 2
    rows, cells = [], []
    for optimizer in args.optimizers:
        arms = {
            way: Arm(models, optimizer, budget, way == "device", args.batch, compute)
            for way in ("host", "device")
        }
        moved: dict[str, tuple[int, int]] = {}
        for way, arm in arms.items():
            arm.step()  # warm-up: optimizer state made, traces
            fetched, returned = arm.transfer.fetched, arm.transfer.returned
            arm.step()
            moved[way] = (arm.transfer.fetched - fetched, arm.transfer.returned - returned)
        times: dict[str, list[float]] = {way: [] for way in arms}
        for _ in range(args.rounds):
            for way, arm in arms.items():
                times[way].append(median_step(arm.step, args.steps))
        diff = max(
            float((p - q).detach().abs().max())
            for p, q in zip(
                arms["host"].array.parameters(), arms["device"].array.parameters(), strict=True
            )
        )
        for way, arm in arms.items():
            step = statistics.median(times[way])
            spread = [min(times[way]), max(times[way])]
            engine = arm.engine
            rows.append(
                {
                    "optimizer": optimizer,
                    "step": way,
                    "step_ms": step * 1e3,
                    "step_ms_range": [s * 1e3 for s in spread],
                    "fetched_bytes_per_step": moved[way][0],
                    "returned_bytes_per_step": moved[way][1],
                    "ledger_peak_bytes": engine.ledger.peak,
                    "shards": len(engine.shards),
                    "max_param_diff_host_vs_device": diff,
                }
            )
            cells.append(
                [
                    optimizer,
                    way,
                    f"{step * 1e3:.1f} [{spread[0] * 1e3:.1f}-{spread[1] * 1e3:.1f}]",
                    f"{moved[way][0] / 2**20:.2f}",
                    f"{moved[way][1] / 2**20:.2f}",
                    f"{engine.ledger.peak / 2**20:.2f}",
                    str(len(engine.shards)),
                    f"{diff:.1e}",
                ]
            )
        for arm in arms.values():
            arm.engine.close()
    notes = [
        f"- model: {args.layers} x (Linear({args.width}, {args.width}), Tanh) per member, "
        f"B = {args.size}, batch {args.batch}, float32, a squared error to random targets; each "
        f"optimizer's two arms trained on the same {2 + args.rounds * args.steps} random batches",
        f"- budget {budget / 2**20:.2f} MiB (one stacked layer: {layer / 2**20:.2f} MiB); both "
        "arms' shards cut for the device step (the budget over 4 + the optimizer's "
        "parameter-sized state tensors)",
        f"- medians of {args.steps} steps per round, {args.rounds} alternating rounds (range over "
        "rounds in brackets); bytes copied in and back and the ledger peak are of one step, exact",
        "- host: a shard's gradients go back to the host, the fused step runs there after the "
        "backward; device: a shard's optimizer state comes in as its backward starts, the step "
        "runs on the compute side, parameters and state go back",
        f"- load average while it ran (1, 5, 15 min): "
        f"{', '.join(f'{v:.1f}' for v in os.getloadavg())} (other jobs may share the cores)",
    ]
    if compute.type == "cpu":
        notes.append(
            "- on a CPU the compute side is the host: both steps run on the same cores and a "
            "transfer is a copy in one memory, so these times say what the device step's extra "
            "copies cost here, not what a GPU would gain (no GPU was used)"
        )
    else:
        notes.append(
            f"- compute side {compute}: host storage pinned, copies on a side stream "
            "(CudaTransfer); each timed step ends with a device synchronize"
        )
    columns = [
        "optimizer",
        "step",
        "step ms [range]",
        "MiB copied in per step",
        "MiB copied back per step",
        "ledger peak MiB",
        "shards",
        "largest param difference host / device",
    ]
    write_results(
        out,
        "offload_step.py",
        argv,
        compute,
        "Offload: the optimizer step on the host against on the device, shard by shard "
        f"({'CPU' if compute.type == 'cpu' else 'GPU'})",
        notes,
        columns,
        cells,
        rows,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
