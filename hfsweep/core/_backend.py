"""The sweep engine's part that sets up where arrays train: the executor for the sweep file's
backend (local, or Ray with its elastic allocator when ``ray.elastic`` is on), closed when the
sweep ends; see :mod:`hfsweep.core._parts`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Collection, Iterator
from contextlib import contextmanager

import torch

from .._signals import reclaim
from ..elastic.policy import ElasticPolicy
from ..elastic.scaling import SweepScaling
from ..elastic.survival import from_scheduler
from ..executors import AlternatingExecutor, ExecutorError, LocalExecutor
from ..sizing.device import DTYPES as _DTYPES
from ..sizing.device import resolve_device
from ._parts import _Parts
from .result import SweepError

_log = logging.getLogger("hfsweep.sweep")

__all__: list[str] = []


class _Backend(_Parts):
    """The executor's side of the engine: which one, built how, and its elastic policy."""

    @contextmanager
    def _executor(self) -> Iterator[None]:
        """The executor for the config's backend while the sweep runs, closed after."""
        sc = self.sc
        arrays = sc.fusion.arrays
        if sc.backend == "ray":
            from ..executors import RayExecutor

            try:
                self.executor = RayExecutor(self.task, arrays=arrays, settings=sc.ray)
            except ExecutorError as exc:
                raise SweepError(f"backend ray: {exc}") from exc
            self.where = f"a Ray worker (up to {self.executor.slots} array(s) at once)"
            if sc.ray.elastic.enabled:
                self.executor.policy = self._elastic_policy()
        else:
            device = resolve_device(sc.fusion.device)
            if device.startswith("cuda") and not torch.cuda.is_available():
                raise SweepError(f"fusion.device is {device!r} but torch sees no CUDA device")
            arrays = dataclasses.replace(arrays, device=device)
            if arrays.alternate > 1:
                self.executor = AlternatingExecutor(self.task, arrays=arrays, data=self._data)
                self.where = f"{device} ({arrays.alternate} offloaded arrays at once, alternating)"
            else:
                self.executor = LocalExecutor(self.task, arrays=arrays, data=self._data)
                self.where = str(self.executor.device)
        reclaim()  # ray.init installs a SIGTERM handler of its own
        try:
            yield
        finally:
            self.executor.close()

    def _elastic_policy(self) -> ElasticPolicy:
        """The allocator's policy for the Ray executor's elastic arrays; its plans go to the
        progress line. With ``ray.elastic.scaling: model`` it gets each compatibility key's
        scaling profile from a :class:`SweepScaling` (cached, or modelled in this process on the
        sweep's device and cached); with ``perfect``, perfect scaling is assumed. The trial
        scheduler's rung model (``from_scheduler``: ASHA's or Hyperband's, every bracket's
        rungs; None for the others) is the policy's one source of rungs, for each array's
        horizon and its expected end alike."""

        def show(line: str) -> None:
            with self._lock:
                self.progress.elastic_plan(line)

        budget, settings = self.sc.budget, self.sc.ray.elastic
        scaling = None
        if settings.scaling == "model":
            device = resolve_device(self.sc.fusion.device)
            scaling = SweepScaling(
                self.task,
                device=device,
                dtype=_DTYPES[self.sc.fusion.dtype],
                backend="nccl" if device.startswith("cuda") else "gloo",
                max_workers=settings.max_workers_per_array or 64,
            )
        policy = ElasticPolicy(
            settings,
            budget=budget.max_resource,
            by=budget.resource,
            show=show,
            scaling=scaling,
            remember=scaling.remember if scaling is not None else None,
            record=self.dir.write_elastic,
            queued=self._queued_arrays,
            max_arrays=self.sc.ray.max_concurrent,
            pruner=from_scheduler(self.scheduler, budget.max_resource),
        )
        if self.resume:
            self._carry_elastic_totals(policy)
        return policy

    def _carry_elastic_totals(self, policy: ElasticPolicy) -> None:
        """A resumed sweep's policy goes on from the waits, idle time and plans its earlier
        runs wrote to ``elastic.json``; a file that cannot be read is logged, and the totals
        start from zero (they are a record, not the sweep's state)."""
        try:
            earlier = self.dir.read_elastic()
            if earlier is not None:
                policy.carry_on(earlier)
        except (OSError, ValueError) as exc:
            _log.warning(
                "elastic: the earlier runs' totals were not read, so they start from zero: %s", exc
            )

    def _queued_arrays(self, held: Collection[str]) -> int:
        """About how many more arrays the engine will start beside the policy's ``held``
        folders: those it has formed and not ended whose start the policy has not heard yet
        (the engine forms arrays for every free slot before their threads start them), and
        those the trials in the packer's pools and the ones the searcher may still be asked
        for (none past the time limit or once it has no more) would form at the mix of keys
        asked so far (``Packer.queued_arrays``). The allocator starts these before it grows
        an array."""
        with self._lock:  # the lock ``show`` takes too, in the same order
            unheard = sum(
                1 for a in self.arrays if not a.done and str(self.dir.array(a.index)) not in held
            )
            limit = self.sc.budget.time_limit_s
            asking = self.drivers is not None and not self.source.exhausted
            if asking and (limit is None or self._elapsed() < limit):
                assert self.drivers is not None
                return unheard + self.packer.queued_arrays(self.total - self.drivers.count)
            return unheard + self.packer.queued_arrays(0)
