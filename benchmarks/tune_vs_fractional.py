"""A Ray Tune sweep, two ways: trials sharing the device by fractional resources, vs fused arrays.

    python benchmarks/tune_vs_fractional.py [--sweep examples/digits_asha.yaml] [--trials N]
        [--epochs N] [--array-size B] [--cpu-per-trial 0.25] [--rounds R] [--only ARMS]
        [--out STEM] [--quick]

Both arms run the same sweep through ``tune.Tuner`` with ``OptunaSearch`` and ``ASHAScheduler``:
the sweep file's task, its search space drawn by its own sampler (``make_sampler``: same seed and
options, e.g. TPE with ``constant_liar``; OptunaSearch runs the space define-by-run), its metric,
seed and budget, and ASHA with the sweep file's ``grace_period`` and ``reduction_factor`` and
``max_t`` = the epochs. Both use ``reuse_actors=True`` (the faster setting for the plain arm).

- ``fractional``: what Tune users do today to put several trials on one device.
  ``tune.with_resources(train_fn, {"cpu": 0.25})`` (``--cpu-per-trial``; with ``--device cuda``
  also that fraction of a GPU): each trial trains its own model with ``torch.optim`` (the task's
  model, data, optimizer, schedule and batch order, as ``sweep_vs_optuna.py``'s plain arm) and
  reports the metric every epoch.
- ``fused``: the same ``Tuner`` with the searcher, scheduler and trainable wrapped by
  ``hfsweep.schedulers.tune.Fusion``: each Tune trial trains an array of ``--array-size``
  members with one CPU (one GPU with ``--device cuda``).

Wall-clock is ``time.perf_counter`` around ``tuner.fit()`` (Ray is started once, before the
first round; actors start inside each fit). Best value: the best final metric of a trial that
trained its whole budget. Rounds interleave the arms; the median round is reported with the
per-round range. Writes ``results/tune_vs_fractional_<device>.{md,json}``, or ``STEM.{md,json}``.
``--quick`` runs 8 trials of 2 epochs once (a check that everything works; not a measurement).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import optuna
import ray
import torch
import yaml
from ray import cloudpickle, tune
from ray.tune.schedulers import ASHAScheduler
from ray.tune.search.optuna import OptunaSearch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sweep_vs_optuna as plain
from _results import RESULTS, write_results
from _sweep_args import add_sweep_options, parse_sweep_options
from hfsweep.schedulers.tune import Fusion, member_results

from hfsweep.config import SweepConfig, make_sampler, parse_sweep
from hfsweep.training.step import _epoch_seed

ARMS = ("fractional", "fused")
LABELS = {
    "fractional": "Ray Tune, fractional resources (one model per trial)",
    "fused": "Ray Tune + hfsweep Fusion (one fused array per trial)",
}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------- shared pieces
class DefineByRun:
    """OptunaSearch's define-by-run space: the sweep file's space, sampled by its own code,
    completed to a trial's task config (fixed values, budget). A class, not a closure:
    OptunaSearch saves itself with the standard pickle."""

    def __init__(self, sweep: SweepConfig) -> None:
        self.space = sweep.space
        self.fixed = {**sweep.config, **sweep.budget.trial_config()}

    def __call__(self, trial: Any) -> dict[str, Any]:
        return {**self.fixed, **self.space.sample(trial)}


def optuna_search(sweep: SweepConfig) -> OptunaSearch:
    """OptunaSearch with the sweep file's sampler (a fresh one: same seed every arm)."""
    return OptunaSearch(
        space=DefineByRun(sweep),
        metric=sweep.metric,
        mode=sweep.mode,
        sampler=make_sampler(sweep.searcher, sweep.space),
    )  # (the space is the searcher's, so the Tuner gets no param_space)


def asha(sweep: SweepConfig) -> ASHAScheduler:
    """Tune's ASHA with the sweep file's rungs, ``max_t`` = the epochs (``training_iteration``
    counts epochs in both arms)."""
    options = dict(sweep.scheduler.options)
    return ASHAScheduler(
        time_attr="training_iteration",
        max_t=int(sweep.budget.max_resource),
        grace_period=options.get("grace_period", 1),
        reduction_factor=options.get("reduction_factor", 3),
    )


def tuner(
    trainable: Any,
    sweep: SweepConfig,
    search: Any,
    scheduler: Any,
    storage: str,
    name: str,
    num_samples: int,
) -> tune.Tuner:
    return tune.Tuner(
        trainable,
        tune_config=tune.TuneConfig(
            metric=sweep.metric,
            mode=sweep.mode,
            num_samples=num_samples,
            reuse_actors=True,
            search_alg=search,
            scheduler=scheduler,
        ),
        run_config=tune.RunConfig(storage_path=storage, name=name, verbose=0),
    )


# ---------------------------------------------------------------------- the fractional arm
def plain_trainable(sweep: SweepConfig, device: str) -> Callable[[dict[str, Any]], None]:
    """Train one trial's model alone (``sweep_vs_optuna.train_plain``'s loop), reporting the
    metric to Tune after every epoch."""
    task, metric = sweep.task, sweep.metric
    dtype = getattr(torch, sweep.fusion.dtype)

    def train_fn(config: dict[str, Any]) -> None:
        dev = torch.device(device)
        resolved = task.resolve(config)
        model = task.build_model(resolved).to(device=dev, dtype=dtype)
        train, val = task.build_data(resolved)

        def to(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
            x, y = (t.to(dev) for t in batch)
            return (x.to(dtype) if x.is_floating_point() else x), y

        optimizer = plain.torch_optimizer(model, resolved)
        steps_per_epoch = len(train)  # type: ignore[arg-type]
        schedule = plain.torch_schedule(optimizer, resolved, steps_per_epoch)
        for epoch in range(1, int(resolved["epochs"]) + 1):
            torch.manual_seed(_epoch_seed(int(resolved["data_seed"]), epoch - 1))
            model.train()
            total = torch.zeros((), dtype=torch.float64, device=dev)
            for batch in train:
                x, y = to(batch)
                loss = plain.loss_fn(task, model(x), y, float(resolved["label_smoothing"]))
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                if resolved["grad_clip"] is not None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), float(resolved["grad_clip"]))
                optimizer.step()
                if schedule is not None:
                    schedule.step()
                total += loss.detach()
            metrics = plain.evaluate(task, model, val, to)
            if not (math.isfinite(float(total)) and math.isfinite(metrics["val_loss"])):
                tune.report({metric: math.nan, "diverged": True})
                return
            tune.report({metric: metrics[metric], "epoch": epoch})

    return train_fn


def run_fractional(
    sweep: SweepConfig, device: str, cpu_per_trial: float, storage: str, tag: str
) -> dict[str, Any]:
    resources: dict[str, float] = {"cpu": cpu_per_trial}
    if device.startswith("cuda"):
        resources["gpu"] = cpu_per_trial
    trainable = tune.with_resources(plain_trainable(sweep, device), resources)
    search = optuna_search(sweep)
    t = tuner(
        trainable,
        sweep,
        search,
        asha(sweep),
        storage,
        f"fractional_{tag}",
        num_samples=sweep.budget.trials,
    )
    start = time.perf_counter()
    results = t.fit()
    wall = time.perf_counter() - start
    epochs = int(sweep.budget.max_resource)
    counts = {"COMPLETE": 0, "PRUNED": 0, "FAIL": 0}
    best: float | None = None
    sign = 1.0 if sweep.mode == "max" else -1.0
    for i in range(len(results)):
        r = results[i]
        metrics = r.metrics or {}
        value = _number(metrics.get(sweep.metric))
        if r.error is not None or metrics.get("diverged") or value is None:
            counts["FAIL"] += 1
        elif metrics.get("training_iteration") == epochs:
            counts["COMPLETE"] += 1
            if best is None or sign * value > sign * best:
                best = value
        else:
            counts["PRUNED"] += 1
    log(f"[{tag}] fractional: {wall:.1f} s, best {best}, {counts}")
    return {"wall_s": wall, "best_value": best, "counts": counts, "tune_trials": len(results)}


# ---------------------------------------------------------------------- the fused arm
def run_fused(
    sweep: SweepConfig, device: str, array_size: int, storage: str, tag: str
) -> dict[str, Any]:
    fusion = Fusion(
        sweep.task_ref,
        members=sweep.budget.trials,
        array_size=array_size,
        device=device,
        dtype=sweep.fusion.dtype,
    )
    resources = {"cpu": 1.0, **({"gpu": 1.0} if device.startswith("cuda") else {})}
    trainable = tune.with_resources(fusion.trainable, resources)
    search = fusion.searcher(optuna_search(sweep))
    scheduler = fusion.scheduler(asha(sweep))
    t = tuner(trainable, sweep, search, scheduler, storage, f"fused_{tag}", num_samples=-1)
    start = time.perf_counter()
    results = t.fit()
    wall = time.perf_counter() - start
    table = member_results(results)
    counts = {s: int((table["state"] == s).sum()) for s in ("COMPLETE", "PRUNED", "FAIL")}
    done = table[table["state"] == "COMPLETE"]["value"].dropna()
    best = None
    if len(done):
        best = float(done.max() if sweep.mode == "max" else done.min())
    log(f"[{tag}] fused: {wall:.1f} s, {len(results)} arrays, best {best}, {counts}")
    return {"wall_s": wall, "best_value": best, "counts": counts, "tune_trials": len(results)}


# ---------------------------------------------------------------------- the benchmark
def _number(value: Any) -> float | None:
    """``value`` as a float, or ``None`` when it is missing or not finite."""
    if isinstance(value, int | float) and math.isfinite(value):
        return float(value)
    return None


def _spread(values: list[float], fmt: str) -> str:
    median = statistics.median(values)
    if len(values) == 1 or min(values) == max(values):
        return format(median, fmt)
    return f"{format(median, fmt)} [{format(min(values), fmt)}-{format(max(values), fmt)}]"


def load(path: Path, trials: int | None, epochs: int | None) -> tuple[SweepConfig, Mapping]:
    mapping = yaml.safe_load(path.read_text())
    budget = dict(mapping["budget"])
    if trials is not None:
        budget["trials"] = trials
    if epochs is not None:
        budget["epochs"] = epochs
    mapping["budget"] = budget
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        sweep = parse_sweep(mapping, source=path)
    if sweep.budget.epochs is None or sweep.fusion.eval_every is not None:
        sys.exit(f"{path}: both arms report once per epoch; give budget.epochs")
    if sweep.scheduler.name != "asha":
        sys.exit(f"{path}: the scheduler is {sweep.scheduler.name!r}; this benchmark runs ASHA")
    if sweep.task.loss not in ("cross_entropy", "sequence_cross_entropy") or sweep.metric not in (
        "val_accuracy",
        "val_loss",
    ):
        sys.exit(f"{path}: the plain arm covers cross-entropy tasks and val_accuracy/val_loss")
    return sweep, mapping


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_sweep_options(parser, ARMS, "tune_vs_fractional")
    parser.add_argument(
        "--array-size",
        type=int,
        help="members per array (default: the sweep's fusion.size, 16 if it is 'auto')",
    )
    args, arms = parse_sweep_options(parser, argv, ARMS)

    path = Path(args.sweep)
    sweep, _ = load(path, args.trials, args.epochs)
    size = args.array_size or (sweep.fusion.size if sweep.fusion.size != "auto" else 16)
    device = torch.device(args.device)
    cloudpickle.register_pickle_by_value(plain)  # the plain trainable's helpers, for the workers
    ray.init(
        num_cpus=args.num_cpus,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )
    runs: dict[str, list[dict[str, Any]]] = {a: [] for a in arms}
    with tempfile.TemporaryDirectory(prefix="tune_vs_fractional_") as storage:
        for r in range(args.rounds):
            for arm in arms:
                tag = f"r{r + 1}"
                if arm == "fractional":
                    row = run_fractional(sweep, args.device, args.cpu_per_trial, storage, tag)
                else:
                    row = run_fused(sweep, args.device, int(size), storage, tag)
                runs[arm].append({"arm": arm, "round": r + 1, **row})
    cpus = ray.cluster_resources().get("CPU")
    ray.shutdown()

    cells: list[list[str]] = []
    for arm in arms:
        rs = runs[arm]
        walls = [x["wall_s"] for x in rs]
        if "fractional" in runs and arm != "fractional":
            ratios = [
                f["wall_s"] / x["wall_s"] for f, x in zip(runs["fractional"], rs, strict=True)
            ]
            speed = _spread(ratios, ".2f") + "x"
        else:
            speed = "1.00x" if arm == "fractional" else "-"
        values = [x["best_value"] for x in rs if x["best_value"] is not None]
        counts = "; ".join(
            dict.fromkeys(
                f"{x['counts']['COMPLETE']}/{x['counts']['PRUNED']}/{x['counts']['FAIL']}"
                for x in rs
            )
        )
        trials = "; ".join(dict.fromkeys(str(x["tune_trials"]) for x in rs))
        cells.append(
            [
                LABELS[arm],
                _spread(walls, ".1f"),
                speed,
                _spread(values, ".4f") if values else "-",
                counts,
                trials,
            ]
        )
        for x in rs:
            x.update(
                trials=sweep.budget.trials,
                epochs=sweep.budget.epochs,
                device=str(device),
                cpus=cpus,
                cpu_per_trial=args.cpu_per_trial,
                array_size=size,
            )

    b = sweep.budget
    searcher = (
        f"{sweep.searcher.name} (seed {sweep.searcher.seed}, options {sweep.searcher.options})"
    )
    notes = [
        f"- One sweep, both arms: `{args.sweep}`, task {sweep.task.name}, its search space "
        f"({', '.join(sweep.space.names)}) drawn define-by-run by OptunaSearch with the sweep's "
        f"sampler {searcher}, {b.trials} trials of {b.epochs} epochs, metric {sweep.metric} "
        f"({sweep.mode}), Tune's ASHAScheduler (max_t={b.epochs}, "
        f"options {dict(sweep.scheduler.options)}), on {device} in {sweep.fusion.dtype}, "
        f"Ray with {cpus} CPUs, reuse_actors=True.",
        f"- fractional: `tune.with_resources(train_fn, {{'cpu': {args.cpu_per_trial}}})`; each "
        "trial trains one model with torch.optim and reports every epoch.",
        f"- fused: `hfsweep.schedulers.tune.Fusion(members={b.trials}, array_size={size})` wraps "
        "the same searcher, scheduler and a trainable of one array per Tune trial (1 CPU each).",
        "- Wall-clock: `time.perf_counter` around `tuner.fit()` (Ray started once before; "
        f"actors start inside). Median of {args.rounds} interleaved round(s) [min-max]; "
        "speed-up = fractional wall-clock / fused, per round. Trials: complete/pruned/failed "
        "(complete = trained its whole budget). Tune trials: one per trial (fractional) or "
        "per array (fused).",
        "- Best values need not agree: ASHA sees trials one by one in the fractional arm and an "
        "array's members together with hfsweep, so the searcher learns from different histories.",
    ]
    stem = Path(args.out) if args.out else RESULTS / f"tune_vs_fractional_{device.type}"
    write_results(
        stem,
        "tune_vs_fractional.py",
        argv,
        device,
        f"A {b.trials}-trial Ray Tune sweep: fractional resources vs hfsweep arrays",
        notes,
        [
            "arm",
            "wall-clock s",
            "speed-up vs fractional",
            f"best {sweep.metric}",
            "trials complete/pruned/failed",
            "Tune trials",
        ],
        cells,
        [x for arm in arms for x in runs[arm]],
    )
    print(stem.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
