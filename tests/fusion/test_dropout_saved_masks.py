"""What autograd keeps of a fused dropout for the backward: a 1-byte mask and one scale per
member, not the float multiplier (0 or ``1 / (1 - p)`` per element) that the forward multiplies
by, on every path that applies a member's mask: ``nn.Dropout``/``Dropout2d`` layers, functional
dropout inside a forward, attention dropout (fused ``MultiheadAttention`` and the
``F.scaled_dot_product_attention`` route), peft's ``lora_dropout`` and a checkpointed region's
recomputation; traced and eager. The product and its gradient are those of
``input * multiplier``, bit for bit (signed zeros, infinities and NaN included)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import hfsweep as hs
from hfsweep.nn._dropout import apply_multiplier

B = 3
PS = [0.2, 0.4, 0.6]


def _bits(t: Tensor) -> Tensor:
    """``t``'s bit patterns (so that -0 differs from 0 and NaN equals itself)."""
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().view(ints[t.element_size()])


def _same_bits(a: Tensor, b: Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(_bits(a), _bits(b))


def _awkward(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> Tensor:
    """Random values with -0, +0, infinities and NaN among them."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype).flatten()
    t[:5] = torch.tensor([-0.0, 0.0, float("inf"), float("-inf"), float("nan")], dtype=dtype)
    return t.view(shape)


def _multiplier(rows: int, numel: int, dtype: torch.dtype, ps: list[float] | None = None) -> Tensor:
    op = torch.ops.hfsweep.dropout_multiplier
    p = torch.tensor(ps or [0.0, 0.3, 1.0, 0.5][:rows], dtype=torch.float64)
    return op(torch.arange(rows) * 11 + 1, torch.arange(rows) + 4, p, 7, numel, dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_the_product_and_its_gradient_are_those_of_the_plain_product(dtype: torch.dtype) -> None:
    """One member (no vmap): the op's output and the input's gradient have the bits of
    ``input * multiplier`` and its autograd gradient, for probabilities 0, 0.3, 1 and 0.5."""
    for row, m in enumerate(_multiplier(4, 60, dtype)):
        m = m.view(6, 10)
        x = _awkward((6, 10), dtype, row).requires_grad_(True)
        x_ref = x.detach().clone().requires_grad_(True)
        grad = _awkward((6, 10), dtype, 100 + row)
        out, ref = apply_multiplier(x, m), x_ref * m
        _same_bits(out, ref)
        out.backward(grad)
        ref.backward(grad)
        assert x.grad is not None and x_ref.grad is not None
        _same_bits(x.grad, x_ref.grad)


@pytest.mark.parametrize(
    ("x_dim", "x_shape", "m_shape"),
    [
        (0, (B, 4, 5), (B, 4, 5)),  # a member's own input
        (None, (4, 5), (B, 4, 5)),  # one input for every member (shared)
        (1, (4, B, 5), (B, 4, 5)),  # the member dimension elsewhere
        (0, (B, 4, 5, 3), (B, 4, 5, 1)),  # feature dropout: the mask broadcast over a dimension
        (0, (B, 5), (B, 4, 5)),  # an input of fewer dimensions than the mask
    ],
    ids=["batched", "shared", "moved", "feature", "broadcast-input"],
)
def test_under_vmap_the_product_and_gradient_are_the_plain_ones(
    x_dim: int | None, x_shape: tuple[int, ...], m_shape: tuple[int, ...]
) -> None:
    """The batching rule: every member's product from one call, and the gradient (summed over
    the members for a shared input) with the bits of the vmapped ``input * multiplier``."""
    numel = int(torch.tensor(m_shape[1:]).prod())
    m = _multiplier(B, numel, torch.float64).view(m_shape)
    x = _awkward(x_shape, torch.float64, 1).requires_grad_(True)
    x_ref = x.detach().clone().requires_grad_(True)
    ours = torch.func.vmap(apply_multiplier, in_dims=(x_dim, 0))(x, m)
    ref = torch.func.vmap(torch.mul, in_dims=(x_dim, 0))(x_ref, m)
    _same_bits(ours, ref)
    grad = _awkward(tuple(ref.shape), torch.float64, 2)
    ours.backward(grad)
    ref.backward(grad)
    assert x.grad is not None and x_ref.grad is not None
    _same_bits(x.grad, x_ref.grad)


def test_nested_vmap_and_double_backward() -> None:
    """Two vmap levels (a region's members inside an array's) and a gradient of the gradient."""
    m = _multiplier(B, 2 * 4 * 5, torch.float64).view(B, 2, 4, 5)
    x = _awkward((2, 4, B, 5), torch.float64, 3)
    x = torch.nan_to_num(x).requires_grad_(True)
    x_ref = x.detach().clone().requires_grad_(True)

    def nested(fn: Callable[[Tensor, Tensor], Tensor]) -> Callable[[Tensor, Tensor], Tensor]:
        return torch.func.vmap(torch.func.vmap(fn, in_dims=(1, 0)), in_dims=(0, 1))

    ours, ref = nested(apply_multiplier)(x, m), nested(torch.mul)(x_ref, m)
    _same_bits(ours, ref)
    (g,) = torch.autograd.grad((ours**2).sum(), x, create_graph=True)
    (g_ref,) = torch.autograd.grad((ref**2).sum(), x_ref, create_graph=True)
    _same_bits(g, g_ref)
    (gg,) = torch.autograd.grad(g.sum(), x)
    (gg_ref,) = torch.autograd.grad(g_ref.sum(), x_ref)
    _same_bits(gg, gg_ref)


# --- what a training step saves, path by path -------------------------------------------------


class Layer(nn.Module):
    def __init__(self, kind: type[nn.Module] = nn.Dropout) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 8)
        self.drop = kind(0.5)
        self.out = nn.Linear(8, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.fc(x))
        if isinstance(self.drop, nn.Dropout2d):
            h = self.drop(h.unsqueeze(-1).expand(*h.shape, 3)).sum(-1)
        else:
            h = self.drop(h)
        return self.out(h)


class Functional(Layer):
    """A forward that calls ``F.dropout`` itself (the member's functional stream)."""

    def forward(self, x: Tensor) -> Tensor:
        return self.out(F.dropout(torch.tanh(self.fc(x)), 0.3, self.training))


class Attention(nn.Module):
    """``nn.MultiheadAttention`` with dropout on its attention weights (the fused layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(8, 2, dropout=0.5, batch_first=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.mha(x, x, x, need_weights=True)[0]


class Sdpa(nn.Module):
    """Forward code calling ``F.scaled_dot_product_attention(dropout_p=...)`` (as HF does)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.qkv(x).view(*x.shape[:-1], 3, 2, 4).unbind(-3)
        q, k, v = (t.transpose(-3, -2) for t in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.4 if self.training else 0.0)


class Checkpointed(Layer):
    """The dropout inside a region the model checkpoints (recomputed in the backward)."""

    def forward(self, x: Tensor) -> Tensor:
        def region(x: Tensor) -> Tensor:
            return self.drop(torch.tanh(self.fc(x)))

        return self.out(torch.utils.checkpoint.checkpoint(region, x, use_reentrant=False))


def _lora() -> nn.Module:
    peft = pytest.importorskip("peft")
    torch.manual_seed(5)
    base = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["0", "2"], lora_dropout=0.5)
    return peft.get_peft_model(base, config)


PATHS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "Dropout": (Layer, (5, 6)),
    "Dropout2d": (lambda: Layer(nn.Dropout2d), (5, 6)),
    "F.dropout": (Functional, (5, 6)),
    "MultiheadAttention": (Attention, (2, 5, 8)),
    "F.scaled_dot_product_attention": (Sdpa, (2, 5, 8)),
    "lora_dropout": (_lora, (5, 6)),
    "checkpointed region": (Checkpointed, (5, 6)),
}


def _saved(array: hs.FusedArray, x: Tensor) -> list[Tensor]:
    """The tensors autograd saves in one training step, the recomputation's included."""
    saved: list[Tensor] = []

    def pack(t: Tensor) -> Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = array(x)
        out.square().sum().backward()
    return saved


def _looks_like_a_multiplier(t: Tensor) -> bool:
    """Every member's slice of ``t`` holds two values, 0 and one positive scale (what a dropout
    multiplier holds: an activation of random inputs does not)."""
    if not t.is_floating_point() or t.dim() < 2 or t.shape[0] != B or t[0].numel() < 4:
        return False
    for row in t.detach():
        values = row.unique()
        if len(values) != 2 or values[0] != 0 or values[1] <= 0:
            return False
    return True


@pytest.mark.parametrize("trace", [True, False], ids=["traced", "eager"])
@pytest.mark.parametrize("path", list(PATHS))
def test_autograd_keeps_a_one_byte_mask_not_the_multiplier(path: str, trace: bool) -> None:
    """Before, each dropout call saved its float multiplier (8 bytes an element in float64)
    for the backward; now a ``bool`` mask of the same elements and a scale per member."""
    build, shape = PATHS[path]
    torch.manual_seed(0)
    models = [build().double() for _ in range(B)]
    array = hs.fuse(models, trace=trace)
    if array.dropout:
        array.set_dropout(PS)
    x = torch.randn(*shape, dtype=torch.float64)
    _saved(array, x)  # the first call traces (its saved tensors are fake ones)
    for _ in range(2):
        saved = _saved(array, x)
        multipliers = [tuple(t.shape) for t in saved if _looks_like_a_multiplier(t)]
        assert not multipliers, multipliers
        masks = [t for t in saved if t.dtype == torch.bool and t.shape[0] == B and t[0].numel() > 1]
        assert masks, [(t.dtype, tuple(t.shape)) for t in saved]


def test_the_saved_bytes_of_a_dropout_layer() -> None:
    """The step's saved bytes, whole: the mask is a ``bool`` per element (an eighth of the
    float64 multiplier that was saved before) and a scale per member."""
    torch.manual_seed(0)
    array = hs.fuse([Layer().double() for _ in range(B)], trace=False)
    array.set_dropout(PS)
    x = torch.randn(50, 6, dtype=torch.float64)
    params = {p.data_ptr() for p in array.parameters()}
    storages = {
        t.untyped_storage().data_ptr(): (t.dtype, t.untyped_storage().nbytes())
        for t in _saved(array, x)
        if t.data_ptr() not in params
    }
    elements = B * 50 * 8  # the dropout's elements, every member's
    assert sorted(n for dtype, n in storages.values() if dtype == torch.bool) == [elements]
    floats = sum(n for dtype, n in storages.values() if dtype != torch.bool)
    # the rest: the input (one for all members), tanh's output, the dropout's output (for the
    # second layer's weight gradient), the scales and the loss's input, in float64
    assert floats == 8 * (50 * 6 + 2 * elements + B + B * 50 * 2)
