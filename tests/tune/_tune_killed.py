"""A fused Tune experiment in a process of its own that SIGKILLs itself at a chosen call to its
inner searcher, for the restore test (test_tune_restore_kill.py).

``python -c "import _tune_killed as t; t.main()" STORAGE STAGE KILL_AT PERIOD`` (this folder on
``PYTHONPATH``: the restoring process unpickles the searcher and the callback by name). Stage 0
starts the experiment, a later stage goes on with ``Tuner.restore``. The process kills itself
(SIGKILL, no clean-up) at the ``KILL_AT``-th call to the inner searcher's ``on_trial_result`` or
``on_trial_complete`` in this process, right after the call, or at the first one after it at
which Tune's storage holds a whole copy of the experiment's state; ``KILL_AT`` 0 runs to the
end. ``PERIOD`` is Tune's ``TUNE_GLOBAL_CHECKPOINT_S``: ``0`` saves the experiment at every
step, a large one only at the first step, so Tune's save lags the kill.

The inner searcher (:class:`RecordingOptuna`) writes into ``STORAGE``: ``suggested.log`` (``<pid>
<member id>``, each member it was asked for), ``told.log`` (``<pid> <member id> <state>
<value>``, each end it was told: ``COMPLETE`` with the metric, ``PRUNED`` with the last value,
``FAIL``) and ``twice.log`` (a member told again to a searcher that had heard its end: the
searcher's own record of ends is saved and restored with it).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import Any

import ray
from _tune_lifecycle import SPACE, TASK, _stored_state_is_whole, _wait_for_tunes_copy
from hfsweep.schedulers.tune import Fusion
from ray import tune
from ray.tune.schedulers import ASHAScheduler
from ray.tune.search.optuna import OptunaSearch

NAME = "killed"
MEMBERS = 16
ARRAY_SIZE = 4
METRIC = "val_accuracy"

#: this process's settings (module globals: the searcher is restored from saves, which would
#: bring back a first run's attributes)
_FOLDER = ""
_KILL_AT = 0
_CALLS = 0
#: a Tune trial of this process (its storage says where Tune's staged and stored state are)
_TRIAL: Any = None


class RecordingOptuna(OptunaSearch):
    """OptunaSearch that logs what it is asked and told (see the module docstring) and kills
    the process at the chosen call."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        #: member id -> (state, value) of each end this searcher heard (saved with it)
        self.ends: dict[str, tuple[str, float | None]] = {}

    def suggest(self, trial_id: str) -> dict[str, Any] | None:
        config = super().suggest(trial_id)
        if isinstance(config, dict):
            _log("suggested.log", trial_id)
        return config

    def on_trial_result(self, trial_id: str, result: dict[str, Any]) -> None:
        super().on_trial_result(trial_id, result)
        _maybe_kill()

    def on_trial_complete(
        self, trial_id: str, result: dict[str, Any] | None = None, error: bool = False
    ) -> None:
        if error or result is None:
            end: tuple[str, float | None] = ("FAIL", None)
        elif METRIC in result:
            end = ("COMPLETE", float(result[METRIC]))
        else:
            value = result.get("hfsweep_last_value")
            end = ("PRUNED", None if value is None else float(value))
        if trial_id in self.ends:
            _log("twice.log", f"{trial_id} {self.ends[trial_id]} {end}")
        self.ends[trial_id] = end
        _log("told.log", f"{trial_id} {end[0]} {end[1]!r}")
        super().on_trial_complete(trial_id, result, error)
        _maybe_kill()


class Track(tune.Callback):
    """Keeps a trial of this process, for :func:`_maybe_kill`'s look at Tune's storage."""

    def on_trial_start(self, iteration: int, trials: Any, trial: Any, **info: Any) -> None:
        global _TRIAL
        _TRIAL = trial


def _log(name: str, line: str) -> None:
    with open(os.path.join(_FOLDER, name), "a") as f:
        f.write(f"{os.getpid()} {line}\n")


def _maybe_kill() -> None:
    global _CALLS
    _CALLS += 1
    if not _KILL_AT or _CALLS < _KILL_AT or _TRIAL is None:
        return
    _wait_for_tunes_copy()
    if _stored_state_is_whole(_TRIAL):
        _log("kills.log", str(_CALLS))
        os.kill(os.getpid(), signal.SIGKILL)


def _fusion() -> Fusion:
    return Fusion(TASK, members=MEMBERS, array_size=ARRAY_SIZE)


def _start(storage: str) -> Any:
    fusion = _fusion()
    tuner = tune.Tuner(
        fusion.trainable,
        param_space=dict(SPACE),
        tune_config=tune.TuneConfig(
            metric=METRIC,
            mode="max",
            num_samples=-1,
            reuse_actors=True,
            search_alg=fusion.searcher(RecordingOptuna(seed=0)),
            scheduler=fusion.scheduler(ASHAScheduler(max_t=4, grace_period=1, reduction_factor=2)),
        ),
        run_config=tune.RunConfig(storage_path=storage, name=NAME, verbose=0, callbacks=[Track()]),
    )
    return tuner.fit()


def main() -> None:
    """Run stage ``STAGE`` on a local Ray of 2 CPUs (see the module docstring)."""
    global _FOLDER, _KILL_AT
    storage, stage, kill_at, period = sys.argv[1:]
    _FOLDER, _KILL_AT = storage, int(kill_at)
    os.environ["TUNE_GLOBAL_CHECKPOINT_S"] = period
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        logging_level=logging.WARNING,
        log_to_driver=False,
    )
    try:
        if int(stage) == 0:
            results = _start(storage)
        else:
            path = os.path.join(storage, NAME)
            results = tune.Tuner.restore(path, trainable=_fusion().trainable).fit()
        if results.errors:
            raise SystemExit(f"the experiment has errors: {results.errors}")
    finally:
        ray.shutdown()
