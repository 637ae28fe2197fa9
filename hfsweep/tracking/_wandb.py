"""The Weights & Biases tracker: one W&B run per trial through the ``wandb`` client, offline by
default (the runs are written under the run directory; ``wandb sync`` uploads them)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ._base import Callback, SweepInfo, TrialInfo

__all__ = ["WandbTracker"]

#: settings that keep a run quiet and light: no console capture, no git or code snapshot, no
#: system metrics sampled per run (a sweep has many runs at once); those this wandb lacks are
#: left out
_QUIET: dict[str, Any] = {
    "console": "off",
    "silent": True,
    "disable_git": True,
    "disable_code": True,
    "save_code": False,
    "disable_job_creation": True,
    "x_disable_stats": True,
    "x_disable_meta": True,
}


class WandbTracker(Callback):
    """Logs each trial as a W&B run in ``mode`` (``offline`` by default; ``online`` needs a
    login, ``disabled`` writes nothing) under ``dir`` (default: the run directory, so the runs
    are in ``<run dir>/wandb/``), in ``project`` and ``group`` (both default to the study name).

    A run is named ``trial-<number>`` with id ``<digest of the run dir and study>-<number>``
    (so a resumed sweep continues a trial's run instead of starting another); its config is the
    trial's config plus ``hfsweep.study``, ``hfsweep.trial`` and ``hfsweep.array``; its tags
    ``array:<index>`` (plus ``tags``). Every evaluation is one ``log()`` at the trial's step;
    the end sets the summary's ``hfsweep.status``, ``final_<metric>`` (and ``hfsweep.error``)
    and finishes the run (exit code 1 for a failed trial).
    """

    name = "wandb"

    def __init__(
        self,
        mode: str = "offline",
        project: str | None = None,
        entity: str | None = None,
        group: str | None = None,
        dir: str | Path | None = None,
        tags: Sequence[str] = (),
    ) -> None:
        self.mode = mode
        self.project = project
        self.entity = entity
        self.group = group
        self.dir = Path(dir) if dir is not None else None
        self.tags = list(tags)
        self.runs: dict[int, Any] = {}  # trial number -> wandb Run
        self.sweep: SweepInfo | None = None

    def on_sweep_start(self, sweep: SweepInfo) -> None:
        self.sweep = sweep
        if self.dir is None:
            self.dir = sweep.run_dir
        self.dir.mkdir(parents=True, exist_ok=True)

    def run_id(self, number: int) -> str:
        """Trial ``number``'s W&B run id: the same in every run of this sweep (run dir and
        study), so a resumed trial continues its run."""
        assert self.sweep is not None, "on_sweep_start comes first"
        digest = hashlib.sha256(
            f"{self.sweep.run_dir.resolve()}|{self.sweep.study_name}".encode()
        ).hexdigest()[:10]
        return f"{digest}-{number}"

    def on_trial_start(self, trial: TrialInfo) -> None:
        import wandb

        assert self.sweep is not None and self.dir is not None, "on_sweep_start comes first"
        fields = getattr(wandb.Settings, "model_fields", {})
        settings = wandb.Settings(**{k: v for k, v in _QUIET.items() if k in fields})
        config = {
            **dict(trial.config),
            "hfsweep.study": self.sweep.study_name,
            "hfsweep.trial": trial.number,
            "hfsweep.array": trial.array,
        }
        self.runs[trial.number] = wandb.init(
            mode=self.mode,  # type: ignore[arg-type]
            dir=str(self.dir),
            project=self.project or self.sweep.study_name,
            entity=self.entity,
            group=self.group or self.sweep.study_name,
            job_type="trial",
            name=f"trial-{trial.number}",
            id=self.run_id(trial.number),
            resume="allow" if self.sweep.resumed else None,
            config=config,
            tags=[f"array:{trial.array}", *self.tags],
            reinit="create_new",
            settings=settings,
        )

    def on_evaluation(
        self, trial: TrialInfo, step: int, epoch: float, metrics: Mapping[str, float]
    ) -> None:
        self.runs[trial.number].log({**metrics, "epoch": epoch}, step=step)

    def on_trial_end(
        self, trial: TrialInfo, status: str, value: float | None, error: str | None
    ) -> None:
        assert self.sweep is not None
        run = self.runs.pop(trial.number)
        try:
            run.summary["hfsweep.status"] = str(status)
            if value is not None:
                run.summary[f"final_{self.sweep.metric}"] = float(value)
            if error is not None:
                run.summary["hfsweep.error"] = error
        finally:
            run.finish(exit_code=1 if str(status) == "failed" else 0)

    def on_sweep_end(self) -> None:
        """Finish the runs of trials still training, marked preempted: a resumed sweep
        continues them."""
        runs, self.runs = self.runs, {}
        for run in runs.values():
            mark = getattr(run, "mark_preempting", None)
            if mark is not None:
                mark()
            run.finish()
