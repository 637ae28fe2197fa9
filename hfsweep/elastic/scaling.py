"""The scaling profiles an elastic sweep's allocator decides with: one per compatibility key,
read from the scaling cache, else modelled once and cached.

With ``ray.elastic.scaling: model`` (the default) the engine gives the elastic policy a
:class:`SweepScaling`. When the first array of a compatibility key is placed, the policy asks it
for that key's :class:`~hfsweep.profiler.ScalingProfile`:

- **cached**: a profile stored in the scaling cache (``scaling.json`` beside the array-size
  profiles' ``profiles.json``, :class:`~hfsweep.sizing.allreduce.ScalingCache`) under the key,
  the driver's device and dtype and the collective backend is used as it is, measuring nothing
  (a resumed sweep, a second sweep of the same kind of array);
- **modelled** otherwise, by :func:`~hfsweep.profiler.model_scaling`: the one-worker step time
  of an array of that many members is *measured* in the driver process on its device (a few
  steps, :func:`~hfsweep.sizing.timing.measure_step`, about ``min_seconds``), the gradient bytes
  are every member's trainable parameters, and the all-reduce cost is this machine's, cached
  (measured once per machine with two local processes, :meth:`ScalingCache.allreduce`). The
  profile is cached before it is used.

While the sweep runs, the policy replaces the profile's points by the speed-ups its arrays
measured at two or more worker counts and hands the result back to :meth:`SweepScaling.remember`,
which caches it (the measured points are marked as such).

The model's points are member-samples/s of an array of the first array's size; the allocator uses
only their ratios (speed-ups), which an array's size barely changes (compute and gradient bytes
both grow with the members). The model assumes compute divides by k and no overlap of the
all-reduce with the backward (``benchmarks/scaling_profile.py`` measured it 2.5-2.9x optimistic
at k = 2 on a loaded 2-core CPU). The driver measures on *its* device: on a cluster whose driver
has no accelerator the step is the CPU's, not the workers' (the cached profile can be replaced
with :meth:`ScalingCache.put_profile`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..sizing.allreduce import ScalingCache
from ..sizing.device import describe_device
from ..sizing.scaling import ScalingProfile, model_scaling
from ..sizing.timing import measure_step, model_and_batch
from ..training.task import Task

__all__ = ["SweepScaling", "measured_profile", "short_key"]


class SweepScaling:
    """Scaling profiles by compatibility key for :class:`~hfsweep.elastic.policy.ElasticPolicy`
    (see the module docstring). ``device``/``dtype`` are where the one-worker step is measured
    (the sweep's ``fusion`` settings, resolved in the driver); ``backend`` the collective
    (``"gloo"`` or ``"nccl"``) whose all-reduce cost the model uses; ``max_workers`` the
    largest worker count modelled; ``cache`` the scaling cache (default: beside the array-size
    profiles)."""

    def __init__(
        self,
        task: Task,
        *,
        device: str | torch.device,
        dtype: torch.dtype,
        backend: str,
        max_workers: int,
        cache: ScalingCache | None = None,
        min_seconds: float = 0.2,
    ) -> None:
        self.task = task
        self.device = torch.device(device)
        self.dtype = dtype
        self.backend = backend
        self.max_workers = max_workers
        self.cache = cache if cache is not None else ScalingCache()
        self.min_seconds = min_seconds

    def cache_key(self, key: str) -> str:
        """Where ``key``'s profile is cached: the compatibility key, the dtype, the device's
        hardware and the collective backend."""
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{key}|{dtype}|{describe_device(self.device)}|{self.backend}"

    def __call__(
        self, key: str, config: Mapping[str, Any] | None, members: int
    ) -> tuple[ScalingProfile | None, str]:
        """``(profile, how it was obtained)`` for the compatibility key ``key``: the cached one,
        else modelled from ``config`` (a trial's config of that key) at ``members`` members and
        cached; ``(None, why)`` when nothing is cached and ``config`` is None (an array resumed
        from a checkpoint that holds no live member's config)."""
        where = self.cache_key(key)
        cached = self.cache.get_profile(where)
        if cached is not None:
            earlier = ""
            if cached.measured:
                earlier = "; the points marked (m) were measured by earlier arrays"
            return cached, f"cached in {self.cache.path} (nothing measured now{earlier})"
        if config is None:
            return None, f"none is cached in {self.cache.path} and no trial's config is known"
        profile, how = self._model(where, config, max(1, members))
        self.cache.put_profile(profile)
        return profile, f"{how}; cached in {self.cache.path}"

    def remember(self, profile: ScalingProfile) -> None:
        """Cache ``profile`` (a key's profile with the points the running arrays measured, under
        the cache key it was given with), so that the next sweep of that kind of array starts
        from them."""
        self.cache.put_profile(profile)

    def _model(
        self, where: str, config: Mapping[str, Any], members: int
    ) -> tuple[ScalingProfile, str]:
        """The modelled profile (see the module docstring) and how it was made."""
        resolved = self.task.resolve(config)
        model, x, y = model_and_batch(self.task, resolved, self.device, self.dtype)
        batch_size = int(y.shape[0])
        step = measure_step(
            self.task,
            resolved,
            members,
            device=self.device,
            dtype=self.dtype,
            batch=(x, y),
            min_seconds=self.min_seconds,
        )
        per_member = sum(
            p.numel() * p.element_size() for p in model.parameters() if p.requires_grad
        )
        allreduce = self.cache.allreduce(self.backend)
        profile = model_scaling(
            where,
            step_s=step.step_s,
            members=members,
            batch_size=batch_size,
            gradient_bytes=float(per_member * members),
            allreduce=allreduce,
            max_workers=self.max_workers,
        )
        how = (
            f"modelled from a one-worker step measured here ({step.step_s * 1e3:.2f} ms, "
            f"{members} members, batch {batch_size}, {self.device}) and the all-reduce cost "
            f"({allreduce.source}; {allreduce.bandwidth_bytes_per_s / 1e9:.2f} GB/s, "
            f"{allreduce.latency_s * 1e6:.0f} us per hop)"
        )
        return profile, how


def measured_profile(given: ScalingProfile, median: Mapping[int, float]) -> ScalingProfile:
    """``given`` (the scaling source's profile of a key) with its points replaced by the
    ``median`` measured rates (member-units/s by worker count, two counts or more), anchored
    at the smallest measured count (whose point stays ``given``'s unless it is 1 worker). A
    point not measured above a measured one keeps the profile's error there: it is scaled by
    the measured/profile ratio of the nearest measured count below it, so a model 2.5x
    optimistic at 2 workers is not believed at 4 (the elastic policy's measured feedback,
    :mod:`hfsweep.elastic.policy`)."""
    k0 = min(median)
    anchor = given.rate(k0)
    points = {**given.points, **{k: anchor * m / median[k0] for k, m in median.items()}}
    for k in given.points:
        below = [m for m in median if m < k]
        if k not in median and below:  # the model's error at the nearest measured count
            kb = max(below)
            points[k] = given.rate(k) * points[kb] / given.rate(kb)
    measured = {k for k in median if k != k0 or k0 == 1}
    return ScalingProfile(given.key, points, frozenset(given.measured | measured))


def short_key(key: str, limit: int = 120) -> str:
    """A compatibility key cut for the log."""
    return key if len(key) <= limit else key[: limit - 3] + "..."
