"""Dropout with one probability and one deterministic random stream per member.

Under ``vmap`` a Python float ``p`` is the same for every member, so HFTA could not sweep it. Here
``p`` lives in a ``[B]`` buffer (``member_p``).

Masks do not come from torch's global generator, whose draws under ``vmap`` depend on the array
size and on a member's slot. Each member has a seed (``member_seed``) and a count of the training
forwards it has run through the layer (``member_calls``); the mask is a counter-based hash of
(seed, count, the layer's salt, element index). So member i's masks are the same in an array of 1
and of 8, in any slot, traced or eager, on CPU or CUDA, and a checkpoint of seed and count resumes
them exactly.

The hash works on 32-bit values held in ``int64`` tensors. The per-member keys come from mixing
rounds that multiply a value below ``2**32`` by an odd constant below ``2**31`` (the product stays
below ``2**63``, so no signed overflow, which C++ leaves undefined) and fold the product's high half
into its low half: a few dozen ops on one number per member, per layer and call. Each element is
then hashed by a two-round xorshift-multiply permutation of 32-bit words (the shape and constants
of the well-known ``[16 21f0aaad 15 735a2d97 15]`` hash from Chris Wellons' hash-prospector, with
the second key xored in between the rounds): ten passes, each exact in 32-bit unsigned arithmetic,
so on the CPU NumPy runs them on ``uint32`` arrays, half the memory of ``int64``, and gets the
same values as the torch definition, which masks each product to 32 bits. Large masks are hashed
in cache-sized blocks.

The mask and scale come from one custom op (``hfsweep::dropout_multiplier``) whose batching rule
computes every member's at once. Under ``vmap`` each of the fifty-odd small ops would otherwise
pass through the batching layer, and a traced array forward would record each of them: in a
small MLP the dropout layer would take about 85% of the time to trace the whole forward.

The input is multiplied by that multiplier through a second op (``hfsweep::dropout_apply``,
:func:`apply_multiplier`): the same product, but what autograd keeps for the backward is a
1-byte mask (``multiplier != 0``) and one scale per member, not the multiplier itself (4 or 8
bytes an element). The backward rebuilds the multiplier from them (``mask * scale``: every
element 0 or the scale, as it was) and multiplies the gradient by it, so the gradient is the
one ``input * multiplier`` gives, bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from .._errors import FusionError
from ._shard import global_shape

__all__ = [
    "FusedDropoutMixin",
    "apply_multiplier",
    "dropout_mask_hash",
    "feature_dims",
    "key_multiplier",
    "key_uniform",
    "stream_multiplier",
]

#: how many trailing dimensions share one mask value, by dropout class name
feature_dims: dict[str, int] = {"Dropout": 0, "Dropout1d": 1, "Dropout2d": 2, "Dropout3d": 3}

_MASK32 = 0xFFFFFFFF
# Odd multipliers below 2**31: (value < 2**32) * multiplier < 2**63 never overflows int64.
_ROUND_1 = 0x7FEB352D
_ROUND_2 = 0x5851F42D
_ROUND_3 = 0x2545F491
_GOLDEN = 0x9E3779B9  # spreads consecutive layer indices over 32 bits
# The element hash's multipliers: odd and below 2**31, like the rounds' above.
_ELEMENT_1 = 0x21F0AAAD
_ELEMENT_2 = 0x735A2D97
_UNIFORM_BITS = 24  # resolution of the uniform number compared with p
_MAX_ELEMENTS = 1 << 32  # element indices must fit the hash's 32-bit words


def _fold(h: Tensor, multiplier: int) -> Tensor:
    """One mixing round of the key derivation: ``(h * m) mod 2**32`` xor the product's high half.

    ``h`` holds values in ``[0, 2**32)``; the result does too. The product's low half spreads low
    input bits upwards, the high half brings every input bit back down. One round alone mixes
    poorly (inputs that differ in low bits stay related); the derivation always runs two or more
    rounds after anything that varies.
    """
    h = h * multiplier
    return (h ^ (h >> 32)) & _MASK32


def _layer_word(salt: int) -> int:
    """The 32-bit word that makes one dropout layer's stream differ from the others'."""
    return ((salt + 1) * _GOLDEN) & _MASK32


def _member_keys(seed: Tensor, calls: Tensor, salt: int) -> tuple[Tensor, Tensor]:
    """Two 32-bit keys from (seed, call count, layer salt), one value per member.

    ``seed`` and ``calls`` are non-negative ``int64`` (0-dim per member, or ``[*K]``). The first
    key absorbs the layer, both halves of the seed and the low half of the count; the second
    goes on from it with the count's high half (zero for the first ``2**32`` calls), so every
    (seed, calls, salt) gets its own pair of keys. Few ops: this runs once per layer and call.
    """
    return _derive_keys(seed, calls, salt, _fold)


def _derive_keys(seed: Any, calls: Any, salt: int, fold: Any) -> tuple[Any, Any]:
    """:func:`_member_keys`' arithmetic on torch tensors or NumPy arrays, with ``fold`` the
    mixing round for that kind (:func:`_fold` or :func:`_fold_np`)."""
    k = fold((seed & _MASK32) ^ _layer_word(salt), _ROUND_1)
    k = fold(k ^ (seed >> 32), _ROUND_2)
    k1 = fold(k ^ (calls & _MASK32), _ROUND_3)
    k2 = fold(k1 ^ (calls >> 32), _ROUND_1)
    return k1, k2


def _check_numel(numel: int) -> None:
    if numel >= _MAX_ELEMENTS:
        raise FusionError(
            f"a dropout mask of {numel} elements per member is too large for the per-member "
            f"random stream (at most {_MAX_ELEMENTS - 1}); use smaller inputs per call"
        )


def dropout_mask_hash(seed: Tensor, calls: Tensor, salt: int, numel: int) -> Tensor:
    """32-bit hashes (``int64`` in ``[0, 2**32)``) of element indices ``0..numel-1``: shape
    ``[numel]`` for 0-dim ``seed`` and ``calls``, ``[*K, numel]`` for keys of shape ``[*K]``.

    The value of element j depends only on (seed, calls, salt, j): elementwise over an ``arange``,
    so it is the same whatever else is batched alongside (``vmap`` over members, or none). For
    fixed keys the element hash is a permutation of 32-bit words, so no two elements of one
    mask share a value; the second key, xored in between its two rounds, keeps the masks of two
    calls from being permutations of each other.
    """
    _check_numel(numel)
    k1, k2 = _member_keys(seed, calls, salt)
    h = torch.arange(numel, dtype=torch.int64, device=seed.device) ^ k1.unsqueeze(-1)
    return _hash_elements(h, k2.unsqueeze(-1), torch.empty_like(h))


def _hash_elements(h: Tensor, k2: Tensor, spare: Tensor) -> Tensor:
    """The element hash, in place on ``h`` (32-bit values in ``int64``, the index xor the first
    key), with ``k2`` the second key (broadcast against ``h``) and ``spare`` a buffer of
    ``h``'s shape. Each product is below ``2**63`` and is masked to its low 32 bits."""
    torch.bitwise_right_shift(h, 16, out=spare)
    h.bitwise_xor_(spare).mul_(_ELEMENT_1).bitwise_and_(_MASK32)
    h.bitwise_xor_(k2)
    torch.bitwise_right_shift(h, 15, out=spare)
    h.bitwise_xor_(spare).mul_(_ELEMENT_2).bitwise_and_(_MASK32)
    torch.bitwise_right_shift(h, 15, out=spare)
    return h.bitwise_xor_(spare)


def _hash_elements_np(h: np.ndarray, k2: np.ndarray, spare: np.ndarray) -> None:
    """:func:`_hash_elements` on NumPy ``uint32`` arrays, in place: the products wrap modulo
    ``2**32``, which is the masking above."""
    np.right_shift(h, 16, out=spare)
    np.bitwise_xor(h, spare, out=h)
    np.multiply(h, _U32_ELEMENT_1, out=h)
    np.bitwise_xor(h, k2, out=h)
    np.right_shift(h, 15, out=spare)
    np.bitwise_xor(h, spare, out=h)
    np.multiply(h, _U32_ELEMENT_2, out=h)
    np.right_shift(h, 15, out=spare)
    np.bitwise_xor(h, spare, out=h)


_U32_ELEMENT_1, _U32_ELEMENT_2 = np.uint32(_ELEMENT_1), np.uint32(_ELEMENT_2)


def _keep_threshold(p: Tensor) -> Tensor:
    """The smallest hash kept for probability ``p``: keep iff ``hash >> 8`` read as a 24-bit
    uniform in ``[0, 1)`` is ``>= p``. Exact in integers (``p * 2**24`` is exact in floating point),
    so ``p = 0`` keeps every element and ``p = 1`` none. Half precision would overflow at
    ``2**24``, so ``p`` is widened to at least float32 first."""
    p = p.to(torch.promote_types(p.dtype, torch.float32))
    ticks = torch.ceil(p * (1 << _UNIFORM_BITS)).to(torch.int64)
    return ticks << (32 - _UNIFORM_BITS)


def _scale(p: Tensor, dtype: torch.dtype) -> Tensor:
    """What a kept element is multiplied by: ``1 / (1 - p)``, or 0 where ``p = 1`` (nothing is
    kept; the division would be by zero)."""
    p = p.to(dtype)
    return torch.where(p < 1, 1 / (1 - p), torch.zeros_like(p))


@torch.library.custom_op("hfsweep::dropout_multiplier", mutates_args=())
def _multiplier_op(
    seed: Tensor, calls: Tensor, p: Tensor, salt: int, numel: int, dtype: torch.dtype
) -> Tensor:
    """``[*K, numel]`` in ``dtype``: per element 0 (dropped) or ``1 / (1 - p)`` (kept), for
    keys and probabilities of shape ``[*K]`` (0-dim for one member)."""
    if seed.device.type == "cpu":
        return _multiplier_cpu(seed, calls, p, salt, numel, dtype)
    keep = dropout_mask_hash(seed, calls, salt, numel) >= _keep_threshold(p).unsqueeze(-1)
    return keep * _scale(p, dtype).unsqueeze(-1)


def _fold_np(h: np.ndarray, multiplier: int) -> np.ndarray:
    """:func:`_fold` on a NumPy ``int64`` array (same values)."""
    h = h * multiplier
    return (h ^ (h >> 32)) & _MASK32


#: at most this many members derive their keys with Python ints (see :func:`_cpu_columns`)
_PYTHON_KEYS = 4

#: NumPy types of the dtypes whose scale NumPy computes as torch would (one correctly rounded
#: operation after another); others (``bfloat16``) take :func:`_scale`
_NUMPY_FLOATS: dict[torch.dtype, type[np.floating[Any]]] = {
    torch.float16: np.float16,
    torch.float32: np.float32,
    torch.float64: np.float64,
}


def _cpu_columns(
    seed: Tensor, calls: Tensor, p: Tensor, salt: int, dtype: torch.dtype
) -> tuple[np.ndarray, np.ndarray, np.ndarray, Tensor]:
    """:func:`_member_keys`, :func:`_keep_threshold` and :func:`_scale` for CPU tensors of one
    shape, as ``[K, 1]`` columns (keys and threshold in NumPy ``uint32``, the scale in
    ``dtype``).

    The same arithmetic in NumPy: a few dozen ops on one number per member, where each torch op
    would cost its dispatch (about 0.1 ms per layer and call for a small MLP's mask). A
    threshold above ``2**32 - 1`` (``p`` within ``2**-24`` of 1, or 1), which keeps nothing,
    does not fit 32 bits: it becomes ``2**32 - 1`` and that member's scale 0, so the one hash
    that passes it is dropped too. A threshold below 0 (a negative ``p``) keeps everything, as
    0 does.
    """
    if seed.numel() <= _PYTHON_KEYS:
        # a few members (an array of one, a small last rung): Python ints, exact as int64
        # here (every product stays below 2**63), beat two dozen NumPy calls
        pairs = [
            _derive_keys(a, b, salt, _fold_np)
            for a, b in zip(seed.reshape(-1).tolist(), calls.reshape(-1).tolist(), strict=True)
        ]
        k1 = np.array([a for a, _ in pairs], dtype=np.int64)
        k2 = np.array([b for _, b in pairs], dtype=np.int64)
    else:
        s = seed.reshape(-1).numpy().astype(np.int64, copy=False)
        c = calls.reshape(-1).numpy().astype(np.int64, copy=False)
        k1, k2 = _derive_keys(s, c, salt, _fold_np)
    column = p.reshape(-1, 1)
    p_np = column.numpy() if column.dtype in _NUMPY_FLOATS else None
    p64 = p_np.astype(np.float64) if p_np is not None else column.to(torch.float64).numpy()
    wide = np.ceil(p64 * (1 << _UNIFORM_BITS)).astype(np.int64) << (32 - _UNIFORM_BITS)
    threshold = np.minimum(np.maximum(wide, 0), _MASK32).astype(np.uint32)
    np_float = _NUMPY_FLOATS.get(dtype)
    if np_float is None:
        scale = _scale(column, dtype)
    else:
        # numpy and torch both round a float conversion to nearest even: the same q
        q = p_np.astype(np_float, copy=False) if p_np is not None else column.to(dtype).numpy()
        out = np.zeros_like(q)
        scale = torch.from_numpy(np.divide(np_float(1), np_float(1) - q, out=out, where=q < 1))
    keeps_none = wide > _MASK32
    if keeps_none.any():
        scale = scale.masked_fill(torch.from_numpy(keeps_none), 0)
    return (
        k1.reshape(-1, 1).astype(np.uint32),
        k2.reshape(-1, 1).astype(np.uint32),
        threshold,
        scale,
    )


#: elements per block of the CPU hash: 1 MiB of ``uint32``, which stays in cache through the
#: hash's passes
_BLOCK = 1 << 18


def _multiplier_cpu(
    seed: Tensor, calls: Tensor, p: Tensor, salt: int, numel: int, dtype: torch.dtype
) -> Tensor:
    """The op's result on the CPU: the same values as :func:`dropout_mask_hash` (checked in the
    tests), hashed in NumPy ``uint32``. ``benchmarks/dropout_masks.py`` compares the op with
    the same hash in torch's ``int64`` ops (its definition) and with ``torch.bernoulli``."""
    if seed.shape == calls.shape == p.shape:
        keys = seed.shape
    else:
        keys = torch.broadcast_shapes(seed.shape, calls.shape, p.shape)
        seed, calls, p = seed.expand(keys), calls.expand(keys), p.expand(keys)
    out = torch.empty(math.prod(keys), numel, dtype=dtype)
    if out.numel() == 0:
        return out.view(*keys, numel)
    k1, k2, threshold, scale = _cpu_columns(seed, calls, p, salt, dtype)
    _fill_numpy(k1, k2, threshold, scale, out)
    return out.view(*keys, numel)


def _block_shape(rows: int, numel: int) -> tuple[int, int]:
    """``(rows, columns)`` of the largest block of a ``[rows, numel]`` mask: whole rows grouped
    while a row fits ``_BLOCK`` elements, else one row in pieces."""
    cols = min(numel, _BLOCK)
    return min(rows, max(1, _BLOCK // cols)), cols


def _blocks(rows: int, numel: int) -> Iterator[tuple[int, int, int, int]]:
    """``(r0, r1, c0, c1)`` of the blocks of a ``[rows, numel]`` mask (:func:`_block_shape`)."""
    step, cols = _block_shape(rows, numel)
    for c0 in range(0, numel, cols):
        for r0 in range(0, rows, step):
            yield r0, min(rows, r0 + step), c0, min(numel, c0 + cols)


def _fill_numpy(
    k1: np.ndarray, k2: np.ndarray, threshold: np.ndarray, scale: Tensor, out: Tensor
) -> None:
    """``out[K, numel]`` = the multipliers, from ``uint32`` ``[K, 1]`` key and threshold
    columns and the ``[K, 1]`` scale, block by block in reused NumPy buffers."""
    rows, numel = out.shape
    np_out = out.numpy() if out.dtype in _NUMPY_FLOATS else None
    np_scale = scale.numpy() if np_out is not None else None
    shape = _block_shape(rows, numel)
    h, spare, keep = np.empty(shape, np.uint32), np.empty(shape, np.uint32), np.empty(shape, bool)
    for r0, r1, c0, c1 in _blocks(rows, numel):
        x, y, kept = (
            h[: r1 - r0, : c1 - c0],
            spare[: r1 - r0, : c1 - c0],
            keep[: r1 - r0, : c1 - c0],
        )
        np.bitwise_xor(np.arange(c0, c1, dtype=np.uint32), k1[r0:r1], out=x)
        _hash_elements_np(x, k2[r0:r1], y)
        np.greater_equal(x, threshold[r0:r1], out=kept)
        if np_out is not None and np_scale is not None:
            np.multiply(kept, np_scale[r0:r1], out=np_out[r0:r1, c0:c1])
        else:
            torch.mul(torch.from_numpy(kept), scale[r0:r1], out=out[r0:r1, c0:c1])


@_multiplier_op.register_fake
def _multiplier_fake(
    seed: Tensor, calls: Tensor, p: Tensor, salt: int, numel: int, dtype: torch.dtype
) -> Tensor:
    keys = torch.broadcast_shapes(seed.shape, calls.shape, p.shape)
    return seed.new_empty((*keys, numel), dtype=dtype)


def _front(info: Any, t: Tensor, dim: int | None) -> Tensor:
    """A vmap rule's key tensor with the member dimension first (expanded if it has none)."""
    return t.expand(info.batch_size, *t.shape) if dim is None else t.movedim(dim, 0)


def _multiplier_vmap(
    info: Any,
    in_dims: tuple[int | None, ...],
    seed: Tensor,
    calls: Tensor,
    p: Tensor,
    salt: int,
    numel: int,
    dtype: torch.dtype,
) -> tuple[Tensor, int]:
    """Every member's multiplier from one call of the op on ``[B, ...]`` keys."""

    seed, calls, p = (_front(info, t, d) for t, d in zip((seed, calls, p), in_dims, strict=False))
    return _multiplier_op(seed, calls, p, salt, numel, dtype), 0


_multiplier_op.register_vmap(_multiplier_vmap)


@torch.library.custom_op("hfsweep::dropout_apply", mutates_args=())
def _apply_op(input: Tensor, multiplier: Tensor, member_dims: int) -> tuple[Tensor, Tensor, Tensor]:
    """``input * multiplier`` (broadcast), where ``multiplier`` holds per element 0 or its
    member's scale and its first ``member_dims`` dimensions index members (0 for one member;
    each ``vmap`` level's rule adds one); with it, what the backward keeps instead of
    ``multiplier``: the ``bool`` mask (``multiplier != 0``) and each member's scale
    (:func:`_member_scales`). One op for the three, so that a step dispatches one operator per
    dropout, as ``input * multiplier`` did."""
    return _apply(input, multiplier, member_dims)


def _apply(input: Tensor, multiplier: Tensor, member_dims: int) -> tuple[Tensor, Tensor, Tensor]:
    """The arithmetic of ``hfsweep::dropout_apply``, on real tensors or fake ones."""
    return input * multiplier, multiplier.bool(), _member_scales(multiplier, member_dims)


@_apply_op.register_fake
def _apply_fake(
    input: Tensor, multiplier: Tensor, member_dims: int
) -> tuple[Tensor, Tensor, Tensor]:
    # the op's own arithmetic on fake tensors: each output has the strides the kernels give it
    # (a product follows a permuted input's layout), which a compiled graph checks at run time
    return _apply(input, multiplier, member_dims)


def _member_scales(multiplier: Tensor, member_dims: int) -> Tensor:
    """Each member's scale, shaped to broadcast against ``multiplier``: the largest of its
    elements (its scale, or 0 where it keeps nothing, which ``mask * 0`` gives as well). A
    member of one element, or an empty multiplier, is its own scale (a copy: an op's outputs
    may not alias its inputs)."""
    dims = tuple(range(member_dims, multiplier.dim()))
    if not dims or multiplier.numel() == 0:
        return multiplier.clone()
    return multiplier.amax(dim=dims, keepdim=True)


def _apply_setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    input, _, _ = inputs
    _, keep, scale = output
    ctx.mark_non_differentiable(keep, scale)
    ctx.set_materialize_grads(False)  # no zeros made for the mask's and scales' gradients
    ctx.input_shape = input.shape
    if ctx.needs_input_grad[0]:
        ctx.save_for_backward(keep, scale)


def _apply_backward(ctx: Any, grad: Tensor | None, *_: Any) -> tuple[Tensor | None, None, None]:
    if not ctx.needs_input_grad[0] or grad is None:
        return None, None, None
    keep, scale = ctx.saved_tensors
    grad_input = _masked_scaled_op(grad, keep, scale)
    if grad_input.shape != ctx.input_shape:  # an input broadcast against the multiplier
        grad_input = grad_input.sum_to_size(ctx.input_shape)
    return grad_input, None, None


_apply_op.register_autograd(_apply_backward, setup_context=_apply_setup_context)


@torch.library.custom_op("hfsweep::dropout_apply_backward", mutates_args=())
def _masked_scaled_op(grad: Tensor, keep: Tensor, scale: Tensor) -> Tensor:
    """``grad * multiplier`` from the mask and the scales, bit for bit: ``(grad * keep) *
    scale`` (``grad * 1`` is ``grad``; ``grad * 0`` keeps its sign, infinities and NaN, which
    a positive scale, or a zero one where nothing is kept, leave as they are). On the CPU in
    NumPy, whose mixed float-times-bool loop and in-place scaling take a fraction of torch's
    (``benchmarks/dropout_apply.py``); elsewhere in torch, ``grad * (keep * scale)``."""
    if not _in_numpy(grad):
        return grad * (keep * scale)
    out = torch.empty(torch.broadcast_shapes(grad.shape, keep.shape), dtype=grad.dtype)
    if out.numel():
        np_out = out.numpy()
        with np.errstate(all="ignore"):  # inf * 0 is NaN, as torch gives it, silently
            np.multiply(grad.numpy(), keep.numpy(), out=np_out)
            np.multiply(np_out, scale.numpy(), out=np_out)
    return out


def _in_numpy(grad: Tensor) -> bool:
    """Whether ``hfsweep::dropout_apply_backward`` computes ``grad``'s product in NumPy (a CPU
    tensor of a dtype NumPy has), which its fake kernel must know for the output's layout."""
    return grad.device.type == "cpu" and grad.dtype in _NUMPY_FLOATS


@_masked_scaled_op.register_fake
def _masked_scaled_fake(grad: Tensor, keep: Tensor, scale: Tensor) -> Tensor:
    # the layout of the op's branch for these tensors: torch's product follows the gradient's
    # strides, NumPy's writes a new contiguous tensor
    if not _in_numpy(grad):
        return grad * (keep * scale)
    return grad.new_empty(torch.broadcast_shapes(grad.shape, keep.shape))


def _masked_scaled_setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    _, keep, scale = inputs
    ctx.save_for_backward(keep, scale)


def _masked_scaled_backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
    # linear in the gradient: its own gradient is the same product (a double backward)
    keep, scale = ctx.saved_tensors
    return _masked_scaled_op(grad, keep, scale), None, None


_masked_scaled_op.register_autograd(
    _masked_scaled_backward, setup_context=_masked_scaled_setup_context
)


def _batch_front(t: Tensor, dim: int | None, rank: int) -> Tensor:
    """A vmap rule's operand with its member dimension first and, after it, as many size-1
    dimensions as it has fewer than ``rank`` (so that operands broadcast as they do per member);
    an operand without a member dimension as it is."""
    if dim is None:
        return t
    if dim != 0:
        t = t.movedim(dim, 0)
    while t.dim() <= rank:
        t = t.unsqueeze(1)
    return t


def _apply_vmap(
    info: Any, in_dims: tuple[int | None, ...], input: Tensor, multiplier: Tensor, member_dims: int
) -> tuple[tuple[Tensor, Tensor, Tensor], tuple[int | None, ...]]:
    """Every member's product, mask and scale from one call of the op, the member dimension
    in front."""
    input_dim, multiplier_dim, _ = in_dims
    if input_dim is None and multiplier_dim is None:
        return _apply_op(input, multiplier, member_dims), (None, None, None)
    rank = max(
        input.dim() - (input_dim is not None), multiplier.dim() - (multiplier_dim is not None)
    )
    out = _apply_op(
        _batch_front(input, input_dim, rank),
        _batch_front(multiplier, multiplier_dim, rank),
        member_dims + (multiplier_dim is not None),
    )
    mask_dim = None if multiplier_dim is None else 0
    return out, (0, mask_dim, mask_dim)


_apply_op.register_vmap(_apply_vmap)


def apply_multiplier(input: Tensor, multiplier: Tensor) -> Tensor:
    """``input * multiplier`` for a dropout multiplier (0 or the member's scale per element,
    from :func:`stream_multiplier` or :func:`key_multiplier`): the same values and gradients,
    while autograd keeps a 1-byte mask and the scales, not ``multiplier``."""
    return _apply_op(input, multiplier, 0)[0]


def stream_multiplier(
    module: nn.Module, shape: tuple[int, ...], dtype: torch.dtype, *, only_if_dropping: bool = False
) -> Tensor:
    """The next mask of ``module``'s per-member stream, scaled (``0`` or ``1 / (1 - p)`` per
    element), in ``shape``; advances the member's call count (with ``only_if_dropping``, only
    for members whose ``p`` is above 0). ``module`` holds the stream (``member_p``,
    ``member_seed``, ``member_calls`` and ``_hfsweep_salt``): a fused dropout layer, or a fused
    ``MultiheadAttention`` for its attention weights."""
    multiplier = _drawn(
        shape,
        0,
        lambda numel: _multiplier_op(
            module.get_buffer("member_seed"),
            module.get_buffer("member_calls"),
            module.get_buffer("member_p"),
            int(getattr(module, "_hfsweep_salt", 0)),
            numel,
            dtype,
        ),
    )
    p = module.get_buffer("member_p")
    module.get_buffer("member_calls").add_((p > 0).to(torch.int64) if only_if_dropping else 1)
    return multiplier


def _drawn(shape: tuple[int, ...], dim: int, draw: Callable[[int], Tensor]) -> Tensor:
    """``draw(numel)`` (flat, element j keyed by its index j) viewed as ``shape``. Inside a
    data-parallel shard (:func:`~hfsweep.nn._shard.batch_shard`) whose size dimension ``dim``
    of ``shape`` has, the draw is of the global batch's shape and this worker's rows are kept:
    the values the 1-worker run draws for them."""
    wide = global_shape(shape, dim)
    if wide is None:
        numel = math.prod(shape)
        _check_numel(numel)
        return draw(numel).view(shape)
    full, offset, rows = wide
    numel = math.prod(full)
    _check_numel(numel)
    return draw(numel).view(full).narrow(dim, offset, rows)


class FusedDropoutMixin(nn.Module):
    """Forward of ``nn.Dropout``/``Dropout1d/2d/3d`` with the probability read from ``member_p``
    and the mask from the member's own stream (``member_seed``, ``member_calls``).

    A training-mode forward advances ``member_calls`` by one; eval mode is the identity.
    """

    member_p: Tensor
    member_seed: Tensor
    member_calls: Tensor
    inplace: bool
    _hfsweep_feature_dims: int = 0
    _hfsweep_salt: int = 0

    def forward(self, input: Tensor) -> Tensor:
        if not self.training:
            return input
        k = self._hfsweep_feature_dims
        shape = input.shape if k == 0 else (*input.shape[: input.dim() - k], *([1] * k))
        return apply_multiplier(input, stream_multiplier(self, tuple(shape), input.dtype))


@torch.library.custom_op("hfsweep::uniform", mutates_args=())
def _uniform_op(seed: Tensor, calls: Tensor, salt: int, numel: int, dtype: torch.dtype) -> Tensor:
    """``[*K, numel]`` uniform numbers in ``[0, 1)`` of ``dtype`` from the same stream as the
    dropout masks: element j is the top 24 bits of its hash over ``2**24`` (the resolution of
    ``torch.rand`` in float32), for keys of shape ``[*K]``. A dtype with fewer significant bits
    (half precision) takes that many, so that no number rounds up to 1."""
    bits = min(_UNIFORM_BITS, 1 - int(math.log2(torch.finfo(dtype).eps)))
    uniform = (dropout_mask_hash(seed, calls, salt, numel) >> (32 - bits)).to(dtype)
    return uniform / (1 << bits)


@_uniform_op.register_fake
def _uniform_fake(seed: Tensor, calls: Tensor, salt: int, numel: int, dtype: torch.dtype) -> Tensor:
    keys = torch.broadcast_shapes(seed.shape, calls.shape)
    return seed.new_empty((*keys, numel), dtype=dtype)


def _uniform_vmap(
    info: Any,
    in_dims: tuple[int | None, ...],
    seed: Tensor,
    calls: Tensor,
    salt: int,
    numel: int,
    dtype: torch.dtype,
) -> tuple[Tensor, int]:
    """Every member's numbers from one call of the op on ``[B]`` keys."""

    seed, calls = (_front(info, t, d) for t, d in zip((seed, calls), in_dims, strict=False))
    return _uniform_op(seed, calls, salt, numel, dtype), 0


_uniform_op.register_vmap(_uniform_vmap)


def key_multiplier(
    seed: Tensor, calls: Tensor, p: Tensor, salt: int, shape: tuple[int, ...], dtype: torch.dtype
) -> Tensor:
    """A mask of the stream keyed by (``seed``, ``calls``, ``salt``), scaled (``0`` or
    ``1 / (1 - p)`` per element), in ``shape``: :func:`stream_multiplier` for a stream that
    is not one layer's (the functional dropout calls of a forward)."""
    return _drawn(shape, 0, lambda numel: _multiplier_op(seed, calls, p, salt, numel, dtype))


def key_uniform(
    seed: Tensor,
    calls: Tensor,
    salt: int,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    batch_dim: int = 0,
) -> Tensor:
    """Uniform numbers in ``[0, 1)`` in ``shape`` from the stream keyed by (``seed``,
    ``calls``, ``salt``): ``torch.rand`` drawn from a member's own stream. ``batch_dim`` is the
    dimension of ``shape`` that holds the batch (a data-parallel worker keeps its rows of it)."""
    return _drawn(shape, batch_dim, lambda numel: _uniform_op(seed, calls, salt, numel, dtype))
