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
import functools
import logging
import math
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef

from .._compat import TorchDispatchMode, pytree
from .._malloc import retaining_freed_memory_on
from ..fusion import FusedArray, fuse
from ..fusion._compile import check_compile, mode_for
from ..offload import OffloadChoice, OffloadedArray, check_offload, offload_budget
from ..training._compiled import CompiledLoss
from ..training.step import any_smoothing, backward, update
from ..training.task import Task, fork_rng, make_optimizer, make_schedule
from ._provenance import conditions, refresh_requested
from .beyond import offload_beyond
from .cache import Profile, ProfileCache, cache_key, signature
from .compiled import DEFAULT_HORIZON_STEPS, CompileChoice, choose_compile
from .device import _describe_device, device_budget
from .measure import _is_oom, profile_sizes
from .model import Measurement, MemoryModel, choose_size
from .offloading import profile_offload  # noqa: F401  (registers it with the trainer)

__all__ = ["measure_step", "profile_task", "settled", "time_steps"]

_log = logging.getLogger("hfsweep.profiler")


class _LiveTensorBytes(TorchDispatchMode):
    """Follows the bytes of live tensor storages while it is active, and their peak.

    ``existing`` are the tensors alive when it starts (parameters, optimizer state, the
    batch): they count from the start, and in-place ops on them (which return them) add
    nothing. Every other storage an op returns counts until it is freed.
    """

    def __init__(self, existing: Any = ()) -> None:
        super().__init__()
        self.live = 0
        self._held: dict[int, tuple[StorageWeakRef, int]] = {}
        for t in pytree.tree_leaves(existing):
            if isinstance(t, Tensor):
                self._hold(t)
        self.peak = self.live

    def _hold(self, t: Tensor) -> None:
        storage = t.untyped_storage()
        key, size = storage.data_ptr(), storage.nbytes()
        if size and key not in self._held:
            self._held[key] = (StorageWeakRef(storage), size)
            self.live += size

    def _sweep(self) -> None:
        for key in [k for k, (ref, _) in self._held.items() if ref.expired()]:
            self.live -= self._held.pop(key)[1]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self._sweep()
        for t in pytree.tree_leaves(out):
            if isinstance(t, Tensor) and t.device.type != "meta":
                self._hold(t)
        self.peak = max(self.peak, self.live)
        return out


#: settled timings may end a measurement once this share of ``min_seconds`` has passed
_SETTLE_SHARE = 0.2
#: timings have settled when the median step time is known to within this fraction...
_SETTLE_ERROR = 0.02
#: ... from at least this many timed samples
_SETTLE_SAMPLES = 5
#: on CUDA, the steps of one timed block take about this long (a synchronize ends each block)
_BLOCK_SECONDS = 0.01


def settled(samples: Sequence[float]) -> bool:
    """Whether the median of per-step times is known to within ``_SETTLE_ERROR`` of itself:
    its standard error, estimated robustly from the interquartile range (``1.2533 * sigma /
    sqrt(n)`` with ``sigma = IQR / 1.349``, so interruptions by other processes do not
    inflate it), is that small. Steady steps settle after a few samples, scattered ones
    (a busy machine) need many more."""
    n = len(samples)
    if n < _SETTLE_SAMPLES:
        return False
    q1, median, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    error = 1.2533 * (q3 - q1) / 1.349 / math.sqrt(n)
    return error <= _SETTLE_ERROR * median


def time_steps(
    step: Callable[[], None],
    sync: Callable[[], None],
    *,
    min_seconds: float,
    min_steps: int,
    block: int = 1,
    clock: Callable[[], float] = time.perf_counter,
) -> list[float]:
    """Seconds per step of consecutive blocks of ``block`` steps (each ended by ``sync``).

    Times at least ``min_steps`` steps, then stops once ``min_seconds`` have passed, or earlier,
    after ``_SETTLE_SHARE`` of them, when the times have :func:`settled`: a quiet device needs
    a fraction of the time; a noisy one (other processes, clock changes) gets all of it.
    """
    samples: list[float] = []
    steps = 0
    start = clock()
    while True:
        began = clock()
        for _ in range(block):
            step()
        sync()
        now = clock()
        samples.append((now - began) / block)
        steps += block
        elapsed = now - start
        if steps >= min_steps and (
            elapsed >= min_seconds or (elapsed >= _SETTLE_SHARE * min_seconds and settled(samples))
        ):
            return samples


def measure_step(
    task: Task,
    config: Mapping[str, Any],
    size: int,
    *,
    device: torch.device,
    dtype: torch.dtype,
    batch: Any,
    min_seconds: float = 0.5,
    min_steps: int = 3,
    warmup: int = 2,
    traces: dict[Any, Any] | None = None,
    compile: bool | str = False,
    first_step: list[float] | None = None,
    share_frozen: bool = True,
    offload: bool = False,
    device_memory: int | None = None,
    offload_step: str = "host",
) -> Measurement:
    """Time the training step of an array of ``size`` members of ``config`` on ``batch``.

    Members get seeds 0..size-1; ``warmup`` steps run first (tracing, optimizer state), then
    steps are timed (:func:`time_steps`: ``min_seconds`` at most unless the times settle
    sooner, and at least ``min_steps``); the step time is the median, which other processes'
    interruptions do not move. Then one more step measures peak memory. ``traces``: a trace
    cache the array shares (see :func:`profile_task`). ``compile``: the array, the loss and
    the optimizer's update compiled as the trainer's ``compile`` does; its peak memory is not measured (0: the op by
    op tracker would not see inside compiled kernels). ``first_step``: a list the first warm-up
    step's seconds are appended to (tracing and compiling included). ``share_frozen``: the
    array keeps frozen tensors every member holds identically once, as the trainer's arrays
    do with ``fusion.share_frozen`` (``False``: B copies, so the peak counts the frozen
    backbone B times). ``offload``: the array kept in host memory and run shard by shard by
    :class:`~hfsweep.offload.OffloadedArray` with ``device_memory`` bytes on ``device``, as the
    trainer's ``offload="host"`` runs it (frozen tensors kept once with ``share_frozen``, as
    on the device); its peak is the engine's
    ledger peak, the bytes it held on the compute side. ``offload_step`` (``"host"`` or
    ``"device"``): where the offloaded array's optimizer steps, as the trainer's
    ``offload_step`` (the device step cuts the shards for it and steps each after its
    backward; a model it cannot step raises :class:`~hfsweep.offload.OffloadError`).
    """
    with retaining_freed_memory_on(device):
        resolved = task.resolve(config)
        configs = [{**resolved, "seed": i} for i in range(size)]
        models = [task.build_model(c).to(dtype) for c in configs]
        engine: OffloadedArray | None = None
        if offload:  # in host storage, as the trainer offloads
            array = fuse(models, share_frozen=share_frozen)
            engine = OffloadedArray(array, device=device, budget_bytes=device_memory)
        else:
            array = fuse(models, compile=compile, share_frozen=share_frozen).to(device)
        del models
        try:
            return _time_array(
                task, array, engine, configs, device=device, dtype=dtype, batch=batch,
                min_seconds=min_seconds, min_steps=min_steps, warmup=warmup, traces=traces,
                compile=compile, first_step=first_step,
                on_device=engine is not None and offload_step == "device",
            )  # fmt: skip
        finally:
            if engine is not None:
                engine.close()


def _time_array(
    task: Task,
    array: FusedArray,
    engine: OffloadedArray | None,
    configs: list[dict[str, Any]],
    *,
    device: torch.device,
    dtype: torch.dtype,
    batch: Any,
    min_seconds: float,
    min_steps: int,
    warmup: int,
    traces: dict[Any, Any] | None,
    compile: bool | str,
    first_step: list[float] | None,
    on_device: bool = False,
) -> Measurement:
    """The timing of :func:`measure_step` on the built ``array`` (run by ``engine`` where it
    is offloaded; ``on_device``: with its optimizer stepped on the device) of the members
    ``configs``."""
    size = len(configs)
    mode = mode_for(check_compile(compile), device)
    loss = CompiledLoss(task, mode) if mode is not None else None
    if traces is not None:
        array._share_traces(traces)
    array.train()
    opt = make_optimizer(array, configs)
    if mode is not None:  # the update compiled as the trainer compiles it
        opt.compile()
    sched = make_schedule(opt, configs, [10**9] * size, 1)
    if on_device:
        assert engine is not None
        engine.step_on_device(opt)
    smoothing = (
        torch.tensor([c["label_smoothing"] for c in configs], dtype=dtype, device=device)
        if any_smoothing(configs)
        else None
    )
    x, y = batch
    n = int(y.shape[0]) if isinstance(y, Tensor) and y.dim() else 1
    sync: Callable[[], None] = (
        (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    )

    def step() -> None:
        backward(task, array, x, y, smoothing, None, loss, engine)
        update(opt, sched, stepped=on_device)

    warm_s = 0.0
    for k in range(max(warmup, 1 if first_step is not None else 0)):
        began = time.perf_counter()
        step()
        sync()
        warm_s = time.perf_counter() - began
        if k == 0 and first_step is not None:
            first_step.append(warm_s)
    # on a GPU, steps are timed in blocks: a synchronize after every step would leave the
    # device idle while the next one is launched
    block = max(1, round(_BLOCK_SECONDS / max(warm_s, 1e-9))) if device.type == "cuda" else 1
    samples = time_steps(step, sync, min_seconds=min_seconds, min_steps=min_steps, block=block)
    if engine is not None:
        peak = engine.ledger.peak
    elif mode is not None:
        peak = 0
    elif device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        step()
        sync()
        peak = int(torch.cuda.max_memory_allocated(device))
    else:
        existing = [dict(array.state_dict(keep_vars=True)), opt.state, x, y]
        with _LiveTensorBytes(existing) as tracker:
            step()
        peak = tracker.peak
    step_s = statistics.median(samples)
    return Measurement(size=size, samples_per_s=size * n / step_s, peak_bytes=peak, step_s=step_s)


def _model_and_batch(
    task: Task,
    resolved: Mapping[str, Any],
    device: torch.device,
    dtype: torch.dtype,
    data: tuple[Any, Any] | None = None,
) -> tuple[torch.nn.Module, Tensor, Tensor]:
    """One model of the task's resolved config in ``dtype`` and its first training batch on
    ``device`` (floating inputs in ``dtype``), built with the global RNG left as it was:
    what a measurement of the config's step starts from. ``data``: the task's
    ``(train, eval)`` loaders where already built."""
    with fork_rng():
        model = task.build_model(resolved).to(dtype)
        train, _ = data if data is not None else task.build_data(resolved)
        first = next(iter(train))
    x, y = (t.to(device) for t in first)
    if x.is_floating_point():
        x = x.to(dtype)
    return model, x, y


def _arch(
    model: torch.nn.Module, resolved: Mapping[str, Any], x: Tensor, share_frozen: bool
) -> str:
    """The architecture part of a profile's cache key: the model's :func:`signature`, the
    optimizer (its state) and the input shape, which change time and memory as much as the
    model; ``share_frozen=False`` (frozen tensors per member: another memory model) is added,
    sharing keeps the keys cached before the option existed."""
    arch = f"{signature(model)}|{resolved['optimizer']}|in={tuple(x.shape)}"
    return arch if share_frozen else f"{arch}|share_frozen=False"


def _step_of(
    task: Task,
    resolved: Mapping[str, Any],
    batch: tuple[Tensor, Tensor],
    device: torch.device,
    dtype: torch.dtype,
    min_seconds: float,
    **fixed: Any,
) -> Callable[..., Measurement]:
    """:func:`measure_step` of ``resolved``'s arrays on ``batch``, with the ``fixed`` keyword
    arguments; called with the size (and any others)."""
    return functools.partial(
        measure_step, task, resolved, device=device, dtype=dtype, batch=batch,
        min_seconds=min_seconds, **fixed,
    )  # fmt: skip


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
    model, x, y = _model_and_batch(task, resolved, device, dtype, data)
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
        device=_describe_device(device),
        batch_size=batch_size,
        dtype=str(dtype).removeprefix("torch."),
        measurements=tuple(measurements),
        memory=memory,
        budget_bytes=budget,
        chosen=chosen,
        reason=reason,
        offload=beyond,
        measured_at=time.time(),
        measured_under=conditions(_describe_device(device)),
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
