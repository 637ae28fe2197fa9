"""Runs of stacked Linears computed features-first (``hfsweep/fusion/_graph_features_first.py``).

A run of fused Linears from the graph's input (``Linear -> relu -> Linear ...``) is computed as
``h_next^T = baddbmm(b.unsqueeze(-1), w, h^T)`` with native autograd: every member must train
exactly as its model alone (forward, every gradient, several optimizer steps, float64), where
the run meets a ``LayerNorm``, a softmax, a residual add or a dropout with member seeds too, and
the backward must copy no weight gradient and call no Python ``autograd.Function``. The rewrite
changes no state (the parameters keep their ``[B, out, in]`` layout), so checkpoints, member
extraction and refills read the same tensors as before; ``assert_states`` compares each
member's extracted state against its reference.
"""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from _side_by_side import classification_steps, with_optimizer
from torch import nn

import hfsweep as hs
from hfsweep.fusion import _graph_linear
from hfsweep.testing._op_counts import OpCounter


def _code(array: hs.FusedArray) -> str:
    traces = [t for t in array._traces.values() if t is not None and hasattr(t, "graph")]
    assert traces, "the array traced no forward"
    return "".join(t.graph.__self__.code for t in traces)  # type: ignore[attr-defined]


def _mlp(bias: bool = True, act: type[nn.Module] = nn.ReLU) -> nn.Module:
    return nn.Sequential(
        nn.Linear(6, 8, bias=bias),
        act(),
        nn.Linear(8, 8, bias=bias),
        act(),
        nn.Linear(8, 4, bias=bias),
    ).double()


@pytest.mark.parametrize("size", [1, 3])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_an_mlp_trains_as_its_members_alone(size: int, bias: bool, optimizer: str) -> None:
    """Outputs, losses, every gradient, the weights and the optimizer states after five steps;
    at B > 1 the traced forward has no stacked-Linear ``autograd.Function`` left (an array of
    one member runs the plain model's ``addmm``)."""
    torch.manual_seed(0)
    refs = [_mlp(bias) for _ in range(size)]
    array = hs.fuse(copy.deepcopy(refs))
    run = with_optimizer(array, refs, [0.05, 0.1, 0.2][:size], optimizer, momentum=0.9)
    classification_steps(run, torch.Generator().manual_seed(1), (5, 6), 4, steps=5)
    run.assert_states()
    if size > 1:
        code = _code(array)
        assert "stacked_linear" not in code
        assert ("torch.baddbmm(" if bias else "torch.bmm(") in code
    for p in array.parameters():
        assert p.grad is not None and p.grad.is_contiguous()


@pytest.mark.parametrize("act", [nn.Tanh, nn.GELU, nn.Sigmoid, nn.SiLU, nn.LeakyReLU])
def test_other_elementwise_activations_and_a_sequence_input(act: type[nn.Module]) -> None:
    """A ``[N, T, in]`` input (the Linear's rows are ``N * T``) through activations other than
    relu, forward and gradients against the models alone."""
    torch.manual_seed(0)
    refs = [_mlp(act=act) for _ in range(3)]
    array = hs.fuse(copy.deepcopy(refs))
    gen = torch.Generator().manual_seed(2)
    for _ in range(2):
        array.zero_grad()
        x = torch.randn(2, 3, 6, dtype=torch.float64, generator=gen)
        out = array(x)
        assert out.is_contiguous()
        out.square().sum().backward()
        params = dict(array.named_parameters())
        for i, r in enumerate(refs):
            r.zero_grad()
            expected = r(x)
            torch.testing.assert_close(out[i], expected, rtol=1e-7, atol=1e-10)
            expected.square().sum().backward()
            for name, p in r.named_parameters():
                fused = params[f"module.{name}"].grad
                assert fused is not None and p.grad is not None
                torch.testing.assert_close(fused[i], p.grad, rtol=1e-7, atol=1e-10)
    assert "stacked_linear" not in _code(array)


class _Mixed(nn.Module):
    """A run (``l1 -> gelu -> l2``) from the input that ends at a residual add with a Linear
    alone (``skip``), then a ``LayerNorm``, another run (``l3 -> relu -> l4``) that does not
    start at the input, and a softmax over the features."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.skip = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(6, 8)
        self.norm = nn.LayerNorm(8)
        self.l3, self.l4 = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l2(F.gelu(self.l1(x))) + self.skip(x)
        h = self.norm(h)
        return torch.log_softmax(self.l4(F.relu(self.l3(h))), -1)


def test_a_run_meeting_layernorm_softmax_and_a_residual_add() -> None:
    """Where a run ends at an op that is not elementwise (an add of two tensors, a
    ``LayerNorm``, a softmax), it hands over the layout it had before: every member trains as
    alone, with the run features-first and the Linears alone as the stacked product."""
    torch.manual_seed(0)
    refs = [_Mixed().double() for _ in range(3)]
    array = hs.fuse(copy.deepcopy(refs))
    run = with_optimizer(array, refs, [0.05, 0.1, 0.2], "adam")
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        x = torch.randn(5, 6, generator=gen, dtype=torch.float64)
        y = torch.randint(0, 4, (5,), generator=gen)
        run.step(
            x,
            loss=lambda out, y=y: hs.member_losses(out, y, F.nll_loss),
            ref_loss=lambda out, y=y: F.nll_loss(out, y),
            grads=True,
        )
    run.assert_states()
    code = _code(array)
    assert "stacked_linear" in code  # skip, l3 and l4: not a run from the input
    assert "torch.unsqueeze(" in code and ", 2)" in code  # l1 -> l2: a bias column


class _Dropped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 4)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l3(self.drop(F.relu(self.l2(F.relu(self.l1(x))))))


@pytest.mark.parametrize("size", [1, 3])
def test_dropout_with_member_seeds_draws_the_same_masks(size: int) -> None:
    """A run that ends at a dropout with per-member probabilities and seeds: the traced array
    (the run features-first, the dropout reading the run's output in its old layout) draws the
    masks the eager array draws, so outputs and gradients are the same over several steps."""
    torch.manual_seed(0)
    models = [_Dropped().double() for _ in range(size)]
    ps = [0.3, 0.5, 0.7][:size]
    traced = hs.fuse(copy.deepcopy(models), dropout=ps)
    eager = hs.fuse(copy.deepcopy(models), dropout=ps, trace=False)
    for i in range(size):
        traced.manual_seed(i, 100 + i)
        eager.manual_seed(i, 100 + i)
    gen = torch.Generator().manual_seed(3)
    for _ in range(4):
        x = torch.randn(5, 6, generator=gen, dtype=torch.float64)
        outs = []
        for array in (traced, eager):
            array.zero_grad()
            out = array(x)
            out.square().sum().backward()
            outs.append((out.detach(), [p.grad.clone() for p in array.parameters()]))
        torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-7, atol=1e-10)
        for a, b in zip(outs[0][1], outs[1][1], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-10)
    assert traced._last_call_traced
    if size > 1:
        assert "torch.unsqueeze(" in _code(traced)


def test_the_step_copies_no_weight_gradient_and_calls_no_python_function() -> None:
    """The MLP's backward dispatches no ``new_empty_strided``/``copy_`` (autograd's own weight
    gradient is in the weight's layout) and the step never applies the stacked Linear's
    ``autograd.Function``; its products: 3 forward, 5 backward (both weights' and the hidden
    layers' inputs' gradients; none for the shared batch)."""
    array = hs.fuse([_mlp() for _ in range(3)])
    x, y = torch.randn(5, 6, dtype=torch.float64), torch.randint(0, 4, (5,))
    for _ in range(2):
        hs.member_losses(array(x), y).sum().backward()
    with (
        mock.patch.object(
            _graph_linear._StackedLinear, "apply", wraps=_graph_linear._StackedLinear.apply
        ) as applied,
        OpCounter() as forward,
    ):
        out = array(x)
    loss = hs.member_losses(out, y).sum()
    with OpCounter() as backward:
        loss.backward()
    assert array._last_call_traced
    assert applied.call_count == 0
    assert forward.ops["baddbmm"] == 3 and forward.ops["transpose_copy"] == 1  # [B, N, out]
    assert backward.ops["bmm"] == 5
    assert backward.ops["copy_"] == 0 and backward.ops["new_empty_strided"] == 0


def test_one_input_per_member() -> None:
    """``array(xs, shared=False)``: each member's own ``[N, in]`` batch, the run's input
    transposed as a view; outputs and gradients as each model alone."""
    torch.manual_seed(0)
    refs = [_mlp() for _ in range(3)]
    array = hs.fuse(copy.deepcopy(refs))
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):
        array.zero_grad()
        xs = torch.randn(3, 5, 6, dtype=torch.float64, generator=gen)
        out = array(xs, shared=False)
        out.square().sum().backward()
        params = dict(array.named_parameters())
        for i, r in enumerate(refs):
            r.zero_grad()
            expected = r(xs[i])
            torch.testing.assert_close(out[i], expected, rtol=1e-7, atol=1e-10)
            expected.square().sum().backward()
            for name, p in r.named_parameters():
                fused = params[f"module.{name}"].grad
                assert fused is not None and p.grad is not None
                torch.testing.assert_close(fused[i], p.grad, rtol=1e-7, atol=1e-10)
    assert array._last_call_traced and "stacked_linear" not in _code(array)
