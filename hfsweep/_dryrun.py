"""The dry run: the task's own code run once on a sweep's configs, before anything is written.

Parsing a sweep file checks every value the file holds, but not the task's code: a forward
pass whose shapes do not match, a loss of the wrong shape, data of the wrong dtype or a model
that rejects some configs would only show once the sweep had written its run directory and
started its trials. :func:`dry_run` builds the model of the configs a sweep's space can produce
(its corners and a few random draws, as the config check resolves them) and trains an array
of two members for one step on one training batch, then evaluates it on one validation batch,
through the trainer the sweep itself uses. It takes about as long as building a few models
and one step of training; ``hfsweep validate`` and every sweep start with it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from ._task import Task
from ._usercode import describe, phase_of
from .config import _SAMPLES, ConfigError, SweepConfig, _samples
from .trainer import ArrayTrainer, Member, _DataCache

__all__ = ["dry_run"]

#: most sampled configs whose model the dry run builds (every corner of the space first)
_BUILDS = 12
_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def dry_run(
    sc: SweepConfig, *, device: str | torch.device | None = None, data: _DataCache | None = None
) -> None:
    """Run the task of ``sc`` once, as described in the module docstring.

    ``device`` defaults to the sweep's (``auto``: CUDA if available; the CPU where the sweep
    names a CUDA device this machine does not have: the dry run checks the task's code, the
    device is checked where the sweep starts). Raises :class:`~hfsweep.config.ConfigError` at
    YAML path ``task``, naming the part of the task that failed (its ``model(config)``, its
    ``data(config)``, the forward pass with the submodule that raised, the loss, the metrics)
    and the sampled config, chained to the task's exception. ``data``: a cache to load the
    data into (and to take it from), so that the sweep's arrays need not load it again.
    """
    task = sc.task
    configs = _configs(sc)
    if not configs:
        return
    for sampled, config in configs[:_BUILDS]:
        try:
            task.build_model(config)
        except Exception as exc:
            raise _error(
                sc,
                f"its model(config) raised {describe(exc)} for the sampled config "
                f"{_shown(sampled)}; fix the model, or narrow the search space so that it "
                "never samples such a config",
            ) from exc
    dtype = _DTYPES[sc.fusion.dtype]
    where = torch.device(device if device is not None else _device(sc))
    (first_sampled, first), second = configs[0], _partner(task, configs)
    real = ArrayTrainer(task, device=where, dtype=dtype)
    if data is not None:
        real._data_cache = data
    step = f"an array of 2 of the sampled config {_shown(first_sampled)}"
    try:
        real.steps_per_epoch(first)  # the whole data, as the sweep loads it
        train, val = real._dataset(first)
        one = dataclasses.replace(
            task, data=lambda _config: (_FirstBatch(train), _FirstBatch(val)), steps_per_epoch=1
        )
        trainer = ArrayTrainer(
            one, device=where, dtype=dtype, trace=False, keep_states=False, final_states="none"
        )
        results = trainer.run(
            [
                Member("dry-run-0", {**first, "max_steps": 1}),
                Member("dry-run-1", {**second, "max_steps": 1}),
            ]
        )
    except Exception as exc:
        phase = phase_of(exc)
        raise _error(
            sc,
            f"{step}, trained for one step on one batch, raised "
            + (f"in {phase}: " if phase else "")
            + f"{describe(exc)}; fix the task",
        ) from exc
    for result in results:
        if result.status == "failed" and (result.error or "").startswith("the task's model"):
            raise _error(sc, f"{step}: {result.error}; fix the model")


class _FirstBatch:
    """The first batch of ``batches``, alone: one training step, one validation batch."""

    def __init__(self, batches: Iterable[Any]) -> None:
        self._batches = batches

    def __len__(self) -> int:
        return 1

    def __iter__(self) -> Iterator[Any]:
        for batch in self._batches:
            yield batch
            return


def _configs(sc: SweepConfig) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """``(sampled, resolved trial config)`` of the space's corners, then of random draws with a
    shared config not seen yet (a new architecture or data), without repeats."""
    out: list[tuple[dict[str, Any], dict[str, Any]]] = []
    seen: set[str] = set()
    keys: set[str] = set()
    samples = _samples(sc.space, sc.seed)
    corners = len(samples) - _SAMPLES  # _samples gives the corners, then the random draws
    for n, sampled in enumerate(samples):
        try:
            config = sc.task.resolve(sc.trial_config(sampled))
            key = sc.task.compatibility_key(config)
        except ValueError:  # a config the task rejects fails its trial alone
            continue
        text = repr(sorted(config.items()))
        if text in seen or (n >= corners and key in keys):
            continue
        seen.add(text)
        keys.add(key)
        out.append((sampled, config))
    return out


def _partner(task: Task, configs: list[tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, Any]:
    """The second member of the dry run's array: another config of the first one's shared
    values (its other hyperparameters exercise the per-member paths), else the first again."""
    key = task.compatibility_key(configs[0][1])
    for _, config in configs[1:]:
        if task.compatibility_key(config) == key:
            return config
    return configs[0][1]


def _device(sc: SweepConfig) -> str:
    device = sc.fusion.device
    if sc.backend == "ray" or device == "cpu":
        return "cpu"  # on Ray the driver only checks the code; the workers train
    if device == "auto" or not torch.cuda.is_available():
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def _shown(sampled: Mapping[str, Any]) -> str:
    return "{" + ", ".join(f"{k}: {v!r}" for k, v in sampled.items()) + "}" if sampled else "{}"


def _error(sc: SweepConfig, problem: str) -> ConfigError:
    return ConfigError(
        f"task {sc.task.name!r} fails a dry run: {problem} (hfsweep validate --debug prints the "
        "traceback)",
        path="task",
        file=str(sc.source) if sc.source is not None else None,
    )
