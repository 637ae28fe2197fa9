"""Keep freed memory in the process while arrays train on the CPU (glibc on Linux only).

A fused array's tensors are B times a model's, so on the CPU they cross glibc's thresholds for
serving an allocation from fresh ``mmap`` pages and for handing freed memory back to the system.
Every training step then allocates its activations in pages the kernel must map and zero again,
a page fault per 4 KiB. Measured on the project's 2-core CPU with
``fusion_throughput.py --models small_cnn transformer --sizes 8 --rounds 2 --max-processes 0``,
with and without ``HFSWEEP_MALLOC=system``: the small CNN at B=8 trained at 5.6-6.0k
member-samples/s against 4.3k (two runs each, and serial gained as much). The digits MLP sweep and the Transformer
showed no difference beyond this machine's noise.

:func:`retaining_freed_memory` raises both thresholds for a block of code, the trainer's run
(and the profiler's measurements), so memory freed in one step serves the next, as the CUDA
caching allocator does on a GPU (and as PyTorch's CPU launcher does with jemalloc). The cost:
memory the process freed stays counted in its resident size, up to :data:`TRIM_THRESHOLD` beyond
what it uses. When the last such block ends (blocks may nest and overlap in threads), the memory
kept beyond use is handed back to the system (``malloc_trim``) and the thresholds are set to
:data:`AFTER_MMAP_THRESHOLD` and :data:`AFTER_TRIM_THRESHOLD`: where glibc's own adaptive rule
takes them once the process has freed a block of 32 MiB (the mmap threshold rises to the freed
block's size, at most 32 MiB, and the trim threshold to twice that). glibc has no way to read its
thresholds, nor to turn that adaptive rule back on once they were set; setting back its fixed
128 KiB starting values instead (as hfsweep did before) left every later tensor over 128 KiB in
fresh ``mmap`` pages for the rest of the process: an array trained in the same process after a
trainer's run (a user's own loop, the benchmarks' in-process ways) page-faulted its activations
in on every step (``benchmarks/op_times.py``'s page-fault counts, issue 21).

``HFSWEEP_MALLOC=system`` leaves the allocator alone, as do thresholds the user set
(``GLIBC_TUNABLES``, ``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``), another allocator
in ``LD_PRELOAD`` and a C library other than glibc. :func:`retain_freed_memory` raises them for
the rest of the process instead (the benchmarks run every arm with the same allocator).
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import sys
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = [
    "AFTER_MMAP_THRESHOLD",
    "AFTER_TRIM_THRESHOLD",
    "DEFAULT_THRESHOLD",
    "MMAP_THRESHOLD",
    "TRIM_THRESHOLD",
    "retain_freed_memory",
    "retaining_freed_memory",
    "retaining_freed_memory_on",
]

_log = logging.getLogger("hfsweep")

#: allocations below this come from the heap, whose freed memory is reused (glibc's own upper
#: bound for its adaptive threshold, 32 MiB on 64-bit machines)
MMAP_THRESHOLD = 32 << 20
#: free memory at the top of the heap is handed back to the system only beyond this
TRIM_THRESHOLD = 1 << 30
#: glibc's default mmap and trim thresholds, where its adaptive rule starts from
DEFAULT_THRESHOLD = 128 << 10
#: the thresholds once the last run ends: where glibc's adaptive rule leaves them after the
#: process freed a block of :data:`MMAP_THRESHOLD` (the trim threshold twice the mmap one)
AFTER_MMAP_THRESHOLD = MMAP_THRESHOLD
AFTER_TRIM_THRESHOLD = 2 * MMAP_THRESHOLD

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_lock = threading.Lock()
#: blocks of :func:`retaining_freed_memory` open now
_open = 0
#: whether the thresholds are raised now, and whether for the rest of the process
_raised = False
_pinned = False


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


def _set(mmap: int, trim: int) -> bool:
    """Set glibc's mmap and trim thresholds; whether both were accepted."""
    try:
        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, mmap)) and bool(
            libc.mallopt(_M_TRIM_THRESHOLD, trim)
        )
    except (OSError, AttributeError) as exc:  # no mallopt in this process's C library
        _log.debug("malloc thresholds left as they are: %s", exc)
        return False


def _raise() -> None:
    """Raise the thresholds unless the user chose otherwise (with :data:`_lock` held)."""
    global _raised
    reason = _user_settings()
    if reason is not None:
        _log.debug("malloc thresholds left as they are: %s", reason)
        return
    _raised = _set(MMAP_THRESHOLD, TRIM_THRESHOLD)


def _restore() -> None:
    """The thresholds glibc's adaptive rule would have reached (:data:`AFTER_MMAP_THRESHOLD`,
    :data:`AFTER_TRIM_THRESHOLD`), and the freed memory kept handed back (``malloc_trim``)."""
    global _raised
    _raised = False
    if _set(AFTER_MMAP_THRESHOLD, AFTER_TRIM_THRESHOLD):
        try:
            ctypes.CDLL(None).malloc_trim(0)
        except (OSError, AttributeError) as exc:
            _log.debug("malloc_trim: %s", exc)


@contextmanager
def retaining_freed_memory() -> Iterator[bool]:
    """Within the block, glibc keeps this process's freed memory for reuse (raised mmap and
    trim thresholds); yields whether it does. When the last open block ends (in any thread),
    the thresholds are lowered to where glibc's adaptive rule would have taken them (32 MiB
    and 64 MiB) and the freed memory kept is handed back, unless
    :func:`retain_freed_memory` made them the process's. :class:`~hfsweep.ArrayTrainer` runs
    on the CPU inside one."""
    global _open
    with _lock:
        _open += 1
        if _open == 1 and not _raised:
            _raise()
        raised = _raised
    try:
        yield raised
    finally:
        with _lock:
            _open -= 1
            if _open == 0 and _raised and not _pinned:
                _restore()


def retain_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for the rest of the process; ``True`` if they are
    raised. For a whole program that trains on the CPU (the benchmarks, to run every arm with
    the same allocator); the trainer raises them only while it runs
    (:func:`retaining_freed_memory`)."""
    global _pinned
    with _lock:
        if not _raised:
            _raise()
        _pinned = _raised
        return _raised


def retaining_freed_memory_on(device: torch.device) -> AbstractContextManager[object]:
    """:func:`retaining_freed_memory` where ``device`` is the CPU (its activations are in this
    process's heap), a block that does nothing on any other device."""
    return retaining_freed_memory() if device.type == "cpu" else nullcontext()
