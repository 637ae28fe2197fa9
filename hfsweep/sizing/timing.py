"""Timing one array's training step, for the profiler: :func:`measure_step` builds an array of
a config's members and times the trainer's own step (forward, per-member losses, backward,
fused optimizer step) on one shared batch until the times settle (:func:`time_steps`), then
measures the step's peak memory.

Peak memory is the CUDA caching allocator's ``max_memory_allocated`` on a GPU. A CPU has no
allocator statistics, so there it is the peak of the bytes held by live tensors, followed op
by op through a dispatch mode (parameters, gradients, optimizer state, activations and
temporaries; allocator slack and Python objects are not counted).

:func:`~hfsweep.sizing.task.profile_task` and the offloaded measurements
(:mod:`~hfsweep.sizing.offloading`) both measure through this module.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef

from .._compat import TorchDispatchMode, pytree
from .._malloc import retaining_freed_memory_on
from ..fusion import FusedArray, check_compile, fuse, mode_for
from ..offload import OffloadedArray
from ..training import CompiledLoss
from ..training.step import any_smoothing, backward, update
from ..training.task import Task, fork_rng, make_optimizer, make_schedule
from .cache import signature
from .model import Measurement

__all__ = ["measure_step", "model_and_batch", "settled", "time_steps"]


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


def model_and_batch(
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
