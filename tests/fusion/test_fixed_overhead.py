"""The fused step's fixed cost: what a step dispatches besides the arithmetic (issue 21).

An array of one member (what the profiler picks where fusion does not pay) reads its member's
parameters through views whose backward is a view (``squeeze``), not ``select``, whose backward
fills a zero ``[1, ...]`` tensor and copies the gradient into it, per parameter and step; its
per-member loss is the loss itself. The stacked Linear of larger arrays is an
``autograd.Function`` whose ``apply`` binds no arguments through ``inspect.signature`` (the
``setup_context`` form does, about 30 us a call). Each checked against plain PyTorch too.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hfsweep as hs
from hfsweep.fusion._graph_linear import stacked_linear
from hfsweep.testing._op_counts import OpCounter


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4)).double()


def _data(rows: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(rows, 6, dtype=torch.float64, generator=gen), torch.randint(
        0, 4, (rows,), generator=gen
    )


def _plain_step(model: nn.Module, opt: torch.optim.Optimizer, x: Any, y: Any) -> None:
    F.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _fused_step(array: hs.FusedArray, opt: torch.optim.Optimizer, x: Any, y: Any) -> None:
    hs.member_losses(array(x), y).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _counted(step: Callable[[], None]) -> OpCounter:
    for _ in range(3):  # traced by then
        step()
    with OpCounter() as c:
        step()
    return c


def test_a_one_member_step_selects_nothing_and_allocates_as_the_plain_model() -> None:
    """No ``select``/``select_backward`` (each a zero-filled gradient and a copy) on the step's
    path, forward or backward, and the bytes the step creates are the plain model's (plus the
    8-byte sum of the one loss)."""
    torch.manual_seed(0)
    model = _mlp()
    array = hs.fuse([copy.deepcopy(model)])
    x, y = _data()
    plain_opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fused_opt = torch.optim.SGD(array.parameters(), lr=0.1)
    one = _counted(lambda: _plain_step(model, plain_opt, x, y))
    fused = _counted(lambda: _fused_step(array, fused_opt, x, y))
    assert array._last_call_traced
    for op in ("select", "select_backward", "zeros", "zero_", "fill_", "new_zeros", "copy_"):
        assert fused.ops[op] == 0, (op, dict(fused.ops))
    assert fused.bytes <= one.bytes + 8, (fused.bytes, one.bytes)
    # every heavy operator of the plain model's step, as often
    for op in ("addmm", "mm", "relu", "threshold_backward", "_log_softmax", "nll_loss_forward"):
        assert fused.ops[op] == one.ops[op], op


@pytest.mark.parametrize("shared", [True, False])
def test_a_one_member_array_trains_as_the_plain_model(shared: bool) -> None:
    """Outputs, gradients (the input's too, through ``squeeze``) and weights after five SGD
    steps with momentum, against the plain model; one input per member (``shared=False``) too."""
    torch.manual_seed(0)
    model = _mlp()
    array = hs.fuse([copy.deepcopy(model)])
    plain_opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    fused_opt = torch.optim.SGD(array.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(2)
    for _ in range(5):
        x = torch.randn(5, 6, dtype=torch.float64, generator=gen)
        y = torch.randint(0, 4, (5,), generator=gen)
        xp = x.clone().requires_grad_()
        xf = (x.clone() if shared else x.unsqueeze(0).clone()).requires_grad_()
        out = model(xp)
        fused_out = array(xf, shared=shared)
        torch.testing.assert_close(fused_out[0], out, rtol=1e-12, atol=1e-12)
        F.cross_entropy(out, y).backward()
        hs.member_losses(fused_out, y).sum().backward()
        assert xf.grad is not None and xp.grad is not None
        torch.testing.assert_close(xf.grad.reshape(xp.shape), xp.grad, rtol=1e-12, atol=1e-12)
        for (name, p), q in zip(model.named_parameters(), array.parameters(), strict=True):
            assert q.grad is not None and p.grad is not None
            torch.testing.assert_close(q.grad[0], p.grad, rtol=1e-12, atol=1e-12, msg=name)
        plain_opt.step()
        fused_opt.step()
        plain_opt.zero_grad(set_to_none=True)
        fused_opt.zero_grad(set_to_none=True)
    for p, q in zip(model.parameters(), array.parameters(), strict=True):
        torch.testing.assert_close(q[0], p, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "loss_fn, kwargs, target",
    [
        (F.cross_entropy, {}, "classes"),
        (F.cross_entropy, {"ignore_index": 1}, "classes"),
        (F.cross_entropy, {"label_smoothing": 0.1}, "classes"),
        (F.mse_loss, {}, "values"),
        (lambda o, t: (o - t).abs().pow(3).mean(), {}, "values"),
    ],
)
def test_one_members_loss_is_the_loss_itself(
    loss_fn: Callable[..., torch.Tensor], kwargs: dict[str, Any], target: str
) -> None:
    """``member_losses`` of a one-member output: the loss with its mean reduction, as a ``[1]``
    tensor, and its gradient, for a shared target and for one target per member."""
    gen = torch.Generator().manual_seed(3)
    out = torch.randn(1, 7, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    if target == "classes":
        y = torch.randint(0, 4, (7,), generator=gen)
    else:
        y = torch.randn(7, 4, dtype=torch.float64, generator=gen)
    ref_out = out.detach()[0].clone().requires_grad_()
    ref = loss_fn(ref_out, y, **kwargs)
    ref.backward()
    for shared in (True, False):
        out.grad = None
        got = hs.member_losses(
            out, y if shared else y.unsqueeze(0), loss_fn, shared_target=shared, **kwargs
        )
        assert got.shape == (1,)
        torch.testing.assert_close(got[0], ref, rtol=1e-12, atol=1e-12)
        got.sum().backward()
        assert out.grad is not None and ref_out.grad is not None
        torch.testing.assert_close(out.grad[0], ref_out.grad, rtol=1e-12, atol=1e-12)


def test_the_fused_step_binds_no_arguments_per_call() -> None:
    """A traced array's step (forward and backward of the stacked Linear) calls no
    ``inspect.signature``: ``autograd.Function.apply`` of the ``setup_context`` form binds its
    arguments through it on every call."""
    torch.manual_seed(0)
    # a LayerNorm before each Linear: each is a Linear alone, so it stays the stacked Linear's
    # autograd.Function (a run of Linears from the input is native: _graph_features_first.py)
    model = nn.Sequential(nn.LayerNorm(6), nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 4))
    array = hs.fuse([copy.deepcopy(model.double()) for _ in range(3)])
    x, y = _data()
    for _ in range(2):
        hs.member_losses(array(x), y).sum().backward()
    assert "stacked_linear" in next(iter(array._traces.values())).graph.__self__.code
    with mock.patch.object(
        torch.autograd.function.inspect, "signature", wraps=inspect.signature
    ) as signature:
        hs.member_losses(array(x), y).sum().backward()
    assert array._last_call_traced
    assert signature.call_count == 0


def test_the_stacked_product_under_torch_func_transforms() -> None:
    """Under ``vmap`` and ``grad`` the product takes its transformable form: the same values
    and gradients as the plain expression."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 3, 4, 5, dtype=torch.float64, generator=gen)  # [V, B, N, in]
    w = torch.randn(3, 2, 5, dtype=torch.float64, generator=gen)
    b = torch.randn(3, 2, dtype=torch.float64, generator=gen)

    def plain(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return x @ w.transpose(1, 2) + b.unsqueeze(1)

    got = torch.func.vmap(lambda xi: stacked_linear(xi, w, b, True))(x)
    torch.testing.assert_close(got, plain(x, w, b), rtol=1e-12, atol=1e-12)
    loss = lambda f: lambda w: f(x[0], w, b).square().sum()  # noqa: E731
    torch.testing.assert_close(
        torch.func.grad(loss(lambda *a: stacked_linear(*a, True)))(w),
        torch.func.grad(loss(plain))(w),
        rtol=1e-12,
        atol=1e-12,
    )


def test_the_trainers_one_member_loss_is_torchs_cross_entropy() -> None:
    """A ready task's loss of a one-member array (``Task.member_loss``, what the trainer's step
    calls) is ``F.cross_entropy`` itself, value and gradient, with none of the gather path's
    zero-filled scatter in its backward; with label smoothing, or at B > 1, the per-member
    formula stays (checked against torch's ``label_smoothing`` elsewhere)."""
    task = hs.Task(name="one_member_loss", model=lambda c: _mlp(), data=lambda c: ([], []))
    gen = torch.Generator().manual_seed(5)
    out = torch.randn(1, 9, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    y = torch.randint(0, 4, (9,), generator=gen)
    ref_out = out.detach()[0].clone().requires_grad_()
    ref = F.cross_entropy(ref_out, y)
    ref.backward()
    with OpCounter() as counted:
        got = task.member_loss(out, y, None)
        got.sum().backward()
    assert got.shape == (1,)
    assert torch.equal(got[0], ref)
    assert out.grad is not None and ref_out.grad is not None
    assert torch.equal(out.grad[0], ref_out.grad)
    for op in ("gather", "scatter", "scatter_add", "zeros", "new_zeros", "zero_", "fill_"):
        assert counted.ops[op] == 0, (op, dict(counted.ops))
    two = torch.cat([out.detach(), out.detach() + 1]).requires_grad_()
    both = task.member_loss(two, y, None)
    torch.testing.assert_close(both[0], ref.detach(), rtol=1e-12, atol=1e-12)
