"""What the fake-clock tests of hfsweep run's elastic policy share: a clock the test moves, a
policy on it, and one evaluation report of an array's members."""

from __future__ import annotations

from typing import Any

from hfsweep.config.schema import ElasticConfig
from hfsweep.elastic.policy import ElasticPolicy
from hfsweep.training.results import Evaluation


class FakeClock:
    """The policy's clock: ``now`` seconds, set by the test."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def fake_policy(
    clock: FakeClock,
    shown: list[str],
    *,
    scaling: Any = None,
    rungs: tuple[float, ...] = (),
    queued: Any = None,
    **settings: object,
) -> ElasticPolicy:
    """An enabled policy on ``clock`` for a budget of 10 epochs that may resize at any time,
    its status lines appended to ``shown``; ``rungs`` the trial scheduler's; ``queued`` the
    engine's count of trials still to form into arrays; ``settings`` override
    :class:`ElasticConfig`'s."""
    config = ElasticConfig(enabled=True, **{"resize_every_s": 0.0, **settings})  # type: ignore[arg-type]
    return ElasticPolicy(
        config,
        budget=10,
        by="epochs",
        show=shown.append,
        clock=clock,
        scaling=scaling,
        rungs=rungs,
        queued=queued,
    )


def evals(epoch: float, members: int = 4) -> list[Evaluation]:
    """One evaluation of ``members`` members at ``epoch`` (5 steps an epoch)."""
    return [Evaluation(f"trial-{i}", int(epoch * 5), epoch, {}, False) for i in range(members)]
