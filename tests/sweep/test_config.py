"""sweep.yaml: the schema, its validation errors, and ``hfsweep validate``."""

from __future__ import annotations

import copy
import json
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from hfsweep import tasks
from hfsweep.cli import main
from hfsweep.config import (
    Budget,
    ConfigError,
    FusionConfig,
    SchedulerConfig,
    SearcherConfig,
    SweepConfig,
    load_sweep,
    make_sampler,
    parse_sweep,
)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

BASE: dict[str, Any] = {
    "task": "digits_mlp",
    "search_space": "sgd_momentum",
    "budget": {"trials": 8, "epochs": 3},
    "metric": "val_accuracy",
    "mode": "max",
}

TASK_FILE = """
import hfsweep as hs
from hfsweep.tasks import digits_mlp

task = hs.Task(model=digits_mlp.model, data=digits_mlp.data, defaults=dict(digits_mlp.defaults),
               name="my_task")
"""


def with_(**changes: Any) -> dict[str, Any]:
    """BASE with top-level keys replaced (None removes the key)."""
    out = copy.deepcopy(BASE)
    for key, value in changes.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = value
    return out


def write(folder: Path, data: Any, name: str = "sweep.yaml") -> Path:
    path = folder / name
    path.write_text(
        data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False), encoding="utf-8"
    )
    return path


# ---------------------------------------------------------------------------- valid sweeps
def test_minimal_sweep_gets_the_documented_defaults(tmp_path: Path) -> None:
    sweep = load_sweep(write(tmp_path, BASE, "my_sweep.yaml"))
    assert sweep.task is tasks.digits_mlp and sweep.task_ref == "digits_mlp"
    assert sweep.config == {}
    assert sweep.space.names == ["optimizer", "lr", "momentum", "weight_decay"]
    assert sweep.searcher == SearcherConfig("tpe", 0, {}, None)
    assert sweep.scheduler == SchedulerConfig("fifo", {})
    assert sweep.budget == Budget(trials=8, epochs=3)
    assert sweep.budget.resource == "epochs" and sweep.budget.max_resource == 3
    assert sweep.fusion == FusionConfig("auto", "auto", "float32", None)
    assert (sweep.backend, sweep.storage, sweep.seed) == ("local", None, 0)
    assert sweep.output == tmp_path / "runs" / "my_sweep"
    assert sweep.study_name == "my_sweep"
    assert sweep.source == tmp_path / "my_sweep.yaml"
    assert sweep.trial_config({"lr": 0.1}) == {"lr": 0.1, "epochs": 3}


def test_every_key_given(tmp_path: Path) -> None:
    (tmp_path / "spaces").mkdir()
    write(tmp_path / "spaces", {"lr": {"type": "float", "low": 0.01, "high": 0.1}}, "s.yaml")
    (tmp_path / "my_task.py").write_text(TASK_FILE)
    sweep = load_sweep(
        write(
            tmp_path,
            {
                "task": "my_task.py:task",
                "config": {"hidden": 32, "momentum": 0.9},
                "search_space": "spaces/s.yaml",
                "searcher": {"name": "random", "seed": 3, "options": {}},
                "scheduler": {"name": "optuna:median", "options": {"n_startup_trials": 2}},
                "budget": {"trials": 4, "steps": 100, "time_limit": "1h30m"},
                "metric": "val_loss",
                "mode": "min",
                "fusion": {"size": 4, "device": "cuda:1", "dtype": "float64", "eval_every": 10},
                "backend": "local",
                "storage": "sqlite:///study.db",
                "output": "out/here",
                "study_name": "named",
                "seed": 7,
            },
        )
    )
    assert sweep.task.name == "my_task"
    assert sweep.task_ref == f"{tmp_path / 'my_task.py'}:task"
    assert sweep.config == {"hidden": 32, "momentum": 0.9}
    assert sweep.space.names == ["lr"]
    assert sweep.searcher == SearcherConfig("random", 3, {})
    assert sweep.scheduler == SchedulerConfig("optuna:median", {"n_startup_trials": 2})
    assert sweep.budget == Budget(trials=4, steps=100, time_limit_s=5400.0)
    assert sweep.budget.trial_config() == {"max_steps": 100}
    assert sweep.fusion == FusionConfig(4, "cuda:1", "float64", 10)
    assert (sweep.storage, sweep.study_name, sweep.seed) == ("sqlite:///study.db", "named", 7)
    assert sweep.output == tmp_path / "out" / "here"


@pytest.mark.parametrize("value", [True, False, "auto"])
def test_fusion_compile(value: Any) -> None:
    parsed = parse_sweep(with_(fusion={"compile": value})).fusion.compile
    assert parsed == value and type(parsed) is type(value)
    assert parse_sweep(with_()).fusion.compile is False


@pytest.mark.parametrize("elastic", [False, True])
@pytest.mark.parametrize("value", [True, False, "auto"])
def test_fusion_compile_on_the_ray_backend(value: Any, elastic: bool) -> None:
    """Each Ray worker's arrays compile as on the local backend, elastic (data-parallel)
    arrays' workers too (it was refused: they trained uncompiled)."""
    pytest.importorskip("ray")
    ray = {"elastic": {"enabled": elastic}}
    parsed = parse_sweep(with_(backend="ray", ray=ray, fusion={"compile": value}))
    assert parsed.backend == "ray" and parsed.fusion.compile == value
    assert parsed.ray.elastic.enabled is elastic


@pytest.mark.parametrize(
    ("limit", "seconds"), [(90, 90.0), (2.5, 2.5), ("90s", 90.0), ("30m", 1800.0), ("2h", 7200.0)]
)
def test_time_limits(limit: Any, seconds: float) -> None:
    budget = {"trials": 1, "epochs": 1, "time_limit": limit}
    assert parse_sweep(with_(budget=budget)).budget.time_limit_s == seconds


def test_searcher_seed_defaults_to_the_sweep_seed() -> None:
    assert parse_sweep(with_(seed=5)).searcher.seed == 5
    assert parse_sweep(with_(seed=5, searcher={"name": "qmc", "seed": 1})).searcher.seed == 1


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")
@pytest.mark.parametrize("name", ["tpe", "random", "cmaes", "qmc", "gp"])
def test_every_searcher_builds(name: str) -> None:
    import importlib.util

    if name == "cmaes" and importlib.util.find_spec("cmaes") is None:
        with pytest.raises(ConfigError, match="needs the cmaes package"):
            parse_sweep(with_(searcher=name))
        return
    sweep = parse_sweep(with_(searcher=name))
    assert type(make_sampler(sweep.searcher, sweep.space)).__name__.lower().startswith(name[:2])


def test_grid_records_its_size_and_allows_more_trials() -> None:
    space = {
        "lr": {"type": "float", "low": 0.01, "high": 0.05, "step": 0.01},
        "optimizer": {"type": "categorical", "choices": ["sgd", "adam"]},
    }
    sweep = parse_sweep(with_(search_space=space, searcher="grid"))
    assert sweep.searcher.grid_size == 10 and sweep.budget.trials == 8
    sweep = parse_sweep(
        with_(search_space=space, searcher="grid", budget={"trials": 99, "epochs": 1})
    )
    assert sweep.searcher.grid_size == 10
    assert "trials capped at 10" in sweep.summary()
    assert len(make_sampler(sweep.searcher, sweep.space)._all_grids) == 10  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", ["sgd_momentum", "adamw", "sgd_or_adamw"])
def test_ready_spaces_validate_with_every_ready_task(name: str) -> None:
    for task in tasks.TASKS:
        metric = tasks.TASKS[task].metric_names[-1]
        parse_sweep(with_(task=task, search_space=name, metric=metric))


@pytest.mark.parametrize("example", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_examples_validate(example: Path) -> None:
    sweep = load_sweep(example)
    assert sweep.source == example and sweep.mode == "max"


def test_the_digits_asha_example_is_the_one_the_issue_asks_for() -> None:
    sweep = load_sweep(EXAMPLES / "digits_asha.yaml")
    assert sweep.budget == Budget(trials=64, epochs=10)
    assert (sweep.searcher.name, sweep.scheduler.name) == ("tpe", "asha")
    assert sweep.searcher.options == {"constant_liar": True}
    assert sweep.metric == "val_accuracy" and sweep.fusion.size == "auto"
    assert {"dropout", "lr", "momentum", "weight_decay"} <= set(sweep.space.names)
    assert sweep.config == {"hidden": 64}  # one compatibility key: every trial can share an array


def test_to_dict_is_json_and_parses_back_to_an_equal_config(tmp_path: Path) -> None:
    for source in [EXAMPLES / "digits_asha.yaml", EXAMPLES / "digits_quick.yaml"]:
        sweep = load_sweep(source)
        data = json.loads(json.dumps(sweep.to_dict()))
        assert data == sweep.to_dict()
        assert parse_sweep(data, source=sweep.source) == sweep
        assert parse_sweep(data) == dataclass_replace_source(sweep, None)


def dataclass_replace_source(sweep: SweepConfig, source: Path | None) -> SweepConfig:
    import dataclasses

    return dataclasses.replace(sweep, source=source)


def test_python_objects_are_accepted_by_parse_sweep() -> None:
    from hfsweep.search_spaces import load_space

    space = load_space("adamw")
    sweep = parse_sweep(with_(task=tasks.digits_cnn, search_space=space))
    assert sweep.task is tasks.digits_cnn and sweep.task_ref == "digits_cnn"
    assert sweep.space is space
    assert sweep.output == Path.cwd() / "runs" / "sweep" and sweep.study_name == "sweep"


def test_config_error_keeps_its_parts_through_pickling() -> None:
    exc = ConfigError("bad", path="budget.trials", file="s.yaml")
    assert str(exc) == "s.yaml: budget.trials: bad"
    back = pickle.loads(pickle.dumps(exc))
    assert (back.problem, back.path, back.file) == ("bad", "budget.trials", "s.yaml")
    assert isinstance(exc, ValueError)


# ---------------------------------------------------------------------------- errors
ERRORS: list[tuple[str, dict[str, Any], str, str]] = [
    # id, sweep, path, message fragment
    ("not-a-mapping", [1, 2], "", "is not a mapping"),  # type: ignore[list-item]
    (
        "unknown-top",
        with_(serch_space="x"),
        "serch_space",
        "unknown key 'serch_space' (did you mean 'search_space'?)",
    ),
    ("missing-task", with_(task=None), "task", "missing required key 'task'"),
    ("missing-space", with_(search_space=None), "search_space", "missing required key"),
    ("missing-budget", with_(budget=None), "budget", "missing required key 'budget'"),
    ("missing-metric", with_(metric=None), "metric", "missing required key"),
    ("missing-mode", with_(mode=None), "mode", "missing required key"),
    ("task-type", with_(task=3), "task", "3 (int) is not a non-empty string"),
    ("task-unknown", with_(task="digits_mpl"), "task", "is not a ready task"),
    (
        "task-module",
        with_(task="no_such_module_xyz:task"),
        "task",
        "importing module 'no_such_module_xyz' failed",
    ),
    ("task-file", with_(task="nope.py:task"), "task", "does not exist"),
    ("task-attr", with_(task="hfsweep.tasks:nothing"), "task", "has no attribute 'nothing'"),
    ("task-not-task", with_(task="hfsweep.tasks:TASKS"), "task", "is a dict, not an hfsweep.Task"),
    ("budget-type", with_(budget=10), "budget", "10 (int) is not a mapping"),
    (
        "budget-key",
        with_(budget={"trials": 1, "epochs": 1, "epoch": 2}),
        "budget.epoch",
        "did you mean 'epochs'?",
    ),
    ("budget-no-trials", with_(budget={"epochs": 1}), "budget", "missing required key 'trials'"),
    (
        "trials-zero",
        with_(budget={"trials": 0, "epochs": 1}),
        "budget.trials",
        "0 (int) is not an integer from 1 to 1,000,000",
    ),
    (
        "trials-bool",
        with_(budget={"trials": True, "epochs": 1}),
        "budget.trials",
        "True (bool) is not an integer",
    ),
    ("trials-float", with_(budget={"trials": 2.5, "epochs": 1}), "budget.trials", "2.5 (float)"),
    (
        "both",
        with_(budget={"trials": 1, "epochs": 1, "steps": 5}),
        "budget",
        "both epochs and steps",
    ),
    ("neither", with_(budget={"trials": 1}), "budget", "neither epochs nor steps"),
    (
        "epochs-zero",
        with_(budget={"trials": 1, "epochs": 0}),
        "budget.epochs",
        "is not an integer from 1 to 100,000",
    ),
    ("steps-str", with_(budget={"trials": 1, "steps": "5"}), "budget.steps", "'5' (str)"),
    (
        "time-unit",
        with_(budget={"trials": 1, "epochs": 1, "time_limit": "30 minutes"}),
        "budget.time_limit",
        "'30 minutes' is not a duration",
    ),
    (
        "time-zero",
        with_(budget={"trials": 1, "epochs": 1, "time_limit": 0}),
        "budget.time_limit",
        "not a positive number",
    ),
    (
        "time-0s",
        with_(budget={"trials": 1, "epochs": 1, "time_limit": "0s"}),
        "budget.time_limit",
        "'90s', '30m', '2h'",
    ),
    ("config-type", with_(config=[1]), "config", "is not a mapping"),
    (
        "config-key",
        with_(config={"hiden": 3}),
        "config.hiden",
        "'hiden' is not a config key of task 'digits_mlp' (did you mean 'hidden'?)",
    ),
    (
        "config-known-keys",
        with_(config={"x": 1}),
        "config.x",
        "known keys: alpha, batch_size, beta1, beta2, dampening, data_seed, depth, dropout, eps,",
    ),
    ("config-epochs", with_(config={"epochs": 3}), "config.epochs", "use budget.epochs"),
    ("config-max-steps", with_(config={"max_steps": 3}), "config.max_steps", "use budget.steps"),
    (
        "config-value",
        # (a key of the space, such as lr, would be refused first as searched and fixed both)
        with_(config={"batch_size": 64, "label_smoothing": -1.0}),
        "config.label_smoothing",
        "label_smoothing=-1.0 must be a finite number >= 0",
    ),
    (
        "config-optimizer",
        with_(config={"optimizer": "sgdd"}, search_space={"lr": 0.1}),
        "config.optimizer",
        "is not one of",
    ),
    (
        "config-combo",
        with_(config={"momentum": 0.9, "optimizer": "adam"}, search_space={"lr": 0.1}),
        "config.momentum",
        "'momentum' is not a hyperparameter of optimizer 'adam'",
    ),
    ("space-type", with_(search_space=5), "search_space", "5 (int) is not a search space"),
    (
        "space-ready",
        with_(search_space="sgd_momentun"),
        "search_space",
        "is not a ready search space",
    ),
    (
        "space-low-high",
        with_(search_space={"lr": {"type": "float", "low": 1.0, "high": 0.1}}),
        "search_space.lr.high",
        "is not greater than low (1.0)",
    ),
    (
        "space-choices",
        with_(search_space={"optimizer": {"type": "categorical", "choices": []}}),
        "search_space.optimizer.choices",
        "empty",
    ),
    (
        "space-unknown-param",
        with_(search_space={"lr": 0.1, "widht": {"type": "int", "low": 1, "high": 3}}),
        "search_space.widht",
        "not a config key of task 'digits_mlp'",
    ),
    (
        "space-epochs",
        with_(search_space={"epochs": {"type": "int", "low": 1, "high": 3}}),
        "search_space.epochs",
        "use budget.epochs",
    ),
    (
        "space-and-config",
        with_(config={"lr": 0.1}),
        "search_space.lr",
        "both searched and fixed in config",
    ),
    (
        "space-sample",
        with_(
            search_space={"optimizer": "adam", "beta1": {"type": "float", "low": 0.5, "high": 1.0}}
        ),
        "search_space.beta1",
        "beta1=1.0 must be a finite number",
    ),
    (
        "space-sample-combo",
        with_(
            search_space={
                "optimizer": {"type": "categorical", "choices": ["sgd", "adam"]},
                "momentum": {"type": "float", "low": 0.0, "high": 0.9},
            }
        ),
        "search_space.momentum",
        "is not a hyperparameter of optimizer 'adam'",
    ),
    ("metric-unknown", with_(metric="accuracy"), "metric", "did you mean 'val_accuracy'?"),
    (
        "metric-list",
        with_(metric="val_f1"),
        "metric",
        "its metrics: train_loss, val_loss, val_accuracy",
    ),
    ("mode", with_(mode="maximize"), "mode", "give one of: max, min"),
    (
        "searcher-name",
        with_(searcher="tpee"),
        "searcher",
        "'tpee' is not valid (did you mean 'tpe'?)",
    ),
    (
        "searcher-name-map",
        with_(searcher={"name": "bayes"}),
        "searcher.name",
        "tpe, random, grid, cmaes, qmc, gp",
    ),
    ("searcher-no-name", with_(searcher={"seed": 1}), "searcher", "missing key 'name'"),
    (
        "searcher-key",
        with_(searcher={"name": "tpe", "option": {}}),
        "searcher.option",
        "did you mean 'options'?",
    ),
    (
        "searcher-seed",
        with_(searcher={"name": "tpe", "seed": -1}),
        "searcher.seed",
        "not an integer >= 0",
    ),
    (
        "searcher-option",
        with_(searcher={"name": "tpe", "options": {"constant_lair": True}}),
        "searcher.options.constant_lair",
        "did you mean 'constant_liar'?",
    ),
    (
        "searcher-option-seed",
        with_(searcher={"name": "tpe", "options": {"seed": 1}}),
        "searcher.options.seed",
        "set by hfsweep (searcher.seed)",
    ),
    (
        "searcher-option-python",
        with_(searcher={"name": "tpe", "options": {"gamma": 0.1}}),
        "searcher.options.gamma",
        "takes a Python object",
    ),
    (
        "searcher-option-type",
        with_(searcher={"name": "tpe", "options": {"n_startup_trials": "5"}}),
        "searcher.options.n_startup_trials",
        "is not an integer",
    ),
    (
        "searcher-option-value",
        with_(searcher={"name": "qmc", "options": {"qmc_type": "bogus"}}),
        "searcher.options",
        "QMCSampler rejects the options",
    ),
    (
        "searcher-options-type",
        with_(searcher={"name": "tpe", "options": [1]}),
        "searcher.options",
        "is not a mapping",
    ),
    (
        "grid-no-step",
        with_(searcher="grid"),
        "search_space.lr",
        "in ready space 'sgd_momentum': searcher 'grid' cannot use this space: float param 'lr' has no step",
    ),
    (
        "grid-conditional",
        with_(
            searcher="grid",
            search_space={
                "optimizer": {"type": "categorical", "choices": ["sgd", "adam"]},
                "momentum": {
                    "type": "categorical",
                    "choices": [0.0, 0.9],
                    "when": {"optimizer": "sgd"},
                },
            },
        ),
        "search_space.momentum.when",
        "searcher 'grid' cannot use this space",
    ),
    ("scheduler-name", with_(scheduler="ashaa"), "scheduler", "did you mean 'asha'?"),
    (
        "scheduler-name-map",
        with_(scheduler={"name": "optuna:nope"}),
        "scheduler.name",
        "optuna:median",
    ),
    ("scheduler-no-name", with_(scheduler={"options": {}}), "scheduler", "missing key 'name'"),
    (
        "scheduler-key",
        with_(scheduler={"name": "asha", "option": {}}),
        "scheduler.option",
        "did you mean 'options'?",
    ),
    (
        "scheduler-option",
        with_(scheduler={"name": "asha", "options": {"grace_period": 1, "reduction": 2}}),
        "scheduler.options.reduction",
        "unknown option(s) 'reduction'",
    ),
    (
        "scheduler-value",
        with_(scheduler={"name": "asha", "options": {"reduction_factor": 1}}),
        "scheduler.options.reduction_factor",
        "rejects it",
    ),
    (
        "scheduler-grace",
        with_(scheduler={"name": "asha", "options": {"grace_period": 10}}),
        "scheduler.options.grace_period",
        "max_resource 3 epochs",
    ),
    (
        "scheduler-pruner-option",
        with_(scheduler={"name": "optuna:median", "options": {"n_startup": 1}}),
        "scheduler.options.n_startup",
        "valid options",
    ),
    ("fusion-type", with_(fusion="auto"), "fusion", "is not a mapping"),
    ("fusion-key", with_(fusion={"sise": 4}), "fusion.sise", "did you mean 'size'?"),
    ("fusion-size", with_(fusion={"size": 0}), "fusion.size", "not 'auto' or an integer >= 1"),
    ("fusion-size-str", with_(fusion={"size": "big"}), "fusion.size", "'big'"),
    (
        "fusion-device",
        with_(fusion={"device": "gpu"}),
        "fusion.device",
        "auto, cpu, cuda or cuda:N",
    ),
    (
        "fusion-dtype",
        with_(fusion={"dtype": "float16"}),
        "fusion.dtype",
        "float32, float64, bfloat16",
    ),
    ("fusion-eval", with_(fusion={"eval_every": 0}), "fusion.eval_every", "integer >= 1"),
    (
        "fusion-compile",
        with_(fusion={"compile": "yes"}),
        "fusion.compile",
        "'yes' is not valid; give true (torch.compile the fused step), false or auto",
    ),
    ("fusion-compile-int", with_(fusion={"compile": 1}), "fusion.compile", "1 is not valid"),
    (
        "fusion-compile-ray",
        with_(backend="ray", fusion={"compile": "auto", "offload": "host"}),
        "fusion.compile",
        "'auto' together with offload: host is not supported yet (an offloaded array runs its "
        "shards uncompiled); give compile: false, or offload: none",
    ),
    ("backend", with_(backend="slurm"), "backend", "local, ray"),
    ("storage", with_(storage="study.db"), "storage", "sqlite:///study.db"),
    ("output", with_(output=3), "output", "3 (int) is not a non-empty string"),
    ("study-name", with_(study_name=""), "study_name", "not a non-empty string"),
    ("seed", with_(seed=-2), "seed", "-2 (int) is not an integer >= 0"),
]


@pytest.mark.parametrize(
    ("sweep", "path", "fragment"), [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS]
)
def test_errors_name_the_path_and_the_problem(
    tmp_path: Path, sweep: Any, path: str, fragment: str
) -> None:
    file = write(tmp_path, sweep)
    with pytest.raises(ConfigError) as info:
        load_sweep(file)
    exc = info.value
    assert exc.path == path, str(exc)
    assert fragment in exc.problem, str(exc)
    assert exc.file == str(file)
    assert str(exc) == ": ".join(p for p in (str(file), path, exc.problem) if p)


@pytest.mark.parametrize("optimizer_first", [True, False])
def test_a_sampled_conflict_blames_the_param_that_needs_a_condition(
    optimizer_first: bool,
) -> None:
    params = {
        "optimizer": {"type": "categorical", "choices": ["sgd", "adam"]},
        "momentum": {"type": "float", "low": 0.0, "high": 0.9},
    }
    if not optimizer_first:
        params = dict(reversed(params.items()))
    with pytest.raises(ConfigError) as info:
        parse_sweep(with_(search_space=params))
    assert info.value.path == "search_space.momentum"
    assert "add a when condition" in info.value.problem
    params["momentum"]["when"] = {"optimizer": "sgd"}
    parse_sweep(with_(search_space=params))


def test_error_ids_are_unique() -> None:
    assert len({e[0] for e in ERRORS}) == len(ERRORS)


def test_a_bad_space_file_is_named(tmp_path: Path) -> None:
    write(tmp_path, {"lr": {"type": "float", "low": 1.0, "high": 0.1}}, "space.yaml")
    with pytest.raises(ConfigError) as info:
        load_sweep(write(tmp_path, with_(search_space="space.yaml")))
    assert info.value.path == "search_space.lr.high"
    assert info.value.problem.startswith(f"in {tmp_path / 'space.yaml'}: 0.1 is not greater")


def test_a_missing_space_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_sweep(write(tmp_path, with_(search_space="spaces/none.yaml")))
    assert info.value.path == "search_space"
    assert "none.yaml" in info.value.problem and "cannot read" in info.value.problem


def test_an_unknown_key_in_a_space_file_names_the_file(tmp_path: Path) -> None:
    write(tmp_path, {"widht": {"type": "int", "low": 1, "high": 3}}, "space.yaml")
    with pytest.raises(ConfigError) as info:
        load_sweep(write(tmp_path, with_(search_space="space.yaml")))
    assert info.value.path == "search_space.widht"
    assert "space.yaml" in info.value.problem


def test_a_task_file_that_fails_to_import(tmp_path: Path) -> None:
    (tmp_path / "broken.py").write_text("raise RuntimeError('boom')\n")
    with pytest.raises(ConfigError) as info:
        load_sweep(write(tmp_path, with_(task="broken.py:task")))
    assert info.value.path == "task" and "boom" in info.value.problem


def test_a_grid_space_file_error_names_the_file(tmp_path: Path) -> None:
    write(tmp_path, {"lr": {"type": "float", "low": 0.01, "high": 0.1}}, "space.yaml")
    with pytest.raises(ConfigError) as info:
        load_sweep(write(tmp_path, with_(search_space="space.yaml", searcher="grid")))
    assert info.value.path == "search_space.lr"
    assert info.value.problem.startswith(f"in {tmp_path / 'space.yaml'}: searcher 'grid' cannot")


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("", "the file is empty"),
        ("task: [unclosed\n", "not valid YAML at line 2"),
        ("task: a\n  b: c\n", "not valid YAML at line 2"),
    ],
)
def test_unreadable_sweep_files(tmp_path: Path, text: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_sweep(write(tmp_path, text))
    assert fragment in str(info.value) and str(tmp_path / "sweep.yaml") in str(info.value)


def test_a_missing_sweep_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"no\.yaml: cannot read the sweep file"):
        load_sweep(tmp_path / "no.yaml")


# ---------------------------------------------------------------------------- the CLI
def test_validate_prints_a_summary_and_writes_nothing(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    write(tmp_path, with_(scheduler="asha"))
    assert main(["validate", "sweep.yaml"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("sweep.yaml is valid:")
    for fragment in ["task digits_mlp", "8 trials of 3 epochs", "searcher tpe, scheduler asha"]:
        assert fragment in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep.yaml"]


@pytest.mark.parametrize(
    ("sweep", "fragment"),
    [
        (with_(budget={"trials": 0, "epochs": 1}), "sweep.yaml: budget.trials: 0 (int)"),
        ("mode: [\n", "sweep.yaml: not valid YAML at line"),
        (None, "sweep.yaml: cannot read the sweep file"),
    ],
    ids=["invalid", "yaml-syntax", "missing-file"],
)
def test_validate_exits_2_with_the_message(
    tmp_path: Path, monkeypatch, capsys, sweep: Any, fragment: str
) -> None:
    monkeypatch.chdir(tmp_path)
    if sweep is not None:
        write(tmp_path, sweep)
    assert main(["validate", "sweep.yaml"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("hfsweep validate: ") and fragment in captured.err
    assert sorted(p.name for p in tmp_path.iterdir()) == ([] if sweep is None else ["sweep.yaml"])


@pytest.mark.slow
def test_validate_in_a_subprocess_writes_nothing_even_for_a_task_file(tmp_path: Path) -> None:
    (tmp_path / "my_task.py").write_text(TASK_FILE)
    write(tmp_path, with_(task="my_task.py:task", search_space={"lr": 0.1, "hidden": 32}))
    before = sorted(p.name for p in tmp_path.iterdir())
    done = subprocess.run(
        [sys.executable, "-m", "hfsweep.cli", "validate", "sweep.yaml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert "task my_task" in done.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no __pycache__, no runs/
    write(tmp_path, with_(task="my_task.py:task", metric="val_f1"))
    done = subprocess.run(
        [sys.executable, "-m", "hfsweep.cli", "validate", "sweep.yaml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and "hfsweep validate: sweep.yaml: metric: 'val_f1'" in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before
