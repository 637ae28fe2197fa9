"""SearchSpace.sample draws configs through a real Optuna study: in bounds, on steps, on log
scales, with conditional params present exactly when their condition holds."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import optuna
import pytest
from _space_checks import check_config, should_be_drawn
from hfsweep.search_spaces import SearchSpace
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

optuna.logging.set_verbosity(optuna.logging.WARNING)

SPEC: dict[str, Any] = {
    "lr": {"type": "float", "low": 1.0e-4, "high": 1.0, "log": True},
    "momentum": {"type": "float", "low": 0.0, "high": 0.99, "step": 0.01},
    "hidden": {"type": "int", "low": 32, "high": 256, "log": True},
    "depth": {"type": "int", "low": 1, "high": 7, "step": 2},
    "optimizer": {"type": "categorical", "choices": ["sgd", "adamw"]},
    "batch_size": 64,
    "epochs": {"type": "fixed", "value": 10},
    "beta1": {"type": "float", "low": 0.8, "high": 0.99, "when": {"optimizer": "adamw"}},
    "nesterov_like": {"type": "categorical", "choices": [0.0, 0.5], "when": {"optimizer": ["sgd"]}},
    "width2": {"type": "int", "low": 8, "high": 64, "when": {"depth": [3, 5, 7]}},
    "dropout": {"type": "float", "low": 0.0, "high": 0.5, "when": {"batch_size": 64}},
}

# a chain: c needs b == 1, b needs a == "x"; d needs a in [x, y] and b == 2 (so a == "x" too)
CHAIN: dict[str, Any] = {
    "d": {"type": "fixed", "value": "deep", "when": {"a": ["x", "y"], "b": 2}},
    "c": {"type": "float", "low": 0.0, "high": 1.0, "when": {"b": 1}},
    "b": {"type": "categorical", "choices": [1, 2], "when": {"a": "x"}},
    "a": {"type": "categorical", "choices": ["x", "y", "z"]},
}


def _sample(spec: dict[str, Any], n: int, seed: int = 0) -> list[dict[str, Any]]:
    space = SearchSpace.from_dict(spec)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed))
    configs = []
    for _ in range(n):
        trial = study.ask()
        config = space.sample(trial)
        study.tell(trial, 0.0)
        configs.append(config)
    return configs


def test_random_sampling_respects_the_space() -> None:
    configs = _sample(SPEC, 400)
    for config in configs:
        check_config(SPEC, config)
        assert config["batch_size"] == 64 and config["epochs"] == 10
        assert ("beta1" in config) == (config["optimizer"] == "adamw")
        assert ("nesterov_like" in config) == (config["optimizer"] == "sgd")
        assert ("width2" in config) == (config["depth"] > 1)
        assert "dropout" in config  # its condition is on a fixed value that always holds
    # every branch and every value of the discrete params shows up
    assert {c["optimizer"] for c in configs} == {"sgd", "adamw"}
    assert {c["depth"] for c in configs} == {1, 3, 5, 7}
    assert {c["nesterov_like"] for c in configs if "nesterov_like" in c} == {0.0, 0.5}
    # log scales: about half of log-uniform draws in [1e-4, 1] fall below 1e-2 (uniform: 1%)
    below = sum(c["lr"] < 1e-2 for c in configs) / len(configs)
    assert 0.35 < below < 0.65
    small = sum(c["hidden"] < 90 for c in configs) / len(configs)  # log2(90/32)/log2(8) ~ 0.5
    assert 0.35 < small < 0.65
    # momentum stays on its 0.01 grid and spreads over it
    assert len({round(c["momentum"], 6) for c in configs}) > 60


def test_sampled_order_and_keys_follow_names() -> None:
    space = SearchSpace.from_dict(SPEC)
    for config in _sample(SPEC, 20):
        assert list(config) == [n for n in space.names if n in config]


def test_chained_conditions() -> None:
    configs = _sample(CHAIN, 300)
    seen = set()
    for config in configs:
        check_config(CHAIN, config)
        assert ("b" in config) == (config["a"] == "x")
        assert ("c" in config) == (config.get("b") == 1)
        assert ("d" in config) == (config["a"] == "x" and config.get("b") == 2)
        seen.add(tuple(sorted(config)))
    assert seen == {("a",), ("a", "b", "c"), ("a", "b", "d")}


def test_tpe_with_conditional_params() -> None:
    """Define-by-run conditional spaces work with TPE (the embedded default), whose independent
    sampling meets each conditional param only in some trials."""
    space = SearchSpace.from_dict(CHAIN | SPEC)
    study = optuna.create_study(
        sampler=optuna.samplers.TPESampler(seed=0, n_startup_trials=5), direction="minimize"
    )

    def objective(trial: optuna.Trial) -> float:
        config = space.sample(trial)
        check_config(CHAIN | SPEC, config)
        return float(config["lr"] + config.get("c", 0.5))

    study.optimize(objective, n_trials=25)
    assert len(study.trials) == 25
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials)


def test_fixed_values_are_not_suggested() -> None:
    space = SearchSpace.from_dict(SPEC)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    trial = study.ask()
    config = space.sample(trial)
    assert set(trial.params) == set(config) - {"batch_size", "epochs"}
    assert all(trial.params[k] == config[k] for k in trial.params)


def test_fixed_trial_replays_a_config() -> None:
    space = SearchSpace.from_dict(SPEC)
    params = {
        "lr": 0.01,
        "momentum": 0.9,
        "hidden": 64,
        "depth": 1,
        "optimizer": "adamw",
        "beta1": 0.9,
        "dropout": 0.25,
    }
    config = space.sample(optuna.trial.FixedTrial(params))
    assert config == params | {"batch_size": 64, "epochs": 10}


class _Recorder:
    """A stand-in trial that records the suggest calls and returns each range's low end."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def suggest_float(self, name: str, low: float, high: float, *, step: Any, log: bool) -> float:
        self.calls.append(("float", name, low, high, step, log))
        return low

    def suggest_int(self, name: str, low: int, high: int, *, step: int, log: bool) -> int:
        self.calls.append(("int", name, low, high, step, log))
        return low

    def suggest_categorical(self, name: str, choices: Any) -> Any:
        self.calls.append(("categorical", name, tuple(choices)))
        return choices[0]


def test_suggest_calls_have_optunas_arguments() -> None:
    trial = _Recorder()
    config = SearchSpace.from_dict(SPEC).sample(trial)  # type: ignore[arg-type,unused-ignore]
    assert trial.calls == [
        ("float", "lr", 1e-4, 1.0, None, True),
        ("float", "momentum", 0.0, 0.99, 0.01, False),
        ("int", "hidden", 32, 256, 1, True),
        ("int", "depth", 1, 7, 2, False),
        ("categorical", "optimizer", ("sgd", "adamw")),
        ("categorical", "nesterov_like", (0.0, 0.5)),
        ("float", "dropout", 0.0, 0.5, None, False),
    ]
    assert config["optimizer"] == "sgd" and "beta1" not in config and "width2" not in config


def test_fixed_values_are_copies() -> None:
    space = SearchSpace.from_dict({"sizes": {"type": "fixed", "value": [64, 64]}})
    first = space.sample(optuna.trial.FixedTrial({}))
    first["sizes"].append(1)
    assert space.sample(optuna.trial.FixedTrial({}))["sizes"] == [64, 64]
    assert space.fixed == {"sizes": [64, 64]}


# ---------------------------------------------------------------------------- property test
_POOL = ["a", "b", "c", 2, 3.5, None, True, -1]
_STEPS = ["0.01", "0.1", "0.25", "0.5", "1", "2"]


@st.composite
def spaces(draw: st.DrawFn) -> dict[str, Any]:
    """Random valid specs: every kind, steps, log scales, and conditions on earlier discrete
    params (each param names at most one, so conditions chain but never contradict)."""
    spec: dict[str, Any] = {}
    discrete: dict[str, list[Any]] = {}  # name -> the values a condition may test
    for i in range(draw(st.integers(1, 6))):
        name = f"p{i}"
        kind = draw(
            st.sampled_from(["float", "float_step", "float_log", "int", "int_log", "cat", "fixed"])
        )
        if kind == "float":
            low = draw(st.floats(-1e3, 1e3))
            param = {"type": "float", "low": low, "high": low + draw(st.floats(1e-3, 1e3))}
        elif kind == "float_step":
            unit = Decimal(draw(st.sampled_from(_STEPS)))
            a, n = draw(st.integers(-50, 50)), draw(st.integers(1, 40))
            param = {"type": "float", "low": float(a * unit), "high": float((a + n) * unit)}
            param["step"] = float(unit)
        elif kind == "float_log":
            low = draw(st.sampled_from([1e-6, 1e-3, 0.1, 1.0, 3.0]))
            param = {
                "type": "float",
                "low": low,
                "high": low * draw(st.floats(1.5, 1e4)),
                "log": True,
            }
        elif kind == "int":
            low, n, step = (
                draw(st.integers(-20, 20)),
                draw(st.integers(1, 10)),
                draw(st.integers(1, 4)),
            )
            param = {"type": "int", "low": low, "high": low + n * step, "step": step}
            discrete[name] = list(range(low, low + n * step + 1, step))
        elif kind == "int_log":
            low = draw(st.integers(1, 50))
            param = {
                "type": "int",
                "low": low,
                "high": low + draw(st.integers(1, 500)),
                "log": True,
            }
        elif kind == "cat":
            choices = draw(st.lists(st.sampled_from(_POOL), min_size=1, max_size=5, unique=True))
            param = {"type": "categorical", "choices": choices}
            discrete[name] = choices
        else:
            value = draw(st.sampled_from(_POOL))
            param = {"type": "fixed", "value": value}
            discrete[name] = [value]
        earlier = [k for k in discrete if k != name]
        if draw(st.booleans()) and earlier:
            key = draw(st.sampled_from(earlier))
            values = draw(
                st.lists(st.sampled_from(discrete[key]), min_size=1, max_size=3, unique=True)
            )
            param["when"] = {key: values if len(values) > 1 else values[0]}
        spec[name] = param
    # the declaration order is shuffled; the space must still order conditions first
    return dict(draw(st.permutations(list(spec.items()))))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=spaces(), seed=st.integers(0, 2**16))
def test_sampled_configs_always_satisfy_the_space(spec: dict[str, Any], seed: int) -> None:
    space = SearchSpace.from_dict(spec)
    assert SearchSpace.from_dict(space.to_dict()) == space
    names = space.names
    assert sorted(names) == sorted(spec)
    for name in names:  # conditions come first
        for key in spec[name].get("when", {}):
            assert names.index(key) < names.index(name)
    for config in _sample(spec, 8, seed=seed):
        check_config(spec, config)
        for name in spec:
            assert (name in config) == should_be_drawn(spec, config, name)


@pytest.mark.parametrize("seed", [0, 1])
def test_sampling_is_reproducible(seed: int) -> None:
    a = _sample(CHAIN | SPEC, 10, seed=seed)
    b = _sample(CHAIN | SPEC, 10, seed=seed)
    assert a == b
