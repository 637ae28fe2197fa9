"""What the trainer tests share (tests/fusion, tests/training, tests/offload): members from
configs, a report callback that crashes a run at a given evaluation, and the check that two runs'
member results are the same (history, weights, optimizer state), rtol 1e-7 in float64."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import hfsweep as hs


class Crash(Exception):
    """Raised by :func:`crashing_report`'s report callback: a run interrupted mid-way."""


def members(configs: list[dict[str, Any]], prefix: str = "t") -> list[hs.Member]:
    """One member per config, named ``<prefix><index>``."""
    return [hs.Member(f"{prefix}{i}", c) for i, c in enumerate(configs)]


def crashing_report(evaluation: int | None) -> Callable[[list[hs.Evaluation]], None]:
    """A report callback that raises :class:`Crash` at its ``evaluation``-th call (never for
    ``None``)."""
    calls = 0

    def report(evals: list[hs.Evaluation]) -> None:
        nonlocal calls
        calls += 1
        if calls == evaluation:
            raise Crash

    return report


def assert_same(
    a: hs.MemberResult,
    b: hs.MemberResult,
    *,
    optimizer: bool = True,
    optimizer_atol: float = 1e-12,
    rng: bool = False,
) -> None:
    """``a`` and ``b`` ended alike, with the same history and weights (rtol 1e-7); with
    ``optimizer``, the same optimizer state (``optimizer_atol``), with ``rng`` the same saved
    random state."""
    assert (a.status, a.steps) == (b.status, b.steps)
    assert len(a.history) == len(b.history)
    for ra, rb in zip(a.history, b.history, strict=True):
        for k in ra:
            assert ra[k] == pytest.approx(rb[k], rel=1e-7, abs=1e-12), (a.id, k)
    assert a.state is not None and b.state is not None
    assert a.state["model"].keys() == b.state["model"].keys()
    for k, v in a.state["model"].items():
        torch.testing.assert_close(v, b.state["model"][k], rtol=1e-7, atol=1e-12, msg=k)
    if optimizer:
        states_a, states_b = a.state["optimizer"]["state"], b.state["optimizer"]["state"]
        assert states_a.keys() == states_b.keys()
        for k, st in states_a.items():
            for name, v in st.items():
                torch.testing.assert_close(v, states_b[k][name], rtol=1e-7, atol=optimizer_atol)
    if rng:
        assert a.state["rng"] == b.state["rng"]
