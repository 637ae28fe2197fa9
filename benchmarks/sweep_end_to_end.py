"""One sweep, five ways, side by side in one run: plain Optuna, Ray Tune with fractional
resources, hfsweep (local backend, with ASHA and with Optuna's pruner) and hfsweep's Tune plugin.

    python benchmarks/sweep_end_to_end.py [--sweep examples/digits_asha.yaml] [--rounds R]
        [--array-size B] [--cpu-per-trial 0.25] [--only ARMS] [--device cpu] [--num-cpus N]
        [--out STEM]
        [--quick]

Every arm runs the sweep file's task, search space, sampler (``make_sampler``: TPE with the
constant liar for ``examples/digits_asha.yaml``), metric, budget and seed:

- ``optuna``: plain Optuna, trials one after another with ``SuccessiveHalvingPruner(min_resource=1,
  reduction_factor=3)`` (``sweep_vs_optuna.py``'s plain arm: an in-memory study, one model per
  trial trained with ``torch.optim``);
- ``tune-fractional``: ``tune.Tuner`` with ``OptunaSearch`` and ``ASHAScheduler``, each trial one
  model, ``{"cpu": 0.25}`` per trial (``tune_vs_fractional.py``'s fractional arm);
- ``hfsweep``: ``hs.sweep`` of the sweep file unchanged (ASHA, ``fusion.size: auto`` from a profile
  cache filled before timing, a run directory with the journal and checkpoints);
- ``hfsweep-sh``: ``hs.sweep`` with the plain arm's pruner (``optuna:successive_halving``);
- ``tune-fused``: the ``tune-fractional`` Tuner wrapped by ``hfsweep.schedulers.tune.Fusion``, one
  array of ``--array-size`` members per Tune trial (1 CPU each).

Round r runs every arm with the sweep's seed + r. Wall-clock: ``time.perf_counter`` around the
whole sweep (``study.optimize``, ``tuner.fit()`` or ``hs.sweep``), imports and Ray's start
excluded (Ray starts once before the first round; its actors start inside each fit). Reported:
the median round [min-max], speed-ups against plain Optuna per round, the best value per round
(best final metric of a trial that trained its whole budget) and its mean. Writes
``results/sweep_end_to_end_<device>.{md,json}``, or ``STEM.{md,json}``. ``--quick``: 8 trials of
2 epochs, one round (a check that every arm runs; not a measurement).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import optuna
import ray
import torch
from ray import cloudpickle

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sweep_vs_optuna as svo
import tune_vs_fractional as tvf
from _results import RESULTS, write_results
from _sweep_args import add_sweep_options, parse_sweep_options

from hfsweep.config import parse_sweep

ARMS = ("optuna", "tune-fractional", "hfsweep", "hfsweep-sh", "tune-fused")
LABELS = {
    "optuna": "plain Optuna, SuccessiveHalving pruner (one model at a time)",
    "tune-fractional": "Ray Tune + OptunaSearch + ASHA, fractional resources",
    "hfsweep": "hfsweep run, ASHA (local backend)",
    "hfsweep-sh": "hfsweep run, Optuna SuccessiveHalving (local backend)",
    "tune-fused": "Ray Tune + OptunaSearch + ASHA through hfsweep's Fusion plugin",
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_sweep_options(parser, ARMS, "sweep_end_to_end")
    parser.add_argument(
        "--array-size", type=int, default=16, help="members per array of the Tune plugin"
    )
    args, arms = parse_sweep_options(parser, argv, ARMS)

    path = Path(args.sweep)
    sweep, mapping = tvf.load(path, args.trials, args.epochs)
    mapping = {**mapping, "fusion": {**mapping.get("fusion", {}), "device": args.device}}
    device = torch.device(args.device)
    svo.warm_up(sweep, device)
    cache = Path(tempfile.mkdtemp(prefix="sweep_end_to_end_profiles_"))
    if any(a.startswith("hfsweep") for a in arms):
        svo.prefill_profiles(sweep, cache)
    tuned = any(a.startswith("tune") for a in arms)
    if tuned:
        for module in (svo, tvf):  # the trainables and their helpers, for the workers
            cloudpickle.register_pickle_by_value(module)
        ray.init(
            num_cpus=args.num_cpus,
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
        )
    runs: dict[str, list[dict[str, Any]]] = {a: [] for a in arms}
    seeds = [sweep.seed + r for r in range(args.rounds)]
    pruned = {
        **mapping,
        "scheduler": {"name": "optuna:successive_halving", "options": svo.PRUNER_OPTIONS},
    }
    try:
        with tempfile.TemporaryDirectory(prefix="sweep_end_to_end_") as storage:
            for r, seed in enumerate(seeds):
                seeded = {**mapping, "seed": seed}
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                    round_sweep = parse_sweep(seeded, source=path)
                for arm in arms:
                    tag = f"{arm} r{r + 1} seed {seed}"
                    if arm == "optuna":
                        row = svo.run_plain(round_sweep, device, tag)
                    elif arm == "tune-fractional":
                        row = tvf.run_fractional(
                            round_sweep, args.device, args.cpu_per_trial, storage, f"r{r + 1}"
                        )
                    elif arm == "tune-fused":
                        row = tvf.run_fused(
                            round_sweep, args.device, args.array_size, storage, f"r{r + 1}"
                        )
                    else:
                        config = {**pruned, "seed": seed} if arm == "hfsweep-sh" else seeded
                        row = svo.run_hfsweep(config, tag, cache)
                    svo.log(f"[{tag}] wall {row['wall_s']:.1f} s, best {row['best_value']}")
                    runs[arm].append({"arm": arm, "round": r + 1, "seed": seed, **row})
        cpus = ray.cluster_resources().get("CPU") if tuned else None
    finally:
        if tuned:
            ray.shutdown()

    cells: list[list[str]] = []
    for arm in arms:
        rs = runs[arm]
        walls = [x["wall_s"] for x in rs]
        if "optuna" in runs and arm != "optuna":
            ratios = [p["wall_s"] / x["wall_s"] for p, x in zip(runs["optuna"], rs, strict=True)]
            speed = svo._spread(ratios, ".2f") + "x"
        else:
            speed = "1.00x" if arm == "optuna" else "-"
        values = [x["best_value"] for x in rs if x["best_value"] is not None]
        counts = "; ".join(
            dict.fromkeys(
                f"{x['counts']['COMPLETE']}/{x['counts']['PRUNED']}/{x['counts']['FAIL']}"
                for x in rs
            )
        )
        cells.append(
            [
                LABELS[arm],
                svo._spread(walls, ".1f"),
                speed,
                " ".join(format(v, ".4f") for v in values) if values else "-",
                format(statistics.mean(values), ".4f") if values else "-",
                counts,
            ]
        )
        for x in rs:
            x.update(
                trials=sweep.budget.trials,
                epochs=sweep.budget.epochs,
                device=str(device),
                torch_threads=torch.get_num_threads(),
                ray_cpus=cpus,
            )

    b = sweep.budget
    sh = ", ".join(f"{k}={v}" for k, v in svo.PRUNER_OPTIONS.items())
    notes = [
        f"- One sweep, every arm: `{args.sweep}`, task {sweep.task.name}, its search space "
        f"({', '.join(sweep.space.names)}), sampler {sweep.searcher.name} (options "
        f"{sweep.searcher.options}), {b.trials} trials of {b.epochs} epochs, metric "
        f"{sweep.metric} ({sweep.mode}), on {device} in {sweep.fusion.dtype}. Round r runs "
        f"every arm with seed {', '.join(map(str, seeds))} in turn.",
        f"- plain Optuna: in-memory study, `SuccessiveHalvingPruner({sh})`, each trial one model "
        "trained with `torch.optim`, reporting every epoch.",
        f"- Ray Tune arms ({cpus} CPUs, `reuse_actors=True`): OptunaSearch with the same sampler, "
        f"ASHAScheduler(max_t={b.epochs}, {dict(sweep.scheduler.options)}). Fractional: "
        f"`{{'cpu': {args.cpu_per_trial}}}` per trial, one model each. Fusion plugin: "
        f"`Fusion(members={b.trials}, array_size={args.array_size})`, 1 CPU per array.",
        "- hfsweep run: `hs.sweep` with a fresh run directory (journal, checkpoints), the array "
        "size from a profile cache filled before timing (`fusion.size: auto`, at most half the "
        f"trials for TPE); the sweep file's ASHA, or `optuna:successive_halving` ({sh}).",
        f"- Wall-clock: the whole sweep, imports and Ray's start excluded. Median of "
        f"{args.rounds} interleaved round(s) [min-max]; speed-up = plain Optuna's wall-clock / "
        "the arm's, per round. Best: the best final metric of a trial that trained its whole "
        "budget, per round, and their mean. Trials: complete/pruned/failed.",
        "- Best values need not agree round by round: each arm's pruner sees trials in a "
        "different order, so the searcher learns from different histories.",
    ]
    if args.quick:
        notes.append("- `--quick`: a smoke run, not a measurement.")
    stem = Path(args.out) if args.out else RESULTS / f"sweep_end_to_end_{device.type}"
    write_results(
        stem,
        "sweep_end_to_end.py",
        argv,
        device,
        f"A {b.trials}-trial sweep end to end: plain Optuna, Ray Tune and hfsweep",
        notes,
        [
            "arm",
            "wall-clock s",
            "speed-up vs plain Optuna",
            f"best {sweep.metric} by round",
            "mean best",
            "trials complete/pruned/failed",
        ],
        cells,
        [x for arm in arms for x in runs[arm]],
    )
    print(stem.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
