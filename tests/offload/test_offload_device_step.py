"""The optimizer step on the compute device, shard by shard (``offload_step="device"``):
every ``hs.optim`` optimizer steps an offloaded array exactly as the host step and as the
array without offload (float64: a schedule, a frozen member, a non-finite member), the
ledger holds the fetched optimizer state within the budget, the trainer's ``offload_step``
(``device``, ``auto``) trains every member as without offload (a non-finite member, a
resume), clipping is refused with ``device`` and steps on the host under ``auto``, and
``fusion.offload_step`` is read and checked with its YAML path."""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from _offload_toy import ADAMW, SGD, toy_task
from _same_results import assert_same, members
from test_offload_sweep import BASE
from torch import nn

import hfsweep as hs
from hfsweep.config import ConfigError, parse_sweep
from hfsweep.offload import OffloadBudgetError, OffloadedArray, OffloadError, choose_step

#: SGD's configs without clipping (the device step refuses it)
SGD_NO_CLIP = [{**c, "grad_clip": None} for c in SGD]

OPTIMIZERS: dict[str, Callable[[hs.FusedArray], hs.optim.FusedOptimizer]] = {
    "sgd-momentum-nesterov": lambda a: hs.optim.SGD(
        a, lr=[0.1, 0.05, 0.02], momentum=[0.9, 0.5, 0.7], nesterov=True, weight_decay=1e-3
    ),
    "sgd-dampening": lambda a: hs.optim.SGD(a, lr=0.05, momentum=0.9, dampening=[0.0, 0.3, 0.1]),
    "adam-amsgrad": lambda a: hs.optim.Adam(a, lr=[1e-2, 3e-3, 1e-3], amsgrad=True),
    "adamw": lambda a: hs.optim.AdamW(a, lr=1e-2, betas=([0.8, 0.9, 0.85], 0.99), weight_decay=0.1),
    "rmsprop-centered-momentum": lambda a: hs.optim.RMSprop(
        a, lr=[1e-3, 2e-3, 5e-4], momentum=0.5, centered=True, weight_decay=1e-2
    ),
    "adagrad": lambda a: hs.optim.Adagrad(a, lr=[0.1, 0.05, 0.02], lr_decay=1e-2),
}


def _models() -> list[nn.Module]:
    torch.manual_seed(0)
    return [
        nn.Sequential(*[m for _ in range(5) for m in (nn.Linear(16, 16), nn.Tanh())]).double()
        for _ in range(3)
    ]


class _Watched:
    """Wraps a ledger's ``add`` to keep the most optimizer state ever held at once and the
    total held at that moment."""

    def __init__(self, engine: OffloadedArray) -> None:
        self.state_peak = 0
        ledger = engine.ledger
        add = ledger.add

        def watched(kind: str, nbytes: int) -> None:
            add(kind, nbytes)
            self.state_peak = max(self.state_peak, ledger.by_kind["optimizer state"])
            assert ledger.budget is None or ledger.resident <= ledger.budget

        ledger.add = watched  # type: ignore[method-assign]


def _train(
    make: Callable[[hs.FusedArray], hs.optim.FusedOptimizer],
    way: str,
    steps: int = 4,
    budget: int = 60_000,
    weights: torch.Tensor | None = None,
) -> tuple[hs.FusedArray, hs.optim.FusedOptimizer, OffloadedArray | None]:
    """``steps`` steps of an array of :func:`_models` on ``way`` (``none``, ``host``,
    ``device``), a cosine schedule, member 1 frozen; each member's loss times ``weights``."""
    array = hs.fuse(_models())
    opt = make(array)
    sched = hs.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=[4, 6, 8], eta_min=1e-4)
    opt.set_active(1, False)
    engine = None
    if way != "none":
        engine = OffloadedArray(array, budget_bytes=budget)
        if way == "device":
            engine.step_on_device(opt)
    gen = torch.Generator().manual_seed(5)
    for _ in range(steps):
        x = torch.randn(8, 16, dtype=torch.float64, generator=gen)
        out = array(x) if engine is None else engine(x)
        losses = out.square().mean(dim=(1, 2))
        if weights is not None:
            losses = losses * weights
        losses.sum().backward()
        if way != "device":
            opt.step()
        opt.zero_grad()
        sched.step()
    return array, opt, engine


def _assert_same_training(a: tuple[Any, ...], b: tuple[Any, ...]) -> None:
    (array_a, opt_a, _), (array_b, opt_b, _) = a, b
    for p, q in zip(array_a.parameters(), array_b.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-7, atol=1e-12)
    for i in range(3):
        sa, sb = opt_a.member_state_dict(i), opt_b.member_state_dict(i)
        assert sa["state"].keys() == sb["state"].keys()
        for k in sa["state"]:
            assert sa["state"][k].keys() == sb["state"][k].keys()
            for name in sa["state"][k]:
                torch.testing.assert_close(
                    torch.as_tensor(sa["state"][k][name]),
                    torch.as_tensor(sb["state"][k][name]),
                    rtol=1e-7,
                    atol=1e-12,
                )
    assert opt_a.nonfinite_members == opt_b.nonfinite_members


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_every_optimizer_steps_on_the_device_as_on_the_host(name: str) -> None:
    make = OPTIMIZERS[name]
    plain = _train(make, "none")
    host = _train(make, "host")
    device = _train(make, "device")
    _assert_same_training(device, host)
    _assert_same_training(device, plain)
    engine = device[2]
    assert engine is not None and len(engine.shards) >= 3
    assert engine.ledger.resident == 0
    assert engine.ledger.peak <= 60_000
    # the frozen member did not move
    first = _train(make, "device", steps=0)[0]
    for p, q in zip(device[0].parameters(), first.parameters(), strict=True):
        torch.testing.assert_close(p[1], q[1], rtol=0, atol=0)


@pytest.mark.parametrize("name", ["sgd-momentum-nesterov", "adam-amsgrad"])
def test_the_fetched_optimizer_state_is_counted_within_the_budget(name: str) -> None:
    budget = 60_000
    array = hs.fuse(_models())
    opt = OPTIMIZERS[name](array)
    host_engine = OffloadedArray(hs.fuse(_models()), budget_bytes=budget)
    engine = OffloadedArray(array, budget_bytes=budget)
    engine.step_on_device(opt)
    # the shards are cut smaller, leaving room for one shard's state beside them
    assert max(s.nbytes for s in engine.shards) <= budget // (4 + len(opt.state_keys))
    assert len(engine.shards) > len(host_engine.shards)
    watched = _Watched(engine)
    for _ in range(3):
        engine(torch.randn(8, 16, dtype=torch.float64)).square().mean().backward()
    assert watched.state_peak > 0  # state was fetched (from the second step: made on the first)
    assert engine.ledger.peak <= budget
    assert engine.ledger.peaks["step"] <= budget
    assert engine.ledger.resident == 0
    assert all(p.grad is None for p in array.parameters())  # gradients never reached the host


def test_a_budget_without_room_for_the_state_is_refused_before_it_is_exceeded() -> None:
    array = hs.fuse(_models())
    opt = hs.optim.Adam(array, lr=1e-3)
    engine = OffloadedArray(array, budget_bytes=40_000, shard_bytes=9_000)  # no room left
    engine.step_on_device(opt)
    with pytest.raises(OffloadBudgetError, match=r"optimizer state|gradients"):
        for _ in range(2):
            engine(torch.randn(8, 16, dtype=torch.float64)).square().mean().backward()
    assert engine.ledger.peak <= 40_000
    engine._release()
    assert engine.ledger.resident == 0


def test_a_nonfinite_member_is_isolated_as_on_the_host() -> None:
    """Member 2's loss is NaN at every step: its output gradient carries it into the first
    shard the backward steps, so it is isolated before any of its tensors move."""
    weights = torch.tensor([1.0, 1.0, float("nan")], dtype=torch.float64)
    make = OPTIMIZERS["adamw"]
    host = _train(make, "host", weights=weights)
    device = _train(make, "device", weights=weights)
    plain = _train(make, "none", weights=weights)
    assert host[1].nonfinite_members == [2]
    _assert_same_training(device, host)
    _assert_same_training(device, plain)


class _RootNet(nn.Module):
    """sqrt(|x W1|) then tanh layers: a member whose first layer is all zeros has finite
    outputs and a non-finite gradient in its first layer only."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(16, 16, bias=False)
        self.rest = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(16, 16), nn.Tanh())])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rest(self.first(x).abs().sqrt())


def test_a_gradient_nonfinite_only_in_an_early_shard_isolates_the_member_from_there() -> None:
    """What docs/offload.md says: the shards stepped before the one with the non-finite
    gradient keep that member's update of this step; the other members are exact."""
    torch.manual_seed(1)
    models = [_RootNet().double() for _ in range(3)]
    with torch.no_grad():
        models[1].first.weight.zero_()
    results = []
    for way in ("host", "device"):
        array = hs.fuse(copy.deepcopy(models))
        opt = hs.optim.SGD(array, lr=0.1, momentum=0.9)
        engine = OffloadedArray(array, budget_bytes=40_000)
        if way == "device":
            engine.step_on_device(opt)
        x = torch.randn(8, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
        engine(x).square().mean().backward()
        if way == "host":
            opt.step()
        results.append((array, opt, engine))
    (host, host_opt, _), (device, device_opt, engine) = results
    assert len(engine.shards) >= 3
    assert host_opt.nonfinite_members == device_opt.nonfinite_members == [1]
    assert not bool(device_opt.active[1])
    start = hs.fuse(copy.deepcopy(models))
    moved = []
    for p, q, s in zip(host.parameters(), device.parameters(), start.parameters(), strict=True):
        for i in (0, 2):
            torch.testing.assert_close(p[i], q[i], rtol=1e-7, atol=1e-12)
        torch.testing.assert_close(p[1], s[1], rtol=0, atol=0)  # the host step: untouched
        moved.append(not torch.equal(q[1], s[1]))
    assert not moved[0]  # the first layer, where the gradient is not finite: untouched
    assert any(moved[1:])  # the later shards, stepped first: this step's update kept


class _Blocks(nn.Module):
    """Repeated blocks in an ``nn.ModuleList``: what the engine can stream unit by unit."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def test_a_model_streamed_between_its_blocks_is_refused() -> None:
    array = hs.fuse([_Blocks().double() for _ in range(3)])
    engine = OffloadedArray(array, budget_bytes=40_000, cut="blocks")
    with pytest.raises(OffloadError, match=r"offload_step='device' .*cut='blocks'"):
        engine.step_on_device(hs.optim.SGD(array, lr=0.1))


def test_choose_step_keeps_the_faster_and_a_tie_goes_to_the_host() -> None:
    assert choose_step(0.02, 0.01, 2)[0] == "device"
    assert choose_step(0.01, 0.02, 2)[0] == "host"
    mode, why = choose_step(0.01, 0.01, 3)
    assert mode == "host" and "10.00 ms with the host step" in why and "fastest of 3" in why


@pytest.mark.parametrize("configs", [SGD_NO_CLIP, ADAMW], ids=["sgd-cosine", "adamw-step"])
@pytest.mark.parametrize("step", ["device", "auto"])
def test_the_trainer_steps_on_the_device_as_without_offload(
    configs: list[dict[str, Any]], step: str, caplog: pytest.LogCaptureFixture
) -> None:
    task = toy_task()
    plain = hs.ArrayTrainer(task, dtype=torch.float64).run(members(configs))
    with caplog.at_level(logging.INFO, logger="hfsweep.trainer"):
        off = hs.ArrayTrainer(
            task, dtype=torch.float64, offload="host", offload_step=step, device_memory=48 * 1024
        ).run(members(configs))
    for a, b in zip(off, plain, strict=True):
        assert_same(a, b, rng=True)
    said = [r.getMessage() for r in caplog.records if "offload_step: auto" in r.getMessage()]
    if step == "auto":  # both were timed and one was chosen, with both figures
        assert len(said) == 1 and "with the host step and" in said[0], said
    else:
        assert not said


def test_a_nonfinite_member_fails_alone_with_the_device_step() -> None:
    task = toy_task()
    with_bad = [SGD_NO_CLIP[0], {**SGD_NO_CLIP[1], "lr": 1e300}, SGD_NO_CLIP[2]]
    plain = hs.ArrayTrainer(task, dtype=torch.float64).run(members(with_bad))
    off = hs.ArrayTrainer(
        task, dtype=torch.float64, offload="host", offload_step="device", device_memory=48 * 1024
    ).run(members(with_bad))
    assert [r.status for r in off] == ["completed", "failed", "completed"]
    assert [r.status for r in plain] == [r.status for r in off]
    assert off[1].steps == plain[1].steps
    for i in (0, 2):
        assert_same(off[i], plain[i], rng=True)


def test_resume_with_the_device_step_equals_an_uninterrupted_run(tmp_path: Path) -> None:
    task = toy_task()
    calls = {"n": 0}

    def report(evaluations: list[hs.Evaluation]) -> dict[str, bool]:
        calls["n"] += 1
        if calls["n"] == 1:
            raise KeyboardInterrupt  # a crash after the first evaluation's checkpoint
        return {}

    def trainer() -> hs.ArrayTrainer:
        return hs.ArrayTrainer(
            task,
            dtype=torch.float64,
            offload="host",
            offload_step="device",
            device_memory=48 * 1024,
            checkpoint_dir=tmp_path,
            eval_every=2,
        )

    with pytest.raises(KeyboardInterrupt):
        trainer().run(members(ADAMW), report=report)
    resumed = trainer().run(members(ADAMW), resume=True)
    again = hs.ArrayTrainer(task, dtype=torch.float64, eval_every=2).run(members(ADAMW))
    for a, b in zip(resumed, again, strict=True):
        assert_same(a, b, rng=True)


@pytest.mark.parametrize("mode", ["device", "auto"])
def test_an_array_with_a_clipping_member_steps_on_the_host_and_says_so(
    mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A member that clips (a refill may bring one in at any step) makes its array step on the
    host, exactly as without offload: a warning under ``device``, a log line under ``auto``."""
    task = toy_task()
    plain = hs.ArrayTrainer(task, dtype=torch.float64).run(members(SGD))  # members 0, 2 clip
    with caplog.at_level(logging.INFO, logger="hfsweep.trainer"):
        got = hs.ArrayTrainer(task, dtype=torch.float64, offload="host", offload_step=mode).run(
            members(SGD)
        )
    for a, b in zip(got, plain, strict=True):
        assert_same(a, b, rng=True)
    said = [
        r for r in caplog.records if f"offload_step: {mode} steps on the host" in r.getMessage()
    ]
    assert len(said) == 1 and "(grad_clip)" in said[0].getMessage()
    assert said[0].levelno == (logging.WARNING if mode == "device" else logging.INFO)


@pytest.mark.parametrize("where", ["before any shard stepped", "in a shard's update"])
def test_out_of_memory_in_a_device_step_replays_only_what_it_can(
    where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An out-of-memory error in the backward before any shard's device update is replayed
    as without offload (the array split, every member exact); one once a shard's update has
    begun cannot be replayed exactly (the host's parameters and state may have moved): the
    array's members fail, saying why and what to change, rather than train on wrong values."""
    from hfsweep.offload import _step as stepping

    task = toy_task()
    reference = hs.ArrayTrainer(task, dtype=torch.float64).run(members(SGD_NO_CLIP))
    begin, step = stepping._DeviceStep.begin, stepping._DeviceStep.step
    seen = {"backward": 0, "raised": False}

    def raise_once(stepper: Any) -> None:
        if not seen["raised"] and stepper.optimizer.size == 3 and seen["backward"] == 3:
            seen["raised"] = True
            raise torch.OutOfMemoryError("simulated: out of memory")

    def counted_begin(self: Any) -> None:
        seen["backward"] += 1
        begin(self)
        if where == "before any shard stepped":
            raise_once(self)

    def failing_step(self: Any, *args: Any) -> Any:
        if where == "in a shard's update" and self.written == 2:  # one shard written back
            raise_once(self)
        return step(self, *args)

    monkeypatch.setattr(stepping._DeviceStep, "begin", counted_begin)
    monkeypatch.setattr(stepping._DeviceStep, "step", failing_step)
    got = hs.ArrayTrainer(
        task, dtype=torch.float64, offload="host", offload_step="device", device_memory=48 * 1024
    ).run(members(SGD_NO_CLIP))
    assert seen["raised"]
    if where == "before any shard stepped":
        for a, b in zip(got, reference, strict=True):
            assert_same(a, b, rng=True)
    else:
        assert [r.status for r in got] == ["failed"] * 3
        assert all("cannot replay such a step exactly" in (r.error or "") for r in got)


def test_offload_step_arguments_are_checked() -> None:
    with pytest.raises(
        ValueError,
        match=r"ArrayTrainer\(offload_step=...\) must be one of 'host', 'device', 'auto', "
        r"got 'gpu'",
    ):
        hs.ArrayTrainer(toy_task(), offload="host", offload_step="gpu")
    with pytest.raises(ValueError, match=r"offload_step='device' .* needs offload='host'"):
        hs.ArrayTrainer(toy_task(), offload_step="device")
    trainer = hs.ArrayTrainer(toy_task(), offload="host", offload_step="device")
    with pytest.raises(ValueError, match=r"jobs\[0\]\.trainer has offload_step='device'"):
        hs.train_together([hs.ArrayJob(trainer, members(SGD_NO_CLIP))])


def test_fusion_offload_step_is_read_and_checked_with_its_yaml_path() -> None:
    assert parse_sweep(BASE).fusion.offload_step == "host"
    for value in ("host", "device", "auto"):
        sweep = parse_sweep({**BASE, "fusion": {"offload": "host", "offload_step": value}})
        assert sweep.fusion.offload_step == value
        assert sweep.fusion.to_dict()["offload_step"] == value
    with pytest.raises(
        ConfigError,
        match=r"fusion\.offload_step: 'gpu' is not valid; give one of: host, device, auto",
    ):
        parse_sweep({**BASE, "fusion": {"offload": "host", "offload_step": "gpu"}})
    with pytest.raises(ConfigError, match=r"fusion\.offload_step: 'device' .* needs offload"):
        parse_sweep({**BASE, "fusion": {"offload_step": "device"}})
    with pytest.raises(
        ConfigError, match=r"fusion\.offload_step: 'auto' is not supported with alternate: 2"
    ):
        parse_sweep({**BASE, "fusion": {"offload": "host", "offload_step": "auto", "alternate": 2}})


@pytest.mark.slow
def test_hfsweep_run_with_the_device_step_gives_the_same_trials(tmp_path: Path) -> None:
    from hfsweep.cli import main

    values = {}
    for step in ("host", "device"):
        data = {
            **BASE,
            "fusion": {
                "size": 4,
                "device": "cpu",
                "dtype": "float64",
                "offload": "host",
                "offload_step": step,
            },
            "output": f"run_{step}",
        }
        sweep = tmp_path / f"{step}.yaml"
        sweep.write_text(yaml.safe_dump(data), encoding="utf-8")
        assert main(["run", str(sweep), "--quiet"]) == 0
        text = (tmp_path / f"run_{step}" / "trials.csv").read_text(encoding="utf-8")
        values[step] = [line.split(",") for line in text.splitlines()[1:]]
    assert len(values["host"]) == len(values["device"]) == 4
    header = (tmp_path / "run_host" / "trials.csv").read_text(encoding="utf-8").splitlines()[0]
    at = header.split(",").index("value")
    for a, b in zip(values["host"], values["device"], strict=True):
        assert float(b[at]) == pytest.approx(float(a[at]), rel=1e-7)
