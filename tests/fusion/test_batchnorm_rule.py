"""BatchNorm's batching rule: the members folded into the channels, one native ``batch_norm``.

Exact against B independent ``nn.BatchNorm`` modules (float64, several SGD steps, running
statistics included), and one operator forward and one backward however many members.
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


class ConvBN(nn.Module):
    """conv -> BN -> relu -> conv -> BN, with a residual: the layout a CNN gives BatchNorm."""

    def __init__(self, momentum: float | None = 0.1, affine: bool = True) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(4, momentum=momentum, affine=affine)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(4, momentum=momentum, affine=affine)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(h)) + h)


CASES: dict[
    str, tuple[Callable[[], nn.Module], Callable[[torch.Generator], tuple[torch.Tensor]]]
] = {
    "conv-bn-momentum-0.1": (ConvBN, _randn(5, 3, 6, 6)),
    "conv-bn-momentum-0.7": (lambda: ConvBN(momentum=0.7), _randn(5, 3, 6, 6)),
    "conv-bn-momentum-None": (lambda: ConvBN(momentum=None), _randn(5, 3, 6, 6)),
    "conv-bn-no-affine": (lambda: ConvBN(affine=False), _randn(5, 3, 6, 6)),
    "bn1d-first-layer": (lambda: nn.BatchNorm1d(5, momentum=0.3), _randn(7, 5)),
    "bn3d": (lambda: nn.BatchNorm3d(2, momentum=0.2), _randn(3, 2, 3, 4, 2)),
    "linear-bn1d-3d": (
        lambda: nn.Sequential(nn.Conv1d(3, 4, 1), nn.BatchNorm1d(4, eps=1e-3)),
        _randn(4, 3, 5),
    ),
}


@pytest.mark.parametrize("size", [1, 3])
@pytest.mark.parametrize("name", sorted(CASES))
def test_batchnorm_rule_matches_independent_modules(name: str, size: int) -> None:
    make_model, make_input = CASES[name]
    assert_fusion_matches(make_model, make_input, size=size, steps=3)


@pytest.mark.parametrize("name", ["conv-bn-momentum-0.7", "bn1d-first-layer"])
def test_batchnorm_rule_matches_with_one_input_per_member(name: str) -> None:
    make_model, make_input = CASES[name]
    assert_fusion_matches(make_model, make_input, size=3, steps=3, shared=False)


def test_batchnorm_rule_matches_without_tracing() -> None:
    assert_fusion_matches(ConvBN, _randn(5, 3, 6, 6), size=3, steps=3, trace=False)


def test_the_running_statistics_are_torchs_after_training_then_eval() -> None:
    """Five training steps, then eval: each member's statistics and outputs are those of its
    own ``nn.BatchNorm2d`` (which updates them the same way, momentum 0.7)."""
    torch.manual_seed(0)
    models = [ConvBN(momentum=0.7).double() for _ in range(3)]
    refs = [ConvBN(momentum=0.7).double() for _ in range(3)]
    for r, m in zip(refs, models, strict=True):
        r.load_state_dict(m.state_dict())
    array = hs.fuse(models)
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        x = torch.randn(4, 3, 6, 6, generator=gen, dtype=torch.float64)
        array(x)
        for r in refs:
            r(x)
    for i, r in enumerate(refs):
        state = array.member_state_dict(i)
        for key in ("bn1.running_mean", "bn1.running_var", "bn2.running_var"):
            torch.testing.assert_close(state[key], r.state_dict()[key], rtol=1e-12, atol=1e-12)
        assert int(state["bn1.num_batches_tracked"]) == 5
    array.eval()
    x = torch.randn(4, 3, 6, 6, generator=gen, dtype=torch.float64)
    out = array(x)
    for i, r in enumerate(refs):
        torch.testing.assert_close(out[i], r.eval()(x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("size", [2, 8])
def test_a_fused_batchnorm_is_one_native_call_forward_and_backward(size: int) -> None:
    """The whole array's BatchNorm is one ``native_batch_norm`` and one backward, with no
    decomposition into products and sums (what the generic batching rule dispatched) and no
    copy: behind a convolution the members already sit next to the channels."""
    torch.manual_seed(0)
    array = hs.fuse(
        [nn.Sequential(nn.Conv2d(4, 4, 1, bias=False), nn.BatchNorm2d(4)) for _ in range(size)]
    )
    x = torch.randn(6, 4, 3, 3)
    for _ in range(2):  # traced on the first call
        array(x).sum().backward()
    with OpCounter() as c:
        array(x).sum().backward()
    assert c.ops["native_batch_norm"] == 1
    assert c.ops["native_batch_norm_backward"] == 1
    assert not {"mul", "var", "mean", "clone"} & set(c.ops)
