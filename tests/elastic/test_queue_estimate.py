"""The queue's estimate while few trials are asked (``Packer.queued_arrays``): the unasked
trials' arrays per trial are one standard error below the mean of the asked trials' ``1 /
size``, never below the arrays of the largest size seen, so that an early, noisy mix does not
make the allocator believe the queue needs workers it will never need. A fake sweep of the
simulator's mix: cifar_resnet in arrays of 1 (a fifth of the trials), token_transformer of 16
(three tenths), digits_mlp of 64 (half): about 0.227 arrays per trial."""

from __future__ import annotations

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
    is an array: one standard error below the mean (0.65, with one more trial of the largest
    spread a value in (0, 1] can have) is below the arrays of the largest size seen, which is
    1. Nothing asked yet tells of a larger array; the bound helps once tens of trials are
    asked (above). With many asked it comes close to the mean."""
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
