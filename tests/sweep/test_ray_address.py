"""A `ray.address` where no Ray cluster answers is refused within seconds, before anything is
written, by `hfsweep run`, `hfsweep validate` and `hs.sweep` (``ray.init`` alone retries for
ever): exit 2 naming ``ray.address`` and ``ray.connect_timeout_s``."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

import hfsweep as hs
from hfsweep.cli import main
from hfsweep.config import ConfigError, parse_sweep

from ._toy import sweep_config

pytest.importorskip("ray")

_TOY = Path(__file__).resolve().parent / "_toy.py"


def _write_sweep(folder: Path, address: str, timeout: float = 30) -> Path:
    sweep = folder / "sweep.yaml"
    sweep.write_text(
        f"""
task: "{_TOY}:TASK"
search_space:
  lr: {{type: float, low: 1.0e-3, high: 0.5, log: true}}
budget: {{trials: 4, epochs: 1}}
metric: val_accuracy
mode: max
fusion: {{size: 4, device: cpu}}
backend: ray
ray: {{address: "{address}", connect_timeout_s: {timeout}}}
output: run
"""
    )
    return sweep


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A loopback port that accepts connections and never answers (not a Ray cluster)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield listener.getsockname()[1]


@pytest.mark.parametrize("command", ["validate", "run"])
def test_a_refused_address_exits_2_naming_the_setting_and_writes_nothing(
    tmp_path: Path, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    sweep = _write_sweep(tmp_path, "127.0.0.1:1")
    assert main([command, str(sweep)]) == 2
    err = capsys.readouterr().err
    assert "ray.address: '127.0.0.1:1': cannot connect to 127.0.0.1:1" in err, err
    assert "ray.connect_timeout_s" in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep.yaml"]


def test_a_port_that_is_not_a_ray_cluster_is_refused_after_the_time_limit(
    tmp_path: Path, silent_port: int
) -> None:
    config = sweep_config(
        tmp_path / "run",
        backend="ray",
        ray={"address": f"127.0.0.1:{silent_port}", "connect_timeout_s": 2},
    )
    with pytest.raises(ConfigError) as info:
        hs.sweep(config, progress=False)
    assert info.value.path == "ray.address"
    assert "no Ray cluster (GCS server) answered there within 2 s" in info.value.problem
    assert not (tmp_path / "run").exists()


def test_connect_timeout_s_is_a_number_of_seconds(tmp_path: Path) -> None:
    config = sweep_config(tmp_path / "run", backend="ray", ray={"address": "auto"})
    assert parse_sweep(config).ray.connect_timeout_s == 30.0
    config["ray"]["connect_timeout_s"] = 0
    with pytest.raises(ConfigError, match=r"ray\.connect_timeout_s: 0 is not a number of seconds"):
        parse_sweep(config)
