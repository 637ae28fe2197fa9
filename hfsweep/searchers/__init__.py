"""Where a sweep's configs come from: Optuna's samplers (by name in ``searcher:``) or a
:class:`Searcher` of your own.

The sweep core asks through a :class:`TrialSource`: :class:`OptunaSource` over an Optuna
sampler, :class:`CustomSource` over a :class:`Searcher`, which raises
:class:`SearcherError` where it answers something the core cannot use.
"""

from ._base import TRIAL_STATES, Searcher
from ._source import CustomSource, OptunaSource, SearcherError, TrialSource

__all__ = [
    "TRIAL_STATES",
    "CustomSource",
    "OptunaSource",
    "Searcher",
    "SearcherError",
    "TrialSource",
]
