"""``Fusion(compile=...)`` and ``Fusion(offload=...)`` take effect in a Tune run's arrays: the
trainer in the trial's worker says it ran the array compiled, or offloaded (its log, kept by the
task in ``_tune_logged.py``), and every member trains to the values it reaches without them.

Each run: one array of two members of a toy task (float64, two epochs) on the tests' local Ray
(2 CPUs, loopback), the members drawn by a seeded random sampler, so every run trains the same
members."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.tune.search.optuna")

import optuna  # noqa: E402
from hfsweep.schedulers.tune import Fusion, member_results  # noqa: E402
from ray import tune  # noqa: E402
from ray.tune.search.optuna import OptunaSearch  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning"),
]

TASK = f"{Path(__file__).resolve().parent / '_tune_logged.py'}:TASK"


def _run(folder: Path, name: str, **settings: Any) -> tuple[dict[float, float], str]:
    """Run the sweep with ``settings``; each member's final ``val_loss`` by its learning rate,
    and what the workers logged."""
    logs = folder / f"{name}-logs"
    logs.mkdir()
    fusion = Fusion(TASK, members=2, array_size=2, device="cpu", dtype="float64", **settings)
    space = {
        "lr": tune.loguniform(1e-2, 0.3),
        "momentum": tune.uniform(0.0, 0.9),
        "log_dir": str(logs),
    }
    tuner = tune.Tuner(
        fusion.trainable,
        param_space=space,
        tune_config=tune.TuneConfig(
            metric="val_loss",
            mode="min",
            num_samples=-1,
            search_alg=fusion.searcher(OptunaSearch(sampler=optuna.samplers.RandomSampler(seed=0))),
            scheduler=fusion.scheduler(),
        ),
        run_config=tune.RunConfig(storage_path=str(folder), name=name, verbose=0),
    )
    results = tuner.fit()
    assert not results.errors
    table = member_results(results)
    assert list(table["status"]) == ["completed", "completed"]
    assert set(table["array"]) and table["array"].nunique() == 1  # one array of both
    values = dict(zip(table["config/lr"], table["value"], strict=True))
    said = "\n".join(p.read_text() for p in sorted(logs.glob("*.log")))
    return values, said


@pytest.fixture(scope="module")
def plain(
    shared_ray: Any, tmp_path_factory: pytest.TempPathFactory
) -> tuple[dict[float, float], str]:
    shared_ray.start()
    return _run(tmp_path_factory.mktemp("plain"), "plain")


@pytest.mark.slow
def test_compile_reaches_the_trials_array_and_trains_the_same(
    plain: tuple[dict[float, float], str], shared_ray: Any, tmp_path: Path
) -> None:
    shared_ray.start()
    values, said = _run(tmp_path, "compiled", compile=True)
    assert "the array's fused step ran compiled" in said
    assert "ran compiled" not in plain[1] and "training an array of 2 members" in plain[1]
    assert sorted(values) == sorted(plain[0])
    for lr, value in values.items():
        assert value == pytest.approx(plain[0][lr], rel=1e-6)


@pytest.mark.slow
def test_offload_host_reaches_the_trials_array_and_trains_the_same(
    plain: tuple[dict[float, float], str], shared_ray: Any, tmp_path: Path
) -> None:
    shared_ray.start()
    values, said = _run(tmp_path, "offloaded", offload="host")
    assert "offload: host, " in said and "shards of at most" in said
    assert "offload: host" not in plain[1]
    assert sorted(values) == sorted(plain[0])
    for lr, value in values.items():
        assert value == pytest.approx(plain[0][lr], rel=1e-9)
