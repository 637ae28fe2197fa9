"""Where an offloaded array's optimizer step runs (``offload_step``), at its edges: an engine
whose device step cannot be prepared is closed with the error (no transfer thread or stream
left running); torch's optimizer step hooks (the optimizer's and the global ones) run once per
step under the device step, the pre hooks before the first shard's update and the post hooks
after the last, seeing the parameters as the host step's hooks do; each step runs on its own
step's cut, so ``auto``'s host steps (timed, then kept once the host wins) are cut exactly as
``offload_step: host`` cuts them, and switching back finds the cut made before."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from _offload_toy import ADAMW, toy_task
from _same_results import assert_same, members
from torch import nn
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

import hfsweep as hs
from hfsweep.offload import OffloadedArray
from hfsweep.training import _offload_step


def test_an_engine_whose_device_step_cannot_be_prepared_is_closed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    closed: list[OffloadedArray] = []
    close = OffloadedArray.close

    def counted(self: OffloadedArray) -> None:
        closed.append(self)
        close(self)

    def broken(self: _offload_step._StepPlace) -> None:
        raise RuntimeError("stand-in: the device step cannot be prepared")

    monkeypatch.setattr(OffloadedArray, "close", counted)
    monkeypatch.setattr(_offload_step._StepPlace, "prepare", broken)
    trainer = hs.ArrayTrainer(
        toy_task(),
        dtype=torch.float64,
        offload="host",
        offload_step="device",
        device_memory=48 * 1024,
    )
    with pytest.raises(RuntimeError, match="stand-in"):
        trainer.run(members(ADAMW))
    assert len(closed) == 1


def _hooked_steps(way: str, steps: int = 3) -> list[tuple[str, list[torch.Tensor]]]:
    """Each optimizer step hook call (its kind, the parameters it saw) over ``steps`` steps of
    an offloaded array, the optimizer stepped on ``way`` (``host`` or ``device``)."""
    torch.manual_seed(0)
    models = [
        nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(8, 8), nn.Tanh())]).double()
        for _ in range(2)
    ]
    array = hs.fuse(models)
    opt = hs.optim.Adam(array, lr=[1e-2, 3e-3])
    engine = OffloadedArray(array, budget_bytes=10_000)
    if way == "device":
        engine.step_on_device(opt)
    assert len(engine.shards) >= 2  # steps shard by shard
    seen: list[tuple[str, list[torch.Tensor]]] = []

    def hook(kind: str) -> Callable[..., None]:
        def record(optimizer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            assert optimizer is opt and args == (opt,) and kwargs == {}
            seen.append((kind, [p.detach().clone() for p in array.parameters()]))

        return record

    handles = [
        opt.register_step_pre_hook(hook("pre")),
        opt.register_step_post_hook(hook("post")),
        register_optimizer_step_pre_hook(hook("global pre")),
        register_optimizer_step_post_hook(hook("global post")),
    ]
    try:
        gen = torch.Generator().manual_seed(1)
        for _ in range(steps):
            x = torch.randn(6, 8, dtype=torch.float64, generator=gen)
            engine(x).square().mean(dim=(1, 2)).sum().backward()
            if way == "host":
                opt.step()
            opt.zero_grad()
    finally:
        for handle in handles:
            handle.remove()
        engine.close()
    return seen


def test_the_optimizer_step_hooks_run_once_a_step_with_the_device_step() -> None:
    host, device = _hooked_steps("host"), _hooked_steps("device")
    kinds = ["global pre", "pre", "post", "global post"]
    assert [k for k, _ in host] == kinds * 3
    assert [k for k, _ in device] == [k for k, _ in host]
    for (_, a), (_, b) in zip(host, device, strict=True):  # before and after the whole step
        for p, q in zip(a, b, strict=True):
            torch.testing.assert_close(p, q, rtol=1e-7, atol=1e-12)


def _cuts_seen(
    step: str, monkeypatch: pytest.MonkeyPatch
) -> tuple[list[tuple[str, list[list[str]]]], list[hs.MemberResult]]:
    """Each training step's kind and its engine's cut (the layers of each shard) under
    ``offload_step=step``, the host winning ``auto``'s measurement; and the results."""
    seen: list[tuple[str, list[list[str]]]] = []
    end = _offload_step._StepPlace.end

    def recorded(self: _offload_step._StepPlace) -> None:
        seen.append((self._kind, [list(s.nodes) for s in self.engine.shards]))
        end(self)

    with monkeypatch.context() as patch:
        patch.setattr(_offload_step._StepPlace, "end", recorded)
        patch.setattr(_offload_step, "choose_step", lambda host, device, n: ("host", "stand-in"))
        results = hs.ArrayTrainer(
            toy_task(),
            dtype=torch.float64,
            offload="host",
            offload_step=step,
            device_memory=48 * 1024,
        ).run(members(ADAMW))
    return seen, results


def test_auto_steps_on_the_host_cut_as_offload_step_host_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    host, host_results = _cuts_seen("host", monkeypatch)
    device, _ = _cuts_seen("device", monkeypatch)
    auto, auto_results = _cuts_seen("auto", monkeypatch)
    host_cut, device_cut = host[0][1], device[0][1]
    assert host_cut != device_cut  # the device step's shards leave room for AdamW's state
    assert {tuple(map(tuple, cut)) for _, cut in host} == {tuple(map(tuple, host_cut))}
    measured = 2 * (_offload_step._MEASURED + 1)
    assert len(auto) == len(host) > measured
    # measured: host, device, host, ... each on its own cut; then the host's, as host cuts it
    assert auto[:measured] == [("host", host_cut), ("device", device_cut)] * (measured // 2)
    assert auto[measured:] == [("host", host_cut)] * (len(auto) - measured)
    for a, b in zip(auto_results, host_results, strict=True):
        assert_same(a, b, rng=True)


def test_switching_the_step_back_finds_the_cut_made_before() -> None:
    torch.manual_seed(0)
    array = hs.fuse([nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)]) for _ in range(2)])
    opt = hs.optim.AdamW(array, lr=1e-3)
    engine = OffloadedArray(array, budget_bytes=10_000)
    host = engine.shards
    engine.step_on_device(opt)
    device = engine.shards
    assert len(device) > len(host)
    engine.step_on_device(None)
    assert engine.shards is host  # the host step's own cut, not traced again
    engine.step_on_device(opt)
    assert engine.shards is device
    engine.close()
