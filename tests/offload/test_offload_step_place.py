"""Where an offloaded array's optimizer step runs (``offload_step``), at its edges: an engine
whose device step cannot be prepared is closed with the error (no transfer thread or stream
left running); torch's optimizer step hooks (the optimizer's and the global ones) run once per
step under the device step, the pre hooks before the first shard's update and the post hooks
after the last, seeing the parameters as the host step's hooks do."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from _offload_toy import ADAMW, toy_task
from _same_results import members
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
