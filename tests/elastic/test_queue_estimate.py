"""The queue's estimate while few trials are asked (``Packer.queued_arrays``): the unasked
trials' arrays per trial are one standard error below the mean of the asked trials' ``1 /
size``, never below the arrays of the largest size seen, so that an early, noisy mix does not
make the allocator believe the queue needs workers it will never need. A fake sweep of the
simulator's mix: cifar_resnet in arrays of 1 (a fifth of the trials), token_transformer of 16
(three tenths), digits_mlp of 64 (half): about 0.227 arrays per trial."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sweep._toy import sweep_config

import hfsweep as hs
from hfsweep.core.loop import _Engine
from hfsweep.core.packer import Packer

SIZES = {"cifar": 1, "token": 16, "mlp": 64}
#: arrays per trial of the true mix: 0.2 / 1 + 0.3 / 16 + 0.5 / 64
TRUE = 0.2 + 0.3 / 16 + 0.5 / 64


def _asked(counts: dict[str, int]) -> Packer[int]:
    """A packer that has asked ``counts`` trials per key and formed their arrays (its pools
    empty), as when a plan reads the count just after an array started."""
    keys = iter([k for k, n in counts.items() for _ in range(n)])
    packer: Packer[int] = Packer(
        ask=lambda array: [(next(keys), 0)],
        size=lambda key, item: SIZES[key],
        may_ask=lambda: True,
        budget=2000,
    )
    for _ in range(sum(counts.values())):
        packer.ask("", size_now=True)
    for key in counts:
        packer.pools.take(key, 10**6)
    return packer


def test_an_early_mix_heavy_in_small_arrays_is_not_believed() -> None:
    """100 trials asked, a quarter of them cifar_resnet (the plans come just after a pool of
    arrays of 1 filled): the plain mean says 1,900 unasked trials form 509 arrays, more than
    the 486 workers that 26 arrays leave free of 512 (508 arrays); the true mix forms 430. The
    bound says 429: fewer than the free workers, so the allocator does not hold them for a
    queue (as on the simulator's seed 2 at 512 accelerators, where the plain mean started
    token_transformer arrays of 16 members on one worker each)."""
    packer = _asked({"token": 32, "cifar": 24, "mlp": 44})
    plain = packer.queued_arrays(1900, bounded=False)
    bounded = packer.queued_arrays(1900)
    assert plain == 508 > 486
    assert bounded == 429 < 486
    assert abs(bounded - 1900 * TRUE) < abs(plain - 1900 * TRUE)


def test_one_trial_asked_says_nothing_of_larger_arrays() -> None:
    """After one cifar_resnet trial (arrays of 1) both say every one of the 1,999 trials left
    is an array: with one trial no spread is measured, and the estimate is its key's arrays,
    one a trial. Nothing asked yet tells of a larger array; the bound helps once tens of
    trials are asked (above). With many asked it comes close to the mean."""
    one = _asked({"cifar": 1})
    assert one.queued_arrays(1999, bounded=False) == 1999 == one.queued_arrays(1999)
    many = _asked({"token": 300, "cifar": 200, "mlp": 500})
    plain, bounded = many.queued_arrays(1000, bounded=False), many.queued_arrays(1000)
    assert 0.93 * plain < bounded <= plain


def test_never_below_the_arrays_of_the_largest_size_seen() -> None:
    """Every trial asked so far is a digits_mlp one (arrays of 64): one standard error below
    their mean would be below zero, the bound is 1,900 / 64 arrays; pooled trials count in full,
    and with none left to ask, the pools alone."""
    packer = _asked({"mlp": 5})
    assert packer.queued_arrays(1900) == 30 == packer.queued_arrays(1900, bounded=False)
    packer.pools.add("cifar", 1)
    assert packer.queued_arrays(1900) == 31
    assert packer.queued_arrays(0) == 1


def _keyed(sized: int, unsized: int, size: int = 4) -> Packer[int]:
    """A packer that asked ``sized`` trials of key "a" (arrays of ``size``, sized as they were
    asked) and then ``unsized`` of key "b" in refills (``size_now=False``: not sized until the
    next array starts), their arrays formed (its pools empty)."""
    keys = iter(["a"] * sized + ["b"] * unsized)
    packer: Packer[int] = Packer(
        ask=lambda array: [(next(keys), 0)],
        size=lambda key, item: size,
        may_ask=lambda: True,
        budget=2000,
    )
    for _ in range(sized):
        packer.ask("", size_now=True)
    for _ in range(unsized):
        packer.ask("", size_now=False)
    packer.pools.take("a", 10**6)
    packer.pools.take("b", 10**6)
    return packer


def test_one_trial_of_a_key_of_arrays_of_4_says_a_quarter_array_per_trial_left() -> None:
    """A single trial asked, its key of arrays of 4, 100 left: 25 arrays, bounded or not. With
    one trial there is no spread to measure, so no standard error is taken: the estimate is
    the one key's arrays, ``ceil(100 / 4)``, not one array per trial left."""
    one = _keyed(1, 0)
    assert one.queued_arrays(100) == 25 == one.queued_arrays(100, bounded=False)
    assert one.queued_arrays(99) == 25  # rounded up


def test_a_key_not_sized_yet_is_left_out_of_the_mix() -> None:
    """One trial of a key of arrays of 4 and one of a key asked in a refill, not sized yet: its
    size is not known, so it is left out of the mix, and the 100 trials left form 25 arrays,
    as after the sized trial alone. It counted as arrays of 1 before: 63 arrays by the mean,
    33 one standard error below it. Its pooled trial still counts as one array (its size is
    not known); with no sized key asked, each trial left is one array (nothing is known)."""
    packer = _keyed(1, 1)
    assert packer.queued_arrays(100) == 25 == packer.queued_arrays(100, bounded=False)
    packer.pools.add("b", 0)
    assert packer.queued_arrays(100) == 26
    assert _keyed(0, 1).queued_arrays(100) == 100
    many = _keyed(30, 10)
    assert many.queued_arrays(100) == _keyed(30, 0).queued_arrays(100)


def test_a_resumed_sweep_recalls_the_mix_of_the_trials_its_study_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sweep of 4 trials in one array of 4, resumed with a budget of 12: before it asks its
    first trial the packer's mix is the 4 trials of the study (one key, arrays of 4), so the 8
    trials still to ask count as 2 arrays, not as 8 arrays of one trial each."""
    run = tmp_path / "run"
    hs.sweep(sweep_config(run, budget={"trials": 4, "epochs": 1}), progress=False)
    seen: list[tuple[dict[str, int], int]] = []
    recall = _Engine._recall_mix

    def recalling(engine: _Engine, trials: Any) -> None:
        recall(engine, trials)
        seen.append((dict(engine.packer.asked), engine.packer.queued_arrays(8)))

    monkeypatch.setattr(_Engine, "_recall_mix", recalling)
    result = hs.sweep(
        sweep_config(run, budget={"trials": 12, "epochs": 1}), resume=True, progress=False
    )
    assert result.counts["completed"] == 12
    [(asked, queued)] = seen
    assert list(asked.values()) == [4]  # one key, every trial of the first run
    assert queued == 2
