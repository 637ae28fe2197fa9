"""Sizing: how many trials (B) go into one fused array on a device.

Fusing more members into one array is not free and does not always pay: past some size the device
is saturated and throughput stops growing while memory keeps growing, and on some devices (grouped
convolutions on many CPUs) an array of two is already slower than training the two trials one after
the other. So B is chosen from measurements, not as "the largest array that fits":

1. :func:`profile_sizes` measures member-samples/s and peak memory at B = 1, 2, 4, 8, ... through
   a callable the trainer provides, and stops as soon as more sizes cannot help: the memory model
   predicts the next size will not fit, the device ran out of memory, or throughput stopped growing.
2. :class:`MemoryModel` fits ``peak(B) = base + per_member * B`` to the measured peaks.
3. :func:`choose_size` picks the *knee*: the smallest B whose throughput is within ``knee`` (90% by
   default) of the best measured throughput that fits the memory budget. Smaller arrays lose little
   throughput, leave memory for the data pipeline and let a sweep start more, smaller arrays.
   If no B > 1 beats B = 1, B = 1 is chosen: fusion must never be slower than serial training.
4. A :class:`Profile` records all of it; :class:`ProfileCache` keeps profiles in a JSON file keyed
   by :func:`cache_key` (architecture :func:`signature`, batch size, dtype, device hardware), so a
   sweep profiles each kind of array once per machine, not once per run.

The code lives in :mod:`hfsweep.sizing`; this module is its public face. Nothing here trains or
imports the trainer; the data-parallel scaling profiles (:class:`ScalingProfile`, the elastic
allocator's input) are here too; matplotlib is imported only by :func:`plot`.
"""

from __future__ import annotations

from .sizing.cache import Profile, ProfileCache, cache_key, signature
from .sizing.device import device_budget
from .sizing.measure import profile_sizes
from .sizing.model import Measurement, MemoryModel, choose_size
from .sizing.plotting import plot
from .sizing.scaling import AllReduceCost, ScalingProfile, model_scaling, step_s_at

__all__ = [
    "AllReduceCost",
    "Measurement",
    "MemoryModel",
    "Profile",
    "ProfileCache",
    "ScalingProfile",
    "cache_key",
    "choose_size",
    "device_budget",
    "model_scaling",
    "plot",
    "profile_sizes",
    "signature",
    "step_s_at",
]
