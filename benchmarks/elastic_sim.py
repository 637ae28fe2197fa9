"""A discrete-event simulation of a sweep at cluster scale: static arrays (one accelerator each,
for life) against elastic arrays (``hfsweep.elastic.allocator`` deciding workers per array).

Nothing trains: a fake clock advances from one array's evaluation boundary to the next. The
per-step costs are this machine's measured ones (``results/elastic_profiles_cpu.json``, written
by ``scaling_profile.py`` from ``profile_tasks_cpu.json``: seconds per step at each array size,
gradient bytes per member, and the measured gloo all-reduce cost); the time of an array on k
workers is ``hfsweep.profiler.model_scaling``'s. ASHA (asynchronous successive halving) stops
trials at its rungs from synthetic learning curves. Both arms see the same trials and the same
curves, and form arrays as ``hfsweep run``'s engine does: hfsweep's own packer asks the trials in
order and forms arrays of the profiler's chosen size per model from its pools, and refills freed
slots from them. Elastic, as in the engine, a formed array is a pool of waiting trials to the
allocator until a plan starts it, and no other array is formed while it waits; the number of
workers per array, and when a formed array starts, are all that differ.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _elastic_account import ARMS
from _elastic_report import markdown
from _elastic_sweep import Result, Sim, load_models, make_trials

from hfsweep.elastic.allocator import Allocator
from hfsweep.profiler import AllReduceCost

RESULTS = Path(__file__).resolve().parent / "results"
PROFILES = RESULTS / "elastic_profiles_cpu.json"


def simulate(
    *,
    workers: int,
    trials: int,
    mix: dict[str, float],
    elastic: bool,
    seed: int = 0,
    steps_per_epoch: int = 200,
    max_epochs: int = 27,
    eta: int = 3,
    noise: float = 0.5,
    resize_every_s: float = 60.0,
    resize_cost_s: float = 20.0,
    max_workers: int | None = None,
    profiles: Path = PROFILES,
    bandwidth: float | None = None,
    latency: float | None = None,
    queue_seen: bool = True,
    bounded_queue: bool = True,
    knows_pruner: bool = True,
) -> Result:
    """One arm: the same trials (``seed``) for static and elastic; ``queue_seen`` False: the
    elastic allocator is not told the trials queued behind the formed array (before issue
    19's throughput rule); ``bounded_queue`` False: told the queue's plain estimate, which
    overcounts while few trials are asked; ``knows_pruner`` False: not given the end estimate
    that knows ASHA's rungs (both False: the allocator before issue 19's end estimate, the
    elastic-before arm)."""
    models, cost = load_models(profiles, mix)
    if bandwidth is not None or latency is not None:
        cost = AllReduceCost(
            cost.latency_s if latency is None else latency,
            cost.bandwidth_bytes_per_s if bandwidth is None else bandwidth,
            "assumed",
        )
    allocator = Allocator(
        resize_every_s=resize_every_s, resize_cost_s=resize_cost_s, max_workers=max_workers
    )
    sim = Sim(
        make_trials(trials, mix, models, seed),
        models,
        cost,
        workers=workers,
        elastic=elastic,
        steps_per_epoch=steps_per_epoch,
        max_epochs=max_epochs,
        eta=eta,
        noise=noise,
        seed=seed + 1,
        allocator=allocator,
        queue_seen=queue_seen,
        bounded_queue=bounded_queue,
        knows_pruner=knows_pruner,
    )
    return sim.run()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, nargs="+", default=[64, 512])
    p.add_argument("--trials", type=int, default=2000)
    p.add_argument("--mix", default="digits_mlp=0.5,token_transformer=0.3,cifar_resnet=0.2")
    p.add_argument("--steps-per-epoch", type=int, default=200)
    p.add_argument("--max-epochs", type=int, default=27)
    p.add_argument("--eta", type=int, default=3)
    p.add_argument("--resize-every-s", type=float, default=60.0)
    p.add_argument("--resize-cost-s", type=float, default=20.0)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--profiles", type=Path, default=PROFILES)
    p.add_argument("--out", type=Path, default=RESULTS / "elastic_sim")
    p.add_argument(
        "--note",
        action="append",
        default=[],
        help="a line for the results file's header (where an input such as --resize-cost-s "
        "comes from); repeatable",
    )
    args = p.parse_args(argv)
    mix = {k: float(v) for k, v in (item.split("=") for item in args.mix.split(","))}
    rows: list[dict[str, Any]] = []
    for workers in args.workers:
        for seed in args.seeds:
            res = {}
            for arm in ARMS:
                r = simulate(
                    workers=workers,
                    trials=args.trials,
                    mix=mix,
                    elastic=arm != "static",
                    bounded_queue=arm == "elastic",
                    knows_pruner=arm == "elastic",
                    seed=seed,
                    steps_per_epoch=args.steps_per_epoch,
                    max_epochs=args.max_epochs,
                    eta=args.eta,
                    resize_every_s=args.resize_every_s,
                    resize_cost_s=args.resize_cost_s,
                    profiles=args.profiles,
                )
                res[arm] = r
                rows.append(
                    {
                        "workers": workers,
                        "seed": seed,
                        "arm": arm,
                        "makespan_s": r.makespan_s,
                        "idle_accelerator_h": r.idle_worker_s / 3600,
                        "trials_per_h": r.trials_ended / (r.makespan_s / 3600),
                        "best_trial_s": r.best_time_s,
                        "best_trial": r.best_trial,
                        "resizes": r.resizes,
                        "allocator_decisions": r.decisions,
                        "account": r.account.to_dict(),
                        "bounds": r.bounds,
                    }
                )
                print({k: v for k, v in rows[-1].items() if k != "account"}, flush=True)
            for arm in ARMS[1:]:
                ratio = res["static"].makespan_s / res[arm].makespan_s
                print(
                    f"workers={workers} seed={seed}: static/{arm} makespan {ratio:.2f}x",
                    flush=True,
                )
    command = "python benchmarks/elastic_sim.py " + shlex.join(
        argv if argv is not None else sys.argv[1:]
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(
        json.dumps(
            {
                "command": command.strip(),
                "args": vars(args) | {"profiles": str(args.profiles), "out": str(args.out)},
                "rows": rows,
            },
            indent=1,
        )
        + "\n"
    )
    args.out.with_suffix(".md").write_text(markdown(rows, args, mix, command.strip()))
    print(f"wrote {args.out.with_suffix('.json')} and .md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
