"""Ray Tune with fused LoRA arrays: the ready ``text_lora`` task through hfsweep's Tune plugin.

    python examples/tune_lora.py [--members 16] [--epochs 3] [--array-size 8]

LoRA (peft) fine-tuning of a tiny BERT encoder that the task pretrains in-process, on generated
keyword texts (offline, CPU; needs transformers and peft). OptunaSearch + ASHA over learning
rate, weight decay, ``lora_alpha`` and ``lora_dropout``, as ``examples/lora_asha.yaml`` does
with ``hfsweep run``: each Tune trial trains one fused array whose members share one frozen
encoder. Tune's ``ResultGrid`` has one row per array; ``member_results`` one per trial.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import warnings
from typing import Any

import optuna
import ray
from hfsweep.schedulers.tune import Fusion, best_member, member_results
from ray import tune
from ray.tune.schedulers import ASHAScheduler
from ray.tune.search.optuna import OptunaSearch


def sweep(
    members: int,
    epochs: int,
    array_size: int,
    storage: str,
    config: dict[str, Any] | None = None,
) -> tuple[Fusion, Any]:
    """Run the sweep on the Ray this process initialised; ``config`` overrides task defaults
    (the test's smaller data). Returns the ``Fusion`` and Tune's ``ResultGrid``."""
    fusion = Fusion("text_lora", members=members, array_size=array_size)  # hfsweep
    space = {
        **(config or {}),
        "lora_r": 4,  # the adapter's shape: part of the compatibility key
        "epochs": epochs,
        "lr": tune.loguniform(2e-3, 5e-2),
        "weight_decay": tune.loguniform(1e-5, 1e-1),
        "lora_alpha": tune.loguniform(2.0, 32.0),  # per member
        "lora_dropout": tune.uniform(0.0, 0.3),  # per member
    }
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
                ASHAScheduler(max_t=epochs, grace_period=1, reduction_factor=3)
            ),
        ),
        run_config=tune.RunConfig(name="tune_lora", storage_path=storage, verbose=0),
    )
    return fusion, tuner.fit()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--members", type=int, default=16, help="trials in all (the budget)")
    parser.add_argument("--epochs", type=int, default=3, help="each trial's budget")
    parser.add_argument("--array-size", type=int, default=8, help="trials per fused array")
    parser.add_argument("--storage", help="Tune's storage_path (default: a temporary folder)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    logging.getLogger("hfsweep").setLevel(logging.WARNING)
    ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
    storage = args.storage or tempfile.mkdtemp(prefix="tune_lora_")
    fusion, results = sweep(args.members, args.epochs, args.array_size, storage)

    table = member_results(results)
    print(f"{len(results)} fused arrays (Tune trials), {len(table)} members:")
    print(table["state"].value_counts().to_string())
    best = best_member(results)
    print(f"best member {best.id} (array {best.array}): val_accuracy={best.value:.4f}")
    model = best.load_model(fusion.task)  # hfsweep: its final weights in the task's model
    adapter = os.path.join(storage, "best_adapter")
    model.model.save_pretrained(adapter)  # peft's own format: PeftModel.from_pretrained loads it
    print(f"its adapter: {adapter}")
    ray.shutdown()


if __name__ == "__main__":
    main()
