"""``fusion: {offload: ...}`` in a sweep file: checked with the YAML path, and ``hfsweep run``
with ``offload: host`` gives the same trials as without."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import pytest
import yaml

from hfsweep.cli import main
from hfsweep.config import ConfigError, parse_sweep

BASE: dict[str, Any] = {
    "task": "digits_mlp",
    "search_space": "sgd_momentum",
    "searcher": {"name": "random"},
    "budget": {"trials": 4, "epochs": 1},
    "metric": "val_accuracy",
    "mode": "max",
    "seed": 3,
}


def test_offload_is_read_and_checked_with_its_yaml_path() -> None:
    assert parse_sweep(BASE).fusion.offload == "none"
    for value in ("none", "host", "auto"):
        sweep = parse_sweep({**BASE, "fusion": {"offload": value}})
        assert sweep.fusion.offload == value and sweep.fusion.to_dict()["offload"] == value
    with pytest.raises(
        ConfigError, match=r"fusion\.offload: 'cpu' is not valid; give one of: none, host, auto"
    ):
        parse_sweep({**BASE, "fusion": {"offload": "cpu"}})
    with pytest.raises(ConfigError, match=r"fusion\.offload: True is not valid"):
        parse_sweep({**BASE, "fusion": {"offload": True}})


def test_device_memory_is_read_and_checked_with_its_yaml_path() -> None:
    sweep = parse_sweep({**BASE, "fusion": {"offload": "auto", "device_memory": 2**30}})
    assert sweep.fusion.device_memory == 2**30
    assert sweep.fusion.to_dict()["device_memory"] == 2**30
    assert parse_sweep(BASE).fusion.device_memory is None
    with pytest.raises(
        ConfigError, match=r"fusion\.device_memory: 5 .* needs offload: host or auto"
    ):
        parse_sweep({**BASE, "fusion": {"device_memory": 5}})
    with pytest.raises(
        ConfigError, match=r"fusion\.device_memory: '8GB' \(str\) is not an integer"
    ):
        parse_sweep({**BASE, "fusion": {"offload": "host", "device_memory": "8GB"}})


def test_offload_with_elastic_ray_arrays_is_refused() -> None:
    pytest.importorskip("ray")
    for value in ("host", "auto"):  # each Ray actor offloads on its own device
        sweep = parse_sweep({**BASE, "backend": "ray", "fusion": {"offload": value}})
        assert sweep.fusion.offload == value
    elastic = {"elastic": {"enabled": True}}
    with pytest.raises(
        ConfigError, match=r"fusion\.offload: 'host' is not supported with ray\.elastic yet"
    ):
        parse_sweep({**BASE, "backend": "ray", "ray": elastic, "fusion": {"offload": "host"}})


def _run(folder: Path, offload: str) -> list[dict[str, str]]:
    sweep = folder / f"{offload}.yaml"
    data = {
        **BASE,
        "fusion": {"size": 4, "device": "cpu", "dtype": "float64", "offload": offload},
        "output": f"run_{offload}",
    }
    sweep.write_text(yaml.safe_dump(data), encoding="utf-8")
    assert main(["run", str(sweep), "--quiet"]) == 0
    with (folder / f"run_{offload}" / "trials.csv").open(newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_hfsweep_run_with_offload_host_gives_the_same_trials(tmp_path: Path) -> None:
    plain = _run(tmp_path, "none")
    offloaded = _run(tmp_path, "host")
    assert len(plain) == len(offloaded) == 4
    for a, b in zip(plain, offloaded, strict=True):
        assert a["state"] == b["state"] == "COMPLETE"
        assert {k: v for k, v in a.items() if k.startswith("params_")} == {
            k: v for k, v in b.items() if k.startswith("params_")
        }
        assert float(b["value"]) == pytest.approx(float(a["value"]), rel=1e-7)
    # every evaluation of every trial: losses and accuracies
    for n in range(4):
        rows = [
            _history(tmp_path / f"run_{o}" / "histories" / f"trial-{n}.csv")
            for o in ("none", "host")
        ]
        assert len(rows[0]) == len(rows[1]) > 0
        for ra, rb in zip(*rows, strict=True):
            assert ra.keys() == rb.keys()
            for k in ra:
                assert float(rb[k]) == pytest.approx(float(ra[k]), rel=1e-7, abs=1e-12), (n, k)


def _history(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))
