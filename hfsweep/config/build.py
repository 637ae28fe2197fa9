"""What a validated sweep builds at run time: the Optuna sampler a :class:`SearcherConfig`
names, or an instance of the user's own :class:`hfsweep.Searcher`."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from ..search_spaces import SearchSpace
from .schema import _SAMPLERS, SearcherConfig

if TYPE_CHECKING:
    from optuna.samplers import BaseSampler

    from ..searchers import Searcher


def make_sampler(searcher: SearcherConfig, space: SearchSpace) -> BaseSampler:
    """The Optuna sampler ``searcher`` describes (``grid`` gets ``space.grid()``). A custom
    searcher's study gets a seeded random sampler, which never samples: the searcher's
    configs are recorded as the trials' params."""
    import optuna

    if searcher.custom:
        return optuna.samplers.RandomSampler(seed=searcher.seed)

    cls = getattr(optuna.samplers, _SAMPLERS[searcher.name])
    if searcher.name == "grid":
        cls = _ask_tell_grid_sampler()
        sampler: BaseSampler = cls(space.grid(), seed=searcher.seed, **searcher.options)
    else:
        sampler = cls(seed=searcher.seed, **searcher.options)
    return sampler


@functools.cache
def _ask_tell_grid_sampler() -> Any:
    """Optuna's GridSampler without its ``study.stop()`` once the grid is done: that call only
    works inside ``study.optimize``, and the engine (ask and tell) caps the trials at the grid
    size itself."""
    import optuna

    class GridSampler(optuna.samplers.GridSampler):
        def after_trial(self, *args: Any, **kwargs: Any) -> None:
            return None

    return GridSampler


def make_searcher(searcher: SearcherConfig) -> Searcher:
    """A new instance of the custom searcher class ``searcher.name`` names (``module:Class`` or
    ``file.py:Class``), built with ``searcher.options``. Raises ``ImportError`` when it cannot
    be imported or is not a :class:`hfsweep.Searcher` subclass."""
    from ..searchers import Searcher
    from .entry import load_object

    cls = load_object(searcher.name, "searcher")
    if not (isinstance(cls, type) and issubclass(cls, Searcher)):
        raise ImportError(
            f"searcher {searcher.name!r} is {cls!r}, not a subclass of hfsweep.Searcher"
        )
    instance: Searcher = cls(**searcher.options)
    return instance
