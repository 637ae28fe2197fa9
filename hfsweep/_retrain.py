"""``hs.retrain``: train one finished trial of a sweep again, alone, and compare it with what the
sweep recorded.

A member of an array trains exactly as its trial would alone; this is how a user checks that
for a trial of their own sweep (the winner, say) without reading hfsweep's code. The trial's
config comes from the run directory's resolved sweep (``sweep.json``) and the trial's params in
the study, its place in the shared data stream from its ``start_step`` user attribute (where a
trial that joined its array by refill started), and the recorded history from
``histories/trial-N.csv``. It trains as an array of one member with the sweep's device, dtype
and evaluation period, and stops after as many evaluations as were recorded (a pruned trial's).
docs/reproducing.md says what fixes a trial's training, for retraining it without hfsweep.
"""

from __future__ import annotations

import csv
import json
import math
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ._status import Status
from .sizing.device import DTYPES, resolve_device
from .training import ArrayTrainer, Evaluation, Member, MemberResult
from .training.task import Task

__all__ = ["Retrained", "retrain"]

#: the relative difference a retrained value may have by the sweep's dtype: float64 is exact to
#: rounding; float32 and bfloat16 round differently in an array of B and of one member
_RTOL = {"float64": 1e-7, "float32": 1e-4, "bfloat16": 1e-2}


@dataclass
class Retrained:
    """One trial trained again alone (:func:`retrain`), beside what the sweep recorded."""

    number: int  #: the trial's number in the study
    start_step: int  #: where in its array's data stream the trial started
    recorded: list[dict[str, float]]  #: the sweep's evaluations (``histories/trial-N.csv``)
    result: MemberResult  #: the retraining's result (its ``history``, final ``state``...)
    max_rel_diff: float  #: the largest relative difference over every recorded value
    rtol: float  #: the difference :attr:`matches` allows

    @property
    def matches(self) -> bool:
        """Whether every evaluation agrees with the recorded one within :attr:`rtol`."""
        return len(self.result.history) == len(self.recorded) and self.max_rel_diff <= self.rtol

    def table(self) -> str:
        """The recorded and retrained values, evaluation by evaluation, as text."""
        keys = [k for k in self.recorded[0] if k not in ("step", "epoch")] if self.recorded else []
        lines = [f"trial {self.number}, started at step {self.start_step} of its array's data"]
        lines.append("  step  " + "  ".join(f"{k:>24}" for k in keys))
        for rec, new in zip(self.recorded, self.result.history, strict=False):
            cells = [f"{rec[k]:>11.6g} / {new.get(k, math.nan):<10.6g}" for k in keys]
            lines.append(f"{int(rec['step']):>6}  " + "  ".join(cells))
        verdict = "matches" if self.matches else "DIFFERS"
        lines.append(
            f"recorded / retrained: {verdict} (largest relative difference "
            f"{self.max_rel_diff:.3g}, allowed {self.rtol:g})"
        )
        return "\n".join(lines)


def retrain(
    run_dir: str | os.PathLike[str],
    number: int,
    *,
    task: Task | None = None,
    device: str | torch.device | None = None,
    rtol: float | None = None,
) -> Retrained:
    """Train trial ``number`` of the sweep in ``run_dir`` again, alone, and compare its
    evaluations with the recorded ones.

    ``task`` is needed only for a sweep that was given an :class:`hfsweep.Task` object from
    Python, which ``sweep.json`` cannot name. ``device`` defaults to the sweep's (``auto``: CUDA where there is one). ``rtol`` defaults
    by the sweep's dtype: 1e-7 for float64, 1e-4 for float32, 1e-2 for bfloat16. Raises
    ``ValueError`` naming the problem for a trial that does not exist, has not finished or has
    no recorded history; a run directory older than the ``start_step`` record retrains from
    the data's start with a warning (exact only for trials that started their array).
    """
    from .config import parse_sweep
    from .report import load_study, read_sweep

    run = Path(run_dir)
    sweep_json = run / "sweep.json"
    spec = read_sweep(run)
    with sweep_json.open(encoding="utf-8") as f:
        saved = json.load(f)
    if task is not None:
        saved["task"] = task
    elif str(saved.get("task", "")).startswith("<python object"):
        raise ValueError(
            f"{sweep_json}: the sweep's task was a Python object ({saved['task']}), which the "
            "run directory cannot name: pass it, hs.retrain(run_dir, number, task=your_task)"
        )
    sc = parse_sweep(saved)
    study = load_study(run, spec)
    trials = {t.number: t for t in study.get_trials(deepcopy=False)}
    if number not in trials:
        raise ValueError(
            f"{run}: the study has no trial {number!r}; its trials are numbered "
            f"0 to {len(trials) - 1}"
        )
    trial = trials[number]
    status = Status.of_trial_state(trial.state)
    if not status.final:
        raise ValueError(f"{run}: trial {number} is {status.value}, not finished")
    recorded = _read_history(run / "histories" / f"trial-{number}.csv")
    if not recorded:
        raise ValueError(
            f"{run}: trial {number} has no recorded evaluation "
            f"(histories/trial-{number}.csv is missing or empty)"
        )
    start = trial.user_attrs.get("start_step")
    if start is None:
        warnings.warn(
            f"{run}: trial {number} has no start_step (the run directory predates it): "
            "retraining from the data's start, which matches only a trial that started its array",
            stacklevel=2,
        )
        start = 0
    target = resolve_device(device if device is not None else sc.fusion.device)
    trainer = ArrayTrainer(
        sc.task,
        device=target,
        dtype=DTYPES[sc.fusion.dtype],
        eval_every=sc.fusion.eval_every,
        share_frozen=sc.fusion.share_frozen,
    )
    wanted = len(recorded)
    seen = 0

    def stop_when_recorded_ends(evaluations: list[Evaluation]) -> dict[str, bool]:
        nonlocal seen
        seen += len(evaluations)
        return {e.member: seen < wanted for e in evaluations}

    import optuna

    # the engine's config of the trial: the space sampled at the trial's params (fixed values
    # and conditions included), the sweep's fixed config and the budget
    config = sc.trial_config(sc.space.sample(optuna.trial.FixedTrial(dict(trial.params))))
    (result,) = trainer.run(
        [Member(f"trial-{number}", config)], report=stop_when_recorded_ends, start_step=int(start)
    )
    return Retrained(
        number=number,
        start_step=int(start),
        recorded=recorded,
        result=result,
        max_rel_diff=_max_rel_diff(recorded, result.history),
        rtol=rtol if rtol is not None else _RTOL[sc.fusion.dtype],
    )


def _read_history(path: Path) -> list[dict[str, float]]:
    """The evaluations of ``histories/trial-N.csv`` as floats (empty when it is missing)."""
    if not path.exists():
        return []
    with path.open(newline="", encoding="utf-8") as f:
        return [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]


def _max_rel_diff(
    recorded: Sequence[Mapping[str, float]], retrained: Sequence[Mapping[str, Any]]
) -> float:
    """The largest ``|a - b| / max(|a|, tiny)`` over the values both histories hold, ``inf``
    where one has a value the other lacks or only one of them is finite."""
    worst = 0.0
    for rec, new in zip(recorded, retrained, strict=False):
        for key, a in rec.items():
            b = new.get(key)
            if b is None:
                return math.inf
            b = float(b)
            if math.isnan(a) and math.isnan(b):
                continue
            if not (math.isfinite(a) and math.isfinite(b)):
                if a != b:
                    return math.inf
                continue
            worst = max(worst, abs(a - b) / max(abs(a), 1e-300))
    return worst
