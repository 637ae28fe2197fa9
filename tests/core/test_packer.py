"""The packer on its own (``hfsweep.core.packer``): pools per compatibility key, sizing requests,
the fill policy, starting an array from the fullest pool, refill of freed slots and requeue,
driven by a scripted searcher instead of Optuna or Tune."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from hfsweep.core.packer import (
    REFILL_ASKS,
    Packer,
    Pools,
    learning_cap,
    limit_for_learning,
)


class Script:
    """A searcher that answers from a script of keys: ``"a"`` asks a trial of key ``a``,
    ``None`` gives no trial (nothing now), ``"!"`` a trial the front door rejects."""

    def __init__(self, keys: Sequence[str | None], budget: int = 100) -> None:
        self.keys = list(keys)
        self.budget = budget
        self.asked = 0
        self.calls: list[str] = []  # the array each ask was made for
        self.sized: list[tuple[str, str]] = []  # (key, first item) of each sizing request
        self.saved: list[tuple[str, int]] = []

    def ask(self, array: str) -> list[tuple[str, str]] | None:
        self.calls.append(array)
        key = self.keys.pop(0) if self.keys else None
        if key is None:
            return None
        self.asked += 1
        if key == "!":
            return []
        return [(key, f"{key}{self.asked}")]

    def may_ask(self) -> bool:
        return self.asked < self.budget

    def packer(self, sizes: dict[str, int], budget: int = 100) -> Packer[str]:
        def size(key: str, item: str) -> int:
            self.sized.append((key, item))
            return sizes[key]

        return Packer(
            ask=self.ask,
            size=size,
            may_ask=self.may_ask,
            budget=budget,
            on_sized=lambda key, n: self.saved.append((key, n)),
        )


def test_fill_asks_until_a_pool_holds_its_array_size() -> None:
    s = Script(["a", "b", "a", "b", "a", "b"])
    p = s.packer({"a": 3, "b": 2})
    assert p.next_array("0") == ("b", ["b2", "b4"])  # b filled first, after 4 asks
    assert s.asked == 4 and s.calls == ["0"] * 4
    assert s.sized == [("a", "a1"), ("b", "b2")]  # each key sized once, with its first trial
    assert s.saved == [("a", 3), ("b", 2)]
    assert p.pools.as_dict() == {"a": ["a1", "a3"], "b": []}


def test_sizes_are_kept_between_one_and_the_budget() -> None:
    s = Script(["a", "b"])
    p = s.packer({"a": 0, "b": 50}, budget=4)
    p.add("a", "x", size_now=True)
    p.add("b", "y", size_now=True)
    assert p.sizes == {"a": 1, "b": 4}


def test_fill_stops_when_no_more_may_be_asked_and_starts_the_fullest_pool() -> None:
    s = Script(["b", "a", "b", "a", "b"], budget=5)
    p = s.packer({"a": 4, "b": 8})
    assert p.next_array() == ("a", ["a2", "a4"])  # a holds 2 of 4, b 3 of 8
    assert s.asked == 5
    assert p.next_array() == ("b", ["b1", "b3", "b5"])
    assert p.next_array() is None


def test_a_tie_between_pools_goes_to_the_key_seen_first() -> None:
    s = Script(["b", "a", "b", "a", "b", "b"], budget=6)
    p = s.packer({"a": 4, "b": 8})
    assert p.next_array() == ("b", ["b1", "b3", "b5", "b6"])  # 4 of 8 against 2 of 4


def test_fill_stops_when_the_searcher_gives_nothing_and_partial_arrays_wait_if_told() -> None:
    s = Script(["a", None, "a", "a"])
    p = s.packer({"a": 3})
    assert p.next_array(partial=lambda: False) is None  # nothing now: no array of 1 yet
    assert s.calls == ["", ""]
    assert p.next_array(partial=lambda: False) == ("a", ["a1", "a2", "a3"])


def test_a_rejected_trial_counts_as_asked_and_asking_goes_on() -> None:
    s = Script(["!", "a", "!", "a"])
    p = s.packer({"a": 2})
    assert p.next_array() == ("a", ["a2", "a4"])
    assert s.asked == 4


def test_refill_takes_a_waiting_trial_before_asking() -> None:
    s = Script(["a", "a", "a"])
    p = s.packer({"a": 2})
    assert p.next_array() == ("a", ["a1", "a2"])
    p.add("a", "w", size_now=True)
    assert p.refill("a", 1, "0") == ["w"] and s.asked == 2


def test_refill_asks_at_most_refill_asks_and_defers_sizing_other_keys() -> None:
    s = Script(["a", "b", "c", "b", "a"])
    p = s.packer({"a": 1, "b": 2, "c": 5})
    assert p.next_array() == ("a", ["a1"])
    assert p.refill("a", 1, "0") == []  # b, c, b: none of a's key in REFILL_ASKS asks
    assert s.asked == 1 + REFILL_ASKS and s.calls[1:] == ["0"] * REFILL_ASKS
    assert "b" not in p.sizes and "c" not in p.sizes  # sized when the next array starts
    assert s.sized == [("a", "a1")]
    # the next array sizes them with their first trials, then b is full
    assert p.next_array() == ("b", ["b2", "b4"])
    assert s.sized[1:] == [("b", "b2"), ("c", "c3")] and s.asked == 4


def test_refill_of_several_slots_shares_its_asks_and_stops_when_nothing_comes() -> None:
    s = Script(["a", "a", "x", "a", "a", "a"])
    p = s.packer({"a": 1, "x": 1})
    assert p.next_array() == ("a", ["a1"])
    assert p.refill("a", 5) == ["a2", "a4"]  # three asks for five slots
    assert s.asked == 4
    s.keys = [None, "a"]
    assert p.refill("a", 2) == [] and s.asked == 4  # the searcher had nothing: no more asks


def test_refill_asks_nothing_when_no_more_may_be_asked() -> None:
    s = Script(["a", "a"], budget=1)
    p = s.packer({"a": 1})
    assert p.next_array() == ("a", ["a1"])
    assert p.refill("a") == [] and s.calls == [""]


def test_a_requeued_trial_waits_at_the_head_of_its_pool() -> None:
    s = Script(["a", "a", "a", "a"])
    p = s.packer({"a": 2})
    assert p.next_array() == ("a", ["a1", "a2"])
    p.add("a", "w", size_now=False)
    p.requeue("a", "a2")
    assert p.refill("a") == ["a2"]
    assert p.next_array() == ("a", ["w", "a3"])


def test_pools_save_and_load_as_plain_lists() -> None:
    pools: Pools[str] = Pools({"k": ["m1", "m2"], "j": []})
    pools.add("j", "m3")
    pools.add("k", "m0", first=True)
    again: Pools[str] = Pools(pools.as_dict())
    assert again.as_dict() == {"k": ["m0", "m1", "m2"], "j": ["m3"]}
    assert list(again) == ["m0", "m1", "m2", "m3"] and len(again) == 4
    assert again.unsized({"k": 3}) == [("j", "m3")]
    assert again.pick({"k": 3, "j": 1}) == "k"  # full pools in the order keys appeared


@pytest.mark.parametrize(
    ("budget", "learns", "cap"), [(7, True, 4), (7, False, 7), (1, True, 1), (64, True, 32)]
)
def test_learning_cap_is_half_the_budget_for_searchers_that_learn(
    budget: int, learns: bool, cap: int
) -> None:
    assert learning_cap(budget, learns) == cap


def test_limit_for_learning_says_why_it_capped() -> None:
    kw: dict[str, Any] = {"budget": 7, "searcher": "the tpe searcher", "unit": "trials"}
    assert limit_for_learning(4, "fits", learns=True, **kw) == (4, "fits")
    assert limit_for_learning(64, "fits", learns=False, **kw) == (7, "fits")  # the budget
    size, reason = limit_for_learning(64, "fits", learns=True, **kw)
    assert size == 4
    assert reason == (
        "fits; at most half the 7 trials (4) so that the tpe searcher draws the later trials "
        "knowing the first results"
    )
