"""Sizing fused arrays: how many trials (B) go into one array on a device.

One job per module, each importing only those above it in this list:

- ``model``: a measured size (:class:`Measurement`), the memory model and the choice of B.
- ``measure``: which sizes to measure and when to stop (:func:`profile_sizes`).
- ``device``: what ``device: auto`` means, the dtype names, the memory budget, the hardware's name.
- ``compiled``: eager or compiled (``compile: auto``), compile time amortised (:func:`choose_compile`).
- ``cache``: profiles and their JSON cache, keyed by architecture, batch, dtype and hardware.
- ``plotting``: a PNG of a profile.
- ``beyond``: ``size: auto`` with ``offload: auto``: sizes beyond what the device holds,
  measured offloaded (:func:`~hfsweep.sizing.beyond.offload_beyond`).
- ``timing``: timing one array's real training step through the trainer
  (:func:`~hfsweep.sizing.timing.measure_step`) and its peak memory.
- ``offloading``: ``offload: auto`` where some members fit, by measured throughput
  (:func:`~hfsweep.sizing.offloading.profile_offload`): it measures through ``timing`` and
  hands itself to the trainer, which cannot import it.
- ``task``: a task's profile over array sizes (:func:`profile_task`); importing it registers
  ``offloading`` with the trainer. ``timing``, ``offloading`` and ``task`` import the trainer,
  so this package itself imports none of them.

Users import the public names from :mod:`hfsweep.profiler`, which gathers them from these
modules (and ``profile_task`` from :mod:`hfsweep`); the package itself re-exports nothing, so
that the list of public names stands in one place.
"""

__all__: list[str] = []
