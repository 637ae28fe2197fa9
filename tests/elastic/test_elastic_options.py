"""``ray.elastic:`` in a sweep file: defaults, validation errors that name the YAML path, the
value and what is valid, ``enabled: true`` accepted, and its refusal (exit 2) while ``WIRED``
says the allocator is not connected to ``backend: ray``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from hfsweep.cli import main
from hfsweep.config import ConfigError, ElasticConfig, parse_sweep

pytest.importorskip("ray")

BASE: dict[str, Any] = {
    "task": "digits_mlp",
    "search_space": "sgd_momentum",
    "budget": {"trials": 8, "epochs": 3},
    "metric": "val_accuracy",
    "mode": "max",
    "backend": "ray",
}


def _with(elastic: object) -> dict[str, Any]:
    return {**BASE, "ray": {"elastic": elastic}}


def test_off_by_default_and_round_trips() -> None:
    sc = parse_sweep(BASE)
    assert sc.ray.elastic == ElasticConfig() and not sc.ray.elastic.enabled
    assert "ray: elastic off (1 to the cluster workers per array" in sc.summary()
    sc = parse_sweep(
        _with({"max_workers_per_array": 8, "resize_every_s": "2m", "min_workers_per_array": 2})
    )
    e = sc.ray.elastic
    assert (e.min_workers_per_array, e.max_workers_per_array, e.resize_every_s) == (2, 8, 120.0)
    assert parse_sweep(sc.to_dict()).ray.elastic == e
    assert (
        "elastic off (2 to 8 workers per array, resized at most every 120 s, model scaling)"
        in sc.summary()
    )
    assert e.scaling == "model"
    assert parse_sweep(_with({"scaling": "perfect"})).ray.elastic.scaling == "perfect"


@pytest.mark.parametrize(
    ("elastic", "path", "text"),
    [
        ("on", "ray.elastic", "is not a mapping"),
        ({"enable": True}, "ray.elastic.enable", "did you mean 'enabled'"),
        ({"enabled": "yes"}, "ray.elastic.enabled", "'yes' (str) is not true or false"),
        ({"max_workers_per_array": 0}, "ray.elastic.max_workers_per_array", "integer >= 1"),
        (
            {"min_workers_per_array": 4, "max_workers_per_array": 2},
            "ray.elastic.max_workers_per_array",
            "less than min_workers_per_array (4)",
        ),
        ({"resize_every_s": -5}, "ray.elastic.resize_every_s", "positive number of seconds"),
        ({"max_wait_s": "soon"}, "ray.elastic.max_wait_s", "is not a duration"),
        ({"scaling": "measured"}, "ray.elastic.scaling", "'measured' is not one of model, perfect"),
    ],
)
def test_errors_name_the_path_the_value_and_what_is_valid(
    elastic: object, path: str, text: str
) -> None:
    with pytest.raises(ConfigError) as info:
        parse_sweep(_with(elastic))
    assert info.value.path == path
    assert text in str(info.value)


def test_enabled_is_accepted_now_that_the_backend_runs_elastic_arrays() -> None:
    from hfsweep.config import elastic

    assert elastic.WIRED
    sc = parse_sweep(_with({"enabled": True, "max_workers_per_array": 2}))
    assert sc.ray.elastic.enabled and sc.ray.elastic.max_workers_per_array == 2


def test_validate_and_run_refuse_enabled_with_exit_2_while_not_wired(
    tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hfsweep.config import elastic

    monkeypatch.setattr(elastic, "WIRED", False)
    with pytest.raises(ConfigError, match="not connected to backend: ray") as info:
        parse_sweep(_with({"enabled": True}))
    assert info.value.path == "ray.elastic.enabled"
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(yaml.safe_dump({**_with({"enabled": True}), "output": str(tmp_path / "r")}))
    for command in (["validate", str(sweep)], ["run", str(sweep)]):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert "ray.elastic.enabled" in err and "not supported yet" in err
    assert not (tmp_path / "r").exists()
