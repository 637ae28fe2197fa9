"""A search algorithm of your own: local search around the best trial so far.

The first ``explore`` trials are drawn at random from the search space; after that, each new
trial perturbs the best completed trial's floats (on a log scale where the param is log) and
sometimes switches a categorical choice. Use it from a sweep file::

    searcher: {name: "custom_searcher.py:LocalSearch", options: {explore: 8, scale: 0.3}}

(the path is relative to the sweep file's folder), or from Python::

    hs.sweep("examples/digits_local.yaml", searcher=LocalSearch(explore=8))
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from typing import Any

from hfsweep.search_spaces import CategoricalParam, FixedParam, FloatParam, IntParam

import hfsweep as hs


class LocalSearch(hs.Searcher):
    """Random exploration, then Gaussian steps around the best completed config."""

    def __init__(self, explore: int = 8, scale: float = 0.3) -> None:
        if explore < 1 or scale <= 0:
            raise ValueError(f"explore must be >= 1 and scale > 0, got {explore}, {scale}")
        self.explore = explore
        self.scale = scale
        self.best: tuple[float, dict[str, Any]] | None = None
        self.asked = 0

    def setup(self, space: Any, *, metric: str, mode: str, seed: int) -> None:
        super().setup(space, metric=metric, mode=mode, seed=seed)
        self.rng = random.Random(seed)

    def ask(self, numbers: Sequence[int]) -> list[dict[str, Any]]:
        out = []
        for _ in numbers:
            near = self.best[1] if self.best and self.asked >= self.explore else None
            out.append(self._draw(near))
            self.asked += 1
        return out

    def tell(self, number: int, config: Mapping[str, Any], state: str, value: float | None) -> None:
        if state != "complete" or value is None:
            return
        better = self.best is None or (
            value > self.best[0] if self.mode == "max" else value < self.best[0]
        )
        if better:
            self.best = (value, dict(config))

    def _draw(self, near: Mapping[str, Any] | None) -> dict[str, Any]:
        config: dict[str, Any] = {}
        for name in self.space.names:
            p = self.space[name]
            if isinstance(p, FixedParam) or (p.when and not p.is_active(config)):
                continue
            centre = near.get(name) if near is not None else None
            if isinstance(p, CategoricalParam):
                keep = centre is not None and self.rng.random() > self.scale
                config[name] = centre if keep else self.rng.choice(p.choices)
            elif isinstance(p, FloatParam | IntParam):
                config[name] = self._number(p, centre)
        return config

    def _number(self, p: FloatParam | IntParam, centre: Any) -> float | int:
        lo, hi = (math.log(p.low), math.log(p.high)) if p.log else (p.low, p.high)
        if centre is None:
            x = self.rng.uniform(lo, hi)
        else:
            c = math.log(centre) if p.log else centre
            x = min(max(self.rng.gauss(c, self.scale * (hi - lo)), lo), hi)
        value = math.exp(x) if p.log else x
        step = p.step
        if step is not None:
            value = p.low + round((value - p.low) / step) * step
        value = min(max(value, p.low), p.high)
        return round(value) if isinstance(p, IntParam) else float(value)
