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
import gc
import warnings
import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from .._usercode import describe, phase_of
from ..config import ConfigError, SweepConfig
from ..config.validate import RANDOM_SAMPLES, sample_configs
from ..sizing.device import DTYPES, resolve_device
from ..training import ArrayTrainer, DataCache, Member
from ..training.task import Task, fork_rng
from .result import _blame_hfsweep, _raised_by_the_task

__all__ = ["dry_run"]

#: most sampled configs whose model the dry run builds (every corner of the space first)
_BUILDS = 12
#: copies of a model's tensors the dry run's array of two needs at least: the two models it is
#: built from, the array's two members, and their gradients
_COPIES = 6


def runs_on_the_driver(sc: SweepConfig) -> bool:
    """Whether a sweep's dry run runs where it starts: not for a Ray cluster given by
    ``ray.address``, whose data and devices may exist on its workers only (the workers' first
    array checks the task there). ``hs.sweep``, ``hfsweep run`` and ``hfsweep validate`` all
    follow this."""
    return sc.backend != "ray" or sc.ray.address is None


def dry_run(
    sc: SweepConfig, *, device: str | torch.device | None = None, data: DataCache | None = None
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
    dtype = DTYPES[sc.fusion.dtype]
    where = torch.device(device if device is not None else _device(sc))
    for sampled, config in configs[:_BUILDS]:
        if sc.backend != "ray":  # on Ray the workers' memory counts, which this cannot see
            _check_size(sc, sampled, config, where, dtype)
        try:
            task.build_model(config)
        except Exception as exc:
            raise _error(
                sc,
                f"its model(config) raised {describe(exc)} for the config "
                f"{_shown(sc, sampled)}; fix the model, or narrow the search space so that it "
                "never samples such a config",
            ) from exc
    (first_sampled, first), second = configs[0], _partner(task, configs)
    real = ArrayTrainer(task, device=where, dtype=dtype)
    if data is not None:
        real._data_cache = data
    step = f"an array of 2 of the config {_shown(sc, first_sampled)}"
    try:
        real.steps_per_epoch(first)  # the whole data, as the sweep loads it
        train, val = real._dataset(first)
        one = dataclasses.replace(
            task, data=lambda _config: (_FirstBatch(train), _FirstBatch(val)), steps_per_epoch=1
        )
        trainer = ArrayTrainer(
            one,
            device=where,
            dtype=dtype,
            trace=False,
            keep_states=False,
            final_states="none",
            share_frozen=sc.fusion.share_frozen,
        )
        results = trainer.run(
            [
                Member("dry-run-0", {**first, "max_steps": 1}),
                Member("dry-run-1", {**second, "max_steps": 1}),
            ]
        )
    except Exception as exc:
        phase = phase_of(exc)
        if not _raised_by_the_task(exc):  # hfsweep's own code (its optimizer step), not the task's
            _blame_hfsweep(exc)
            raise
        raise _error(
            sc,
            f"{step}, trained for one step on one batch, raised "
            + (f"in {phase}: " if phase else "")
            + f"{describe(exc)}; fix the task",
        ) from exc
    for result in results:
        # a member that fails without raising: its model (built above, so not likely), or out
        # of memory alone; a non-finite loss after one step is the hyperparameters' doing
        if result.status == "failed" and not (result.error or "").startswith("non-finite"):
            raise _error(sc, f"{step}: {result.error}", raised=False)


def _check_size(
    sc: SweepConfig,
    sampled: Mapping[str, Any],
    config: Mapping[str, Any],
    device: torch.device,
    dtype: torch.dtype,
) -> None:
    """Refuse a model too large for the dry run's array on ``device`` before building it: a
    typo such as ``hidden: 1000000000`` would otherwise exhaust the machine's memory (and get
    the process killed) rather than fail. The model is built on the meta device (no memory)
    to count its parameters and buffers; the array of two members with their gradients and the
    two models it is built from need at least :data:`_COPIES` times that. A model that cannot
    be built on the meta device is not checked here. A task that keeps the tensors it builds
    (a base model in ``functools.lru_cache``) would keep meta tensors and fail every real
    build, blaming the model: that is refused here, saying so."""
    from ..sizing.device import device_budget

    counted = _count_on_meta(sc.task, config)
    if counted is None:
        return
    floats, others, kept = counted
    gc.collect()  # the meta model is gone: what is left of its tensors, something else holds
    if any(ref() is not None for ref in kept):
        raise _error(
            sc,
            f"its model(config) keeps tensors from one call to the next (a pretrained part "
            "held in functools.lru_cache, a global or a class attribute?): hfsweep built the "
            f"model of the config {_shown(sc, sampled)} on the meta device, to count its "
            "size before allocating it, and the tensors created then are still held, without "
            "data, so every later model would be built from them. Create what the cache holds "
            "on a device of its own (with torch.device('cpu'): inside the cached function), "
            "or load it once outside model(config), and start a new Python process (this "
            "one's cache holds the meta tensors now)",
            raised=False,
        )
    size = max(dtype.itemsize, 1)
    need = _COPIES * (floats * size + others)
    try:
        budget = device_budget(device, fraction=1.0)
    except (RuntimeError, ValueError):
        return
    if need > budget:
        raise _error(
            sc,
            f"the model of the config {_shown(sc, sampled)} has {floats:,} parameters "
            f"({_size(floats * size)} in {sc.fusion.dtype}); an array of 2 of it needs at "
            f"least {_size(need)}, and {device} has {_size(budget)} available. Make the model "
            "smaller, or narrow the search space",
            raised=False,
        )


def _count_on_meta(
    task: Task, config: Mapping[str, Any]
) -> tuple[int, int, list[weakref.ref[torch.Tensor]]] | None:
    """``(floating elements, bytes of the other tensors, weak references to every tensor)`` of
    ``task.model(config)`` built on the meta device (no memory); ``None`` if it cannot be built
    there. The model and its tensors are dropped on return: a weak reference that still
    answers after a garbage collection is a tensor the task's own state keeps."""
    try:
        with fork_rng(), torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the real build warns as it should
            model = task.model(config)
        tensors = [*model.parameters(), *model.buffers()]
    except Exception:
        return None
    floats = sum(t.numel() for t in tensors if t.is_floating_point())
    others = sum(t.numel() * t.element_size() for t in tensors if not t.is_floating_point())
    return floats, others, [weakref.ref(t) for t in tensors if t.is_meta]


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
    samples = sample_configs(sc.space, sc.seed)
    corners = (
        len(samples) - RANDOM_SAMPLES
    )  # sample_configs gives the corners, then the random draws
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
    if not torch.cuda.is_available():
        return "cpu"  # a dry run checks the code where it can: here, on the CPU
    return resolve_device(device)


def _shown(sc: SweepConfig, sampled: Mapping[str, Any]) -> str:
    """The sweep's fixed config values and ``sampled``, as a YAML-like mapping."""
    values = {**sc.config, **sampled}
    return "{" + ", ".join(f"{k}: {v!r}" for k, v in values.items()) + "}"


def _size(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _error(sc: SweepConfig, problem: str, *, raised: bool = True) -> ConfigError:
    """The dry run's error; ``raised``: the task raised (``--debug`` shows its traceback)."""
    debug = " (hfsweep validate --debug prints the traceback)" if raised else ""
    return ConfigError(
        f"task {sc.task.name!r} fails a dry run: {problem}{debug}",
        path="task",
        file=str(sc.source) if sc.source is not None else None,
    )
