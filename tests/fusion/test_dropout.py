"""Per-member dropout: each member draws its own masks with its own probability."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hfsweep as hs
from hfsweep.testing import MLP, LeNet


class Drop(nn.Module):
    def __init__(self, p: float = 0.5, kind: type[nn.Module] = nn.Dropout) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))
        self.drop = kind(p)

    def forward(self, x):
        return self.drop(x * self.scale)


def test_each_member_keeps_its_own_probability_by_default() -> None:
    ps = [0.0, 0.25, 0.5, 0.9]
    array = hs.fuse([Drop(p) for p in ps])
    assert array.dropout == {"drop": pytest.approx(ps)}
    out = array(torch.ones(200, 100))
    for i, p in enumerate(ps):
        zero = (out[i] == 0).float().mean().item()
        assert zero == pytest.approx(p, abs=0.02)
        kept = out[i][out[i] != 0]
        torch.testing.assert_close(kept, torch.full_like(kept, 1 / (1 - p)))


def test_masks_are_independent_across_members() -> None:
    array = hs.fuse([Drop(0.5) for _ in range(3)])
    out = array(torch.ones(100, 100))
    masks = (out != 0).float().flatten(1)
    for i in range(3):
        for j in range(i + 1, 3):
            agree = (masks[i] == masks[j]).float().mean().item()
            assert agree == pytest.approx(0.5, abs=0.03)  # independent halves agree half the time


def test_masks_change_from_call_to_call() -> None:
    array = hs.fuse([Drop(0.5) for _ in range(2)])
    x = torch.ones(50, 50)
    assert not torch.equal(array(x), array(x))


def test_probability_one_and_zero() -> None:
    array = hs.fuse([Drop(1.0), Drop(0.0)])
    out = array(torch.ones(10, 10))
    assert torch.equal(out[0], torch.zeros(10, 10))
    assert torch.equal(out[1], torch.ones(10, 10))


def test_dropout2d_drops_whole_channels() -> None:
    array = hs.fuse([Drop(0.5, nn.Dropout2d) for _ in range(2)])
    out = array(torch.ones(8, 16, 4, 4))
    per_channel = out.flatten(3)  # [B, N, C, H*W]
    assert torch.all((per_channel == 0).all(-1) | (per_channel != 0).all(-1))
    assert 0.3 < (out == 0).float().mean().item() < 0.7


def test_eval_mode_is_the_identity() -> None:
    array = hs.fuse([Drop(0.7) for _ in range(2)])
    array.eval()
    x = torch.randn(5, 5)
    torch.testing.assert_close(array(x), x.expand(2, 5, 5))


def test_fuse_argument_overrides_probabilities() -> None:
    array = hs.fuse([LeNet(dropout=0.1) for _ in range(3)], dropout=[0.2, 0.3, 0.4])
    assert array.dropout == {"drop": pytest.approx([0.2, 0.3, 0.4])}
    assert array.member(2).drop.p == pytest.approx(0.4)


def test_per_layer_probabilities_by_path() -> None:
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 3)
            self.a = nn.Dropout(0.1)
            self.b = nn.Dropout(0.1)

        def forward(self, x):
            return self.b(self.a(self.fc(x)))

    array = hs.fuse([Two(), Two()], dropout={"b": [0.5, 0.6]})
    assert array.dropout == {"a": pytest.approx([0.1, 0.1]), "b": pytest.approx([0.5, 0.6])}


@pytest.mark.parametrize(
    ("dropout", "match"),
    [
        ([0.1, 0.2], "got 2 values for 3 members"),
        ([0.1, 0.2, 1.5], "1.5 is not a probability"),
        ({"nope": [0.1, 0.1, 0.1]}, r"dropout\['nope'\].*layers are \['drop'\]"),
    ],
)
def test_invalid_dropout_arguments(dropout, match) -> None:
    with pytest.raises(hs.FusionError, match=match):
        hs.fuse([MLP(dropout=0.1) for _ in range(3)], dropout=dropout)


def test_dropout_argument_without_dropout_layers() -> None:
    with pytest.raises(hs.FusionError, match=r"no nn\.Dropout"):
        hs.fuse([nn.Linear(2, 2), nn.Linear(2, 2)], dropout=[0.1, 0.2])


def test_load_member_carries_the_newcomers_probability() -> None:
    array = hs.fuse([MLP(dropout=0.1) for _ in range(2)])
    array.load_member(1, MLP(dropout=0.6))
    assert array.dropout["drop"] == pytest.approx([0.1, 0.6])
