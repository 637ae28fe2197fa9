"""The scaling profiles of an elastic sweep (hfsweep.elastic.scaling.SweepScaling): modelled
from a one-worker step measured here and the all-reduce cost, cached in the scaling cache, and
read back from it on resume without measuring again; the policy decides with them."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch import nn

import hfsweep as hs
from hfsweep.config.schema import ElasticConfig
from hfsweep.elastic import scaling as scaling_module
from hfsweep.elastic.policy import ElasticPolicy
from hfsweep.elastic.scaling import SweepScaling
from hfsweep.sizing.allreduce import ScalingCache, allreduce_key
from hfsweep.sizing.scaling import AllReduceCost
from hfsweep.tasks import TensorBatches


def _data(config: dict) -> tuple[TensorBatches, TensorBatches]:
    g = torch.Generator().manual_seed(config["data_seed"])
    x = torch.randn(64, 8, generator=g)
    y = x[:, :3].argmax(1)
    return TensorBatches(x, y, 16, shuffle=True), TensorBatches(x, y, 32, shuffle=False)


def _task() -> hs.Task:
    return hs.Task(
        name="scaling_toy",
        model=lambda config: nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 3)),
        data=_data,
        defaults={"max_steps": 4},
    )


#: a very slow network: 1 s per hop, 1 kB/s (an all-reduce of the toy's gradients takes
#: seconds, far more than any step of it: the direction of the model's answer is certain)
_SLOW = AllReduceCost(latency_s=1.0, bandwidth_bytes_per_s=1e3, source="given by the test")


def _scaling(cache: ScalingCache) -> SweepScaling:
    return SweepScaling(
        _task(),
        device="cpu",
        dtype=torch.float32,
        backend="gloo",
        max_workers=4,
        cache=cache,
        min_seconds=0.05,
    )


def test_modelled_once_cached_and_reused_on_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    cache = ScalingCache(tmp_path / "scaling.json")
    cache.put_allreduce(allreduce_key("gloo"), _SLOW)  # no processes spawned to measure it
    measured: list[int] = []
    real = scaling_module.measure_step

    def counting(*args: object, **kwargs: object) -> object:
        measured.append(int(args[2]))  # type: ignore[call-overload]
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(scaling_module, "measure_step", counting)
    config = {"lr": 0.1, "seed": 0}
    key = _task().compatibility_key(config)
    settings = ElasticConfig(enabled=True, resize_every_s=0.0)
    policy = ElasticPolicy(settings, budget=4, by="steps", scaling=_scaling(cache))
    (tmp_path / "0").mkdir()
    with caplog.at_level(logging.INFO, logger="hfsweep.elastic"):
        workers = policy.started(str(tmp_path / "0"), key, 3, total=4, config=config)
    assert measured == [3]  # one step time measured, of an array of 3 members
    profile = policy.profiles[key]
    assert sorted(profile.points) == [1, 2, 4] and not profile.measured
    # the model: half the compute plus one all-reduce of 3 members' gradients on a slow network
    assert profile.speedup(2) < 1.0
    assert workers == 1  # so the array is not given a second worker
    assert "modelled from a one-worker step measured here" in caplog.text
    assert cache.get_profile(_scaling(cache).cache_key(key)) == profile

    # the sweep resumed: a new engine, the same cache; nothing is measured again
    monkeypatch.setattr(scaling_module, "measure_step", lambda *a, **k: pytest.fail("re-measured"))
    caplog.clear()
    again = ElasticPolicy(settings, budget=4, by="steps", scaling=_scaling(cache))
    (tmp_path / "1").mkdir()
    with caplog.at_level(logging.INFO, logger="hfsweep.elastic"):
        assert again.started(str(tmp_path / "1"), key, 3, total=4, config=None) == 1
    assert again.profiles[key] == profile
    assert "(nothing measured now)" in caplog.text


def test_a_fast_network_makes_more_workers_worth_it(tmp_path: Path) -> None:
    """The same array, an all-reduce 10,000 times cheaper: 2 workers beat one (the model's
    arithmetic from a measured step, so no timing is asserted beyond its direction)."""
    cache = ScalingCache(tmp_path / "scaling.json")
    fast = AllReduceCost(latency_s=1e-9, bandwidth_bytes_per_s=1e13, source="given by the test")
    cache.put_allreduce(allreduce_key("gloo"), fast)
    profile, how = _scaling(cache)(_task().compatibility_key({}), {"seed": 0}, 3)
    assert profile is not None and profile.speedup(2) > 1.5
    assert "given by the test" in how


def test_a_resumed_array_without_a_config_and_nothing_cached_has_no_profile(
    tmp_path: Path,
) -> None:
    profile, how = _scaling(ScalingCache(tmp_path / "scaling.json"))("k", None, 2)
    assert profile is None and "no trial's config is known" in how


def test_a_resumed_array_names_its_key_and_a_trials_config_from_its_checkpoint(
    tmp_path: Path,
) -> None:
    """An elastic array resumed without members (a driver restarted) gets its compatibility
    key and a live trial's config from the checkpoint, so the policy finds the key's profile,
    and counts the members still in training (not those that ended before the checkpoint)."""
    from hfsweep.executors._elastic import _checkpointed

    class Stop(Exception):
        pass

    seen: list[int] = []

    def report(evaluations: list[hs.Evaluation]) -> dict[str, bool]:
        seen.append(1)
        if len(seen) > 1:  # the checkpoint of the first evaluation is written
            raise Stop
        return {"m2": False}  # stopped at the first evaluation

    def on_finish(result: hs.MemberResult) -> None:
        raise Stop  # killed after the checkpoint, before m2's end was delivered

    members = [hs.Member(f"m{i}", {"lr": 0.1 * (i + 1), "seed": i}) for i in range(3)]
    trainer = hs.ArrayTrainer(_task(), eval_every=2, checkpoint_dir=tmp_path / "0")
    with pytest.raises(Stop):
        trainer.run(members, report=report)
    key, config, held = _checkpointed(str(tmp_path / "0"))
    assert key == _task().compatibility_key(members[0].config)
    assert config is not None and _task().compatibility_key(config) == key
    assert held == {"m0", "m1"}  # the members in training: m2 stopped
    seen.clear()
    trainer = hs.ArrayTrainer(_task(), eval_every=2, checkpoint_dir=tmp_path / "1")
    with pytest.raises(Stop):
        trainer.run(members, report=report, on_finish=on_finish)
    # m2's end is in the checkpoint but was not delivered: the resume delivers it, and the
    # array goes on with the two others
    assert _checkpointed(str(tmp_path / "1"))[2] == {"m0", "m1"}
    assert _checkpointed(str(tmp_path / "none"))[1:] == (None, set())
