"""Random calls a forward makes itself (LSTM/GRU inter-layer dropout, ``F.dropout``,
``F.scaled_dot_product_attention(dropout_p=...)``, ``torch.rand``/``randn``): each member draws
them from its own seeded stream, so a member trains the same alone and in any array; random ops
that cannot be routed are refused, naming the op and the submodule."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from _streams import train_member
from torch import nn

import hfsweep as hs
from hfsweep import FusionError


class Recurrent(nn.Module):
    """A 2-layer LSTM or GRU with dropout between its layers."""

    def __init__(self, kind: type[nn.RNNBase], p: float = 0.4) -> None:
        super().__init__()
        self.rnn = kind(4, 6, num_layers=2, dropout=p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(x)[0]


class Functional(nn.Module):
    """``F.dropout`` with a probability of its own (a float attribute)."""

    def __init__(self, p: float = 0.3) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 8))
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x * self.scale, self.p, self.training)


class Attention(nn.Module):
    """Scaled dot-product attention with attention dropout, as Hugging Face models call it."""

    def __init__(self, p: float = 0.3, causal: bool = False) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 24)
        self.p, self.causal = p, causal

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.proj(x).view(*x.shape[:2], 3, 2, 4).permute(2, 0, 3, 1, 4)
        p = self.p if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=self.causal)
        return out.transpose(1, 2).flatten(2)


def _pair(models: list[nn.Module], slot: int, trace: bool = True) -> tuple[hs.FusedArray, ...]:
    """The array of ``models`` and member ``slot`` alone, seeded alike."""
    alone = hs.fuse([copy.deepcopy(models[slot])], trace=trace)
    array = hs.fuse(models, trace=trace)
    for i in range(len(models)):
        array.manual_seed(i, 100 + i)
    alone.manual_seed(0, 100 + slot)
    return array, alone


@pytest.mark.parametrize("kind", [nn.LSTM, nn.GRU])
@pytest.mark.parametrize("slot", [0, 2])
def test_recurrent_dropout_of_a_member_is_the_same_alone(kind: type[nn.RNNBase], slot: int) -> None:
    """Before, the masks between layers came from torch's generator under vmap: member 0 of an
    array of two differed from itself alone by 0.07."""
    torch.manual_seed(0)
    models = [Recurrent(kind).double() for _ in range(3)]
    array, alone = _pair(models, slot)
    inputs = [torch.randn(5, 2, 4, dtype=torch.float64) for _ in range(3)]
    fused, single = train_member(array, slot, inputs), train_member(alone, 0, inputs)
    for (out, grad), (out1, grad1) in zip(fused, single, strict=True):
        torch.testing.assert_close(out, out1, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(grad, grad1, rtol=1e-10, atol=1e-12)
    assert array.rng_state(slot) == alone.rng_state(0) == {"<functional>": [100 + slot, 3]}


@pytest.mark.parametrize("kind", [nn.LSTM, nn.GRU])
def test_recurrent_dropout_masks_differ_between_members_and_calls(kind) -> None:
    model = kind(4, 6, num_layers=2, dropout=0.5).double()
    array = hs.fuse([copy.deepcopy(model) for _ in range(2)])
    array.manual_seed(0, 1)
    array.manual_seed(1, 2)
    x = torch.randn(5, 2, 4, dtype=torch.float64)
    first, again = array(x)[0], array(x)[0]
    assert not torch.allclose(first[0], first[1])  # same weights, other masks
    assert not torch.allclose(first[0], again[0])


@pytest.mark.parametrize("kind", [nn.LSTM, nn.GRU])
def test_recurrent_dropout_in_eval_mode_is_plain_torch(kind) -> None:
    torch.manual_seed(1)
    models = [Recurrent(kind).double() for _ in range(3)]
    array = hs.fuse(models).eval()
    x = torch.randn(5, 2, 4, dtype=torch.float64)
    out = array(x)
    for i, m in enumerate(models):
        torch.testing.assert_close(out[i], m.eval()(x), rtol=1e-7, atol=1e-12)
    assert array.rng_state(0)["<functional>"][1] == 0  # eval mode draws nothing


@pytest.mark.parametrize("trace", [True, False], ids=["traced", "eager"])
@pytest.mark.parametrize(("size", "slot"), [(2, 0), (2, 1), (3, 2)])
@pytest.mark.parametrize("make", [Functional, Attention, lambda: Attention(causal=True)])
def test_functional_dropout_of_a_member_is_the_same_alone(make, size, slot, trace) -> None:
    """Before, member 0 of an array of two differed from itself alone by 0.53."""
    torch.manual_seed(2)
    models = [make().double() for _ in range(size)]
    array, alone = _pair(models, slot, trace)
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    for _ in range(3):
        out, out1 = array(x)[slot], alone(x)[0]
        assert torch.equal(out, out1)
    assert array.rng_state(slot) == alone.rng_state(0) == {"<functional>": [100 + slot, 3]}


def test_functional_dropout_masks_keep_one_minus_p() -> None:
    p = 0.3
    model = Functional(p)
    with torch.no_grad():
        model.scale.fill_(1.0)
    array = hs.fuse([copy.deepcopy(model) for _ in range(3)])
    out = array(torch.ones(100, 50, 8))
    for i in range(3):
        kept = out[i][out[i] != 0]
        assert kept.numel() / out[i].numel() == pytest.approx(1 - p, abs=0.01)
        torch.testing.assert_close(kept, torch.full_like(kept, 1 / (1 - p)))
    agree = ((out[0] != 0) == (out[1] != 0)).float().mean().item()
    assert agree == pytest.approx(p * p + (1 - p) ** 2, abs=0.01)  # independent masks


def test_attention_dropout_keeps_one_minus_p_of_the_weights() -> None:
    """With values that are the identity, the output is the dropped attention weights."""
    p = 0.25

    class Weights(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(()))

        def forward(self, q: torch.Tensor) -> torch.Tensor:
            eye = torch.eye(q.shape[-2], dtype=q.dtype).expand(*q.shape[:-1], q.shape[-2])
            return F.scaled_dot_product_attention(q * self.scale, q, eye, dropout_p=p)

    array = hs.fuse([Weights().double() for _ in range(2)])
    q = torch.randn(4, 2, 30, 5, dtype=torch.float64)
    out = array(q)
    plain = torch.softmax(q @ q.transpose(-2, -1) / 5**0.5, dim=-1)
    for i in range(2):
        kept = out[i] != 0
        assert kept.float().mean().item() == pytest.approx(1 - p, abs=0.02)
        torch.testing.assert_close(out[i][kept], (plain / (1 - p))[kept], rtol=1e-12, atol=0)


@pytest.mark.parametrize("draw", ["rand", "randn", "rand_like", "randn_like"])
def test_rand_and_randn_in_forward_come_from_the_members_stream(draw: str) -> None:
    class Noisy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(()))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if draw.endswith("_like"):
                noise = getattr(torch, draw)(x)
            else:
                noise = getattr(torch, draw)(x.shape, dtype=x.dtype)
            return x * self.scale + noise

    models = [Noisy().double() for _ in range(3)]
    array, alone = _pair(models, 1)
    x = torch.zeros(200, 100, dtype=torch.float64)
    out, out1 = array(x), alone(x)[0]
    assert torch.equal(out[1], out1)
    assert not torch.equal(out[0], out[1])
    if draw.startswith("randn"):
        assert out[1].mean().item() == pytest.approx(0.0, abs=0.02)
        assert out[1].std().item() == pytest.approx(1.0, abs=0.02)
    else:
        assert out.min() >= 0 and out.max() < 1
        assert out[1].mean().item() == pytest.approx(0.5, abs=0.01)


def test_rrelu_slopes_come_from_the_members_stream() -> None:
    models = [nn.Sequential(nn.Linear(4, 4), nn.RReLU()).double() for _ in range(3)]
    array, alone = _pair(models, 2)
    x = torch.randn(50, 4, dtype=torch.float64)
    torch.testing.assert_close(array(x)[2], alone(x)[0], rtol=1e-12, atol=1e-14)


def _bert(attention: str = "sdpa") -> nn.Module:
    from transformers import BertConfig, BertModel

    config = BertConfig(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        vocab_size=50, max_position_embeddings=16, attn_implementation=attention,
    )  # fmt: skip
    return _LastHidden(BertModel(config, add_pooling_layer=False))


def _gpt2(attention: str = "sdpa") -> nn.Module:
    from transformers import GPT2Config, GPT2Model

    config = GPT2Config(
        n_embd=16, n_layer=1, n_head=2, vocab_size=50, n_positions=16,
        attn_implementation=attention,
    )  # fmt: skip
    return _LastHidden(GPT2Model(config))


def _t5(attention: str = "sdpa") -> nn.Module:
    from transformers import T5Config, T5EncoderModel

    config = T5Config(
        d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2, vocab_size=50,
        attn_implementation=attention,
    )  # fmt: skip
    return _LastHidden(T5EncoderModel(config))


def _llama(attention: str = "sdpa") -> nn.Module:
    """Llama's attention dropout is a float from its config (0 by default; 0.2 here)."""
    from transformers import LlamaConfig, LlamaModel

    config = LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=50, attention_dropout=0.2,
        attn_implementation=attention,
    )  # fmt: skip
    return _LastHidden(LlamaModel(config))


class _LastHidden(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids).last_hidden_state


def _train(array: hs.FusedArray, ids: torch.Tensor, steps: int = 3) -> None:
    opt = torch.optim.SGD(array.parameters(), lr=0.5)
    for _ in range(steps):
        opt.zero_grad()
        array(ids).pow(2).flatten(1).mean(1).sum().backward()
        opt.step()


@pytest.mark.slow
@pytest.mark.parametrize("attention, trace", [("sdpa", True), ("eager", True), ("sdpa", False)])
@pytest.mark.parametrize("make", [_bert, _gpt2, _t5, _llama], ids=["bert", "gpt2", "t5", "llama"])
def test_hugging_face_member_trains_as_it_does_alone(make, attention: str, trace: bool) -> None:
    """Tiny BERT, GPT-2, T5 and Llama with their default dropout, 3 SGD steps: member k's
    parameters are those of the same member alone (before: 0.06 apart after 3 steps), through
    the traced path users get by default and through eager vmap."""
    pytest.importorskip("transformers")
    torch.manual_seed(3)
    models = [make(attention=attention).double() for _ in range(3)]
    assert models[0].model.config._attn_implementation == attention
    slot = 1
    array, alone = _pair(models, slot, trace=trace)
    ids = torch.randint(0, 50, (2, 7))
    _train(array, ids)
    _train(alone, ids)
    for (name, stacked), (_, single) in zip(
        array.named_parameters(), alone.named_parameters(), strict=True
    ):
        torch.testing.assert_close(stacked[slot], single[0], rtol=1e-10, atol=1e-13, msg=name)
    before = dict(models[slot].named_parameters())
    moved = [n for n, t in alone.module.named_parameters() if not torch.equal(t[0], before[n])]
    assert moved  # the steps changed something
    assert array.rng_state(slot) == alone.rng_state(0)


@pytest.mark.slow
def test_hugging_face_attention_dropout_is_per_member() -> None:
    """BERT's SDPA attention reads its dropout probability from its dropout layer
    (``self.dropout.p``): each member gets its own, as ``array.dropout`` reports, the same as a
    model built with that probability (before: member 0's for every member)."""
    pytest.importorskip("transformers")
    torch.manual_seed(4)
    models = [_bert().double() for _ in range(3)]  # default: sdpa, every p 0.1
    ps = [0.0, 0.5, 0.2]
    layer = "model.encoder.layer.0.attention.self.dropout"
    array = hs.fuse(models, trace=False)
    array.set_dropout({layer: ps})
    assert array.dropout[layer] == pytest.approx(ps)
    ids = torch.randint(0, 50, (2, 7))
    for i in range(3):
        array.manual_seed(i, 7)
    out = array(ids)
    for i, p in enumerate(ps):
        built = copy.deepcopy(models[i])
        built.get_submodule(layer).p = p
        alone = hs.fuse([built], trace=False)
        alone.manual_seed(0, 7)
        torch.testing.assert_close(out[i], alone(ids)[0], rtol=1e-10, atol=1e-13)


class _Inner(nn.Module):
    def __init__(self, draw) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.draw = draw

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.draw(self.linear(x))


class _Outer(nn.Module):
    def __init__(self, draw) -> None:
        super().__init__()
        self.block = _Inner(draw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


@pytest.mark.parametrize("size", [1, 2])
@pytest.mark.parametrize(
    ("draw", "op"),
    [
        (lambda x: x * torch.bernoulli(torch.full_like(x, 0.5)), "torch.bernoulli"),
        (lambda x: x + torch.empty_like(x).normal_(), "Tensor.normal_"),
        (lambda x: F.alpha_dropout(x, 0.2, True), "F.alpha_dropout"),
        (lambda x: x * torch.randint(0, 2, x.shape), "torch.randint"),
    ],
    ids=["bernoulli", "normal_", "alpha_dropout", "randint"],
)
def test_random_ops_that_cannot_be_routed_are_refused(draw, op: str, size: int) -> None:
    array = hs.fuse([_Outer(draw) for _ in range(size)])
    with pytest.raises(FusionError, match=rf"submodule 'block' \(_Inner\) calls {op},"):
        array(torch.randn(2, 3))


def _gamma(x: torch.Tensor) -> torch.Tensor:
    return torch._standard_gamma(x.abs())


@pytest.mark.parametrize("trace", [True, False], ids=["traced", "eager"])
def test_a_random_op_seen_only_by_vmap_is_refused_by_name(trace: bool) -> None:
    """An op that the routing does not know by name: vmap refuses it, the error names it."""
    array = hs.fuse([_Outer(_gamma) for _ in range(2)], trace=trace)
    match = r"submodule 'block' \(_Inner\) calls torch._standard_gamma"
    with pytest.raises(FusionError, match=match):
        array(torch.randn(2, 3))


def test_alpha_dropout_in_eval_mode_and_plain_models_still_run() -> None:
    models = [nn.Sequential(nn.Linear(3, 3), nn.AlphaDropout(0.2)) for _ in range(2)]
    array = hs.fuse(models).eval()
    x = torch.randn(4, 3)
    torch.testing.assert_close(array(x)[1], models[1].eval()(x))
    with pytest.raises(FusionError, match=r"submodule '1' \(AlphaDropout\) calls F.alpha_dropout"):
        array.train()(x)


def test_the_functional_stream_resumes_and_refills() -> None:
    models = [Functional() for _ in range(2)]
    array = hs.fuse(models)
    array.manual_seed(1, 9)
    x = torch.randn(3, 8)
    array(x)
    saved = array.rng_state(1)
    assert saved == {"<functional>": [9, 1]}
    expected = array(x)[1]
    array.set_rng_state(1, saved)
    assert torch.equal(array(x)[1], expected)
    array.load_member(1, Functional())
    assert array.rng_state(1) == {"<functional>": [9, 0]}
    with pytest.raises(ValueError, match="<functional>"):
        array.set_rng_state(1, {"<functional>": [1]})


def test_the_functional_stream_is_listed_once_it_draws_when_layers_carry_the_seed() -> None:
    class Both(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.drop = nn.Dropout(0.5)
            self.p = 0.5

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.dropout(self.drop(x), self.p, self.training)

    array = hs.fuse([Both() for _ in range(2)])
    array.manual_seed(0, 5)
    assert array.rng_state(0) == {"drop": [5, 0]}
    x = torch.randn(3, 4)
    array(x)
    assert array.rng_state(0) == {"drop": [5, 1], "<functional>": [5, 1]}
    # a state saved before the functional stream drew gives it the layers' seed
    fresh = hs.fuse([Both() for _ in range(2)])
    fresh.set_rng_state(0, {"drop": [5, 0]})
    assert torch.equal(fresh(x)[0], _seeded(Both, 5)(x)[0])


def _seeded(make, seed: int) -> hs.FusedArray:
    array = hs.fuse([make()])
    array.manual_seed(0, seed)
    return array


def test_fusing_a_model_that_draws_only_in_forward_leaves_torchs_generator_alone() -> None:
    torch.manual_seed(6)
    a = hs.fuse([Functional() for _ in range(3)])
    after = torch.rand(3)
    torch.manual_seed(6)
    b = hs.fuse([Functional() for _ in range(3)])
    assert torch.equal(torch.rand(3), after)
    seeds = [a.rng_state(i)["<functional>"][0] for i in range(3)]
    assert seeds == [b.rng_state(i)["<functional>"][0] for i in range(3)]
    assert len(set(seeds)) == 3


def test_a_pickled_array_keeps_its_streams_and_per_member_p() -> None:
    import io

    array = hs.fuse([nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)) for _ in range(2)])
    buffer = io.BytesIO()
    torch.save(array, buffer)
    buffer.seek(0)
    copied = torch.load(buffer, weights_only=False)
    for a in (copy.deepcopy(array), copied):
        layer = a.module.get_submodule("1")
        assert layer.p.layer is layer and float(layer.p) == 0.5


def test_members_whose_recurrent_dropout_differs_are_refused_naming_it() -> None:
    """The probability between an RNN's layers is one float for the whole array."""
    with pytest.raises(
        FusionError, match=r"submodule 'rnn': attribute 'dropout' is 0.4 in member 0"
    ):
        hs.fuse([Recurrent(nn.LSTM, 0.4), Recurrent(nn.LSTM, 0.2)])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_uniform_numbers_stay_below_one_in_every_dtype(dtype: torch.dtype) -> None:
    from hfsweep.nn._dropout import key_uniform

    seeds, calls = torch.arange(4), torch.zeros(4, dtype=torch.int64)
    u = torch.func.vmap(lambda s, c: key_uniform(s, c, 3, (50_000,), dtype))(seeds, calls)
    assert u.dtype == dtype and u.min() >= 0 and u.max() < 1
    assert u.float().mean().item() == pytest.approx(0.5, abs=0.01)
    assert torch.equal(u[2], key_uniform(seeds[2], calls[2], 3, (50_000,), dtype))
