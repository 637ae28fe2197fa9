"""The fused optimizers' update arithmetic compiled with ``torch.compile``.

A fused step is a dozen ``torch._foreach_*`` passes over the stacked parameters and states; on a
device bound by launches (a GPU with a small model) each pass costs a launch per tensor list,
and inductor fuses them into a few kernels. What is compiled is the *group update* alone: a plain
function of its arguments (the parameters, gradients, states, hyperparameter views, the group's
``[B]`` values and flags, a few host constants), without the optimizer object, so that its
graphs are shared by every optimizer of the same class, shapes and flags (a new array with the
same model compiles nothing new) and dynamo guards on no optimizer's identity. What reads the
device into Python stays eager around it: the non-finite check, the idle members' restored
rows and the step counts.

A call dynamo refuses (an unsupported construct, a backend failure, the recompile limit) runs
uncompiled, with one ``CompileFallbackWarning``, and so do all later calls of that optimizer.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from .._compat import dynamo_graphs_compiled, dynamo_refused
from ..fusion import CompileFallbackWarning

__all__ = ["CompiledUpdate", "GroupUpdate"]

_log = logging.getLogger("hfsweep.optim")

#: a group's update: ``update(work, group, flags, *constants)``, in place
GroupUpdate = Callable[..., None]

#: compiled group updates by (function, mode): one per function for all optimizers using it
_CACHE: dict[tuple[GroupUpdate, str | None], Any] = {}


def _compiled(update: GroupUpdate, mode: str | None) -> Any:
    key = (update, mode)
    compiled = _CACHE.get(key)
    if compiled is None:
        compiled = _CACHE[key] = torch.compile(update, mode=mode, fullgraph=True)
    return compiled


class CompiledUpdate:
    """An optimizer's group updates compiled in ``mode`` (inductor's default when ``None``), or
    uncompiled from the first call dynamo refuses on."""

    def __init__(self, owner: str, mode: str | None) -> None:
        self._owner = owner
        self.mode = mode
        #: the reason the updates run uncompiled, from the first refusal on
        self.fallback: str | None = None
        #: seconds spent in calls that compiled a new graph (left out of step timings)
        self.seconds = 0.0

    def __call__(self, update: GroupUpdate, *args: Any) -> None:
        if self.fallback is not None:
            update(*args)
            return
        start = time.perf_counter()
        frames = dynamo_graphs_compiled()
        try:
            _compiled(update, self.mode)(*args)
        except Exception as exc:
            if not dynamo_refused(exc):
                raise
            first = str(exc).strip().splitlines()
            self.fallback = f"{type(exc).__name__}: {first[0] if first else ''}"
            warnings.warn(
                f"{self._owner}.compile(): torch.compile refused the update ({self.fallback}); "
                "this optimizer steps uncompiled from now on (same results, slower)",
                CompileFallbackWarning,
                stacklevel=4,
            )
            _log.info("%s steps uncompiled: %s", self._owner, self.fallback)
            update(*args)
            return
        if dynamo_graphs_compiled() != frames:
            self.seconds += time.perf_counter() - start
