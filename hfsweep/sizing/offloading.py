"""``offload: auto`` by measured throughput (:func:`profile_offload`): an array of B members whose
estimated state does not fit the device's memory budget, but B' < B members do, is measured both
ways, offloaded at B and on the device at B', and trains the faster way. B' itself is measured:
the most members whose peak memory on the device, activations included, stays within the budget.

The rule itself (what fits, when there is nothing to measure, which rate wins) is
:mod:`hfsweep.offload`'s (:func:`~hfsweep.offload.choose_by_rate`); this module measures the two
rates through :func:`~hfsweep.sizing.timing.measure_step` (the trainer's own training step, on the
task's first batch) and keeps the choice in the profile cache under a key of its own: the
architecture, optimizer and input as :func:`~hfsweep.profile_task`'s, plus ``offload=auto``, the
budget in bytes and B, so that a resumed or repeated run reads it back instead of measuring again.

The trainer asks for this choice, but the profiler imports the trainer (it measures the trainer's
step), so the trainer cannot import the profiler: this module hands :func:`profile_offload` to the
trainer when it is imported (``use_offload_profiler`` of ``hfsweep.training._offload_auto``), and ``import
hfsweep`` imports it.

On a CPU the "device" and the host are one memory and a shard's transfer is a copy in memory, so
the figures measured there prove the mechanism, not what a GPU would choose.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from ..offload import (
    OffloadChoice,
    OffloadError,
    check_offload_step,
    choose_by_rate,
    fit_size,
    frozen_bytes,
    state_bytes,
)
from ..training import use_offload_profiler
from ..training.task import Task
from ._provenance import conditions, refresh_requested
from .cache import Profile, ProfileCache, cache_key
from .device import describe_device
from .model import Measurement, MemoryModel
from .timing import _arch, _step_of, model_and_batch

__all__ = ["profile_offload"]

_log = logging.getLogger("hfsweep.profiler")

#: ``measure(size, offloaded)``: one :class:`Measurement` of an array of ``size`` members,
#: offloaded (with the budget) or on the device; an offloaded array whose optimizer steps on
#: the device is measured as ``measure(size, True, offload_step="device")``
MeasureFn = Callable[..., Measurement]


def profile_offload(
    task: Task,
    config: Mapping[str, Any] | None,
    size: int,
    *,
    device_memory: int,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    cache: ProfileCache | None = None,
    refresh: bool = False,
    min_seconds: float = 0.5,
    data: tuple[Iterable[Any], Iterable[Any]] | None = None,
    measure: MeasureFn | None = None,
    share_frozen: bool = True,
    offload_step: str = "host",
) -> OffloadChoice:
    """How an array of ``size`` members of ``config`` trains on ``device`` with ``device_memory``
    bytes there under ``offload: auto``: on the device as it is (``"none"``: it fits), offloaded
    (``"host"``: not one member fits, or offloaded at ``size`` was measured faster), or as arrays
    of B' members that fit, one after another (``"split"``: measured faster).

    What fits is first estimated from the training state alone
    (:func:`~hfsweep.offload.state_bytes` per member): where not one member fits by that
    estimate, nothing is measured. Otherwise what fits is measured: the peak memory of arrays on
    the device, activations included (:func:`_measured_fit`), which the estimate leaves out (an
    array whose state fits could still run out of memory in its step). The measured peaks say
    whether the whole array fits (``"none"``), not one member does (``"host"``), or B' < B.
    Where both ways are possible, each is timed for ``min_seconds`` (or less once its step times
    settle) and the member-samples/s of both and the choice are logged on ``hfsweep.profiler``.
    With a ``cache``, the choice is stored with the on-device measurements and read back unless
    ``refresh``. ``measure(size, offloaded)`` replaces the timing (tests). ``data``: the task's
    ``(train, eval)`` loaders where already built. ``share_frozen``: the arrays keep frozen
    tensors every member holds identically once, on the device and offloaded, as the trainer's
    do with ``fusion.share_frozen``: the estimate counts them once for the array
    (:func:`~hfsweep.offload.frozen_bytes`), the measured peaks and rates are of such arrays,
    and the choice is cached under a key of its own (as :func:`~hfsweep.profile_task`'s).
    ``offload_step``: the trainer's (``fusion.offload_step``), so that the offloaded array is
    measured as it will train: with the host step, with the device step, or (``auto``, which
    trains the faster of the two) with both, the faster one's rate compared with splitting;
    a config that clips its gradients is measured with the host step, on which the trainer
    steps it. Where the device step cannot run the array (a model streamed between its
    blocks, a budget that cannot hold its cut), ``auto`` measures the host step alone and
    ``device`` counts as not offloadable. A step other than the host's is part of the cache
    key.
    """
    device = torch.device(device)
    resolved = task.resolve(config or {})
    model, x, y = model_and_batch(task, resolved, device, dtype, data)
    member = max(state_bytes(model, share_frozen=share_frozen), 1)
    shared = frozen_bytes(model) if share_frozen else 0
    fit = min(fit_size(member, device_memory, shared), size)
    if fit == 0:
        return _unmeasured(size, member, shared, device_memory)
    steps = _offload_steps(check_offload_step(offload_step), resolved)
    arch = (
        f"{_arch(model, resolved, x, share_frozen)}|offload=auto|device_memory={device_memory}"
        f"|B={size}"
    )
    if steps != ("host",):
        arch += f"|offload_step={'+'.join(steps)}"
    key = cache_key(arch, int(y.shape[0]), dtype, device)
    if cache is not None and not (refresh or refresh_requested()):
        hit = cache.get(key)
        if hit is not None and hit.offload is not None:
            _log.info("offload choice of %s found in the cache (%s)", task.name, key)
            _log.info("%s", hit.provenance())
            return dataclasses.replace(hit.offload, reason=f"{hit.offload.reason} (cached)")
    if measure is None:
        step = _step_of(
            task, resolved, (x, y), device, dtype, min_seconds,
            share_frozen=share_frozen, device_memory=device_memory,
        )  # fmt: skip

        def measure(n: int, offloaded: bool, offload_step: str = "host") -> Measurement:
            return step(n, offload=offloaded, offload_step=offload_step)

    on_device: dict[int, Measurement] = {}
    fit, memory = _measured_fit(measure, on_device, size, fit, device_memory)
    if fit >= size or fit == 0:
        choice = _fit_by_peaks(size, fit, device_memory, memory, on_device)
        _log.info("%s", choice.reason)
        _store(cache, key, device, y, dtype, on_device, device_memory, choice)
        return choice
    split = on_device[fit]
    try:
        offloaded, stepped = _measure_offloaded(measure, size, steps)
    except OffloadError as exc:  # the budget cannot hold the shards of an array this large
        _log.info("offload: auto cannot offload B=%d in %d bytes: %s", size, device_memory, exc)
        choice = OffloadChoice(
            size, fit, device_memory, "split",
            f"offload: auto splits the array of {size} into arrays of at most {fit} on the "
            f"device: offloaded at B={size} it cannot run in {device_memory} bytes ({exc}); "
            f"measured {split.samples_per_s:,.1f} member-samples/s at B'={fit}",
            None, split.samples_per_s,
        )  # fmt: skip
    else:
        choice = choose_by_rate(
            size, fit, device_memory, offloaded.samples_per_s, split.samples_per_s
        )
        if steps != ("host",):
            choice = dataclasses.replace(
                choice,
                reason=f"{choice.reason} (offloaded with the {stepped} step, offload_step: "
                f"{offload_step})",
            )
    _log.info(
        "offload: auto measured B'=%d on the device: %.1f member-samples/s (%.2f ms a step); "
        "B=%d offloaded: %s; chose %s",
        fit,
        split.samples_per_s,
        split.step_s * 1e3,
        size,
        "could not run" if choice.offloaded_rate is None else f"{choice.offloaded_rate:.1f}",
        choice.mode,
    )
    _store(cache, key, device, y, dtype, on_device, device_memory, choice)
    return choice


def _offload_steps(offload_step: str, resolved: Mapping[str, Any]) -> tuple[str, ...]:
    """The optimizer steps the trainer may train the offloaded array with under
    ``offload_step``: ``auto`` either (it keeps the faster), the host alone where the config
    clips its gradients (the trainer steps such an array on the host)."""
    if resolved.get("grad_clip") is not None:
        return ("host",)
    return ("host", "device") if offload_step == "auto" else (offload_step,)


def _measure_offloaded(
    measure: MeasureFn, size: int, steps: tuple[str, ...]
) -> tuple[Measurement, str]:
    """The array of ``size`` offloaded, measured with each of ``steps``: the fastest one's
    measurement and step. A step the engine cannot run is left out (logged); where none runs,
    the last one's :class:`~hfsweep.offload.OffloadError`."""
    measured: dict[str, Measurement] = {}
    error: OffloadError | None = None
    for step in steps:
        try:
            measured[step] = (
                measure(size, True) if step == "host" else measure(size, True, offload_step=step)
            )
        except OffloadError as exc:
            if len(steps) > 1:
                _log.info("offload: auto cannot measure B=%d with the %s step: %s", size, step, exc)
            error = exc
    if not measured:
        assert error is not None
        raise error
    best = max(measured, key=lambda k: measured[k].samples_per_s)  # a tie: the host step
    if len(measured) > 1:
        _log.info(
            "offload: auto measured B=%d offloaded: %s; the %s step is kept",
            size,
            ", ".join(f"{m.samples_per_s:.1f} member-samples/s with the {k} step"
                      for k, m in measured.items()),
            best,
        )  # fmt: skip
    return measured[best], best


#: how many times B' is measured again where an array of the predicted B' peaked over the budget
_REFITS = 3


def _measured_fit(
    measure: MeasureFn,
    on_device: dict[int, Measurement],
    size: int,
    estimate: int,
    budget: int,
) -> tuple[int, MemoryModel | None]:
    """B' from measured peaks, activations included: arrays of 1 and of ``estimate`` members (the
    state estimate's B') are measured on the device (into ``on_device``), a line
    ``peak(B) = base + per_member * B`` is fitted to their peaks (:class:`MemoryModel`), and B'
    is the most members it predicts under ``budget``, capped at ``size`` (``size``: the whole
    array fits). That B' is measured too: where its peak is over the budget (or it runs out of
    device memory), the line is fitted again with it, at most :data:`_REFITS` times, and B'
    stays below every size seen over the budget. Where the device reports no peak (0: a compiled step), the
    estimate stands and the model is ``None``."""
    over: set[int] = set()

    def fits(n: int) -> bool:
        if n in over:
            return False
        if n not in on_device:
            try:
                on_device[n] = measure(n, False)
            except torch.OutOfMemoryError:
                over.add(n)
                return False
        if on_device[n].peak_bytes > budget:
            over.add(n)
        return n not in over

    if not fits(1):
        return 0, None
    fits(estimate)
    if any(m.peak_bytes == 0 for m in on_device.values()):
        return (estimate if estimate not in over else 1), None
    memory = MemoryModel.fit(list(on_device.values()))
    for _ in range(_REFITS + 1):
        bound = min(memory.max_size(budget), size, min(over, default=size + 1) - 1)
        fit = max(1, bound)  # one member was measured within the budget
        if fits(fit):
            return fit, memory
        memory = MemoryModel.fit(list(on_device.values()))
    return max((n for n in on_device if n not in over), default=0), memory


def _fit_by_peaks(
    size: int,
    fit: int,
    budget: int,
    memory: MemoryModel | None,
    on_device: Mapping[int, Measurement],
) -> OffloadChoice:
    """The choice where the measured peaks leave nothing to compare: the whole array fits
    (``fit == size``: on the device) or not one member does (``fit == 0``: offloaded)."""
    peaks = ", ".join(f"{m.peak_bytes} bytes at B={n}" for n, m in sorted(on_device.items()))
    line = "" if memory is None else f", predicting {memory.predict(size):,.0f} bytes at B={size}"
    if fit >= size:
        return OffloadChoice(
            size, size, budget, "none",
            f"offload: auto keeps the array of {size} on the device: its measured peaks "
            f"({peaks}{line}) fit the {budget} bytes of device memory, activations included",
        )  # fmt: skip
    return OffloadChoice(
        size, 0, budget, "host",
        f"offload: auto spills the array of {size} to the host: one member's measured peak "
        f"({peaks}) exceeds the {budget} bytes of device memory, so offload is the only way to "
        "train it",
    )  # fmt: skip


def _store(
    cache: ProfileCache | None,
    key: str,
    device: torch.device,
    y: torch.Tensor,
    dtype: torch.dtype,
    on_device: Mapping[int, Measurement],
    budget: int,
    choice: OffloadChoice,
) -> None:
    """Keep ``choice`` and the on-device measurements it was made from in ``cache``."""
    if cache is None:
        return
    measured = tuple(on_device[n] for n in sorted(on_device))
    cache.put(
        Profile(
            key=key,
            device=describe_device(device),
            batch_size=int(y.shape[0]),
            dtype=str(dtype).removeprefix("torch."),
            measurements=measured,
            memory=MemoryModel.fit(measured),
            budget_bytes=float(budget),
            chosen=choice.fit_size if choice.mode == "split" else choice.size,
            reason=choice.reason,
            offload=choice,
            measured_at=time.time(),
            measured_under=conditions(describe_device(device)),
        )
    )


def _unmeasured(size: int, member: int, shared: int, budget: int) -> OffloadChoice:
    """The choice where not even one member's estimated state fits ``budget`` (beside the
    ``shared`` bytes kept once): offloaded, the only way to train it, with nothing to measure."""
    once = f", beside {shared} bytes of frozen tensors kept once" if shared else ""
    return OffloadChoice(
        size, 0, budget, "host",
        f"offload: auto spills the array of {size} to the host: not one member fits the {budget} "
        f"bytes of device memory ({member} bytes of estimated state per member{once}), so "
        "offload is the only way to train it (nothing measured)",
    )  # fmt: skip


def _profile_offload_cached(
    task: Task, config: Mapping[str, Any] | None, size: int, **kwargs: Any
) -> OffloadChoice:
    """:func:`profile_offload` with the default profile cache (``$HFSWEEP_CACHE_DIR`` and so
    on, read at each call), as the trainer asks for it."""
    return profile_offload(task, config, size, cache=ProfileCache(), **kwargs)


use_offload_profiler(_profile_offload_cached)
