"""Ray Tune with fused arrays: your Tuner, OptunaSearch and ASHAScheduler, a few lines changed.

    python examples/tune_digits.py [--members 32] [--epochs 6] [--array-size 16]

Sweeps an MLP on scikit-learn's bundled digits (offline, CPU; about a minute on 2 cores, most
of it Ray starting up). The space and scheduler are those of ``examples/digits_asha.yaml``,
with a smaller budget. The lines that differ from a plain Tune sweep are marked ``# hfsweep``:

    plain Ray Tune                              with hfsweep
    tune.Tuner(train_fn, ...,                   tune.Tuner(fusion.trainable, ...,
      num_samples=32,                             num_samples=-1,
      search_alg=OptunaSearch(...),               search_alg=fusion.searcher(OptunaSearch(...)),
      scheduler=ASHAScheduler(...))               scheduler=fusion.scheduler(ASHAScheduler(...)))

Tune's ``ResultGrid`` has one row per fused array; ``member_results`` has one per trial.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import warnings

import optuna
import ray
from hfsweep.schedulers.tune import Fusion, best_member, member_results
from ray import tune
from ray.tune.schedulers import ASHAScheduler
from ray.tune.search.optuna import OptunaSearch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--members", type=int, default=32, help="trials in all (the budget)")
    parser.add_argument("--epochs", type=int, default=6, help="each trial's budget")
    parser.add_argument("--array-size", type=int, default=16, help="trials per fused array")
    parser.add_argument("--storage", help="Tune's storage_path (default: a temporary folder)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    logging.getLogger("hfsweep").setLevel(logging.WARNING)
    ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)

    # hfsweep: the task (model + data, a ready one here), the budget and the array size
    fusion = Fusion("digits_mlp", members=args.members, array_size=args.array_size)
    space = {
        "hidden": 64,
        "optimizer": "sgd",
        "epochs": args.epochs,
        "lr": tune.loguniform(1e-3, 0.5),
        "momentum": tune.uniform(0.0, 0.99),
        "weight_decay": tune.loguniform(1e-6, 1e-2),
        "dropout": tune.uniform(0.0, 0.5),
    }
    # members of one array are asked together: constant_liar keeps TPE from repeating itself
    sampler = optuna.samplers.TPESampler(seed=0, constant_liar=True)
    tuner = tune.Tuner(
        fusion.trainable,  # hfsweep: trains one fused array per Tune trial
        param_space=space,
        tune_config=tune.TuneConfig(
            metric="val_accuracy",
            mode="max",
            num_samples=-1,  # hfsweep: the Fusion owns the budget
            search_alg=fusion.searcher(OptunaSearch(sampler=sampler)),  # hfsweep
            scheduler=fusion.scheduler(  # hfsweep
                ASHAScheduler(max_t=args.epochs, grace_period=1, reduction_factor=3)
            ),
        ),
        run_config=tune.RunConfig(
            name="tune_digits",
            storage_path=args.storage or tempfile.mkdtemp(prefix="tune_digits_"),
            verbose=0,
        ),
    )
    results = tuner.fit()

    table = member_results(results)
    print(f"{len(results)} fused arrays (Tune trials), {len(table)} members:")
    print(table["state"].value_counts().to_string())
    shown = ["member", "array", "state", "value", "evaluations", "config/lr", "config/momentum"]
    top = table.sort_values("value", ascending=False, na_position="last").head(10)
    print(top[shown].to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    best = best_member(results)
    print(f"best member {best.id} (array {best.array}): val_accuracy={best.value:.4f}")
    print(
        "config:", {k: round(v, 6) if isinstance(v, float) else v for k, v in best.config.items()}
    )
    model = best.load_model(fusion.task)  # hfsweep: its final weights in the task's model
    count = sum(p.numel() for p in model.parameters())
    print(f"its weights: {count} parameters, from {best.checkpoint.path}")
    print(f"experiment: {os.path.abspath(results.experiment_path)}")
    ray.shutdown()


if __name__ == "__main__":
    main()
