"""Schedulers by name, as a sweep config names them."""

from __future__ import annotations

import inspect
from typing import Any

from ._asha import ASHAScheduler, HyperbandScheduler
from ._base import TrialScheduler
from ._fifo import FIFOScheduler
from ._median import MedianStoppingScheduler
from ._optuna import PRUNER_NAMES, OptunaPruner, pruner_options

__all__ = ["SCHEDULER_NAMES", "make_scheduler"]

_NATIVE: dict[str, type[TrialScheduler]] = {
    "fifo": FIFOScheduler,
    "asha": ASHAScheduler,
    "hyperband": HyperbandScheduler,
    "median": MedianStoppingScheduler,
}

#: Every name :func:`make_scheduler` accepts.
SCHEDULER_NAMES = (*_NATIVE, *(f"optuna:{p}" for p in PRUNER_NAMES))

_COMMON = ("mode", "max_resource")


def _options(cls: type[TrialScheduler]) -> list[str]:
    params = inspect.signature(cls.__init__).parameters.values()
    return [
        p.name
        for p in params
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        and p.name not in ("self", "pruner", *_COMMON)
    ]


def make_scheduler(name: str, *, mode: str, max_resource: float, **options: Any) -> TrialScheduler:
    """The scheduler called ``name`` (one of :data:`SCHEDULER_NAMES`), built with ``options``.

    ``"fifo"``, ``"asha"``, ``"hyperband"`` and ``"median"`` are :class:`FIFOScheduler`,
    :class:`ASHAScheduler`, :class:`HyperbandScheduler` and :class:`MedianStoppingScheduler`;
    ``"optuna:<pruner>"`` is an :class:`OptunaPruner` around Optuna's pruner of that name,
    whose options are the pruner's constructor arguments plus ``steps_per_resource``. An
    unknown name or option raises ``ValueError`` naming it and listing the valid ones.

    Example::

        make_scheduler("asha", mode="max", max_resource=27, grace_period=1, reduction_factor=3)
        make_scheduler("optuna:median", mode="min", max_resource=20, n_startup_trials=5)
    """
    if not isinstance(name, str):
        raise TypeError(f"scheduler name must be a str, got {name!r}")
    if name in _NATIVE:
        cls = _NATIVE[name]
        valid = _options(cls)
        _check_options(name, options, valid)
        return cls(mode=mode, max_resource=max_resource, **options)
    if name.startswith("optuna:") and name[len("optuna:") :] in PRUNER_NAMES:
        pruner = name[len("optuna:") :]
        valid = _options(OptunaPruner) + list(pruner_options(pruner))
        _check_options(name, options, valid)
        return OptunaPruner(pruner, mode=mode, max_resource=max_resource, **options)
    raise ValueError(f"unknown scheduler {name!r}; valid names: {', '.join(SCHEDULER_NAMES)}")


def _check_options(name: str, options: dict[str, Any], valid: list[str]) -> None:
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(
            f"unknown option(s) {', '.join(map(repr, unknown))} for scheduler {name!r}; "
            f"valid options: {', '.join(valid) or '(none)'} (and mode, max_resource)"
        )
