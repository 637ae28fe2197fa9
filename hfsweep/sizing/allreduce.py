"""Measuring what an all-reduce costs on this machine, and caching it with scaling profiles.

:func:`measure_allreduce` starts ``workers`` local processes joined by ``torch.distributed``
(gloo on 127.0.0.1 by default), times ``all_reduce`` of a few tensor sizes in each, and fits an
:class:`~hfsweep.sizing.scaling.AllReduceCost` to the medians. :class:`ScalingCache` keeps
measured costs and scaling profiles in one JSON file beside the array-size profiles
(``scaling.json`` next to :class:`~hfsweep.profiler.ProfileCache`'s ``profiles.json``), written
atomically like it, so a machine measures them once, not once per sweep.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ._units import _check_int
from .cache import ProfileCache, _default_cache_path, _replace_file
from .device import describe_device
from .scaling import AllReduceCost, ScalingProfile

__all__ = ["ScalingCache", "allreduce_key", "measure_allreduce"]

_log = logging.getLogger("hfsweep.profiler")
_FORMAT = 1
#: tensor sizes (bytes) timed by default: 4 KiB to 16 MiB
DEFAULT_SIZES = (4096, 65536, 1 << 20, 4 << 20, 16 << 20)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _time_sizes(
    rank: int, world: int, port: int, backend: str, sizes: Sequence[int], repeats: int, out: Any
) -> None:
    """One process of the measurement: join the group, time each size, rank 0 reports."""
    torch.set_num_threads(1)
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        medians: list[tuple[int, float]] = []
        for nbytes in sizes:
            x = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
            for _ in range(2):  # warm-up: connection set-up and buffers
                dist.all_reduce(x)
            times = []
            for _ in range(repeats):
                dist.barrier()
                t0 = time.perf_counter()
                dist.all_reduce(x)
                times.append(time.perf_counter() - t0)
            medians.append((x.numel() * 4, statistics.median(times)))
        if rank == 0:
            out.put(medians)
    finally:
        dist.destroy_process_group()


def measure_allreduce(
    *,
    workers: int = 2,
    sizes: Sequence[int] = DEFAULT_SIZES,
    repeats: int = 9,
    backend: str = "gloo",
    timeout_s: float = 120.0,
) -> tuple[AllReduceCost, list[tuple[int, float]]]:
    """Time ``all_reduce`` of float32 tensors of ``sizes`` bytes across ``workers`` local
    processes (``backend`` on 127.0.0.1, one torch thread each) and fit the cost.

    Returns the fitted :class:`AllReduceCost` and the measured ``(bytes, median seconds)``
    points. The processes are spawned (not forked) and joined before this returns; a process
    that fails or a measurement that takes longer than ``timeout_s`` raises RuntimeError.
    """
    workers = _check_int("workers", workers, 2)
    repeats = _check_int("repeats", repeats, 1)
    sizes = [_check_int("sizes[]", s, 4) for s in sizes]
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    port = _free_port()
    procs = [
        ctx.Process(target=_time_sizes, args=(rank, workers, port, backend, sizes, repeats, out))
        for rank in range(workers)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        if any(p.is_alive() for p in procs) or any(p.exitcode != 0 for p in procs):
            codes = [p.exitcode for p in procs]
            raise RuntimeError(
                f"the all-reduce measurement failed or exceeded {timeout_s} s "
                f"(exit codes {codes}; backend {backend!r}, {workers} processes on 127.0.0.1)"
            )
        points: list[tuple[int, float]] = out.get()
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    source = (
        f"measured: {backend} all_reduce, {workers} processes on 127.0.0.1 of "
        f"{describe_device('cpu')}, median of {repeats}"
    )
    return AllReduceCost.fit(points, workers=workers, source=source), points


def allreduce_key(backend: str = "gloo", device: str = "cpu") -> str:
    """The cache key of this machine's all-reduce cost: backend, hardware, torch version."""
    torch_version = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    return f"allreduce|{backend}|{describe_device(device)}|torch={torch_version}"


class ScalingCache:
    """All-reduce costs and scaling profiles in one JSON file, ``scaling.json`` beside the
    array-size profiles (``$HFSWEEP_CACHE_DIR``, ``$XDG_CACHE_HOME/hfsweep`` or
    ``~/.cache/hfsweep``). Like :class:`~hfsweep.profiler.ProfileCache` it only saves time: an
    unreadable file or entry reads as missing with a warning, a failed write is logged and
    skipped, and writes replace the file atomically."""

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self.path = (
            Path(path) if path is not None else _default_cache_path().with_name("scaling.json")
        )

    def __repr__(self) -> str:
        return f"ScalingCache({str(self.path)!r})"

    def _read(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            _log.warning(
                "cannot read the scaling cache %s (%s); treating it as empty", self.path, exc
            )
            return {}
        if not isinstance(data, dict) or data.get("format") != _FORMAT:
            _log.warning("%s is not an hfsweep scaling cache; treating it as empty", self.path)
            return {}
        entries = data.get("entries")
        return entries if isinstance(entries, dict) else {}

    def _put(self, key: str, value: dict[str, Any]) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with ProfileCache(self.path)._locked():  # the same <path>.lock protocol
                entries = self._read()
                entries[key] = value
                _replace_file(
                    self.path,
                    json.dumps({"format": _FORMAT, "entries": entries}, indent=1, sort_keys=True),
                )
        except OSError as exc:
            _log.warning("could not write the scaling cache %s (%s); not cached", self.path, exc)

    def get_allreduce(self, key: str) -> AllReduceCost | None:
        """The all-reduce cost cached under ``key`` (:func:`allreduce_key`), or None."""
        entry = self._read().get(key)
        if entry is None:
            return None
        try:
            return AllReduceCost.from_dict(entry)
        except (ValueError, TypeError) as exc:
            _log.warning("ignoring the unreadable entry %r in %s: %s", key, self.path, exc)
            return None

    def put_allreduce(self, key: str, cost: AllReduceCost) -> None:
        """Store ``cost`` under ``key``."""
        self._put(key, cost.to_dict())

    def get_profile(self, key: str) -> ScalingProfile | None:
        """The scaling profile cached under ``key`` (``"scaling|" + key`` in the file), or None."""
        entry = self._read().get("scaling|" + key)
        if entry is None:
            return None
        try:
            return ScalingProfile.from_dict(entry)
        except ValueError as exc:
            _log.warning(
                "ignoring the unreadable scaling profile %r in %s: %s", key, self.path, exc
            )
            return None

    def put_profile(self, profile: ScalingProfile) -> None:
        """Store ``profile`` under its key."""
        self._put("scaling|" + profile.key, profile.to_dict())

    def allreduce(self, backend: str = "gloo", **measure: Any) -> AllReduceCost:
        """This machine's cost for ``backend``: the cached one, else measured
        (:func:`measure_allreduce` with ``measure``'s arguments) and cached."""
        key = allreduce_key(backend)
        cost = self.get_allreduce(key)
        if cost is None:
            cost, _ = measure_allreduce(backend=backend, **measure)
            self.put_allreduce(key, cost)
        return cost
