"""Convolution's batching rule: one grouped convolution with the bias folded in.

Exact against B independent ``nn.Conv`` modules (float64, several SGD steps), for the options
that change how the input is folded (groups, strides, padding modes, a shared or per-member
input), and one operator forward however many members, without the separate bias add.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import hfsweep as hs
from hfsweep.testing import assert_fusion_matches
from hfsweep.testing._op_counts import OpCounter


def _randn(*shape: int) -> Callable[[torch.Generator], tuple[torch.Tensor]]:
    return lambda g: (torch.randn(*shape, generator=g),)


class _Two(nn.Module):
    """conv -> relu -> conv: the second convolution reads the first's member-folded output."""

    def __init__(self, first: nn.Module, second: nn.Module) -> None:
        super().__init__()
        self.first = first
        self.second = second

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.first(x)))


CASES: dict[
    str, tuple[Callable[[], nn.Module], Callable[[torch.Generator], tuple[torch.Tensor]]]
] = {
    "conv1d": (lambda: nn.Conv1d(3, 4, 3, stride=2), _randn(2, 3, 9)),
    "conv2d-chain": (
        lambda: _Two(nn.Conv2d(2, 4, 3, padding=1), nn.Conv2d(4, 3, 2, dilation=2)),
        _randn(3, 2, 7, 7),
    ),
    "conv2d-groups": (
        lambda: _Two(nn.Conv2d(4, 6, 3, groups=2), nn.Conv2d(6, 6, 1, groups=3, bias=False)),
        _randn(2, 4, 5, 5),
    ),
    "conv2d-reflect": (
        lambda: nn.Conv2d(2, 3, 3, padding=1, padding_mode="reflect"),
        _randn(2, 2, 5, 5),
    ),
    "conv2d-circular-valid": (
        lambda: _Two(
            nn.Conv2d(2, 3, 3, padding=2, padding_mode="circular"),
            nn.Conv2d(3, 2, 2, padding="valid"),
        ),
        _randn(2, 2, 5, 5),
    ),
    "conv2d-same": (lambda: nn.Conv2d(2, 3, 4, padding="same"), _randn(2, 2, 5, 5)),
    "conv3d": (lambda: nn.Conv3d(2, 2, 2), _randn(2, 2, 3, 4, 3)),
    "conv1d-unbatched-sample": (lambda: nn.Conv1d(3, 2, 2), _randn(3, 6)),
}


@pytest.mark.parametrize("size", [1, 3])
@pytest.mark.parametrize("name", sorted(CASES))
def test_conv_rule_matches_independent_modules(name: str, size: int) -> None:
    make_model, make_input = CASES[name]
    assert_fusion_matches(make_model, make_input, size=size, steps=3)


@pytest.mark.parametrize("name", ["conv2d-chain", "conv2d-groups", "conv1d"])
def test_conv_rule_matches_with_one_input_per_member(name: str) -> None:
    make_model, make_input = CASES[name]
    assert_fusion_matches(make_model, make_input, size=3, steps=3, shared=False)


def test_conv_rule_matches_without_tracing() -> None:
    make_model, make_input = CASES["conv2d-groups"]
    assert_fusion_matches(make_model, make_input, size=3, steps=3, trace=False)


def test_a_shared_frozen_convolution_matches() -> None:
    """A frozen first convolution kept once for all members (``in_dims=None``), a trained
    second one: the members go into the batch of the shared one."""

    def make() -> nn.Module:
        torch.manual_seed(5)
        first = nn.Conv2d(2, 3, 3)
        first.requires_grad_(False)
        return _Two(first, nn.Conv2d(3, 2, 1))

    def make_varied() -> nn.Module:
        model = make()
        nn.init.normal_(model.second.weight)  # type: ignore[arg-type]
        return model

    array = assert_fusion_matches(make_varied, _randn(2, 2, 5, 5), size=3, steps=2)
    assert any("first" in name for name in array.shared_frozen)


@pytest.mark.parametrize("size", [2, 8])
def test_a_fused_convolution_with_bias_is_one_operator(size: int) -> None:
    torch.manual_seed(0)
    array = hs.fuse([_Two(nn.Conv2d(2, 3, 3), nn.Conv2d(3, 3, 1)) for _ in range(size)])
    x = torch.randn(2, 2, 5, 5)
    for _ in range(2):  # traced on the first call
        array(x).sum().backward()
    with OpCounter() as c:
        array(x)
    assert c.ops["convolution"] == 2
    assert not {"add", "unsqueeze", "clone"} & set(c.ops), c.ops
    assert c.ops["permute"] == 1  # the array's output, members first
