"""Numbers in a sweep mapping are checked by hfsweep._checks, as everywhere: numpy's integers are
the ints they are, bools and nan are not numbers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hfsweep.config import ConfigError, parse_sweep

from .test_config import BASE


def test_a_sweep_mapping_takes_numpy_integers_as_ints() -> None:
    """parse_sweep (the Python API's route) reads numpy integers as the ints they are; its
    result stays JSON-safe."""
    mapping = {
        **BASE,
        "budget": {"trials": np.int64(8), "epochs": np.int32(3)},
        "fusion": {"size": np.int64(4)},
    }
    sc = parse_sweep(mapping)
    assert (sc.budget.trials, sc.budget.epochs, sc.fusion.size) == (8, 3, 4)
    assert all(type(v) is int for v in (sc.budget.trials, sc.budget.epochs, sc.fusion.size))


@pytest.mark.parametrize("bad", [math.nan, True, "1"])
def test_ray_gpus_per_array_must_be_a_number_at_least_zero(bad: object) -> None:
    pytest.importorskip("ray")
    mapping = {**BASE, "backend": "ray", "ray": {"gpus_per_array": bad}}
    with pytest.raises(ConfigError) as info:
        parse_sweep(mapping)
    assert info.value.path == "ray.gpus_per_array"
    assert "is not 'auto' or a number >= 0" in info.value.problem


def test_ray_cpus_per_array_takes_numpy_numbers() -> None:
    pytest.importorskip("ray")
    mapping = {**BASE, "backend": "ray", "ray": {"cpus_per_array": np.int64(2)}}
    ray = parse_sweep(mapping).ray
    assert ray.cpus_per_array == 2.0 and type(ray.cpus_per_array) is float
