"""Where an offloaded array's optimizer step runs (``offload_step``), at its edges: an engine
whose device step cannot be prepared is closed with the error (no transfer thread or stream
left running)."""

from __future__ import annotations

import pytest
import torch
from _offload_toy import ADAMW, toy_task
from _same_results import members

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
