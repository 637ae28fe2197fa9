"""One set of array settings for every door: a sweep file's ``fusion:`` section and the Tune
plugin's ``Fusion(...)`` take the same settings, with the same defaults, and one function checks
both, its errors naming the value as each source spells it."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import pytest

pytest.importorskip("ray")

from hfsweep.schedulers.tune import Fusion

from hfsweep.config import ConfigError, FusionConfig, parse_sweep
from hfsweep.config import parse as parse_module
from hfsweep.settings import ARRAY_KEYS, ArraySettings

BASE: dict[str, Any] = {
    "task": "digits_mlp",
    "search_space": "sgd_momentum",
    "budget": {"trials": 4, "epochs": 1},
    "metric": "val_accuracy",
    "mode": "max",
}

#: Fusion's arguments that are not array settings: the sweep's own (``array_size`` is a
#: sweep file's ``fusion.size``)
_SWEEP_ARGS = {"self", "task", "members", "array_size", "refill"}


def test_fusion_takes_every_fusion_setting_of_a_sweep_file_with_its_default() -> None:
    """Fails when a ``fusion:`` key is added to the sweep file and not to ``Fusion`` (or the
    other way round), or their defaults part."""
    yaml_keys = {f.name for f in dataclasses.fields(FusionConfig)} - {"size"}
    parameters = inspect.signature(Fusion.__init__).parameters
    assert set(parameters) - _SWEEP_ARGS == yaml_keys
    assert set(parse_module._FUSION) == yaml_keys | {"size"}  # what the parser reads
    assert set(ARRAY_KEYS) == yaml_keys
    defaults = FusionConfig()
    for key in yaml_keys:
        assert parameters[key].default == getattr(defaults, key), key
    assert parameters["array_size"].default == defaults.size


def test_the_sweep_file_and_fusion_build_the_same_settings() -> None:
    values = {
        "device": "cpu",
        "dtype": "float64",
        "eval_every": 3,
        "share_frozen": False,
        "offload": "host",
        "device_memory": 2**20,
        "offload_step": "device",
    }
    from_yaml = parse_sweep({**BASE, "fusion": {"size": 2, **values}}).fusion.arrays
    fusion = Fusion("digits_mlp", members=2, array_size=2, **values)
    assert fusion._spec.arrays == from_yaml == ArraySettings(**values)
    assert parse_sweep(BASE).fusion.arrays == Fusion("digits_mlp", members=2)._spec.arrays


#: (settings, the sweep file's error, Fusion's error): one rule, named as each source names it
_REFUSED = [
    (
        {"compile": True, "offload": "host"},
        r"fusion\.compile: True together with offload: host is not supported yet .* give "
        r"compile: false, or offload: none",
        r"Fusion\(compile=\.\.\.\): True together with offload='host' is not supported yet .* "
        r"give compile=False, or offload='none'",
    ),
    (
        {"device_memory": 1024},
        r"fusion\.device_memory: 1024 is the offload engine's budget .* needs offload: host",
        r"Fusion\(device_memory=\.\.\.\): 1024 is the offload engine's budget .* needs "
        r"offload='host'",
    ),
    (
        {"offload_step": "device"},
        r"fusion\.offload_step: 'device' .* needs offload: host or auto \(got offload: none\)",
        r"Fusion\(offload_step=\.\.\.\): 'device' .* needs offload='host' or auto \(got "
        r"offload='none'\)",
    ),
    (
        {"offload": "disk"},
        r"fusion\.offload: 'disk' is not valid; give one of: none, host, auto",
        r"Fusion\(offload=\.\.\.\): 'disk' is not valid; give one of: none, host, auto",
    ),
    (
        {"device_memory": 0, "offload": "host"},
        r"fusion\.device_memory: 0 \(int\) is not an integer >= 1",
        r"Fusion\(device_memory=\.\.\.\): 0 \(int\) is not an integer >= 1",
    ),
    (
        {"compile": "yes"},
        r"fusion\.compile: 'yes' is not valid; give true .* false or auto",
        r"Fusion\(compile=\.\.\.\): 'yes' is not valid; give True .* False or 'auto'",
    ),
    (
        {"alternate": 2},
        r"fusion\.alternate: 2 trains that many offloaded arrays .* needs offload: host",
        r"Fusion\(alternate=\.\.\.\): 2 trains that many offloaded arrays .* needs "
        r"offload='host'",
    ),
]


@pytest.mark.parametrize(("settings", "yaml_error", "fusion_error"), _REFUSED)
def test_a_bad_setting_is_refused_by_both_sources_naming_it_as_each_does(
    settings: dict[str, Any], yaml_error: str, fusion_error: str
) -> None:
    with pytest.raises(ConfigError, match=yaml_error):
        parse_sweep({**BASE, "fusion": settings})
    with pytest.raises(ValueError, match=fusion_error):
        Fusion("digits_mlp", members=2, array_size=2, **settings)


def test_fusion_refuses_what_tune_trials_cannot_honour_with_the_reason() -> None:
    """A sweep file takes these; a Tune trial cannot: each says why."""
    assert parse_sweep({**BASE, "fusion": {"compile": "auto"}}).fusion.compile == "auto"
    with pytest.raises(ValueError, match=r"Fusion\(compile=\.\.\.\): 'auto' .* not carried to"):
        Fusion("digits_mlp", members=2, compile="auto")  # type: ignore[arg-type]
    two = {"offload": "host", "alternate": 2}
    assert parse_sweep({**BASE, "fusion": two}).fusion.alternate == 2
    with pytest.raises(ValueError, match=r"Fusion\(alternate=\.\.\.\): 2 .* none to alternate"):
        Fusion("digits_mlp", members=2, **two)  # type: ignore[arg-type]
