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


def test_attention_streams_leave_the_dropout_layers_masks_and_torchs_generator_alone() -> None:
    """Dropout layers keep their salts (their index among dropout layers) whatever attention
    layers come before them; a model whose attention never drops draws no seeds."""
    array = hs.fuse([nn.TransformerEncoderLayer(8, 2, 16, dropout=0.1) for _ in range(2)])
    salts = {path: m._hfsweep_salt for path, m, _ in array._streams}
    assert salts["dropout"] == 0 and salts["dropout1"] == 1 and salts["dropout2"] == 2
    assert salts["self_attn"] >= 2**20
    models = [Attend(0.0) for _ in range(2)]
    torch.manual_seed(3)
    hs.fuse(models)
    after_fuse = torch.rand(3)
    torch.manual_seed(3)
    assert torch.equal(torch.rand(3), after_fuse)


def test_rng_state_saved_without_attention_streams_still_loads() -> None:
    array = hs.fuse([Attend(0.2) for _ in range(2)])
    array.manual_seed(1, 11)
    array.set_rng_state(0, {})  # what an array saved before attention had streams holds
    assert array.rng_state(0)["mha"][1] == 0
    with pytest.raises(ValueError, match="unknown"):
        array.set_rng_state(0, {"nope": [1, 2]})


def test_loading_a_state_dict_turns_masks_on_and_off() -> None:
    dropping = hs.fuse([Attend(0.5) for _ in range(2)])
    quiet = hs.fuse([Attend(0.0) for _ in range(2)])
    quiet.load_state_dict(dropping.state_dict())
    assert quiet.module.mha.hfsweep_masks and quiet.member(0).mha.dropout == 0.5
    quiet.load_state_dict(hs.fuse([Attend(0.0) for _ in range(2)]).state_dict())
    assert not quiet.module.mha.hfsweep_masks


@pytest.mark.parametrize("p", [-0.1, 1.5])
def test_attention_dropout_must_be_a_probability(p: float) -> None:
    with pytest.raises(hs.FusionError, match=r"dropout=.* is not a probability"):
        hs.fuse([Attend(0.1), Attend(p)])
    array = hs.fuse([Attend(0.1) for _ in range(2)])
    with pytest.raises(hs.FusionError, match="not a probability"):
        array.load_member(0, Attend(p))


def test_a_key_padding_mask_of_the_wrong_shape_is_refused_as_torch_does() -> None:
    model = nn.MultiheadAttention(4, 2)
    array = hs.fuse([copy.deepcopy(model) for _ in range(2)])
    x = torch.randn(3, 2, 4)  # (L, N, E): batch 2, length 3
    wrong = torch.zeros(3, 2, dtype=torch.bool)  # (S, N) instead of (N, S)
    with pytest.raises(AssertionError):
        model(x, x, x, key_padding_mask=wrong)
    with pytest.raises(AssertionError, match="key_padding_mask"):
        array(x, x, x, key_padding_mask=wrong)


def test_a_sequence_whose_every_key_is_padding_trains_as_in_torch() -> None:
    """torch's training forward (SDPA) gives such queries zeros, then the output projection's
    bias; the fused layer forms the weights itself in training and must not give NaN."""
    models = [nn.MultiheadAttention(8, 2, batch_first=True).double() for _ in range(2)]
    refs = [copy.deepcopy(m) for m in models]
    array = hs.fuse(models)
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    padding = torch.zeros(3, 5, dtype=torch.bool)
    padding[1] = True
    out, _ = array(x, x, x, key_padding_mask=padding, need_weights=False)
    out.sum().backward()
    for i, ref in enumerate(refs):
        expected, _ = ref(x, x, x, key_padding_mask=padding, need_weights=False)
        expected.sum().backward()
        torch.testing.assert_close(out[i], expected)
        torch.testing.assert_close(array.module.in_proj_weight.grad[i], ref.in_proj_weight.grad)
