"""Where the engine gets trials from: an Optuna sampler through the study, or a :class:`Searcher`.

Either way every trial is an Optuna trial of the sweep's study with its params recorded, so
the study stays the one record of the sweep (``trials.csv``, resume, Optuna's dashboards).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .._compat import ask_with_user_attrs, distribution_contains, set_trial_param
from ._base import Searcher

if TYPE_CHECKING:
    import optuna

    from ..search_spaces import SearchSpace

__all__ = ["CustomSource", "OptunaSource", "SearcherError", "TrialSource"]


class SearcherError(ValueError):
    """A custom searcher answered something the engine cannot use."""


class TrialSource:
    """Asks new trials; subclasses decide where their params come from. Each trial is created
    with ``user_attrs`` (the driver that asked it: a trial of a shared study names its driver
    from its first write, see :mod:`hfsweep.storage.drivers`)."""

    def __init__(
        self, study: optuna.Study, space: SearchSpace, user_attrs: Mapping[str, Any] | None = None
    ) -> None:
        self.study = study
        self.space = space
        self.user_attrs = dict(user_attrs or {})
        #: no more trials to come (a custom searcher said so)
        self.exhausted = False

    def ask(self, n: int) -> list[tuple[optuna.Trial, dict[str, Any]]]:
        """Up to ``n`` new running trials of the study, each with its sampled config."""
        raise NotImplementedError

    def report(self, number: int, step: int, value: float) -> None:
        """An intermediate value, for searchers that learn from them."""

    def tell(self, number: int, config: Mapping[str, Any], state: str, value: float | None) -> None:
        """A trial ended (after the study was told)."""


class OptunaSource(TrialSource):
    """Trials from the study's own sampler (``study.ask()``, then the space samples them)."""

    def ask(self, n: int) -> list[tuple[optuna.Trial, dict[str, Any]]]:
        out = []
        for _ in range(n):
            trial = ask_with_user_attrs(self.study, self.user_attrs)
            out.append((trial, self.space.sample(trial)))
        return out


class CustomSource(TrialSource):
    """Trials whose params a :class:`Searcher` chose, recorded in the study as its params."""

    def __init__(
        self,
        study: optuna.Study,
        space: SearchSpace,
        searcher: Searcher,
        user_attrs: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(study, space, user_attrs)
        self.searcher = searcher

    def ask(self, n: int) -> list[tuple[optuna.Trial, dict[str, Any]]]:
        if self.exhausted or n < 1:
            return []
        first = len(self.study.get_trials(deepcopy=False))
        numbers = list(range(first, first + n))
        answer = self.searcher.ask(numbers)
        if not isinstance(answer, Sequence) or isinstance(answer, str | bytes):
            raise SearcherError(
                f"{type(self.searcher).__name__}.ask({numbers}) returned {answer!r}; it must "
                "return a list of configs (dicts), one per trial number"
            )
        configs = list(answer)
        if len(configs) > n:
            raise SearcherError(
                f"{type(self.searcher).__name__}.ask() was asked for {n} config(s) and "
                f"returned {len(configs)}"
            )
        if len(configs) < n:
            self.exhausted = True
        out = []
        for number, config in zip(numbers, configs, strict=False):
            if not isinstance(config, Mapping):
                raise SearcherError(
                    f"{type(self.searcher).__name__}.ask() gave {config!r} for trial {number}; "
                    "a config is a dict of param values"
                )
            self.space.sample(_Given(None, config, self.space, number))  # check it all first
            trial = ask_with_user_attrs(self.study, self.user_attrs)
            if trial.number != number:
                raise SearcherError(
                    f"the study got trial {trial.number} where trial {number} was expected: "
                    "another process is adding trials to the same study; a custom searcher "
                    "needs the study to itself"
                )
            out.append((trial, self.space.sample(_Given(trial, config, self.space, number))))
        return out

    def report(self, number: int, step: int, value: float) -> None:
        self.searcher.report(number, step, value)

    def tell(self, number: int, config: Mapping[str, Any], state: str, value: float | None) -> None:
        self.searcher.tell(number, config, state, value)


class _Given:
    """A trial for ``SearchSpace.sample`` that answers each suggestion with the searcher's
    value, after checking it against the param's distribution, and records it in the study."""

    def __init__(
        self,
        trial: optuna.Trial | None,
        config: Mapping[str, Any],
        space: SearchSpace,
        number: int,
    ) -> None:
        self.trial = trial  # None: check the values only
        self.number = number
        self.config = config
        self.space = space
        unknown = sorted(set(config) - set(space.names))
        if unknown:
            raise SearcherError(
                f"the searcher's config for trial {number} has key(s) "
                f"{', '.join(map(repr, unknown))} that are not in the search space; params: "
                f"{', '.join(space.names)}"
            )

    def _given(self, name: str) -> Any:
        if name not in self.config:
            raise SearcherError(
                f"the searcher's config for trial {self.number} has no value for param "
                f"{name!r}; it gave {dict(self.config)!r}"
            )
        value = self.config[name]
        dist = self.space[name].distribution()
        try:
            internal = dist.to_internal_repr(value)
            inside = distribution_contains(dist, internal) and not (
                isinstance(internal, float) and math.isnan(internal)
            )
        except (TypeError, ValueError):
            inside = False
        if not inside:
            raise SearcherError(
                f"the searcher's config for trial {self.number}: {name}={value!r} is "
                f"outside the search space ({self.space.path}.{name}: {dist})"
            )
        if self.trial is not None:
            set_trial_param(self.trial, name, internal, dist)
        return dist.to_external_repr(internal)

    def suggest_float(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return self._given(name)

    def suggest_int(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return self._given(name)

    def suggest_categorical(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return self._given(name)
