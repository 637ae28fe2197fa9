"""Folding of view and permute chains in a traced forward (``hfsweep.fusion._graph.simplify``).

``vmap`` splits the member dimension out of a fused convolution's channels and the next layer
folds it back in; an elementwise op between two such tensors moves it to the front and back.
The pass removes those round trips: fewer operators forward and backward, the same values.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.fx.experimental.proxy_tensor import make_fx

import hfsweep as hs
from hfsweep.fusion._graph import simplify
from hfsweep.testing._op_counts import OpCounter

_aten = torch.ops.aten


def _targets(gm: torch.fx.GraphModule) -> list[str]:
    return [getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes]


def _check(fn, *inputs: Tensor) -> torch.fx.GraphModule:  # type: ignore[no-untyped-def]
    """simplify(make_fx(fn)) computes what fn computes, values and gradients."""
    gm = simplify(make_fx(fn, tracing_mode="fake")(*inputs))
    a = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    b = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out, ref = gm(*a), fn(*b)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert out.shape == ref.shape and out.stride() == ref.stride()
    (out * torch.arange(out.numel(), dtype=out.dtype).view(out.shape)).sum().backward()
    (ref * torch.arange(ref.numel(), dtype=ref.dtype).view(ref.shape)).sum().backward()
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x.grad, y.grad, rtol=0, atol=0)
    return gm


def test_a_view_and_its_inverse_around_an_elementwise_op_cancel() -> None:
    x = torch.randn(4, 6, 5, dtype=torch.float64)
    gm = _check(lambda t: torch.relu(t.view(4, 2, 3, 5)).view(4, 6, 5) * 2, x)
    assert "view" not in " ".join(_targets(gm))


def test_an_elementwise_op_read_in_both_shapes_keeps_one_view() -> None:
    x = torch.randn(4, 6, dtype=torch.float64)

    def fn(t: Tensor) -> Tensor:
        r = torch.sigmoid(t.view(4, 2, 3))
        return r.view(4, 6) + r.sum(-1).repeat(1, 3)

    gm = _check(fn, x)
    assert " ".join(_targets(gm)).count("view") == 1


def test_a_view_that_changes_the_layout_is_kept() -> None:
    """A view of a transposed tensor is not the tensor: nothing may be folded."""
    x = torch.randn(4, 6, dtype=torch.float64)
    _check(lambda t: torch.relu(t.t().reshape(3, 8)).view(24) + 1, x)


def test_permutes_around_an_elementwise_op_of_two_tensors_cancel() -> None:
    a = torch.randn(3, 2, 4, dtype=torch.float64)
    b = torch.randn(3, 2, 4, dtype=torch.float64)

    def fn(x: Tensor, y: Tensor) -> Tensor:
        s = torch.relu(x.permute(1, 0, 2) + y.permute(1, 0, 2))
        return s.permute(1, 0, 2) * 3

    gm = _check(fn, a, b)
    assert "permute" not in " ".join(_targets(gm))


def test_an_elementwise_op_reading_one_permute_twice() -> None:
    a = torch.randn(3, 2, 4, dtype=torch.float64)
    gm = _check(lambda x: (x.permute(1, 0, 2) * x.permute(1, 0, 2)).permute(1, 0, 2), a)
    _check(lambda x: torch.relu(x.permute(1, 0, 2) + x.permute(1, 0, 2)).permute(1, 0, 2), a)
    assert "permute" not in " ".join(_targets(gm))


def test_permutes_that_differ_are_kept() -> None:
    a = torch.randn(3, 3, 4, dtype=torch.float64)
    b = torch.randn(3, 3, 4, dtype=torch.float64)
    _check(lambda x, y: (x.permute(1, 0, 2) + y.permute(0, 1, 2).transpose(0, 1)) * 2, a, b)
    _check(lambda x, y: (x.permute(1, 0, 2) + y).permute(1, 0, 2), a, b)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 3, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(3)
        self.conv2 = nn.Conv2d(3, 3, 3, padding=1, bias=False)
        self.conv3 = nn.Conv2d(3, 3, 1, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.relu(self.bn1(self.conv1(x)))
        return self.conv3(torch.relu(self.conv2(h) + h))


def test_a_fused_conv_bn_block_replays_without_round_trips() -> None:
    """conv -> BN -> relu -> conv + residual -> relu -> conv: the members stay in the channels
    between the layers; only the array's output moves them to the front."""
    torch.manual_seed(0)
    array = hs.fuse([_Block() for _ in range(3)])
    x = torch.randn(2, 3, 5, 5)
    array(x)
    assert array._last_call_traced
    (trace,) = array._traces.values()
    nodes = list(trace.graph.__self__.graph.nodes)
    permutes = [n for n in nodes if "permute" in str(n.target)]
    assert len(permutes) == 1 and next(iter(permutes[0].users)).op == "output"
    views = [n for n in nodes if "view" in str(n.target)]
    assert not any("view" in str(getattr(n.args[0], "target", "")) for n in views)
    with OpCounter() as c:
        array(x).sum().backward()
    assert c.ops["permute"] == 2  # the output's, forward and backward


def test_views_around_an_elementwise_op_of_two_tensors_cancel() -> None:
    """A residual add of two ``[N, B * C, ...]`` tensors that ``vmap`` viewed as
    ``[N, B, C, ...]``: added as they are, the one view left cancels against the next layer's."""
    a = torch.randn(2, 6, 5, dtype=torch.float64)
    b = torch.randn(2, 6, 5, dtype=torch.float64)

    def fn(x: Tensor, y: Tensor) -> Tensor:
        s = torch.relu(x.view(2, 3, 2, 5) + y.view(2, 3, 2, 5))
        return s.view(2, 6, 5) * 3

    gm = _check(fn, a, b)
    assert "view" not in " ".join(_targets(gm))
    gm = _check(lambda x: (x.view(2, 3, 2, 5) * x.view(2, 3, 2, 5)).view(2, 6, 5), a)
    assert "view" not in " ".join(_targets(gm))


def test_views_of_two_shapes_or_read_elsewhere_are_kept() -> None:
    a = torch.randn(2, 6, 5, dtype=torch.float64)
    b = torch.randn(2, 5, 6, dtype=torch.float64)
    # different base shapes: the op cannot run on the bases
    _check(lambda x, y: (x.view(2, 3, 2, 5) + y.view(2, 3, 2, 5)).view(2, 6, 5), a, b)

    def read_twice(x: Tensor, y: Tensor) -> Tensor:
        v = y.view(2, 3, 2, 5)
        return (x.view(2, 3, 2, 5) + v).view(2, 6, 5) + v.sum()

    gm = _check(read_twice, a, a.clone())
    assert " ".join(_targets(gm)).count("view") == 1  # y's, for its other reader
