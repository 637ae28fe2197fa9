"""A fused Tune experiment in a process of its own, for the lifecycle test
(tests/test_lifecycle.py): ``run(storage, kill_after)`` starts it on a local Ray and SIGKILLs this
process after ``kill_after`` array results; ``restore(storage)`` finishes it with
``Tuner.restore``. Each member told to the inner searcher gets a line ``<pid> <member id>`` in
``told.log`` in the storage folder, so the tells of both processes can be counted.

Run as ``python -c "import _tune_lifecycle as t; t.main()" run|restore STORAGE [KILL_AFTER]``
with this folder on ``PYTHONPATH``: the searcher's class must be importable by name in the
restoring process, which unpickles it from the experiment. :func:`final_study` reads the inner
searcher's study an experiment saved (here and in test_tune_ray.py).
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import threading
import time
from glob import glob
from pathlib import Path
from typing import Any

import optuna
import ray
from hfsweep.schedulers.tune import Fusion
from ray import tune
from ray.tune.schedulers import ASHAScheduler
from ray.tune.search.optuna import OptunaSearch

#: the toy task by path: the workers load it from the file
TASK = f"{Path(__file__).resolve().parent / '_tune_toy.py'}:TASK"
MEMBERS = 12
ARRAY_SIZE = 4
NAME = "lifecycle"
SPACE = {"lr": tune.loguniform(1e-3, 0.5), "momentum": tune.uniform(0.0, 0.9), "hidden": 8}


class LoggedOptuna(OptunaSearch):
    """OptunaSearch that appends each member it is told about to ``told.log`` in ``folder``."""

    def __init__(self, folder: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.folder = folder

    def on_trial_complete(
        self, trial_id: str, result: dict[str, Any] | None = None, error: bool = False
    ) -> None:
        with open(os.path.join(self.folder, "told.log"), "a") as f:
            f.write(f"{os.getpid()} {trial_id}\n")
        super().on_trial_complete(trial_id, result, error)


class KillAfter(tune.Callback):
    """SIGKILLs this process (the driver) at its ``after``-th array result or the first one
    after it at which Tune's storage holds a whole copy of the experiment's state, once per
    ``marker`` file (the restored experiment runs with the callbacks of the first run)."""

    def __init__(self, after: int, marker: str) -> None:
        self.after = after
        self.marker = marker
        self.seen = 0

    def on_trial_result(self, *args: Any, **kwargs: Any) -> None:
        self.seen += 1
        if self.seen < self.after or os.path.exists(self.marker):
            return
        _wait_for_tunes_copy()
        if _stored_state_is_whole(kwargs["trial"]):
            Path(self.marker).write_text("killed")
            os.kill(os.getpid(), signal.SIGKILL)


def _wait_for_tunes_copy(timeout_s: float = 60.0) -> None:
    """Wait until Tune's copy of the experiment's state into its storage folder, made in a
    thread of its own, has ended. No new copy starts while this callback runs: Tune starts them
    from the thread that calls it. The copying thread is named after its function
    (``... (entrypoint)``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(
        t.name.endswith("(entrypoint)") and t.is_alive() for t in threading.enumerate()
    ):
        time.sleep(0.01)


def _stored_state_is_whole(trial: Any) -> bool:
    """Whether the experiment's state files in Tune's storage folder equal those in its
    staging folder, which the driver's thread (this one) writes whole. Tune rewrites a staged
    file in place while an earlier copy to storage may still read it, and then skips the next
    copy, so storage can hold a torn ``experiment_state-*.json`` (empty, or cut short) that
    ``Tuner.restore`` cannot read: it logs "Failed to restore the run state" and starts a new
    experiment. A limit of Tune's own crash safety, not what this test is about, so the kill
    waits for a result at which the stored copy is whole."""
    staging = Path(trial.storage.experiment_driver_staging_path)
    stored = Path(trial.storage.experiment_fs_path)
    files = [p for p in staging.iterdir() if p.is_file() and p.suffix in (".json", ".pkl")]
    return any(p.name.startswith("experiment_state-") for p in files) and all(
        (stored / p.name).is_file() and (stored / p.name).read_bytes() == p.read_bytes()
        for p in files
    )


def final_study(experiment: str) -> tuple[optuna.Study, dict[str, Any]]:
    """The inner OptunaSearch's study and its trials by member id, as the experiment in
    ``experiment`` saved them last."""
    path = sorted(glob(os.path.join(experiment, "searcher-state-*.pkl")))[-1]
    with open(path, "rb") as f:
        saved = pickle.load(f)
    return saved["_ot_study"], saved["_ot_trials"]


def _fusion() -> Fusion:
    return Fusion(TASK, members=MEMBERS, array_size=ARRAY_SIZE)


def run(storage: str, kill_after: int) -> None:
    """Start the experiment; this process is killed mid-way. Tune saves the experiment's state
    at every step here: its default period (10 s at least) is longer than this experiment, so
    the restore would start it over instead of going on from the arrays' checkpoints."""
    os.environ["TUNE_GLOBAL_CHECKPOINT_S"] = "0"
    fusion = _fusion()
    tuner = tune.Tuner(
        fusion.trainable,
        param_space=dict(SPACE),
        tune_config=tune.TuneConfig(
            metric="val_accuracy",
            mode="max",
            num_samples=-1,
            reuse_actors=True,
            search_alg=fusion.searcher(LoggedOptuna(storage, seed=0)),
            scheduler=fusion.scheduler(ASHAScheduler(max_t=4, grace_period=1, reduction_factor=2)),
        ),
        run_config=tune.RunConfig(
            storage_path=storage,
            name=NAME,
            verbose=0,
            callbacks=[KillAfter(kill_after, os.path.join(storage, "killed"))],
        ),
    )
    tuner.fit()
    raise SystemExit("the experiment finished before it was killed")


def restore(storage: str) -> None:
    """Finish the killed experiment."""
    fusion = _fusion()
    results = tune.Tuner.restore(os.path.join(storage, NAME), trainable=fusion.trainable).fit()
    if results.errors:
        raise SystemExit(f"the restored experiment has errors: {results.errors}")


def main() -> None:
    """``run STORAGE KILL_AFTER`` or ``restore STORAGE``, on a local Ray of 2 CPUs."""
    what, storage, *rest = sys.argv[1:]
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        logging_level=logging.WARNING,
        log_to_driver=False,
    )
    try:
        if what == "run":
            run(storage, int(rest[0]))
        else:
            restore(storage)
    finally:
        ray.shutdown()
