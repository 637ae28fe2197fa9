"""Measuring a task's training step at several array sizes, for the profiler.

:func:`profile_task` builds arrays of the task's model for one compatibility key, times the
trainer's own training step (forward, per-member losses, backward, fused optimizer step) on one
shared batch, records the step's peak memory, and lets :mod:`hfsweep.sizing` choose B.

Peak memory is the CUDA caching allocator's ``max_memory_allocated`` on a GPU. A CPU has no
allocator statistics, so there it is the peak of the bytes held by live tensors, followed op
by op through a dispatch mode (parameters, gradients, optimizer state, activations and
temporaries; allocator slack and Python objects are not counted).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from .._malloc import retaining_freed_memory_on
from ..offload import OffloadChoice, check_offload, offload_budget
from ..training.task import Task
from ._provenance import conditions, refresh_requested
from .beyond import offload_beyond
from .cache import Profile, ProfileCache, cache_key
from .compiled import DEFAULT_HORIZON_STEPS, CompileChoice, choose_compile
from .device import describe_device, device_budget
from .measure import _is_oom, profile_sizes
from .model import Measurement, MemoryModel, choose_size
from .offloading import profile_offload  # noqa: F401  (registers it with the trainer)
from .timing import _arch, _step_of, measure_step, model_and_batch, settled, time_steps

__all__ = ["measure_step", "profile_task", "settled", "time_steps"]

_log = logging.getLogger("hfsweep.profiler")


def profile_task(
    task: Task,
    config: Mapping[str, Any] | None = None,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    sizes: list[int] | None = None,
    max_size: int = 64,
    budget_fraction: float = 0.8,
    knee: float = 0.9,
    cache: ProfileCache | None = None,
    refresh: bool = False,
    min_seconds: float = 0.5,
    on_measure: Callable[[Measurement], None] | None = None,
    traces: dict[Any, Any] | None = None,
    data: tuple[Iterable[Any], Iterable[Any]] | None = None,
    compare_compiled: bool = False,
    compile_horizon_steps: int = DEFAULT_HORIZON_STEPS,
    share_frozen: bool = True,
    offload: str = "none",
    device_memory: int | None = None,
) -> Profile:
    """Measure ``task`` with ``config`` at several array sizes on ``device`` and choose B.

    With a ``cache``, a profile stored under the same key (architecture signature, optimizer,
    input shape, batch size, dtype, device) that measured every size in ``sizes`` is reused
    without measuring unless ``refresh``: B is chosen again from its measurements with this
    call's ``knee`` and budget. A new profile is stored. ``sizes=None`` doubles from 1 up to
    ``max_size`` while throughput grows and the memory model says the next size fits
    ``budget_fraction`` of the device's memory. Each size is timed for ``min_seconds``, or a
    fifth of that when its step times settle sooner (:func:`time_steps`).

    ``traces``: the trace cache the trainer's arrays of this compatibility key share
    (``ArrayTrainer._trace_cache[key]``). The arrays measured here trace their training step
    at every size they try into it, so the sweep's first array, and arrays compacted to a
    measured size, replay those traces instead of tracing again.

    ``data``: ``task.build_data(config)`` when the caller has it already (a sweep's arrays
    share it with the profiler); built here otherwise.

    ``compare_compiled`` (``fusion: {compile: auto}``): also time the step compiled at the
    chosen B and record in ``Profile.compile`` whether it is worth it, the compile time
    amortised over ``compile_horizon_steps`` steps (:func:`~hfsweep.profiler.choose_compile`).
    A cached profile without that choice gets it measured and stored.

    ``share_frozen``: measure arrays as the trainer builds them with the same
    ``fusion.share_frozen`` (see :func:`hfsweep.fuse`): ``True`` keeps a frozen backbone that
    every member holds identically once, ``False`` stacks it B times, so each member's memory
    includes it. Profiles without sharing are cached under their own key.

    ``device_memory`` (bytes) replaces the device's budget (``budget_fraction`` of its memory)
    where given. ``offload="auto"`` (``fusion: {size: auto, offload: auto}``): where that budget
    capped the sizes, sizes beyond it are measured offloaded too, with the engine's budget of
    ``device_memory`` or a CUDA device's free memory (not on a CPU without ``device_memory``:
    host and device are one memory there), and the fastest is chosen where it trains more
    member-samples/s than every size that fits (:func:`~hfsweep.sizing.beyond.offload_beyond`;
    the choice is ``Profile.offload``, cached under a key of its own). Not with explicit
    ``sizes`` or ``compare_compiled`` (an offloaded array runs uncompiled).
    """
    if not isinstance(share_frozen, bool):
        raise ValueError(
            f"profile_task(share_frozen={share_frozen!r}): give True (keep identical frozen "
            "tensors once, as hfsweep.fuse does by default) or False (one copy per member)"
        )
    device = torch.device(device)
    check_offload(offload, "profile_task(offload=...)")
    resolved = task.resolve(config or {})
    model, x, y = model_and_batch(task, resolved, device, dtype, data)
    batch_size = int(y.shape[0])
    arch = _arch(model, resolved, x, share_frozen)
    budget = device_budget(device, budget_fraction) if device_memory is None else device_memory
    # the engine's budget where sizes beyond the device are measured offloaded
    engine_budget = offload_budget(device, device_memory) if offload == "auto" else None
    if engine_budget is not None:
        arch = f"{arch}|offload=auto|device_memory={engine_budget}"
    key = cache_key(arch, batch_size, dtype, device)
    step = _step_of(task, resolved, (x, y), device, dtype, min_seconds, share_frozen=share_frozen)

    def measure_compiled(size: int, first: list[float]) -> Measurement:
        return step(size, compile=True, first_step=first)

    if cache is not None and not (refresh or refresh_requested()):
        hit = cache.get(key)
        measured = {m.size for m in hit.measurements} if hit is not None else set()
        if hit is not None and (sizes is None or set(sizes) <= measured):
            _log.info("profile of %s found in the cache (%s)", task.name, key)
            chosen, reason = choose_size(hit.measurements, budget, knee=knee)
            if hit.offload is not None and hit.offload.mode == "host":
                chosen, reason = hit.offload.size, hit.offload.reason
            cached = dataclasses.replace(
                hit, budget_bytes=budget, chosen=chosen, reason=f"{reason} ({hit.provenance()})"
            )
            if not compare_compiled or (hit.compile is not None and hit.compile.size == chosen):
                return cached
            step_s = next(m.step_s for m in hit.measurements if m.size == chosen)
            choice = _compile_choice(chosen, step_s, compile_horizon_steps, measure_compiled)
            cache.put(dataclasses.replace(hit, compile=choice))
            return dataclasses.replace(cached, compile=choice)

    def measure(size: int) -> Measurement:
        return step(size, traces=traces)

    beyond_device = engine_budget is not None and sizes is None and not compare_compiled
    failed: BaseException | None = None
    with retaining_freed_memory_on(device):  # one block for every size measured
        try:
            measurements, memory = profile_sizes(
                measure,
                budget_bytes=budget,
                max_size=max_size,
                sizes=sizes,
                knee=knee,
                on_measure=on_measure,
            )
        except BaseException as exc:
            if not beyond_device or not _is_oom(exc):
                raise
            # not one member fits the device: offloaded arrays may still train
            failed, measurements, memory = exc, [], None
    beyond: OffloadChoice | None = None
    if beyond_device:

        def offloaded(size: int) -> Measurement:
            return step(size, offload=True, device_memory=engine_budget)

        with retaining_freed_memory_on(device):
            beyond, tried = offload_beyond(
                offloaded, measurements, memory, budget, max_size=max_size, knee=knee
            )
        if failed is not None:
            if beyond is None:
                raise failed
            measurements, memory = tried, MemoryModel.fit(tried)  # all it measured: offloaded
    assert memory is not None
    chosen, reason = choose_size(measurements, budget, knee=knee)
    if beyond is not None:
        chosen, reason = beyond.size, beyond.reason
    profile = Profile(
        key=key,
        device=describe_device(device),
        batch_size=batch_size,
        dtype=str(dtype).removeprefix("torch."),
        measurements=tuple(measurements),
        memory=memory,
        budget_bytes=budget,
        chosen=chosen,
        reason=reason,
        offload=beyond,
        measured_at=time.time(),
        measured_under=conditions(describe_device(device)),
    )
    if compare_compiled:
        step_s = next(m.step_s for m in measurements if m.size == chosen)
        choice = _compile_choice(chosen, step_s, compile_horizon_steps, measure_compiled)
        profile = dataclasses.replace(profile, compile=choice)
    if cache is not None:
        cache.put(profile)
    return profile


def _compile_choice(
    size: int,
    eager_step_s: float,
    horizon_steps: int,
    measure_compiled: Callable[[int, list[float]], Measurement],
) -> CompileChoice:
    """Time the compiled step at ``size`` (``measure_compiled(size, first)`` appends its first
    step's seconds to ``first``) and choose against ``eager_step_s``. The compile time is the
    first step's seconds less a steady step's. Compiling that fails outright counts as slower."""
    first: list[float] = []
    compiled = measure_compiled(size, first)
    compile_s = max(first[0] - compiled.step_s, 0.0) if first else 0.0
    choice = choose_compile(size, eager_step_s, compiled.step_s, compile_s, horizon_steps)
    _log.info("compile: auto: %s", choice.reason)
    return choice
