"""distributions() for samplers with a static space, grid()/grid_size() for GridSampler."""

from __future__ import annotations

import itertools
import warnings
from typing import Any

import optuna
import pytest
from _space_checks import check_config
from hfsweep.search_spaces import SearchSpace, SpaceError
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

optuna.logging.set_verbosity(optuna.logging.WARNING)

GRID_SPEC: dict[str, Any] = {
    "momentum": {"type": "float", "low": 0.0, "high": 0.2, "step": 0.1},
    "depth": {"type": "int", "low": 1, "high": 5, "step": 2},
    "hidden": {"type": "int", "low": 31, "high": 32, "log": True},
    "optimizer": {"type": "categorical", "choices": ["sgd", "adamw", None, True]},
    "batch_size": 64,
    "label": {"type": "fixed", "value": "x", "when": {"optimizer": "sgd"}},
}


def test_distributions_are_the_unconditional_sampled_params() -> None:
    space = SearchSpace.from_dict(
        {
            "lr": {"type": "float", "low": 1e-4, "high": 1.0, "log": True},
            "momentum": {"type": "float", "low": 0.0, "high": 0.99, "step": 0.01},
            "hidden": {"type": "int", "low": 32, "high": 256, "log": True},
            "depth": {"type": "int", "low": 1, "high": 4},
            "optimizer": {"type": "categorical", "choices": ["sgd", "adamw"]},
            "batch_size": 64,
            "beta1": {"type": "float", "low": 0.8, "high": 0.99, "when": {"optimizer": "adamw"}},
        }
    )
    assert space.distributions() == {
        "lr": FloatDistribution(1e-4, 1.0, log=True),
        "momentum": FloatDistribution(0.0, 0.99, step=0.01),
        "hidden": IntDistribution(32, 256, log=True),
        "depth": IntDistribution(1, 4),
        "optimizer": CategoricalDistribution(["sgd", "adamw"]),
    }


def test_distributions_match_what_sample_suggests() -> None:
    """The static distributions are those Optuna records for the sampled params, so a config
    can be added to a study as a finished trial (e.g. a baseline) and replayed."""
    spec = {k: v for k, v in GRID_SPEC.items() if k != "label"}
    space = SearchSpace.from_dict(spec)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    trial = study.ask()
    config = space.sample(trial)
    study.tell(trial, 1.0)
    assert study.trials[0].distributions == space.distributions()
    params = {k: v for k, v in config.items() if k in space.distributions()}
    study.add_trial(
        optuna.trial.create_trial(params=params, distributions=space.distributions(), value=0.5)
    )
    assert study.best_trial.params == params
    study.enqueue_trial({"momentum": 0.2, "depth": 3, "hidden": 31, "optimizer": None})
    replay = space.sample(study.ask())
    assert replay == {
        "momentum": 0.2,
        "depth": 3,
        "hidden": 31,
        "optimizer": None,
        "batch_size": 64,
    }


def test_grid_values_and_size() -> None:
    space = SearchSpace.from_dict({k: v for k, v in GRID_SPEC.items() if k != "label"})
    assert space.grid() == {
        "momentum": [0.0, 0.1, 0.2],
        "depth": [1, 3, 5],
        "hidden": [31, 32],
        "optimizer": ["sgd", "adamw", None, True],
    }
    assert space.grid_size() == 3 * 3 * 2 * 4
    assert space.grid(max_points=72) == space.grid()


def test_float_grid_is_exact_decimal_steps() -> None:
    space = SearchSpace.from_dict({"m": {"type": "float", "low": 0.0, "high": 0.99, "step": 0.01}})
    values = space.grid()["m"]
    assert len(values) == 100 == space.grid_size()
    assert values[7] == 0.07 and values[29] == 0.29 and values[-1] == 0.99  # no 0.07000000000000001


def test_grid_sampler_runs_the_whole_grid() -> None:
    spec = {k: v for k, v in GRID_SPEC.items() if k != "label"}
    space = SearchSpace.from_dict(spec)
    study = optuna.create_study(sampler=optuna.samplers.GridSampler(space.grid(), seed=0))
    configs: list[dict[str, Any]] = []

    def objective(trial: optuna.Trial) -> float:
        config = space.sample(trial)
        check_config(spec, config)
        configs.append(config)
        return float(config["depth"])

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Optuna warns if a grid value is off its distribution
        study.optimize(objective, n_trials=10 * space.grid_size())  # stops when exhausted
    assert len(study.trials) == space.grid_size() == len(configs)
    grid = space.grid()
    expected = set(itertools.product(*grid.values()))
    assert {tuple(c[n] for n in grid) for c in configs} == expected
    assert all(c["batch_size"] == 64 for c in configs)


def test_fixed_only_space_has_one_grid_point() -> None:
    space = SearchSpace.from_dict({"batch_size": 64, "epochs": {"type": "fixed", "value": 3}})
    assert space.grid() == {} and space.grid_size() == 1
    assert space.distributions() == {}
    study = optuna.create_study(sampler=optuna.samplers.GridSampler(space.grid()))
    study.optimize(lambda t: float(len(space.sample(t))), n_trials=5)
    assert len(study.trials) == 1


def test_conditional_fixed_values_do_not_block_a_grid() -> None:
    space = SearchSpace.from_dict({k: GRID_SPEC[k] for k in ("depth", "optimizer", "label")})
    assert "label" not in space.grid()
    configs: list[dict[str, Any]] = []

    def objective(trial: optuna.Trial) -> float:
        configs.append(space.sample(trial))
        return 0.0

    study = optuna.create_study(sampler=optuna.samplers.GridSampler(space.grid(), seed=0))
    study.optimize(objective, n_trials=1000)
    assert len(configs) == space.grid_size()
    assert all(("label" in c) == (c["optimizer"] == "sgd") for c in configs)


@pytest.mark.parametrize(
    ("spec", "path", "fragments"),
    [
        (
            {"lr": {"type": "float", "low": 0.1, "high": 1.0}},
            "search_space.lr",
            ["'lr' has no step", "no finite grid", "add step (e.g. step: 0.09)", "another sampler"],
        ),
        (
            {"lr": {"type": "float", "low": 1e-4, "high": 1.0, "log": True}},
            "search_space.lr",
            ["has no step", "drop log and add step"],
        ),
        (
            {
                "optimizer": {"type": "categorical", "choices": ["sgd", "adamw"]},
                "beta2": {
                    "type": "categorical",
                    "choices": [0.99, 0.999],
                    "when": {"optimizer": "adamw"},
                },
            },
            "search_space.beta2.when",
            [
                "'beta2' is conditional",
                "GridSampler needs every param in every trial",
                "remove when",
            ],
        ),
    ],
    ids=["float without step", "float on a log scale", "conditional param"],
)
def test_spaces_without_a_grid(spec: dict[str, Any], path: str, fragments: list[str]) -> None:
    space = SearchSpace.from_dict(spec)
    for call in (space.grid, space.grid_size):
        with pytest.raises(SpaceError) as info:
            call()
        assert info.value.path == path
        for fragment in fragments:
            assert fragment in str(info.value), (fragment, str(info.value))


def test_grid_max_points() -> None:
    space = SearchSpace.from_dict({k: v for k, v in GRID_SPEC.items() if k != "label"})
    with pytest.raises(SpaceError) as info:
        space.grid(max_points=71)
    assert info.value.path == "search_space"
    assert "72 points (momentum: 3 x depth: 3 x hidden: 2 x optimizer: 4)" in str(info.value)
    assert "more than max_points=71" in str(info.value)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="max_points must be a positive int"):
            space.grid(max_points=bad)  # type: ignore[arg-type,unused-ignore]


def test_huge_grid_is_refused_before_it_is_built() -> None:
    space = SearchSpace.from_dict({"n": {"type": "int", "low": 0, "high": 10**12}})
    assert space.grid_size() == 10**12 + 1
    with pytest.raises(SpaceError, match="1000000000001 points"):
        space.grid(max_points=10**6)


def test_grid_errors_from_a_file_name_it(tmp_path: Any) -> None:
    file = tmp_path / "s.yaml"
    file.write_text("lr: {type: float, low: 0.1, high: 1.0}\n")
    with pytest.raises(SpaceError) as info:
        SearchSpace.from_yaml(file).grid()
    assert info.value.file == str(file) and info.value.path == "lr"
