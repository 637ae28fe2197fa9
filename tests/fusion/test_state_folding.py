"""Convolutions and BatchNorms that read the stacked state through views made once.

``hfsweep/fusion/_graph_fold.py`` replaces a traced graph's ``convolution`` and
``native_batch_norm`` whose weight, bias or running statistics are views of the array's stacked
tensors by autograd functions that keep those views: the forward dispatches no view of the
stacked state on a replay. Checked here against the native calls (values, gradients, running
statistics, bit for bit), for the view cache's validity when a tensor is
written in place or given new memory, and against plain PyTorch ResNet blocks trained alone.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from _side_by_side import classification_steps, with_optimizer
from torch import Tensor, nn

import hfsweep as hs
from hfsweep.fusion._graph_fold import _ALIASES, _alias, folded_batch_norm, folded_convolution
from hfsweep.testing._op_counts import OpCounter

B = 3


def _leaf(gen: torch.Generator, *shape: int) -> Tensor:
    return torch.randn(*shape, dtype=torch.float64, generator=gen).requires_grad_()


@pytest.mark.parametrize("bias", [False, True])
def test_the_folded_convolution_is_the_native_call(bias: bool) -> None:
    """Output and every gradient equal ``torch.convolution`` on the views, bit for bit; the
    gradients have the stacked tensors' shapes."""
    gen = torch.Generator().manual_seed(0)
    x = _leaf(gen, 2, B * 2, 5, 5)
    w = _leaf(gen, B, 4, 2, 3, 3)
    b = _leaf(gen, B, 4) if bias else None
    settings = ([1, 1], [1, 1], [1, 1], False, [0, 0], B)
    out = folded_convolution(x, w, [B * 4, 2, 3, 3], b, [B * 4] if bias else None, *settings)
    ref_inputs = [t.detach().clone().requires_grad_() for t in (x, w, *([b] if bias else []))]
    rx, rw, *rb = ref_inputs
    ref = torch.convolution(
        rx, rw.view(B * 4, 2, 3, 3), rb[0].view(-1) if bias else None, *settings
    )
    assert torch.equal(out, ref)
    weights = torch.randn(out.shape, dtype=torch.float64, generator=gen)
    (out * weights).sum().backward()
    (ref * weights).sum().backward()
    for mine, theirs in zip((x, w, *([b] if bias else [])), ref_inputs, strict=True):
        assert mine.grad is not None and mine.grad.shape == mine.shape
        assert torch.equal(mine.grad, theirs.grad)


@pytest.mark.parametrize("training", [True, False])
def test_the_folded_batch_norm_is_the_native_call(training: bool) -> None:
    """Output, gradients and the running statistics it updates in place equal
    ``torch.native_batch_norm`` on the views, bit for bit."""
    gen = torch.Generator().manual_seed(0)
    x = _leaf(gen, 4, B * 3, 2, 2)
    w, b = _leaf(gen, B, 3), _leaf(gen, B, 3)
    mean = torch.randn(B, 3, dtype=torch.float64, generator=gen)
    var = torch.rand(B, 3, dtype=torch.float64, generator=gen) + 0.5
    rx, rw, rb = (t.detach().clone().requires_grad_() for t in (x, w, b))
    rmean, rvar = mean.clone(), var.clone()
    flat = [B * 3]
    out = folded_batch_norm(x, training, 0.1, 1e-5, [flat] * 4, w, b, mean, var)
    ref = torch.native_batch_norm(
        rx, rw.view(-1), rb.view(-1), rmean.view(-1), rvar.view(-1), training, 0.1, 1e-5
    )[0]
    assert torch.equal(out, ref)
    assert torch.equal(mean, rmean) and torch.equal(var, rvar)
    weights = torch.randn(out.shape, dtype=torch.float64, generator=gen)
    (out * weights).sum().backward()
    (ref * weights).sum().backward()
    for mine, theirs in ((x, rx), (w, rw), (b, rb)):
        assert mine.grad is not None and mine.grad.shape == mine.shape
        assert torch.equal(mine.grad, theirs.grad)


def test_a_view_is_made_once_per_memory_and_follows_the_tensor() -> None:
    """A second call makes no view of the weight; an in-place update is read; new memory
    (``.data = ...``) gets a new view; a tensor's views go when it does."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, B, 4, 4, dtype=torch.float64, generator=gen)
    w = _leaf(gen, B, 1, 1, 3, 3)
    settings = ([1, 1], [1, 1], [1, 1], False, [0, 0], B)

    def conv() -> Tensor:
        return folded_convolution(x, w, [B, 1, 3, 3], None, None, *settings)

    def ref() -> Tensor:
        return torch.convolution(x, w.detach().view(B, 1, 3, 3), None, *settings)

    conv()
    with OpCounter() as c:
        out = conv()
    assert c.ops["view"] == 0 and torch.equal(out, ref())
    with torch.no_grad():
        w.mul_(2)  # the optimizers' way: in place
    assert torch.equal(conv(), ref())
    w.data = torch.randn(B, 1, 1, 3, 3, dtype=torch.float64, generator=gen)  # new memory
    assert torch.equal(conv(), ref())
    t = torch.zeros(B, 2)
    _alias(t, (B * 2,))
    key = id(t)
    assert key in _ALIASES
    del t
    gc.collect()
    assert key not in _ALIASES


def test_second_derivatives_reach_the_stacked_weight() -> None:
    """With ``create_graph`` the backward reads the weight differentiably: a gradient penalty
    has the same gradient as through the native call."""
    gen = torch.Generator().manual_seed(0)
    x = _leaf(gen, 2, B, 4, 4)
    w = _leaf(gen, B, 2, 1, 3, 3)
    settings = ([1, 1], [0, 0], [1, 1], False, [0, 0], B)
    rw = w.detach().clone().requires_grad_()

    def penalty(out: Tensor) -> Tensor:
        (gx,) = torch.autograd.grad(out.square().sum(), x, create_graph=True)
        return gx.square().sum()

    penalty(folded_convolution(x, w, [B * 2, 1, 3, 3], None, None, *settings)).backward()
    penalty(torch.convolution(x, rw.view(B * 2, 1, 3, 3), None, *settings)).backward()
    assert w.grad is not None
    torch.testing.assert_close(w.grad, rw.grad, rtol=1e-12, atol=0)


class _Block(nn.Module):
    """A ResNet basic block with a projection shortcut, a convolution with a bias (one not
    followed by a BatchNorm: there a bias's gradient is rounding noise, which Adam would
    amplify), pooling and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, 2, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 4, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(4)
        self.short = nn.Conv2d(3, 4, 1, 2, bias=False)
        self.bn3 = nn.BatchNorm2d(4)
        self.out = nn.Conv2d(4, 4, 1)
        self.head = nn.Linear(4, 5)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.relu(self.bn1(self.conv1(x)))
        h = torch.relu(self.bn2(self.conv2(h)) + self.bn3(self.short(x)))
        return self.head(torch.relu(self.out(h)).mean((2, 3)))


def _graph_code(array: hs.FusedArray) -> str:
    traces = [t for t in array._traces.values() if hasattr(t, "graph")]
    assert traces, "the array traced no forward"
    return "".join(t.graph.__self__.code for t in traces)  # type: ignore[attr-defined]


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_a_fused_resnet_block_trains_as_its_members_alone(optimizer: str) -> None:
    """Outputs, every gradient, weights, BatchNorm statistics and optimizer states after
    four steps, with the folded calls in the traced graph; then evaluation."""
    torch.manual_seed(0)
    refs = [_Block().double() for _ in range(B)]
    array = hs.fuse(copy.deepcopy(refs))
    run = with_optimizer(array, refs, [0.05, 0.1, 0.2], optimizer, momentum=0.9, weight_decay=1e-3)
    gen = torch.Generator().manual_seed(1)
    classification_steps(run, gen, (4, 3, 6, 6), 5, steps=4)
    assert array._last_call_traced
    run.assert_states()
    code = _graph_code(array)
    assert code.count("folded_convolution(") == 4 and code.count("folded_batch_norm(") == 3
    array.eval()
    x = torch.randn(4, 3, 6, 6, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        for _ in range(3):  # traced after a few calls
            out = array(x)
        for i, r in enumerate(refs):
            torch.testing.assert_close(out[i], r.eval()(x), rtol=1e-7, atol=1e-10)


def test_the_replayed_forward_views_no_stacked_tensor() -> None:
    """The forward of a replay dispatches no view of a convolution's weight or a BatchNorm's
    weight, bias or statistics: the one view left is the mean's result read by the head."""
    torch.manual_seed(0)
    array = hs.fuse([_Block() for _ in range(B)])
    x = torch.randn(4, 3, 6, 6)
    for _ in range(2):
        array(x).sum().backward()
    with OpCounter() as c:
        out = array(x)
    assert array._last_call_traced
    assert c.ops["view"] <= 1, c.ops
    with OpCounter() as c:
        out.sum().backward()
    # the backward views each gradient of a folded parameter as the parameter: 4 conv weights,
    # the last one's bias, 3 BatchNorm weights and biases; and the mean's result's gradient
    assert c.ops["view"] <= 4 + 1 + 6 + 1, c.ops


def test_moving_an_array_drops_the_views_of_its_old_memory() -> None:
    """``.to()`` swaps each parameter's memory: the views kept of the old memory go, and the
    next replay reads the new."""
    torch.manual_seed(0)
    array = hs.fuse([_Block() for _ in range(B)])
    x = torch.randn(4, 3, 6, 6)
    array(x)
    weight = array.module.conv1.weight
    assert id(weight) in _ALIASES
    array.double()
    assert id(weight) not in _ALIASES
    out = array(x.double())
    assert out.dtype == torch.float64 and array._last_call_traced
    torch.testing.assert_close(out, array.float()(x).double(), rtol=1e-5, atol=1e-6)


def test_views_kept_from_inference_mode_serve_training() -> None:
    """Views first made in an evaluation under ``torch.inference_mode`` are those a later
    training forward updates the running statistics through: allowed, and exact."""
    torch.manual_seed(0)
    refs = [_Block().double() for _ in range(B)]
    array = hs.fuse(copy.deepcopy(refs))
    x = torch.randn(4, 3, 6, 6, dtype=torch.float64)
    array.eval()
    with torch.inference_mode():
        for _ in range(3):
            array(x)
    assert array._last_call_traced
    array.train()
    for _ in range(3):
        array(x).sum().backward()
        for r in refs:
            r(x)
    assert array._last_call_traced
    for i, r in enumerate(refs):
        mine = array.member_state_dict(i)
        for name in ("bn1.running_mean", "bn2.running_var", "bn3.running_mean"):
            torch.testing.assert_close(mine[name], r.state_dict()[name], rtol=1e-7, atol=1e-10)
