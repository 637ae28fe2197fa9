"""The stacked Linear's product with its weight's gradient in the weight's layout.

``hfsweep/fusion/_graph_linear.py`` replaces ``baddbmm(bias, x, w.transpose(1, 2))`` of a traced
array forward (the fused ``Linear``) by a product whose backward computes ``w``'s gradient as
``grad^T @ x`` in ``[B, out, in]``: no copy of the gradient into the weight's layout. Checked here
against autograd (``gradcheck``) and against plain PyTorch models trained alone (forward,
backward, several optimizer steps), and by the operators the backward dispatches. A run of
Linears from the graph's input (an MLP) is computed features-first with native products instead
(``tests/fusion/test_features_first.py``); the models here put a ``LayerNorm`` before each
Linear, so each is a Linear alone and keeps the product.
"""

from __future__ import annotations

import copy

import pytest
import torch
from _side_by_side import classification_steps, with_optimizer
from torch import nn

import hfsweep as hs
from hfsweep.fusion._graph_linear import stacked_linear
from hfsweep.testing._op_counts import OpCounter

B = 3


@pytest.mark.parametrize("bias", ["none", "vector", "rows", "full"])
def test_the_product_and_its_gradients_match_autograd(bias: str) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(B, 4, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.randn(B, 2, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    shape = {"none": None, "vector": (B, 2), "rows": (B, 1, 2), "full": (B, 4, 2)}[bias]
    b = (
        None
        if shape is None
        else torch.randn(*shape, dtype=torch.float64, generator=gen, requires_grad=True)
    )
    vector = bias == "vector"
    out = stacked_linear(x, w, b, vector)
    bias_term = 0 if b is None else (b.unsqueeze(1) if vector else b)
    torch.testing.assert_close(out, x @ w.transpose(1, 2) + bias_term, rtol=0, atol=1e-12)
    inputs = (x, w) if b is None else (x, w, b)
    assert torch.autograd.gradcheck(
        lambda *t: stacked_linear(t[0], t[1], t[2] if len(t) > 2 else None, vector), inputs
    )
    out.sum().backward()
    assert w.grad is not None and w.grad.is_contiguous()


def _mlp(bias: bool = True) -> nn.Module:
    """In float64, so that the comparisons can be tight (the fused products sum in their own
    order). Each Linear reads a ``LayerNorm``'s output: a Linear alone, not a run."""
    return nn.Sequential(
        nn.LayerNorm(6),
        nn.Linear(6, 8, bias=bias),
        nn.ReLU(),
        nn.LayerNorm(8),
        nn.Linear(8, 4, bias=bias),
    ).double()


def _graph_targets(array: hs.FusedArray) -> set[str]:
    traces = [t for t in array._traces.values() if t is not None and hasattr(t, "graph")]
    assert traces, "the array traced no forward"
    code = "".join(t.graph.__self__.code for t in traces)  # type: ignore[attr-defined]
    return {name for name in ("stacked_linear", "baddbmm", "bmm(") if name in code}


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_a_fused_mlp_trains_as_its_members_alone(bias: bool, optimizer: str) -> None:
    """Outputs, losses, every gradient and the weights after five steps of each optimizer, with
    the stacked product in the traced graph."""
    torch.manual_seed(0)
    refs = [_mlp(bias) for _ in range(B)]
    array = hs.fuse(copy.deepcopy(refs))
    run = with_optimizer(array, refs, [0.05, 0.1, 0.2], optimizer, momentum=0.9)
    classification_steps(run, torch.Generator().manual_seed(1), (5, 6), 4, steps=5)
    run.assert_states()
    assert "stacked_linear" in _graph_targets(array)
    for p in array.parameters():
        assert p.grad is not None and p.grad.is_contiguous()


def test_a_sequence_input_is_batched_the_same() -> None:
    """A ``[N, T, in]`` input (a sequence: the Linear's rows are ``N * T``)."""
    torch.manual_seed(0)
    refs = [_mlp() for _ in range(B)]
    array = hs.fuse(copy.deepcopy(refs))
    x = torch.randn(2, 3, 6, dtype=torch.float64)
    out = array(x)
    out.square().sum().backward()
    for i, r in enumerate(refs):
        expected = r(x)
        torch.testing.assert_close(out[i], expected, rtol=1e-7, atol=1e-10)
        expected.square().sum().backward()
        for name, p in r.named_parameters():
            fused = dict(array.named_parameters())[f"module.{name}"].grad
            assert fused is not None and p.grad is not None
            torch.testing.assert_close(fused[i], p.grad, rtol=1e-7, atol=1e-10)


def test_the_backward_copies_no_weight_gradient() -> None:
    """Per Linear layer the backward dispatches no ``new_empty_strided``/``copy_`` (the weight's
    gradient is made in its layout) and no ``squeeze`` of the bias's gradient."""
    array = hs.fuse([_mlp() for _ in range(B)])
    x = torch.randn(5, 6, dtype=torch.float64)
    for _ in range(2):
        array(x).sum().backward()
    out = array(x)
    with OpCounter() as c:
        out.sum().backward()
    assert c.ops["copy_"] == 0 and c.ops["new_empty_strided"] == 0 and c.ops["squeeze"] == 0
    assert c.ops["bmm"] == 4  # both layers' inputs' gradients (LayerNorms' outputs), both weights'
