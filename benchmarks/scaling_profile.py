"""How well the scaling model predicts data-parallel throughput: real k = 1 and k = 2 training
of small models with a plain torch DDP/gloo loop, against ``hfsweep.profiler.model_scaling``'s
prediction for k = 2 from the measured k = 1 step and this machine's measured all-reduce cost.

Each worker is one process with one torch thread (k = 1: one process, no DDP; k = 2: two
processes, ``DistributedDataParallel`` over gloo on 127.0.0.1, each on half of every batch);
rounds alternate k = 1 and k = 2; the median step of each is reported. The all-reduce cost is
measured first (``hfsweep.sizing.allreduce.measure_allreduce``, 2 gloo processes).

It also writes ``elastic_profiles_<device>.json``: the all-reduce cost and, for every ready task,
its batch size, gradient bytes per member and the measured step times at each array size from
``profile_tasks_<device>.json``, the input of ``benchmarks/elastic_sim.py``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import RESULTS, write_results

from hfsweep import tasks
from hfsweep.profiler import model_scaling
from hfsweep.sizing.allreduce import _free_port, measure_allreduce

#: name -> (layer widths, global batch)
MODELS: dict[str, tuple[list[int], int]] = {
    "mlp_small": ([64, 128, 10], 128),
    "mlp_wide": ([512, 2048, 2048, 10], 256),
}


def _mlp(widths: list[int]) -> nn.Module:
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(widths):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def _worker(rank: int, world: int, port: int, name: str, steps: int, out: Any) -> None:
    """One data-parallel worker: train ``steps`` SGD steps on its share of each batch."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    widths, batch = MODELS[name]
    model: nn.Module = _mlp(widths)
    if world > 1:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
        )
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, widths[0], generator=g)
    y = torch.randint(0, widths[-1], (batch,), generator=g)
    share = batch // world
    xs, ys = x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]
    times = []
    for i in range(steps + 5):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(xs), ys).backward()
        opt.step()
        if i >= 5:  # warm-up steps are not timed
            times.append(time.perf_counter() - t0)
    if world > 1:
        dist.destroy_process_group()
    if rank == 0:
        out.put(statistics.median(times))


def _run(name: str, world: int, steps: int) -> float:
    """Median seconds per step of ``world`` workers training ``name``."""
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world, port, name, steps, out)) for r in range(world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"{name} on {world} workers failed: {[p.exitcode for p in procs]}")
    step_s: float = out.get()
    return step_s


def _task_profiles(device: str) -> list[dict[str, Any]]:
    """Every ready task's batch size, gradient bytes per member and measured step times."""
    source = RESULTS / f"profile_tasks_{device}.json"
    rows = json.loads(source.read_text())["rows"]
    out = []
    for name in sorted({r["task"] for r in rows}):
        task = tasks.get(name)
        config = task.resolve({})
        model = task.model(config)
        grad_bytes = sum(
            p.numel() * p.element_size() for p in model.parameters() if p.requires_grad
        )
        out.append(
            {
                "task": name,
                "batch_size": int(config["batch_size"]),
                "gradient_bytes_per_member": grad_bytes,
                "sizes": {str(r["size"]): r["step_s"] for r in rows if r["task"] == name},
                "source": f"{source.name} (measured step times)",
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--out", type=Path, default=RESULTS / "scaling_profile_cpu")
    parser.add_argument("--profiles-out", type=Path, default=RESULTS / "elastic_profiles_cpu.json")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    load_before = os.getloadavg()[0]
    cost, points = measure_allreduce(workers=2, repeats=9)
    print(
        f"all-reduce: latency {cost.latency_s * 1e6:.1f} us per hop, "
        f"{cost.bandwidth_bytes_per_s / 1e9:.2f} GB/s",
        flush=True,
    )

    rows: list[dict[str, Any]] = []
    cells: list[list[str]] = []
    for name in args.models:
        widths, batch = MODELS[name]
        grad_bytes = sum(p.numel() * 4 for p in _mlp(widths).parameters())
        one, two = [], []
        for _ in range(args.rounds):
            one.append(_run(name, 1, args.steps))
            two.append(_run(name, 2, args.steps))
        s1, s2 = statistics.median(one), statistics.median(two)
        measured1, measured2 = batch / s1, batch / s2
        predicted = model_scaling(
            name,
            step_s=s1,
            members=1,
            batch_size=batch,
            gradient_bytes=grad_bytes,
            allreduce=cost,
            max_workers=2,
        ).rate(2)
        rows.append(
            {
                "model": name,
                "batch": batch,
                "gradient_bytes": grad_bytes,
                "k1_step_s": one,
                "k2_step_s": two,
                "k1_samples_per_s": measured1,
                "k2_samples_per_s": measured2,
                "k2_predicted_samples_per_s": predicted,
                "predicted_over_measured": predicted / measured2,
            }
        )
        cells.append(
            [
                name,
                str(batch),
                f"{grad_bytes / 2**20:.2f}",
                f"{measured1:,.0f}",
                f"{measured2:,.0f}",
                f"{measured2 / measured1:.2f}x",
                f"{predicted:,.0f}",
                f"{predicted / measured1:.2f}x",
                f"{predicted / measured2:.2f}",
            ]
        )
        print(cells[-1], flush=True)
    rows.append({"allreduce": cost.to_dict(), "allreduce_points": points})
    notes = [
        "- Real data-parallel training (plain torch loop; k = 2 is DistributedDataParallel over "
        "gloo on 127.0.0.1), one process per worker, one torch thread each, SGD, global batch "
        "fixed (each of 2 workers trains half of it). Median step over "
        f"{args.rounds} alternating rounds of {args.steps} timed steps each.",
        f"- All-reduce cost measured first ({cost.source}): latency "
        f"{cost.latency_s * 1e6:.1f} us per ring hop, bandwidth "
        f"{cost.bandwidth_bytes_per_s / 1e9:.2f} GB/s; points (bytes, median s): "
        + ", ".join(f"({n}, {t:.2e})" for n, t in points),
        "- Predicted: `model_scaling(step_s=<measured k=1 step>, gradient_bytes=<model>, "
        "allreduce=<measured cost>).rate(2)`, i.e. half the k = 1 compute plus one all-reduce "
        "of all gradients (no overlap with the backward pass, serial_s = 0).",
        "- This machine has 2 CPU cores shared with other work: k = 2 uses both, so its "
        f"figures are the noisiest here (1-minute load average {load_before:.1f} at the start, "
        f"{os.getloadavg()[0]:.1f} at the end).",
    ]
    columns = [
        "model",
        "batch",
        "grad MiB",
        "k=1 samples/s",
        "k=2 measured",
        "measured speed-up",
        "k=2 predicted",
        "predicted speed-up",
        "predicted/measured",
    ]
    write_results(
        args.out,
        "scaling_profile.py",
        argv,
        torch.device("cpu"),
        "Scaling profile: modelled vs measured data-parallel throughput (k = 1, 2)",
        notes,
        columns,
        cells,
        rows,
    )
    profiles = {
        "allreduce": cost.to_dict(),
        "allreduce_points": points,
        "tasks": _task_profiles("cpu"),
        "command": "python benchmarks/scaling_profile.py " + " ".join(argv or sys.argv[1:]),
    }
    args.profiles_out.write_text(json.dumps(profiles, indent=1) + "\n")
    print(f"wrote {args.profiles_out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
