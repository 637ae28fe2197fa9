"""The TensorBoard tracker: one log dir per trial, written with PyTorch's
``torch.utils.tensorboard.SummaryWriter`` (which needs the ``tensorboard`` package), with the
trial's hyperparameters for TensorBoard's HParams dashboard."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._base import Callback, SweepInfo, TrialInfo

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

__all__ = ["TensorBoardTracker"]

#: the HParams plugin's session status of each final hfsweep status
_SESSION_STATUS = {
    "completed": "STATUS_SUCCESS",
    "stopped": "STATUS_SUCCESS",
    "failed": "STATUS_FAILURE",
}


class TensorBoardTracker(Callback):
    """Writes each trial to ``<log_dir>/trial-<number>`` (``log_dir`` defaults to
    ``<run dir>/tensorboard``): every evaluation's metrics as scalars at its step (and
    ``epoch``), the trial's config as hparams (with ``hfsweep.trial``, ``hfsweep.array`` and
    ``hfsweep.study``), and at the end its status as the text ``hfsweep/status``, the scalar
    ``final_<metric>`` and the HParams session's end. ``tensorboard --logdir <log_dir>`` shows
    one run per trial. A resumed trial writes a new event file in the same log dir, which
    TensorBoard reads as one run."""

    name = "tensorboard"

    def __init__(self, log_dir: str | Path | None = None) -> None:
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.writers: dict[int, SummaryWriter] = {}
        self.steps: dict[int, int] = {}
        self.sweep: SweepInfo | None = None

    def on_sweep_start(self, sweep: SweepInfo) -> None:
        self.sweep = sweep
        if self.log_dir is None:
            self.log_dir = sweep.run_dir / "tensorboard"

    def on_trial_start(self, trial: TrialInfo) -> None:
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        assert self.sweep is not None and self.log_dir is not None, "on_sweep_start comes first"
        writer = SummaryWriter(log_dir=str(self.log_dir / f"trial-{trial.number}"))
        self.writers[trial.number] = writer
        values: dict[str, Any] = {k: _hparam(v) for k, v in trial.config.items()}
        values.update(
            {
                "hfsweep.study": self.sweep.study_name,
                "hfsweep.trial": trial.number,
                "hfsweep.array": -1 if trial.array is None else trial.array,
            }
        )
        experiment, start, _ = hparams(values, {self.sweep.metric: 0.0})
        events = writer.file_writer
        assert events is not None  # SummaryWriter opens it in __init__
        events.add_summary(experiment)
        events.add_summary(start)
        writer.add_text(
            "hfsweep/trial",
            f"study {self.sweep.study_name}, trial {trial.number}, array {trial.array}",
        )
        writer.flush()

    def on_evaluation(
        self, trial: TrialInfo, step: int, epoch: float, metrics: Mapping[str, float]
    ) -> None:
        writer = self.writers[trial.number]
        for key, value in metrics.items():
            writer.add_scalar(key, value, global_step=step)
        writer.add_scalar("epoch", epoch, global_step=step)
        self.steps[trial.number] = step
        writer.flush()

    def on_trial_end(
        self, trial: TrialInfo, status: str, value: float | None, error: str | None
    ) -> None:
        assert self.sweep is not None
        writer = self.writers.pop(trial.number)
        step = self.steps.pop(trial.number, 0)
        try:
            text = str(status) + (f": {error}" if error else "")
            writer.add_text("hfsweep/status", text, global_step=step)
            if value is not None:
                writer.add_scalar(f"final_{self.sweep.metric}", value, global_step=step)
            events = writer.file_writer
            assert events is not None
            events.add_summary(_session_end(str(status)))
        finally:
            writer.close()

    def on_sweep_end(self) -> None:
        """Close the writers of trials still training (their log dirs take more events when
        the sweep resumes)."""
        writers, self.writers = self.writers, {}
        for writer in writers.values():
            writer.close()


def _hparam(value: Any) -> int | float | str | bool:
    """A config value as the HParams plugin takes it (a number, bool or string)."""
    if isinstance(value, bool | int | float | str):
        return value
    return str(value)


def _session_end(status: str) -> Any:
    """The HParams plugin's session-end summary with the trial's status (PyTorch's
    ``hparams()`` writes only a successful one)."""
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboard.plugins.hparams.api_pb2 import Status
    from tensorboard.plugins.hparams.metadata import (
        PLUGIN_DATA_VERSION,
        PLUGIN_NAME,
        SESSION_END_INFO_TAG,
    )
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData, SessionEndInfo

    end = SessionEndInfo(status=Status.Value(_SESSION_STATUS.get(status, "STATUS_UNKNOWN")))
    content = HParamsPluginData(session_end_info=end, version=PLUGIN_DATA_VERSION)
    meta = SummaryMetadata(
        plugin_data=SummaryMetadata.PluginData(
            plugin_name=PLUGIN_NAME, content=content.SerializeToString()
        )
    )
    return Summary(value=[Summary.Value(tag=SESSION_END_INFO_TAG, metadata=meta)])
