"""Where a sweep's configs come from: Optuna's samplers (by name in ``searcher:``) or a
:class:`Searcher` of your own."""

from ._base import TRIAL_STATES, Searcher

__all__ = ["TRIAL_STATES", "Searcher"]
