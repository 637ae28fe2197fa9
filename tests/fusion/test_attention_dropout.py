"""Attention-weight dropout inside a fused ``nn.MultiheadAttention``: per-member probability, each
member's own deterministic stream, no masks at all while every member's probability is 0."""

from __future__ import annotations

import copy

import pytest
import torch
from _streams import train_member
from torch import nn

import hfsweep as hs


class Attend(nn.Module):
    """Self-attention with a residual, returning each head's weights too when asked."""

    def __init__(self, p: float, need_weights: bool = False) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(8, 2, dropout=p, batch_first=True)
        self.need_weights = need_weights

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out, weights = self.mha(x, x, x, need_weights=self.need_weights, average_attn_weights=False)
        return (out + x,) if weights is None else (out + x, weights)


def _multiplier_ops(array: hs.FusedArray) -> int:
    (entry,) = array._traces.values()
    nodes = entry.graph.__self__.graph.nodes
    return [n.target for n in nodes if n.op == "call_function"].count(
        torch.ops.hfsweep.dropout_multiplier.default
    )


def test_members_may_differ_in_attention_dropout() -> None:
    """Before, differing MultiheadAttention(dropout=) values refused to fuse."""
    ps = [0.0, 0.3, 0.6]
    array = hs.fuse([nn.TransformerEncoderLayer(8, 2, 16, dropout=p) for p in ps])
    for i, p in enumerate(ps):
        assert array.member(i).self_attn.dropout == pytest.approx(p)
    assert "self_attn" in array.rng_state(0)
    # dropout= and the config's dropout key address the nn.Dropout layers only
    assert sorted(array.dropout) == ["dropout", "dropout1", "dropout2"]


@pytest.mark.parametrize("need_weights", [False, True], ids=["sdpa-call", "weights"])
@pytest.mark.parametrize("trace", [True, False], ids=["traced", "eager"])
@pytest.mark.parametrize("slot", [0, 1, 2])
def test_member_draws_the_masks_it_draws_alone(need_weights: bool, trace: bool, slot: int) -> None:
    ps = [0.2, 0.0, 0.5, 0.4]
    models = [Attend(p, need_weights).double() for p in ps]
    alone = hs.fuse([copy.deepcopy(models[slot])], trace=trace)
    array = hs.fuse(models, trace=trace)
    for i in range(len(ps)):
        array.manual_seed(i, 50 + i)
    alone.manual_seed(0, 50 + slot)
    inputs = [torch.randn(3, 5, 8, dtype=torch.float64) for _ in range(3)]
    fused, single = train_member(array, slot, inputs), train_member(alone, 0, inputs)
    for step, ((out, grad), (out1, grad1)) in enumerate(zip(fused, single, strict=True)):
        torch.testing.assert_close(out, out1, rtol=1e-10, atol=1e-12, msg=f"step {step}")
        torch.testing.assert_close(grad, grad1, rtol=1e-10, atol=1e-12, msg=f"step {step}")
    calls = 0 if ps[slot] == 0 else 3  # a member that drops nothing draws no mask alone
    assert array.rng_state(slot) == alone.rng_state(0) == {"mha": [50 + slot, calls]}


def test_returned_weights_are_dropped_at_each_members_rate() -> None:
    ps = [0.0, 0.25, 0.75, 1.0]
    array = hs.fuse([Attend(p, need_weights=True) for p in ps])
    x = torch.randn(16, 12, 8)
    _, weights = array(x)
    for i, p in enumerate(ps):
        dropped = (weights[i] == 0).float().mean().item()
        assert dropped == pytest.approx(p, abs=0.05), i
    # p = 1 drops every weight: what is left is the output projection's bias and the residual
    out, _ = array(x)
    bias = array.module.mha.out_proj.bias[3].detach()
    torch.testing.assert_close(out[3], bias.expand_as(x) + x)
    array.eval()
    _, weights = array(x)
    assert bool((weights > 0).all())  # eval mode drops nothing


def test_no_masks_while_every_probability_is_zero() -> None:
    array = hs.fuse([Attend(0.0) for _ in range(3)])
    array(torch.randn(2, 4, 8))
    assert _multiplier_ops(array) == 0 and array.rng_state(0)["mha"][1] == 0
    array = hs.fuse([Attend(p) for p in (0.0, 0.1, 0.0)])
    array(torch.randn(2, 4, 8))
    assert _multiplier_ops(array) == 1
    assert [array.rng_state(i)["mha"][1] for i in range(3)] == [0, 1, 0]


def test_a_refill_with_attention_dropout_starts_the_masks() -> None:
    array = hs.fuse([Attend(0.0) for _ in range(2)])
    x = torch.randn(2, 4, 8)
    array(x)
    newcomer = Attend(0.5)
    array.load_member(1, newcomer)
    array.manual_seed(1, 9)
    assert array.member(1).mha.dropout == 0.5
    out = array(x)[0]
    alone = hs.fuse([copy.deepcopy(newcomer)])
    alone.load_member(0, array.member(1))
    alone.manual_seed(0, 9)
    torch.testing.assert_close(out[1], alone(x)[0][0])
    array.load_member(1, Attend(0.0))
    array(x)
    assert not array.module.mha.hfsweep_masks


def test_transformer_layers_with_attention_dropout_train_per_member() -> None:
    """The everyday case: TransformerEncoderLayer(dropout=p) with p swept, every dropout (the
    layer's three nn.Dropout and the attention weights') per member, as each member alone."""
    ps = [0.1, 0.3]
    models = [nn.TransformerEncoderLayer(8, 2, 16, dropout=p, batch_first=True) for p in ps]
    models = [m.double() for m in models]
    alone = hs.fuse([copy.deepcopy(models[1])])
    array = hs.fuse(models)
    array.manual_seed(1, 3)
    alone.manual_seed(0, 3)
    x = torch.randn(3, 6, 8, dtype=torch.float64)
    for _ in range(2):
        torch.testing.assert_close(array(x)[1], alone(x)[0], rtol=1e-10, atol=1e-12)
    assert array.rng_state(1) == alone.rng_state(0)
