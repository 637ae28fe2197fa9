"""Keep freed memory in the process while arrays train on the CPU (glibc on Linux only).

A fused array's tensors are B times a model's, so on the CPU they cross glibc's thresholds for
serving an allocation from fresh ``mmap`` pages and for handing freed memory back to the system.
Every training step then allocates its activations in pages the kernel must map and zero again,
a page fault per 4 KiB. Measured on the project's 2-core CPU with
``fusion_throughput.py --models small_cnn transformer --sizes 8 --rounds 2 --max-processes 0``,
with and without ``HFSWEEP_MALLOC=system``: the small CNN at B=8 trained at 5.6-6.0k
member-samples/s against 4.3k (two runs each, and serial gained as much). The digits MLP sweep and the Transformer
showed no difference beyond this machine's noise.

:func:`retain_freed_memory` raises both thresholds once per process, so memory freed in one
step serves the next, as the CUDA caching allocator does on a GPU (and as PyTorch's CPU launcher
does with jemalloc). The cost: memory the process freed stays counted in its resident size, up
to :data:`TRIM_THRESHOLD` beyond what it uses. ``HFSWEEP_MALLOC=system`` leaves the allocator
alone, as do thresholds the user set (``GLIBC_TUNABLES``, ``MALLOC_MMAP_THRESHOLD_``,
``MALLOC_TRIM_THRESHOLD_``), another allocator in ``LD_PRELOAD`` and a C library other than
glibc.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import sys

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "retain_freed_memory"]

_log = logging.getLogger("hfsweep")

#: allocations below this come from the heap, whose freed memory is reused (glibc's own upper
#: bound for its adaptive threshold, 32 MiB on 64-bit machines)
MMAP_THRESHOLD = 32 << 20
#: free memory at the top of the heap is handed back to the system only beyond this
TRIM_THRESHOLD = 1 << 30

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_applied: bool | None = None


def _user_settings() -> str | None:
    """Why the allocator is left alone, or ``None``."""
    if os.environ.get("HFSWEEP_MALLOC", "").strip().lower() == "system":
        return "HFSWEEP_MALLOC=system"
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if "mmap_threshold" in tunables or "trim_threshold" in tunables:
        return "GLIBC_TUNABLES sets a malloc threshold"
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
        if name in os.environ:
            return f"{name} is set"
    preload = os.environ.get("LD_PRELOAD", "")
    for other in ("jemalloc", "tcmalloc", "mimalloc"):
        if other in preload:
            return f"LD_PRELOAD loads {other}"
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return "the C library is not glibc"
    return None


def retain_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process (once); ``True`` if they are set.

    Called by :class:`~hfsweep.ArrayTrainer` before it trains on the CPU; any number of calls,
    the first decides.
    """
    global _applied
    if _applied is not None:
        return _applied
    reason = _user_settings()
    if reason is not None:
        _log.debug("malloc thresholds left as they are: %s", reason)
        _applied = False
        return False
    try:
        libc = ctypes.CDLL(None)
        ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
            libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
        )
    except (OSError, AttributeError) as exc:  # no mallopt in this process's C library
        _log.debug("malloc thresholds left as they are: %s", exc)
        ok = False
    _applied = ok
    return ok
