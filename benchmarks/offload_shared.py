"""An offloaded fine-tuning array with its frozen backbone kept once against B copies of it.

B members share a frozen backbone (the same "pretrained" weights) and train their own heads.
Three ways side by side, in alternating rounds: the array on the device (not offloaded, the
backbone once, as ``hs.fuse`` keeps it by default), offloaded with the backbone kept once
(``share_frozen``, what the trainer does), and offloaded with ``share_frozen=False`` (B copies:
what offload did before). Each offloaded arm's shard limit is one backbone layer as that array
stores it (once, or stacked B times), so both run a backbone layer per shard and stream the
same number of shards. For each: a training step's
median time (forward, backward, AdamW step), the bytes copied to the compute side per step (a
counting ``CpuTransfer``), the engine's ledger peak, and the bytes of the array's state in host
storage (parameters, buffers, optimizer state).

On a CPU the "device" and the host are one memory: a transfer is a copy, so the times show the
compute and copies saved, not what a GPU's link would cost; bytes and peaks are exact.

    python benchmarks/offload_shared.py
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import statistics
import sys
from pathlib import Path

import torch
from _offload import Counting, median_step
from _results import RESULTS, storage_bytes, write_results
from torch import nn

import hfsweep as hs
from hfsweep.offload import OffloadedArray


class FineTune(nn.Module):
    def __init__(self, seed: int, width: int, layers: int) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same "pretrained" backbone in every member
        blocks: list[nn.Module] = []
        for _ in range(layers):
            blocks += [nn.Linear(width, width), nn.Tanh()]
        self.backbone = nn.Sequential(*blocks).requires_grad_(False)
        torch.manual_seed(seed)
        self.head = nn.Sequential(nn.Linear(width, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


class Arm:
    """One way to train the array: ``step()`` runs a training step; bytes fetched per step."""

    def __init__(self, models: list[nn.Module], offload: bool, share: bool, shard: int) -> None:
        self.array = hs.fuse(copy.deepcopy(models), share_frozen=share)
        self.transfer = Counting()
        self.engine = (
            OffloadedArray(self.array, transfer=self.transfer, shard_bytes=shard)
            if offload
            else None
        )
        self.opt = hs.optim.AdamW(self.array, lr=[1e-3] * self.array.size)

    def step(self, x: torch.Tensor) -> None:
        out = self.array(x) if self.engine is None else self.engine(x)
        out.square().mean().backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def state_bytes(self) -> int:
        tensors = [*self.array.state_dict().values()]
        tensors += [t for st in self.opt.state.values() for t in st.values() if torch.is_tensor(t)]
        return storage_bytes(tensors)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--size", type=int, default=8, help="array size B")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per arm and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS / "offload_shared_cpu")
    args = parser.parse_args(argv)
    models = [FineTune(i, args.width, args.layers) for i in range(args.size)]
    layer = (args.width * args.width + args.width) * 4
    arms = {  # shards of one backbone layer as each array stores it
        "on the device": Arm(models, offload=False, share=True, shard=layer),
        "offloaded, backbone once": Arm(models, offload=True, share=True, shard=layer),
        "offloaded, B backbones": Arm(models, offload=True, share=False, shard=args.size * layer),
    }
    x = torch.randn(args.batch, args.width)
    fetched: dict[str, int] = {}
    for name, arm in arms.items():
        arm.step(x)  # warm-up: optimizer state, traces
        before = arm.transfer.fetched
        arm.step(x)
        fetched[name] = arm.transfer.fetched - before
    times: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(args.rounds):
        for name, arm in arms.items():
            times[name].append(median_step(functools.partial(arm.step, x), args.steps))
    base = statistics.median(times["offloaded, B backbones"])
    rows, cells = [], []
    for name, arm in arms.items():
        step = statistics.median(times[name])
        spread = [min(times[name]), max(times[name])]
        engine = arm.engine
        row = {
            "way": name,
            "step_ms": step * 1e3,
            "step_ms_range": [s * 1e3 for s in spread],
            "vs_b_backbones": base / step,
            "fetched_bytes_per_step": fetched[name] if engine is not None else None,
            "ledger_peak_bytes": engine.ledger.peak if engine is not None else None,
            "shards": len(engine.shards) if engine is not None else None,
            "state_bytes": arm.state_bytes(),
        }
        rows.append(row)
        cells.append(
            [
                name,
                f"{step * 1e3:.1f} [{spread[0] * 1e3:.1f}-{spread[1] * 1e3:.1f}]",
                f"{base / step:.2f}x",
                "-" if engine is None else f"{fetched[name] / 2**20:.2f}",
                "-" if engine is None else f"{engine.ledger.peak / 2**20:.2f}",
                "-" if engine is None else str(len(engine.shards)),
                f"{arm.state_bytes() / 2**20:.2f}",
            ]
        )
    for arm in arms.values():
        if arm.engine is not None:
            arm.engine.close()
    notes = [
        f"- model: a frozen backbone of {args.layers} x (Linear({args.width}, {args.width}), "
        f"Tanh), the same in every member, and a head Linear({args.width}, 64), ReLU, "
        f"Linear(64, 10) per member; B = {args.size}, batch {args.batch}, float32, AdamW",
        f"- shards of one backbone layer as each array stores it ({layer / 2**20:.2f} MiB once, "
        f"{args.size * layer / 2**20:.2f} MiB stacked B times; the heads in shards of their "
        "own), no budget; a step = forward, backward, optimizer step on the host",
        f"- medians of {args.steps} steps per round, {args.rounds} alternating rounds (range over "
        "rounds in brackets); bytes copied in and the ledger peak are of one step, exact",
        f"- load average while it ran (1, 5, 15 min): "
        f"{', '.join(f'{v:.1f}' for v in os.getloadavg())} (other jobs shared the cores: times "
        "are noisy, bytes are not)",
        "- on a CPU a transfer is a copy in one memory: the times say what compute and copies "
        "the shared backbone saves here, not what a GPU's host link would cost",
    ]
    columns = [
        "way",
        "step ms [range]",
        "speed vs B backbones",
        "MiB copied in per step",
        "ledger peak MiB",
        "shards",
        "state MiB (host)",
    ]
    write_results(
        args.out,
        "offload_shared.py",
        argv,
        torch.device("cpu"),
        "Offload of a fine-tuning array: the frozen backbone once against B copies (CPU)",
        notes,
        columns,
        cells,
        rows,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
