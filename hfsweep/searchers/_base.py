"""The extension point for search algorithms of your own: :class:`Searcher`."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..search_spaces import SearchSpace

__all__ = ["TRIAL_STATES", "Searcher"]

#: How a trial ends, as :meth:`Searcher.tell` is told.
TRIAL_STATES = ("complete", "pruned", "failed")


class Searcher(ABC):
    """A search algorithm of your own, in place of an Optuna sampler.

    The engine calls :meth:`setup` once, then :meth:`ask` whenever it needs configs (to fill an
    array, or a slot a stopped trial freed), :meth:`report` after each evaluation of a running
    trial, and :meth:`tell` exactly once per trial when it ends. A config maps the search
    space's sampled params to values (fixed params may be left out); the engine records it as
    the params of an Optuna trial in the sweep's study, so a value must lie in its param's
    range or choices, else the sweep stops with an error naming the trial, the param and the
    range. Trials are named by their Optuna trial number.

    On ``--resume`` the engine builds a new searcher, calls :meth:`setup`, then :meth:`tell`
    for every trial the study already finished (in trial-number order), so a searcher that
    learns only from :meth:`tell` picks up where it was; trials that were running go on with
    their recorded config.

    Subclasses implement :meth:`ask`; ``examples/custom_searcher.py`` is a small example. Use
    one from Python (``hs.sweep(config, searcher=MySearcher())``) or from a sweep file
    (``searcher: {name: "my_module:MySearcher", options: {...}}``, the options passed to its
    constructor).
    """

    space: SearchSpace
    metric: str
    mode: str
    seed: int

    def setup(self, space: SearchSpace, *, metric: str, mode: str, seed: int) -> None:
        """Learn the sweep's search space, metric, ``mode`` (``"max"``/``"min"``) and seed.
        The default stores them as attributes of the same names."""
        self.space, self.metric, self.mode, self.seed = space, metric, mode, seed

    @abstractmethod
    def ask(self, numbers: Sequence[int]) -> Sequence[Mapping[str, Any]]:
        """One config for each trial number in ``numbers`` (the trials about to start).

        Return fewer configs (the first ones) when the search has no more to propose; an
        empty answer ends the sweep once the running trials finish.
        """

    def report(self, number: int, step: int, value: float) -> None:
        """Trial ``number``'s metric at ``step`` (its epoch, or step when the budget counts
        steps): called once per evaluation, after the scheduler's decision on it is saved, and
        only with a finite ``value`` (a NaN or infinite metric, or a diverged loss, is not
        reported). The default ignores it."""
        return None

    def tell(self, number: int, config: Mapping[str, Any], state: str, value: float | None) -> None:
        """Trial ``number`` ended: ``state`` is one of :data:`TRIAL_STATES`, ``value`` its
        final metric (``None`` for a failed trial; a pruned one's last reported value). The
        default ignores it."""
        return None
