"""TrialSpec: one member's trial as the trainer trains it (config, budget, seeds, data position),
and its round trip through a checkpoint's slot record."""

from __future__ import annotations

import hfsweep as hs
from hfsweep.training.checkpoint import _slot_dict, _slot_from_dict
from hfsweep.training.spec import TrialSpec, _SlotState


def _config(**overrides: object) -> dict[str, object]:
    return {"max_steps": None, "epochs": 3, "seed": 7, "data_seed": 11, **overrides}


def test_the_budget_is_max_steps_else_whole_epochs() -> None:
    member = hs.Member("t0", {"lr": 0.1})
    assert TrialSpec.of(member, _config(), steps_per_epoch=5, start=0).budget == 15
    assert TrialSpec.of(member, _config(max_steps=4), steps_per_epoch=5, start=0).budget == 4


def test_the_seeds_and_the_data_position_come_with_the_spec() -> None:
    spec = TrialSpec.of(hs.Member("t0", {"lr": 0.1}), _config(), steps_per_epoch=5, start=12)
    assert (spec.id, spec.seed, spec.data_seed, spec.start) == ("t0", 7, 11, 12)


def test_a_slot_keeps_its_spec_through_a_checkpoint_record() -> None:
    spec = TrialSpec.of(hs.Member("t0", {"lr": 0.1}), _config(), steps_per_epoch=5, start=12)
    slot = _SlotState(spec, steps=3, history=[{"val_loss": 1.0}], since=1, loss_sum=0.5)
    back = _slot_from_dict(_slot_dict(slot))
    assert back == slot
    assert back is not None and back.member.config == {"lr": 0.1} and back.budget == 15
