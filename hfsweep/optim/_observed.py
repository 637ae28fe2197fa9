"""The fused optimizers' ``step`` through torch's optimizer wrapper only while something watches.

``torch.optim.Optimizer`` wraps every optimizer class's ``step`` (``profile_hook_step``): a
profiler range around the step and the step pre- and post-hooks. This module keeps that wrapper
off a fused step's path while nothing uses it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from .._compat import optimizer_step_observed

__all__ = ["observed_step"]


def observed_step(step: Callable[..., Any]) -> Callable[..., Any]:
    """``step`` through torch's optimizer wrapper only while something watches it.

    ``torch.optim.Optimizer`` wraps every optimizer class's ``step`` (``profile_hook_step``): a
    profiler range around the step and the step pre- and post-hooks, the optimizer's own
    (``register_step_pre_hook``...) and every optimizer's
    (``torch.optim.optimizer.register_optimizer_step_pre_hook``...). With no hook registered and
    no profiler running, that range is a fixed cost of every step and the hooks are empty loops:
    then the step runs as it is, and otherwise through torch's very wrapper, so hooks and
    profiler traces see it as they see any optimizer's. The mark ``hooked`` tells torch that
    the class's ``step`` is wrapped already."""
    observed = torch.optim.Optimizer.profile_hook_step(step)

    @functools.wraps(step)
    def wrapper(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        # a subclass's own step is torch-wrapped already (it has no mark): called through
        # super(), this one must not run the hooks a second time
        if type(self).step is wrapper and optimizer_step_observed(self):
            return observed(self, *args, **kwargs)
        return step(self, *args, **kwargs)

    wrapper.hooked = True  # type: ignore[attr-defined]
    return wrapper
