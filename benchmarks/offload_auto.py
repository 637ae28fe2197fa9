"""What ``offload: auto`` chooses for an array that does not fit a device memory budget, and the
two rates it chose between.

For a task of ``hfsweep.tasks`` at array size B and budgets that fit B' = 1, 2, ... members (each
budget is halfway between the measured peak memory of one training step at B' and at B' + 1
members, activations included), :func:`hfsweep.sizing.offloading.profile_offload` measures what
fits, times the trainer's training step offloaded at B (shard by shard, the budget on the compute
side) and on the device at B', and keeps the faster. Nothing is cached, so every row is measured.

On a CPU the host and the "device" are one memory: a shard's transfer is a copy in memory and the
budget is only the engine's own accounting, so these figures show the decision being taken on
measured rates, not what a GPU would choose (there a transfer crosses PCIe).

    python benchmarks/offload_auto.py
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

import torch
from _results import RESULTS, write_results

from hfsweep import tasks
from hfsweep.offload import state_bytes
from hfsweep.sizing.offloading import profile_offload
from hfsweep.sizing.task import measure_step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="digits_mlp", help="a task of hfsweep.tasks")
    parser.add_argument("--size", type=int, default=8, help="array size B")
    parser.add_argument("--fits", type=int, nargs="+", default=[1, 2, 4], help="B' per budget")
    parser.add_argument("--seconds", type=float, default=1.0, help="timing per measurement")
    parser.add_argument("--out", type=Path, default=RESULTS / "offload_auto_cpu")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("hfsweep.profiler").setLevel(logging.INFO)
    device = torch.device("cpu")
    task = tasks.get(args.task)
    resolved = task.resolve({})
    member = state_bytes(task.build_model(resolved))
    train, _ = task.build_data(resolved)
    batch = next(iter(train))

    def peak(n: int) -> int:
        return measure_step(
            task, resolved, n, device=device, dtype=torch.float32, batch=batch,
            min_seconds=0.0, min_steps=1, warmup=1, share_frozen=False,
        ).peak_bytes  # fmt: skip

    rows, cells = [], []
    for fit in args.fits:
        budget = (peak(fit) + peak(fit + 1)) // 2
        choice = profile_offload(
            task, resolved, args.size, device_memory=budget, device=device,
            min_seconds=args.seconds,
        )  # fmt: skip
        offloaded = choice.offloaded_rate
        rows.append(
            {
                "size": args.size,
                "fit_size": choice.fit_size,
                "budget_bytes": budget,
                "offloaded_rate": offloaded,
                "split_rate": choice.split_rate,
                "mode": choice.mode,
                "reason": choice.reason,
            }
        )
        cells.append(
            [
                str(budget),
                str(choice.fit_size),
                "-" if offloaded is None else f"{offloaded:,.0f}",
                "-" if choice.split_rate is None else f"{choice.split_rate:,.0f}",
                choice.mode,
            ]
        )
    write_results(
        args.out,
        "offload_auto.py",
        argv,
        device,
        f"offload: auto on {args.task}, B = {args.size}",
        [
            f"- one member's estimated state: {member} bytes (float32, {resolved['optimizer']}, "
            f"batch {resolved['batch_size']}); each budget is halfway between the measured peaks "
            "of a step at B' and at B' + 1 members",
            "- member-samples/s of the trainer's step: offloaded at B (shard by shard within the "
            "budget), and on the device at B' (what the split arrays run at)",
            "- CPU: host and device are one memory, a transfer is a memcpy; says nothing of a GPU",
            f"- load average when it ended: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores "
            "(other jobs share this machine: the rates are noisy)",
            "- `-`: offloaded at B could not run within the budget (its shards or boundary "
            "activations need more), so the split was the only way",
        ],
        ["budget bytes", "B'", "offloaded at B", "split at B'", "auto chose"],
        cells,
        rows,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
