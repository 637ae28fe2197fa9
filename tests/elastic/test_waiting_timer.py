"""A waiting array is re-decided on a timer (every ``resize_every_s``, at least every second),
as the simulator assumes, not only at events: while it waits, the running arrays report
progress, their remaining time shrinks, and a plan on the timer starts it once its trials save
more member-seconds than the running arrays' extra workers. On a fake clock, in the tail of an
ASHA sweep (tests/elastic/test_waiting_arrays.py): array 0 (4 trials, 1 s per epoch on both
workers, 2 s on one) and the sweep's last trial, array 1 (1 trial x 10 epochs x 2 s), which
waits while array 0 has more than 5 epochs left (4 x left x 2 s > 2 x 20 s)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from _elastic_fakes import FakeClock, evals
from test_waiting_arrays import _asha_tail

from hfsweep.elastic.policy import ElasticPolicy
from hfsweep.parallel import read_resize


def _progress(policy: ElasticPolicy, clock: FakeClock, folder: str, until: float) -> None:
    """Array 0 reports one epoch a second, all 4 members going on, up to epoch ``until``."""
    epoch = 3.0
    while epoch <= until:
        clock.now = epoch
        policy.reported(folder, evals(epoch), live=4)
        epoch += 1.0


def test_a_waiting_array_starts_on_the_timer_once_the_running_ones_progressed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    policy, clock, shown, a, b = _asha_tail(tmp_path, caplog, resize_every_s=3.0)
    plans = len(policy.plans)
    _progress(policy, clock, a, until=4.0)  # 6 epochs left: array 1 still waits
    assert policy.waiting(b, total=2) == 0
    assert len(policy.plans) == plans  # a timer plan that changes nothing is not kept
    _progress(policy, clock, a, until=6.0)  # 4 epochs left: 32 member-s < 20 + 16
    clock.now = 6.5  # 3 s since the last plan (at 4.0, on the timer)
    with caplog.at_level(logging.INFO, logger="hfsweep.elastic"):
        assert policy.waiting(b, total=2) == 1
    assert policy.plans[-1].event == "timer"
    assert policy.plans[-1].workers() == {"array 0": 1, "array 1": 1}
    assert read_resize(a) == 1  # array 0 gives a worker up at its next evaluation boundary
    assert "elastic [timer]: array 1: start 0->1" in caplog.text
    assert shown[-1].startswith("elastic: 2 arrays on 2/2 workers (-1 shrunk, 1 new) [timer]")
    assert "elastic: array 1 starts on 1 worker(s) after waiting 4 s" in caplog.text  # 4.5 s


def test_the_timer_waits_resize_every_s_between_plans(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    policy, clock, _, a, b = _asha_tail(tmp_path, caplog, resize_every_s=30.0)
    _progress(policy, clock, a, until=8.0)  # array 1 would start now
    clock.now = 31.0  # the last plan was at 2.0: 29 s ago
    assert policy.waiting(b, total=2) == 0
    clock.now = 32.0
    assert policy.waiting(b, total=2) == 1
    assert policy.plans[-1].event == "timer"
