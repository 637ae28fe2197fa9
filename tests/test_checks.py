"""One answer to "is this a number?" everywhere: ``hfsweep._checks`` and the callers that read
numbers users give (search spaces, scheduler options, member indices; sweep files in
tests/sweep/test_config_numbers.py)."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from hfsweep.schedulers import make_scheduler
from hfsweep.search_spaces import SearchSpace, SpaceError

import hfsweep as hs
from hfsweep._checks import in_range, is_finite, is_int, is_number


@pytest.mark.parametrize(
    ("value", "integer", "number", "finite"),
    [
        (3, True, True, True),
        (np.int64(3), True, True, True),
        (2.5, False, True, True),
        (np.float32(2.5), False, True, True),
        (Fraction(1, 2), False, True, True),
        (math.inf, False, True, False),
        (math.nan, False, True, False),
        (True, False, False, False),
        (np.bool_(True), False, False, False),
        ("3", False, False, False),
        (None, False, False, False),
    ],
)
def test_kinds(value: object, integer: bool, number: bool, finite: bool) -> None:
    assert (is_int(value), is_number(value), is_finite(value)) == (integer, number, finite)


def test_in_range_ends() -> None:
    assert in_range(0.0, 0.0, 1.0) and in_range(1.0, 0.0, 1.0)
    assert not in_range(0.0, 0.0, 1.0, low_open=True)
    assert not in_range(1.0, 0.0, 1.0, high_open=True)
    assert in_range(5.0) and in_range(-math.inf)
    assert not in_range(math.nan) and not in_range(math.nan, 0.0)


def test_search_space_and_scheduler_refuse_bools() -> None:
    with pytest.raises(SpaceError, match="is not a number"):
        SearchSpace.from_dict({"lr": {"type": "float", "low": True, "high": 1.0}})
    with pytest.raises(TypeError, match="grace_period must be a number"):
        make_scheduler("asha", mode="max", max_resource=10, grace_period=True)


def _linear_array(size: int) -> hs.FusedArray:
    torch.manual_seed(0)
    return hs.fuse([torch.nn.Linear(2, 2) for _ in range(size)])


def test_member_index_takes_numpy_integers_and_refuses_bools() -> None:
    array = _linear_array(3)
    opt = hs.optim.SGD(array, lr=0.1)
    assert torch.equal(array.member(np.int64(2)).weight, array.member(2).weight)
    assert opt._index(np.int64(-1)) == 2
    with pytest.raises(IndexError, match="out of range"):
        array.member(True)
    with pytest.raises(IndexError, match="out of range"):
        opt._index(True)


def test_an_optimizer_refuses_a_bool_hyperparameter() -> None:
    with pytest.raises(ValueError, match="must be a number or one number per member"):
        hs.optim.SGD(_linear_array(2), lr=True)


def test_tensor_batches_refuse_a_bool_batch_size() -> None:
    from hfsweep.tasks import TensorBatches

    x, y = torch.zeros(5, 2), torch.zeros(5)
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
        TensorBatches(x, y, True, shuffle=False)
    assert len(TensorBatches(x, y, np.int64(2), shuffle=False)) == 3
