"""Profile the ready tasks: member-samples/s and peak memory against array size, and the B the
profiler chooses for each.

    python benchmarks/profile_tasks.py [--device cuda] [--tasks digits_mlp,cifar_resnet]

Writes ``results/profile_tasks_<device>.{md,json}`` and one plot per task
(``results/profile_<task>_<device>.png``). The profile cache is not used: every size is measured
in this run. On a GPU it also checks the memory model: the peak predicted for the largest size
from the smaller sizes' fit, against the peak measured there.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import RESULTS, write_results

from hfsweep import profiler, tasks
from hfsweep.sizing.task import profile_task


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tasks", default=",".join(sorted(tasks.TASKS)))
    parser.add_argument("--max-size", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=1.0, help="timing per size")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    rows: list[dict[str, object]] = []
    cells: list[list[str]] = []
    for name in args.tasks.split(","):
        task = tasks.get(name)
        print(f"{name}:", flush=True)
        profile = profile_task(
            task,
            device=device,
            max_size=args.max_size,
            min_seconds=args.seconds,
            on_measure=lambda m: print(
                f"  B={m.size:<3d} {m.samples_per_s:10,.0f} member-samples/s "
                f"{m.peak_bytes / 2**20:8.1f} MiB",
                flush=True,
            ),
        )
        profiler.plot(profile, RESULTS / f"profile_{name}_{device.type}.png")
        ms = list(profile.measurements)
        one = next((m for m in ms if m.size == 1), ms[0])
        best = max(ms, key=lambda m: m.samples_per_s)
        chosen = next(m for m in ms if m.size == profile.chosen)
        check = ""
        if len(ms) >= 3:
            # the memory model fitted without the largest size, predicting it
            fit = profiler.MemoryModel.fit(ms[:-1])
            predicted = fit.predict(ms[-1].size)
            check = f"{predicted / ms[-1].peak_bytes:.3f}"
        for m in ms:
            rows.append(
                {
                    "task": name,
                    "size": m.size,
                    "samples_per_s": m.samples_per_s,
                    "peak_bytes": m.peak_bytes,
                    "step_s": m.step_s,
                    "chosen": m.size == profile.chosen,
                }
            )
        cells.append(
            [
                name,
                ", ".join(str(m.size) for m in ms),
                f"{one.samples_per_s:,.0f}",
                f"{best.samples_per_s:,.0f} (B={best.size})",
                str(profile.chosen),
                f"{chosen.samples_per_s / best.samples_per_s:.2f}",
                f"{chosen.samples_per_s / one.samples_per_s:.2f}x",
                check,
                profile.reason,
            ]
        )
        print(profile.table(), flush=True)
    write_results(
        RESULTS / f"profile_tasks_{device.type}",
        "profile_tasks.py",
        argv,
        device,
        "Profiler: throughput and memory against array size for the ready tasks",
        [
            "- Member-samples/s of the trainer's training step (forward, per-member losses, "
            "backward, fused SGD/AdamW step) on one shared batch of the task's default batch "
            "size, float32. Sizes double from 1 until throughput stops growing, memory would "
            "not fit, or the maximum size.",
            "- Chosen B: the smallest size within 90% of the best throughput that fits the budget "
            "(80% of available RAM on CPU; of GPU memory on a GPU). 'chosen/best' is its "
            "throughput over the best measured; 'vs B=1' its speed-up over one member.",
            "- Memory check: the peak predicted for the largest size by a memory model fitted on "
            "the smaller sizes, divided by the peak measured there (1.00 = exact). On CPU the "
            "peak is the peak of live tensor bytes followed op by op; on GPU the allocator's "
            "max_memory_allocated.",
        ],
        [
            "task",
            "sizes",
            "B=1 samples/s",
            "best samples/s",
            "chosen B",
            "chosen/best",
            "chosen vs B=1",
            "memory predicted/measured",
            "reason",
        ],
        cells,
        rows,
    )


if __name__ == "__main__":
    main()
