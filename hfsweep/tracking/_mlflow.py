"""The MLflow tracker: one MLflow run per trial, through MLflow's own client
(``mlflow.tracking.MlflowClient``), in a local SQLite file by default."""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ._base import Callback, SweepInfo, TrialInfo

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

__all__ = ["MLflowTracker"]

#: what MLflow's run status is for each final hfsweep status
_RUN_STATUS = {"completed": "FINISHED", "stopped": "FINISHED", "failed": "FAILED"}
#: MLflow's limit on a param's value
_PARAM_CHARS = 6000


class MLflowTracker(Callback):
    """Logs each trial as an MLflow run in experiment ``experiment`` (default: the study name)
    at ``tracking_uri`` (default ``sqlite:///<run dir>/mlflow.db``, a file beside the study:
    MLflow 3 refuses a plain ``./mlruns`` folder unless ``MLFLOW_ALLOW_FILE_STORE`` is set).

    A run is named ``trial-<number>``; its params are the trial's config, its tags
    ``hfsweep.study``, ``hfsweep.trial``, ``hfsweep.array``, ``hfsweep.run_dir`` (plus
    ``tags``) and at the end ``hfsweep.status``; every evaluation logs each metric at its step
    (and ``epoch``); the end logs ``final_<metric>`` and the run's status (``FINISHED``, or
    ``FAILED`` for a failed trial). A resumed sweep reopens a trial's run that is still
    ``RUNNING`` instead of starting a second one.
    """

    name = "mlflow"

    def __init__(
        self,
        tracking_uri: str | None = None,
        experiment: str | None = None,
        tags: Mapping[str, str] | None = None,
    ) -> None:
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self.tags = dict(tags or {})
        self.client: MlflowClient | None = None
        self.experiment_id = ""
        self.runs: dict[int, str] = {}  # trial number -> run id
        self.sweep: SweepInfo | None = None

    def on_sweep_start(self, sweep: SweepInfo) -> None:
        from mlflow.tracking import MlflowClient

        self.sweep = sweep
        uri = self.tracking_uri or f"sqlite:///{sweep.run_dir.resolve() / 'mlflow.db'}"
        name = self.experiment or sweep.study_name
        # the store opens here: quietly (MLflow's INFO lines as it creates a database's
        # tables, and SQLAlchemy's deprecation warnings about MLflow's code, would cut
        # through the progress line)
        db_log = logging.getLogger("mlflow.store.db.utils")
        level = db_log.level
        db_log.setLevel(logging.WARNING)
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", category=DeprecationWarning)
                self.client = MlflowClient(tracking_uri=uri)
                found = self.client.get_experiment_by_name(name)
        finally:
            db_log.setLevel(level)
        self.experiment_id = (
            found.experiment_id if found is not None else self.client.create_experiment(name)
        )

    def on_trial_start(self, trial: TrialInfo) -> None:
        client, sweep = self._open()
        if sweep.resumed:
            open_run = self._running(trial.number)
            if open_run is not None:
                self.runs[trial.number] = open_run
                return
        tags = {
            **self.tags,
            "hfsweep.study": sweep.study_name,
            "hfsweep.trial": str(trial.number),
            "hfsweep.array": "" if trial.array is None else str(trial.array),
            "hfsweep.run_dir": str(sweep.run_dir),
        }
        run = client.create_run(self.experiment_id, run_name=f"trial-{trial.number}", tags=tags)
        run_id = run.info.run_id
        self.runs[trial.number] = run_id
        from mlflow.entities import Param

        params = [Param(str(k), _param(v)) for k, v in trial.config.items()]
        if params:
            client.log_batch(run_id, params=params)

    def on_evaluation(
        self, trial: TrialInfo, step: int, epoch: float, metrics: Mapping[str, float]
    ) -> None:
        from mlflow.entities import Metric

        client, _ = self._open()
        now = int(time.time() * 1000)
        rows = [Metric(k, v, now, step) for k, v in metrics.items()]
        rows.append(Metric("epoch", float(epoch), now, step))
        client.log_batch(self.runs[trial.number], metrics=rows)

    def on_trial_end(
        self, trial: TrialInfo, status: str, value: float | None, error: str | None
    ) -> None:
        client, sweep = self._open()
        run_id = self.runs.pop(trial.number)
        client.set_tag(run_id, "hfsweep.status", str(status))
        if error is not None:
            client.set_tag(run_id, "hfsweep.error", error[:_PARAM_CHARS])
        if value is not None:
            client.log_metric(run_id, f"final_{sweep.metric}", float(value))
        client.set_terminated(run_id, _RUN_STATUS.get(str(status), "FINISHED"))

    def _open(self) -> tuple[MlflowClient, SweepInfo]:
        assert self.client is not None and self.sweep is not None, "on_sweep_start comes first"
        return self.client, self.sweep

    def _running(self, number: int) -> str | None:
        """The id of trial ``number``'s run of this run directory that is still ``RUNNING``
        (the sweep was interrupted while it trained), if any."""
        client, sweep = self._open()
        found = client.search_runs(
            [self.experiment_id],
            filter_string=(
                f"tags.`hfsweep.trial` = '{number}' and "
                f"tags.`hfsweep.run_dir` = '{_quoted(str(sweep.run_dir))}' and "
                "attributes.status = 'RUNNING'"
            ),
            max_results=1,
        )
        return found[0].info.run_id if found else None


def _param(value: Any) -> str:
    return str(value)[:_PARAM_CHARS]


def _quoted(text: str) -> str:
    return text.replace("\\", "\\\\").replace("'", "\\'")
