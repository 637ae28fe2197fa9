"""A whole sweep, two ways: plain Optuna (one unfused model after another) against hfsweep.

    python benchmarks/sweep_vs_optuna.py [--sweep examples/digits_asha.yaml] [--trials N]
        [--epochs N] [--only plain,hfsweep-sh,hfsweep-asha,hfsweep-asha-cold] [--rounds R]
        [--fusion-size B] [--same-seed] [--out STEM]

Every arm runs the same sweep: the sweep file's task, search space, sampler (built by
``hfsweep.config.make_sampler``, same seed and options), metric, seed and budget.

- ``plain``: what users do today. ``optuna.create_study(sampler=..., pruner=
  SuccessiveHalvingPruner(min_resource=1, reduction_factor=3))`` and ``study.optimize(objective,
  n_trials=N)``: each trial samples its config from the sweep's own search space, builds the
  task's model, and trains that one model with ``torch.optim``, reporting the metric after every
  epoch and raising ``optuna.TrialPruned`` when the pruner says so. The data is loaded by the
  first trial and kept for the others (as hfsweep keeps it for an array's members).
- ``hfsweep-sh``: ``hs.sweep`` of the same sweep with the very same pruner
  (``scheduler: optuna:successive_halving``), trials trained as fused arrays.
- ``hfsweep-asha``: ``hs.sweep`` of the sweep file unchanged (its own scheduler, ASHA).

Each arm's wall-clock is ``time.perf_counter`` around the whole sweep (models, data, training,
evaluation, the searcher; for hfsweep also the run directory's journal and checkpoints), not
the imports. ``hfsweep-sh`` and ``hfsweep-asha`` find their array sizes in a profile cache
filled before timing (as an earlier sweep or ``hfsweep profile`` leaves it on a machine);
``hfsweep-asha-cold`` starts from an empty cache in every run (a first sweep on a machine).
Rounds interleave the arms; the median round is reported with the range of the per-round
speed-up. Round r runs every arm with the sweep's seed + r (the sampler's seed and the members'
seeds), so the best values compare several searches, not one; ``--same-seed`` repeats the
sweep's seed in every round. Writes ``results/sweep_vs_optuna_<device>.{md,json}``, or ``STEM.{md,json}`` with
``--out``.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import optuna
import torch
import torch.nn.functional as F
import yaml
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import RESULTS, write_results

from hfsweep import Task
from hfsweep._malloc import retain_freed_memory
from hfsweep.config import SweepConfig, make_sampler, parse_sweep
from hfsweep.core.status import Status
from hfsweep.sizing.device import resolve_device
from hfsweep.training.step import _epoch_seed
from hfsweep.training.task import OPTIMIZERS

ARMS = ("plain", "hfsweep-sh", "hfsweep-asha", "hfsweep-asha-cold")
LABELS = {
    "plain": "plain Optuna (one model at a time)",
    "hfsweep-sh": "hfsweep, Optuna SuccessiveHalving",
    "hfsweep-asha": "hfsweep, ASHA (the sweep file's)",
    "hfsweep-asha-cold": "hfsweep, ASHA, empty profile cache",
}
#: the pruner of the plain arm and of ``hfsweep-sh``
PRUNER_OPTIONS = {"min_resource": 1, "reduction_factor": 3}
#: torch.optim classes by hfsweep's optimizer names; their hyperparameters are the config keys
#: hfsweep's fused optimizers take (``hfsweep.training.task.OPTIMIZERS``)
TORCH_OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "rmsprop": torch.optim.RMSprop,
    "adagrad": torch.optim.Adagrad,
}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------- the plain baseline
def torch_optimizer(model: nn.Module, config: Mapping[str, Any]) -> torch.optim.Optimizer:
    """``torch.optim`` optimizer of the config: the class of ``config["optimizer"]`` with the
    hyperparameters hfsweep's trainer gives its fused optimizer (``make_optimizer``)."""
    keys = OPTIMIZERS[config["optimizer"]][1]
    kwargs: dict[str, Any] = {k: float(config[k]) for k in keys}
    if "beta1" in kwargs:
        kwargs["betas"] = (kwargs.pop("beta1"), kwargs.pop("beta2"))
    return TORCH_OPTIMIZERS[config["optimizer"]](model.parameters(), **kwargs)


def torch_schedule(
    optimizer: torch.optim.Optimizer, config: Mapping[str, Any], steps_per_epoch: int
) -> torch.optim.lr_scheduler.LRScheduler | None:
    """The config's learning-rate schedule, stepped once per optimizer step as hfsweep's trainer
    does (``make_schedule``): cosine over the whole budget, ``step`` every ``step_size`` epochs,
    ``exponential`` once per epoch; ``None`` for a constant rate."""
    name = config["lr_schedule"]
    sched = torch.optim.lr_scheduler
    if name == "cosine":
        budget = config["epochs"] * steps_per_epoch
        return sched.CosineAnnealingLR(optimizer, T_max=budget, eta_min=float(config["eta_min"]))
    if name == "step":
        size = config["step_size"] * steps_per_epoch
        return sched.StepLR(optimizer, step_size=size, gamma=float(config["gamma"]))
    if name == "exponential":
        return sched.StepLR(optimizer, step_size=steps_per_epoch, gamma=float(config["gamma"]))
    return None


def loss_fn(
    task: Task, outputs: torch.Tensor, target: torch.Tensor, smoothing: float
) -> torch.Tensor:
    """The task's loss on one model's outputs: classes in dimension 1 (``cross_entropy``) or in
    the last dimension (``sequence_cross_entropy``)."""
    if task.loss == "sequence_cross_entropy":
        outputs, target = outputs.flatten(0, -2), target.flatten()
    return F.cross_entropy(outputs, target, label_smoothing=smoothing)


def evaluate(task: Task, model: nn.Module, val: Iterable[Any], to: Any) -> dict[str, float]:
    """``val_loss`` and ``val_accuracy`` over the validation data (means over its samples)."""
    model.eval()
    loss = correct = 0.0
    count = 0
    with torch.no_grad():
        for batch in val:
            x, y = to(batch)
            out = model(x)
            n = int(y.shape[0])
            loss += float(loss_fn(task, out, y, 0.0)) * n
            classes = 1 if task.loss == "cross_entropy" else -1
            correct += float((out.argmax(classes) == y).double().mean()) * n
            count += n
    return {"val_loss": loss / count, "val_accuracy": correct / count}


def train_plain(
    task: Task,
    config: Mapping[str, Any],
    trial: optuna.Trial,
    metric: str,
    device: torch.device,
    dtype: torch.dtype,
    data_cache: dict[str, Any] | None = None,
) -> float:
    """Train one trial's model alone, as a user writes it by hand, and return its final metric.

    The setup mirrors hfsweep's trainer for one member: the model is the task's, initialised
    from ``config["seed"]`` (``task.build_model`` seeds torch and leaves the global generator as
    it was); the data is the task's (same batch size), built once per sweep and shared
    config (``data_cache``, by compatibility key) as a careful user keeps a loaded dataset
    between trials, and each epoch seeds torch's generator
    with the trainer's per-epoch seed, so the batches come in the trainer's order. Loss with the
    config's label smoothing, ``torch.optim`` with the config's hyperparameters, the config's
    schedule stepped per optimizer step, optional gradient-norm clipping. After every epoch the
    metric is evaluated and reported as ``trial.report(value, epoch)``, epoch = 1, 2, ...; a
    pruned trial raises ``optuna.TrialPruned``. The last epoch's report is not checked for
    pruning (the trainer completes a trial that reached its budget). A non-finite loss returns
    NaN, which Optuna records as FAIL (as hfsweep does).
    """
    model = task.build_model(config).to(device=device, dtype=dtype)
    if data_cache is None:
        data_cache = {}
    key = task.compatibility_key(config)
    if key not in data_cache:
        data_cache[key] = task.build_data(config)
    train, val = data_cache[key]

    def to(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = (t.to(device) for t in batch)
        return (x.to(dtype) if x.is_floating_point() else x), y

    optimizer = torch_optimizer(model, config)
    steps_per_epoch = len(train)  # type: ignore[arg-type]
    schedule = torch_schedule(optimizer, config, steps_per_epoch)
    epochs = int(config["epochs"])
    value = math.nan
    for epoch in range(1, epochs + 1):
        torch.manual_seed(_epoch_seed(int(config["data_seed"]), epoch - 1))
        model.train()
        train_loss = torch.zeros((), dtype=torch.float64, device=device)
        for batch in train:
            x, y = to(batch)
            loss = loss_fn(task, model(x), y, float(config["label_smoothing"]))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if config["grad_clip"] is not None:
                nn.utils.clip_grad_norm_(model.parameters(), float(config["grad_clip"]))
            optimizer.step()
            if schedule is not None:
                schedule.step()
            train_loss += loss.detach()
        metrics = evaluate(task, model, val, to)
        if not (math.isfinite(float(train_loss)) and math.isfinite(metrics["val_loss"])):
            return math.nan
        value = metrics[metric]
        trial.report(value, epoch)
        if epoch < epochs and trial.should_prune():
            raise optuna.TrialPruned()
    return value


def run_plain(sweep: SweepConfig, device: torch.device, tag: str) -> dict[str, Any]:
    """The sweep as one Optuna study, trials one after another, each trained by
    :func:`train_plain`."""
    dtype = getattr(torch, sweep.fusion.dtype)
    start = time.perf_counter()
    data_cache: dict[str, Any] = {}  # loaded inside the timed sweep, once per shared config

    def objective(trial: optuna.Trial) -> float:
        sampled = sweep.space.sample(trial)
        config = sweep.task.resolve(sweep.trial_config(sampled))
        return train_plain(sweep.task, config, trial, sweep.metric, device, dtype, data_cache)

    def progress(study: optuna.Study, t: optuna.trial.FrozenTrial) -> None:
        epochs = t.last_step or 0
        value = t.value if t.value is not None else t.intermediate_values.get(epochs, math.nan)
        log(
            f"[{tag}] trial {t.number + 1:3d}/{sweep.budget.trials} {t.state.name:8s} "
            f"{sweep.metric}={value:.4f} after {epochs} epochs "
            f"({time.perf_counter() - start:.1f} s)"
        )

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        study = optuna.create_study(
            direction="maximize" if sweep.mode == "max" else "minimize",
            sampler=make_sampler(sweep.searcher, sweep.space),
            pruner=optuna.pruners.SuccessiveHalvingPruner(**PRUNER_OPTIONS),
        )
        study.optimize(objective, n_trials=sweep.budget.trials, callbacks=[progress])
    wall = time.perf_counter() - start
    states = [t.state.name for t in study.trials]
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    best = None
    if complete:
        pick = max if sweep.mode == "max" else min
        best = pick(complete, key=lambda t: float(t.value))  # type: ignore[arg-type]
    return {
        "wall_s": wall,
        "best_value": best.value if best is not None else None,
        "best_params": best.params if best is not None else {},
        "counts": {s: states.count(s) for s in ("COMPLETE", "PRUNED", "FAIL", "RUNNING")},
        "arrays": None,
    }


# ---------------------------------------------------------------------- hfsweep
def prefill_profiles(sweep: SweepConfig, cache_dir: Path) -> None:
    """Profile every compatibility key the sweep can draw into ``cache_dir`` (untimed), as a
    first sweep or ``hfsweep profile`` leaves the cache on a user's machine."""
    import hfsweep as hs
    from hfsweep.profiler import ProfileCache

    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    seen: set[str] = set()
    for _ in range(50):
        trial = study.ask()
        config = sweep.trial_config(sweep.space.sample(trial))
        study.tell(trial, 0.0)
        key = sweep.task.compatibility_key(config)
        if key not in seen:
            seen.add(key)
            log(f"[prefill] profiling {key}")
            hs.profile_task(
                sweep.task,
                config,
                device=_device(sweep),
                dtype=getattr(torch, sweep.fusion.dtype),
                cache=ProfileCache(cache_dir / "profiles.json"),
            )


def run_hfsweep(
    mapping: Mapping[str, Any], tag: str, cache_dir: Path | None = None
) -> dict[str, Any]:
    """``hs.sweep`` of ``mapping`` into a fresh run directory, with the profile cache in
    ``cache_dir`` (``None``: an empty one)."""
    import hfsweep as hs

    with tempfile.TemporaryDirectory(prefix="sweep_vs_optuna_") as tmp:
        config = {**copy.deepcopy(dict(mapping)), "output": str(Path(tmp) / "run")}
        saved = os.environ.get("HFSWEEP_CACHE_DIR")
        os.environ["HFSWEEP_CACHE_DIR"] = str(cache_dir or Path(tmp) / "profiles")
        log(f"[{tag}] hs.sweep into {config['output']}")
        try:
            start = time.perf_counter()
            result = hs.sweep(config, progress=False)
            wall = time.perf_counter() - start
        finally:
            if saved is None:
                del os.environ["HFSWEEP_CACHE_DIR"]
            else:
                os.environ["HFSWEEP_CACHE_DIR"] = saved
    # Optuna's state names, as the plain Optuna arm's counts beside it are read from its study
    counts = {Status(s).optuna_name: int(n) for s, n in result.counts.items()}
    log(
        f"[{tag}] done in {wall:.1f} s ({result.arrays} arrays; engine's wall {result.wall_s:.1f} s): "
        f"best {result.best_value}, {counts}"
    )
    return {
        "wall_s": wall,
        "engine_wall_s": float(result.wall_s),
        "best_value": result.best_value,
        "best_params": dict(result.best_params),
        "counts": counts,
        "arrays": int(result.arrays),
    }


# ---------------------------------------------------------------------- the benchmark
def warm_up(sweep: SweepConfig, device: torch.device) -> None:
    """Pay the imports done lazily on first use before any arm is timed: the task's data
    (scikit-learn for the digits), torch.optim's first step (torch._dynamo), Optuna's sampler.
    And set the process's allocator as hfsweep's trainer sets it on the CPU
    (``hfsweep._malloc``), so that every arm runs with the same one (``HFSWEEP_MALLOC=system``
    leaves it alone for all of them)."""
    retain_freed_memory()
    config = sweep.task.resolve(sweep.trial_config(sweep.space.fixed))
    model = sweep.task.build_model(config).to(
        device=device, dtype=getattr(torch, sweep.fusion.dtype)
    )
    train, _ = sweep.task.build_data(config)
    x, y = next(iter(train))
    loss_fn(
        sweep.task, model(x.to(device, next(model.parameters()).dtype)), y.to(device), 0.0
    ).backward()
    torch_optimizer(model, config).step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        study = optuna.create_study(sampler=make_sampler(sweep.searcher, sweep.space))
        for _ in range(2):
            trial = study.ask()
            sweep.space.sample(trial)
            study.tell(trial, 0.0)


def _device(sweep: SweepConfig) -> torch.device:
    return torch.device(resolve_device(sweep.fusion.device))


def _spread(values: list[float], fmt: str) -> str:
    median = statistics.median(values)
    if len(values) == 1 or min(values) == max(values):
        return format(median, fmt)
    return f"{format(median, fmt)} [{format(min(values), fmt)}-{format(max(values), fmt)}]"


def _distinct(values: list[str]) -> str:
    return "; ".join(dict.fromkeys(values))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", default="examples/digits_asha.yaml")
    parser.add_argument("--trials", type=int, help="override budget.trials")
    parser.add_argument("--epochs", type=int, help="override budget.epochs")
    parser.add_argument("--only", default=",".join(ARMS), help=f"arms among {', '.join(ARMS)}")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every arm")
    parser.add_argument(
        "--fusion-size",
        type=int,
        help="a fixed array size for the hfsweep arms (default: the file's)",
    )
    parser.add_argument(
        "--same-seed", action="store_true", help="every round with the sweep's seed (default +r)"
    )
    parser.add_argument("--out", help="results stem (default results/sweep_vs_optuna_<device>)")
    args = parser.parse_args(argv)
    arms = [a.strip() for a in args.only.split(",") if a.strip()]
    bad = [a for a in arms if a not in ARMS]
    if bad or not arms:
        parser.error(f"--only {args.only!r}: arms are {', '.join(ARMS)}")
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: give an integer >= 1")
    optuna.logging.set_verbosity(optuna.logging.WARNING)

    path = Path(args.sweep)
    mapping = yaml.safe_load(path.read_text())
    budget = dict(mapping["budget"])
    if args.trials is not None:
        budget["trials"] = args.trials
    if args.epochs is not None:
        budget["epochs"] = args.epochs
    mapping["budget"] = budget
    if args.fusion_size is not None:
        mapping["fusion"] = {**mapping.get("fusion", {}), "size": args.fusion_size}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        sweep = parse_sweep(mapping, source=path)
    if sweep.budget.epochs is None or sweep.fusion.eval_every is not None:
        sys.exit(f"{path}: the plain baseline reports once per epoch; give budget.epochs")
    if sweep.task.loss not in ("cross_entropy", "sequence_cross_entropy") or sweep.metric not in (
        "val_accuracy",
        "val_loss",
    ):
        sys.exit(f"{path}: the plain baseline covers cross-entropy tasks and val_accuracy/val_loss")
    pruned = {
        **mapping,
        "scheduler": {"name": "optuna:successive_halving", "options": PRUNER_OPTIONS},
    }
    device = _device(sweep)
    warm_up(sweep, device)
    cache = Path(tempfile.mkdtemp(prefix="sweep_vs_optuna_profiles_"))
    if any(a in ("hfsweep-sh", "hfsweep-asha") for a in arms):
        prefill_profiles(sweep, cache)

    runs: dict[str, list[dict[str, Any]]] = {a: [] for a in arms}
    seeds = [sweep.seed + (0 if args.same_seed else r) for r in range(args.rounds)]
    for r, seed in enumerate(seeds):
        seeded = {**mapping, "seed": seed}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            round_sweep = parse_sweep(seeded, source=path)
        for arm in arms:
            tag = f"{arm} r{r + 1} seed {seed}"
            if arm == "plain":
                row = run_plain(round_sweep, device, tag)
            else:
                warm = cache if arm != "hfsweep-asha-cold" else None
                config = {**pruned, "seed": seed} if arm == "hfsweep-sh" else seeded
                row = run_hfsweep(config, tag, warm)
            log(f"[{tag}] wall {row['wall_s']:.1f} s, best {sweep.metric} {row['best_value']}")
            runs[arm].append({"arm": arm, "round": r + 1, "seed": seed, **row})

    cells: list[list[str]] = []
    for arm in arms:
        rs = runs[arm]
        walls = [x["wall_s"] for x in rs]
        if "plain" in runs and arm != "plain":
            speed = _spread(
                [p["wall_s"] / x["wall_s"] for p, x in zip(runs["plain"], rs, strict=True)], ".2f"
            )
            speed += "x"
        else:
            speed = "1.00x" if arm == "plain" else "-"
        values = [x["best_value"] for x in rs if x["best_value"] is not None]
        counts = [
            f"{x['counts']['COMPLETE']}/{x['counts']['PRUNED']}/{x['counts']['FAIL']}" for x in rs
        ]
        arrays = [str(x["arrays"]) for x in rs if x["arrays"] is not None]
        cells.append(
            [
                LABELS[arm],
                _spread(walls, ".1f"),
                speed,
                _spread(values, ".4f") if values else "-",
                format(statistics.mean(values), ".4f") if values else "-",
                _distinct(counts),
                _distinct(arrays) if arrays else "-",
            ]
        )
        for x in rs:
            x.update(
                trials=sweep.budget.trials,
                epochs=sweep.budget.epochs,
                device=str(device),
                torch_threads=torch.get_num_threads(),
            )

    b = sweep.budget
    searcher = f"{sweep.searcher.name} (options {sweep.searcher.options})"
    sh = ", ".join(f"{k}={v}" for k, v in PRUNER_OPTIONS.items())
    notes = [
        f"- One sweep, every arm: `{args.sweep}`, task {sweep.task.name}, its search space "
        f"({', '.join(sweep.space.names)}), sampler {searcher}, {b.trials} trials of {b.epochs} "
        f"epochs, metric {sweep.metric} ({sweep.mode}), on {device} in {sweep.fusion.dtype}.",
        "- plain Optuna: `study.optimize(objective, n_trials)` with an in-memory study and "
        f"`SuccessiveHalvingPruner({sh})`; each trial builds the task's model (the data is "
        "loaded once, inside the timed sweep, and kept between trials) and "
        "trains that one model with `torch.optim` (the config's optimizer, schedule, label "
        "smoothing and seed, the trainer's batch order), reporting the metric every epoch.",
        f"- hfsweep, Optuna SuccessiveHalving: `hs.sweep` with scheduler "
        f"`optuna:successive_halving` ({sh}), the same pruner deciding per member at each rung; "
        "hfsweep, ASHA: `hs.sweep` of the sweep file unchanged "
        f"(scheduler {sweep.scheduler.name} {sweep.scheduler.options}).",
        "- Wall-clock: `time.perf_counter` around the whole sweep (models, data, training, "
        "evaluation, the searcher; for hfsweep also the journal storage and checkpoints in a "
        "fresh run directory), imports excluded. The hfsweep arms find the array size in a "
        "profile cache filled before timing (as any earlier sweep or `hfsweep profile` of the "
        "model on the machine leaves it), except the empty-cache arm, which profiles in every "
        "run (a first sweep on a machine). "
        f"Median of {args.rounds} interleaved round(s) [min-max]; speed-up = plain Optuna's "
        "wall-clock / the arm's, per round. Trials: complete/pruned/failed.",
        f"- Sweep seeds by round: {', '.join(map(str, seeds))} (the sampler's seed, unless the "
        "sweep file sets `searcher.seed`, and the members' seeds); every arm runs each round's "
        "seed. Best value: median [min-max] over rounds, and the mean.",
        "- Best values need not agree: the pruner sees trials one by one in the plain arm and an "
        "array's members together in hfsweep, so the searcher learns from different histories; "
        "dropout masks come from torch's global generator in the plain arm and from each "
        "member's own stream in hfsweep.",
    ]
    if args.fusion_size is not None:
        notes.append(
            f"- `--fusion-size {args.fusion_size}`: the hfsweep arms train arrays of "
            f"{args.fusion_size} (`fusion.size`), not the profiler's size."
        )
    stem = Path(args.out) if args.out else RESULTS / f"sweep_vs_optuna_{device.type}"
    write_results(
        stem,
        "sweep_vs_optuna.py",
        argv,
        device,
        f"A {b.trials}-trial sweep: plain Optuna vs hfsweep",
        notes,
        [
            "arm",
            "wall-clock s",
            "speed-up vs plain Optuna",
            f"best {sweep.metric}",
            f"mean best {sweep.metric}",
            "trials complete/pruned/failed",
            "arrays",
        ],
        cells,
        [x for arm in arms for x in runs[arm]],
    )
    print(stem.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
