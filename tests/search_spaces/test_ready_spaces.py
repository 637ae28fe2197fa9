"""The shipped YAML spaces, load_space, round trips, ordering, and a light import."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import hfsweep.search_spaces as ss
import optuna
import pytest
import yaml
from hfsweep.search_spaces import (
    CategoricalParam,
    FixedParam,
    FloatParam,
    IntParam,
    SearchSpace,
    load_space,
    ready_spaces,
)

from hfsweep import tasks

optuna.logging.set_verbosity(optuna.logging.WARNING)

PACKAGE_DIR = Path(ss.__file__).parent

EXPECTED = {
    "sgd_momentum": {
        "optimizer": "sgd",
        "lr": {"type": "float", "low": 1e-3, "high": 1.0, "log": True},
        "momentum": {"type": "float", "low": 0.0, "high": 0.99},
        "weight_decay": {"type": "float", "low": 1e-6, "high": 1e-2, "log": True},
    },
    "adamw": {
        "optimizer": "adamw",
        "lr": {"type": "float", "low": 1e-4, "high": 1e-1, "log": True},
        "weight_decay": {"type": "float", "low": 1e-5, "high": 1e-1, "log": True},
        "beta1": {"type": "float", "low": 0.8, "high": 0.99},
        "beta2": {"type": "categorical", "choices": [0.99, 0.999]},
    },
    "sgd_or_adamw": {
        "optimizer": {"type": "categorical", "choices": ["sgd", "adamw"]},
        "lr": {"type": "float", "low": 1e-4, "high": 1.0, "log": True},
        "momentum": {"type": "float", "low": 0.0, "high": 0.99, "when": {"optimizer": "sgd"}},
        "beta1": {"type": "float", "low": 0.8, "high": 0.99, "when": {"optimizer": "adamw"}},
        "dropout": {"type": "float", "low": 0.0, "high": 0.5},
    },
}


def test_ready_space_names() -> None:
    assert ready_spaces() == sorted(EXPECTED)
    assert sorted(p.stem for p in PACKAGE_DIR.glob("*.yaml")) == ready_spaces()


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_ready_space_files(name: str) -> None:
    file = PACKAGE_DIR / f"{name}.yaml"
    assert file.read_text().startswith("# "), "each ready space starts with a comment"
    space = SearchSpace.from_yaml(file)
    assert space.to_dict() == EXPECTED[name]
    assert load_space(name) == space == load_space(str(file)) == load_space(file)


@pytest.mark.parametrize("name", sorted(EXPECTED))
@pytest.mark.parametrize("task_name", sorted(tasks.TASKS))
def test_ready_space_configs_are_valid_task_configs(name: str, task_name: str) -> None:
    """Keys are hfsweep's config keys and the ranges pass the task's own range checks."""
    task = tasks.get(task_name)
    space = load_space(name)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(20):
        trial = study.ask()
        config = space.sample(trial)
        resolved = task.resolve(config)
        assert all(resolved[k] == v for k, v in config.items())
        study.tell(trial, 0.0)


def test_load_space_forms(tmp_path: Path) -> None:
    spec = {"lr": {"type": "float", "low": 0.1, "high": 1.0}, "optimizer": "sgd"}
    space = load_space(spec)
    assert load_space(space) is space
    for suffix in (".yaml", ".yml", ".YAML"):
        file = tmp_path / f"space{suffix}"
        file.write_text(yaml.safe_dump(spec))
        assert load_space(str(file)) == space == load_space(file)
    (tmp_path / "noext").write_text(yaml.safe_dump(spec))
    assert load_space(str(tmp_path / "noext")) == space  # has a path separator: a file


def test_to_dict_round_trips_through_yaml(tmp_path: Path) -> None:
    spec: dict[str, Any] = {
        "optimizer": {"type": "categorical", "choices": ["sgd", "adamw", None, True, 2, 0.5]},
        "lr": {"type": "float", "low": 1e-4, "high": 1.0, "log": True},
        "momentum": {"type": "float", "low": 0.0, "high": 0.99, "step": 0.01},
        "hidden": {"type": "int", "low": 32, "high": 256, "log": True},
        "depth": {"type": "int", "low": 1, "high": 4, "step": 1},
        "width": {"type": "int", "low": 8, "high": 64, "step": 8, "when": {"depth": [2, 3]}},
        "batch_size": 64,
        "sizes": {"type": "fixed", "value": [64, 32]},
        "epochs": {"type": "fixed", "value": 10, "when": {"optimizer": ["sgd", None]}},
        "beta1": {"type": "float", "low": 0.8, "high": 0.99, "when": {"optimizer": "adamw"}},
    }
    space = SearchSpace.from_dict(spec)
    out = space.to_dict()
    assert list(out) == list(spec)
    assert out["depth"] == {"type": "int", "low": 1, "high": 4}  # default step left out
    assert out["epochs"] == {"type": "fixed", "value": 10, "when": {"optimizer": ["sgd", None]}}
    assert out["beta1"]["when"] == {"optimizer": "adamw"}
    assert SearchSpace.from_dict(out) == space
    file = tmp_path / "space.yaml"
    file.write_text(yaml.safe_dump(out, sort_keys=False))
    again = SearchSpace.from_yaml(file)
    assert again == space and again.names == space.names


def test_parsed_params() -> None:
    space = load_space("sgd_or_adamw")
    assert len(space) == 5 and "lr" in space and "beta2" not in space
    assert list(space) == space.names
    assert space["lr"] == FloatParam("lr", low=1e-4, high=1.0, log=True)
    assert space["momentum"].when == {"optimizer": ("sgd",)}
    assert isinstance(space["optimizer"], CategoricalParam)
    assert space["optimizer"].choices == ("sgd", "adamw")
    assert isinstance(load_space("adamw")["optimizer"], FixedParam)
    assert isinstance(
        SearchSpace.from_dict({"d": {"type": "int", "low": 1, "high": 3}})["d"], IntParam
    )
    with pytest.raises(KeyError, match="'beta2' is not a param of the space"):
        space["beta2"]
    assert "momentum=float[0.0, 0.99] when optimizer in ['sgd']" in repr(space)
    assert space != load_space("adamw") and space.__eq__(1) is NotImplemented


def test_spaces_pickle() -> None:
    """Spaces travel to other processes (Ray workers, multiprocessing) intact."""
    space = load_space("sgd_or_adamw")
    again = pickle.loads(pickle.dumps(space))
    assert again == space and again.names == space.names and again.fixed == space.fixed


def test_names_put_conditions_first_deterministically() -> None:
    spec = {
        "c": {"type": "fixed", "value": 1, "when": {"b": 1}},
        "lr": {"type": "float", "low": 0.1, "high": 1.0},
        "b": {"type": "categorical", "choices": [1, 2], "when": {"a": "x"}},
        "z": {"type": "fixed", "value": 0, "when": {"a": "x", "b": 2}},
        "a": {"type": "categorical", "choices": ["x", "y"]},
        "dropout": 0.1,
    }
    expected = ["lr", "a", "b", "c", "z", "dropout"]
    for _ in range(3):
        assert SearchSpace.from_dict(spec).names == expected
    assert SearchSpace.from_dict(SearchSpace.from_dict(spec).to_dict()).names == expected
    # without conditions, the order given
    plain = {k: 0 for k in ("wd", "lr", "b")}
    assert SearchSpace.from_dict(plain).names == ["wd", "lr", "b"]


def test_import_does_not_pull_in_optuna() -> None:
    code = (
        "import sys, hfsweep.search_spaces as s\n"
        "assert 'optuna' not in sys.modules, 'import'\n"
        "space = s.load_space('sgd_or_adamw')\n"
        "space.to_dict(); s.SearchSpace.from_dict({'m': {'type': 'float', 'low': 0, 'high': 1,"
        " 'step': 0.5}}).grid(); s.ready_spaces()\n"
        "assert 'optuna' not in sys.modules, 'use'\n"
        "space.distributions()\n"
        "assert 'optuna' in sys.modules\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_public_names() -> None:
    for name in ss.__all__:
        assert hasattr(ss, name)
    assert {"SearchSpace", "SpaceError", "load_space", "ready_spaces"} <= set(ss.__all__)
