"""The checks of a sweep against its task: every config and search-space key is one the task
knows (and not one the budget sets), and the fixed config, the corners of the space and random
draws from it all pass ``task.resolve``; a failure blames the key the task's error points at."""

from __future__ import annotations

import logging
import math
import re
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..search_spaces import SearchSpace
from .fields import _did_you_mean, _Fields, _join
from .schema import Budget

if TYPE_CHECKING:  # imported by the checks against a task, which has imported it already
    from ..training.task import Task, TaskError

#: keys the budget sets; config and the search space may not
_BUDGET_KEYS = {"epochs": "budget.epochs", "max_steps": "budget.steps"}
#: the config key a TaskError's message names
_TASK_KEY = re.compile(r"^config (?:key '(\w+)'|(\w+)=)")
#: random configs drawn from the space to check against task.resolve
RANDOM_SAMPLES = 20
#: the most keys a rejected config may have for each to be left out in turn to find the
#: culprit (a resolve each); a larger one is searched by bisection (a resolve per halving)
_LEAVE_ONE_OUT = 64


def _check_budget_key(fields: _Fields, key: object, path: str, where: str = "") -> None:
    """``key`` (at ``path``; ``where`` says which space it came from) is not one the budget
    sets (a check of the file alone)."""
    if isinstance(key, str) and key in _BUDGET_KEYS:
        raise fields.error(
            path,
            f"{key!r}{where} is set by the budget; use {_BUDGET_KEYS[key]} (every trial's "
            "budget) instead",
        )


def _check_key(fields: _Fields, key: object, task: Task, path: str, where: str = "") -> None:
    """``key`` (at ``path``; ``where`` says which space it came from) is a config key of ``task``
    that the budget does not set."""
    _check_budget_key(fields, key, path, where)
    if not task.knows(key):
        known = [k for k in task.known_keys if k not in _BUDGET_KEYS]
        raise fields.error(
            path,
            f"{key!r}{where} is not a config key of task {task.name!r}"
            f"{_did_you_mean(key, known)}; known keys: {', '.join(known)}",
        )


def _check_config(fields: _Fields, task: Task, budget: Budget, config: dict[str, Any]) -> None:
    """The fixed ``config``, with the budget, passes ``task.resolve``."""
    culprit, exc = _first_failure(task, budget.trial_config(), config)
    if exc is not None:
        path = _join("config", culprit) if culprit is not None else "config"
        raise fields.error(path, f"task {task.name!r} rejects it: {exc}")


def _check_samples(
    fields: _Fields,
    task: Task,
    config: dict[str, Any],
    space: SearchSpace,
    budget: Budget,
    seed: int,
) -> None:
    """Every config :func:`sample_configs` draws from ``space`` passes ``task.resolve``."""
    base = {**budget.trial_config(), **config}
    for sample in sample_configs(space, seed):
        culprit, exc = _first_failure(task, base, sample)
        if exc is not None:
            path = _join("search_space", culprit) if culprit is not None else "search_space"
            raise fields.error(
                path,
                f"the sampled config {sample!r} is rejected by task {task.name!r}: {exc}; "
                "narrow the range, fix the value, or add a when condition",
            )


def _first_failure(
    task: Task, base: Mapping[str, Any], extra: Mapping[str, Any]
) -> tuple[str | None, TaskError | None]:
    """``(key, error)`` when ``task.resolve({**base, **extra})`` fails, else ``(None, None)``.

    The key to blame is the one the task's message names (``config key 'momentum' is not a
    hyperparameter of optimizer 'adam'``, ``config lr=-1.0 ...``) if it is in ``extra``; else
    the last key of ``extra`` whose removal alone makes it pass (for an ``extra`` of at most
    :data:`_LEAVE_ONE_OUT` keys); else a key whose addition to the keys before it makes it fail
    (found by bisection, so a large space costs a few resolves, not one per key); ``None`` if
    ``base`` alone fails.
    """

    from ..training.task import TaskError

    def fails(config: Mapping[str, Any]) -> bool:
        try:
            task.resolve(config)
        except TaskError:
            return True
        return False

    try:
        task.resolve({**base, **extra})
        return None, None
    except TaskError as exc:
        error = exc
    named = _TASK_KEY.match(str(error))
    if named is not None and (named[1] or named[2]) in extra:
        return named[1] or named[2], error
    keys = list(extra)
    if len(keys) <= _LEAVE_ONE_OUT:  # a resolve per key: for a space of the usual size only
        for key in reversed(keys):
            if not fails({**base, **{k: extra[k] for k in keys if k != key}}):
                return key, error
    if fails(base):
        return None, error
    # the shortest failing prefix of extra, by bisection: base with keys[:low] passes, with
    # keys[:high] (all of them) fails, so keys[high - 1] is one whose addition makes it fail
    low, high = 0, len(keys)
    while high - low > 1:
        middle = (low + high) // 2
        if fails({**base, **{k: extra[k] for k in keys[:middle]}}):
            high = middle
        else:
            low = middle
    return (keys[high - 1] if keys else None), error


class _CornerTrial:
    """A stand-in for an Optuna trial that draws the ends of every range and the
    ``index``-th choice of every categorical param."""

    def __init__(self, high: bool, index: int) -> None:
        self.high = high
        self.index = index

    def suggest_float(
        self, name: str, low: float, high: float, *, step: float | None = None, log: bool = False
    ) -> float:
        if not self.high:
            return low
        if step is None:
            return high
        return low + math.floor((high - low) / step + 1e-9) * step

    def suggest_int(
        self, name: str, low: int, high: int, *, step: int = 1, log: bool = False
    ) -> int:
        return low + (high - low) // step * step if self.high else low

    def suggest_categorical(self, name: str, choices: Any) -> Any:
        return choices[self.index % len(choices)]


def sample_configs(space: SearchSpace, seed: int) -> list[dict[str, Any]]:
    """Configs to check: the corners of the space (every categorical choice at both ends of
    the ranges), then random draws."""
    import optuna

    choices = [len(getattr(space[n], "choices", ())) for n in space.names]
    out = [
        space.sample(_CornerTrial(high, index))
        for index in range(max([1, *choices]))
        for high in (False, True)
    ]
    logger = logging.getLogger("optuna")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed))
            for _ in range(RANDOM_SAMPLES):
                trial = study.ask()
                out.append(space.sample(trial))
                study.tell(trial, 0.0)
    finally:
        logger.setLevel(level)
    return out
