"""Dropout with one probability and one deterministic random stream per member.

Under ``vmap`` a Python float ``p`` is the same for every member, so HFTA could not sweep it. Here
``p`` lives in a ``[B]`` buffer (``member_p``).

Masks do not come from torch's global generator, whose draws under ``vmap`` depend on the array
size and on a member's slot. Each member has a seed (``member_seed``) and a count of the training
forwards it has run through the layer (``member_calls``); the mask is a counter-based hash of
(seed, count, the layer's salt, element index). So member i's masks are the same in an array of 1
and of 8, in any slot, traced or eager, on CPU or CUDA, and a checkpoint of seed and count resumes
them exactly.

The hash works on 32-bit values held in ``int64`` tensors. Each mixing round multiplies a value
below ``2**32`` by an odd constant below ``2**31`` (the product stays below ``2**63``, so no signed
overflow, which C++ leaves undefined) and folds the high half of the product into the low half.
Per element that is a dozen or so in-place integer ops; the keys add about two dozen ops on one
number per member, per layer and call. On the CPU the keys, and the whole hash of a small mask,
are computed with NumPy, whose ops on a few thousand elements cost a fraction of a torch op's
dispatch; large masks are hashed by torch in cache-sized blocks (its threads help there).

The mask and scale come from one custom op (``hfsweep::dropout_multiplier``) whose batching rule
computes every member's at once. Under ``vmap`` each of the fifty-odd small ops would otherwise
pass through the batching layer, and a traced array forward would record each of them: in a
small MLP the dropout layer took about 85% of the time to trace the whole forward.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from .._errors import FusionError

__all__ = ["FusedDropoutMixin", "dropout_mask_hash", "feature_dims", "stream_multiplier"]

#: how many trailing dimensions share one mask value, by dropout class name
feature_dims: dict[str, int] = {"Dropout": 0, "Dropout1d": 1, "Dropout2d": 2, "Dropout3d": 3}

_MASK32 = 0xFFFFFFFF
# Odd multipliers below 2**31: (value < 2**32) * multiplier < 2**63 never overflows int64.
_ROUND_1 = 0x7FEB352D
_ROUND_2 = 0x5851F42D
_ROUND_3 = 0x2545F491
_GOLDEN = 0x9E3779B9  # spreads consecutive layer indices over 32 bits
_UNIFORM_BITS = 24  # resolution of the uniform number compared with p
_MAX_ELEMENTS = 1 << 32  # element indices must fit the hash's 32-bit words


def _fold(h: Tensor, multiplier: int) -> Tensor:
    """One mixing round, in place: ``(h * m) mod 2**32`` xor the product's high half.

    ``h`` holds values in ``[0, 2**32)``; the result does too. The product's low half spreads low
    input bits upwards, the high half brings every input bit back down. One round alone mixes
    poorly (inputs that differ in low bits stay related); the hash always runs two or more
    rounds after anything that varies. A round is not one-to-one, so two elements share a 32-bit
    value a few times more often than independent draws would; with 24-bit uniforms, which
    independent draws tie far more often, that cannot be seen in a mask.
    """
    return _fold_into(h, multiplier, torch.empty_like(h))


def _fold_into(h: Tensor, multiplier: int, spare: Tensor) -> Tensor:
    """:func:`_fold` with the product's high half written to ``spare`` (same shape)."""
    h.mul_(multiplier)
    torch.bitwise_right_shift(h, 32, out=spare)
    h.bitwise_xor_(spare)
    return h.bitwise_and_(_MASK32)


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
    so it is the same whatever else is batched alongside (``vmap`` over members, or none).
    Each key is followed by at least two mixing rounds, and the second key, injected between
    rounds, keeps the masks of two calls from being permutations of each other.
    """
    _check_numel(numel)
    k1, k2 = _member_keys(seed, calls, salt)
    h = torch.arange(numel, dtype=torch.int64, device=seed.device) ^ k1.unsqueeze(-1)
    _fold(h, _ROUND_2)
    h.bitwise_xor_(k2.unsqueeze(-1))
    _fold(h, _ROUND_3)
    return _fold(h, _ROUND_1)


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


def _fold_np_into(h: np.ndarray, multiplier: int, spare: np.ndarray) -> None:
    """:func:`_fold_into` on NumPy ``int64`` arrays, in place."""
    np.multiply(h, multiplier, out=h)
    np.right_shift(h, 32, out=spare)
    np.bitwise_xor(h, spare, out=h)
    np.bitwise_and(h, _MASK32, out=h)


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
    shape, as ``[K, 1]`` columns (keys and threshold in NumPy, the scale in ``dtype``).

    The same arithmetic in NumPy: a few dozen ops on one number per member, where each torch op
    would cost its dispatch (about 0.1 ms per layer and call for a small MLP's mask).
    """
    s = seed.reshape(-1).numpy().astype(np.int64)
    c = calls.reshape(-1).numpy().astype(np.int64)
    k1, k2 = _derive_keys(s, c, salt, _fold_np)
    p64 = p.reshape(-1, 1).to(torch.float64).numpy()
    threshold = np.ceil(p64 * (1 << _UNIFORM_BITS)).astype(np.int64) << (32 - _UNIFORM_BITS)
    np_float = _NUMPY_FLOATS.get(dtype)
    if np_float is None:
        scale = _scale(p.reshape(-1, 1), dtype)
    else:
        q = p.reshape(-1, 1).to(dtype).numpy()
        with np.errstate(divide="ignore"):
            scale = torch.from_numpy(np.where(q < 1, np_float(1) / (np_float(1) - q), np_float(0)))
    return k1.reshape(-1, 1), k2.reshape(-1, 1), threshold, scale


#: masks of at most this many elements in all are hashed in NumPy, larger ones by torch in
#: blocks (measured on the 2-core CPU: 3 x 4096 elements in 0.16 ms against 0.56 ms, 32 x 4096
#: in 0.78 ms against 1.0 ms; at 8 x 65536 torch's threads are ahead)
_NUMPY_ELEMENTS = 1 << 16

#: elements per block of :func:`_multiplier_blocked`: 2 MiB of ``int64``, which stays in cache
#: through the hash's dozen passes (measured on the 2-core CPU: 8 masks of 1M elements in 61 ms
#: by blocks of 2**18, 253 ms whole, 80 ms for ``torch.bernoulli_`` of the same size)
_BLOCK = 1 << 18


def _multiplier_cpu(
    seed: Tensor, calls: Tensor, p: Tensor, salt: int, numel: int, dtype: torch.dtype
) -> Tensor:
    """The op's result on the CPU: the same values as :func:`dropout_mask_hash` (checked in the
    tests), hashed in NumPy for a small mask, else by :func:`_multiplier_blocked`."""
    if seed.shape == calls.shape == p.shape:
        keys = seed.shape
    else:
        keys = torch.broadcast_shapes(seed.shape, calls.shape, p.shape)
        seed, calls, p = seed.expand(keys), calls.expand(keys), p.expand(keys)
    if seed.numel() == 0 or numel == 0:
        return torch.empty(*keys, numel, dtype=dtype)
    k1, k2, threshold, scale = _cpu_columns(seed, calls, p, salt, dtype)
    rows = k1.shape[0]
    if rows * numel > _NUMPY_ELEMENTS:
        k1_t, k2_t, threshold_t = (torch.from_numpy(a) for a in (k1, k2, threshold))
        return _multiplier_blocked(k1_t, k2_t, threshold_t, scale, numel, dtype).view(*keys, numel)
    h = np.bitwise_xor(np.arange(numel, dtype=np.int64), k1)
    spare = np.empty_like(h)
    _fold_np_into(h, _ROUND_2, spare)
    np.bitwise_xor(h, k2, out=h)
    _fold_np_into(h, _ROUND_3, spare)
    _fold_np_into(h, _ROUND_1, spare)
    keep = torch.from_numpy(np.greater_equal(h, threshold))
    return torch.mul(keep, scale).view(*keys, numel)


def _multiplier_blocked(
    k1: Tensor, k2: Tensor, threshold: Tensor, scale: Tensor, numel: int, dtype: torch.dtype
) -> Tensor:
    """``[K, numel]`` multipliers from ``[K, 1]`` key, threshold and scale columns, hashed
    block by block, each block through every pass of the hash before the next, in two reused
    buffers: without a dozen trips through memory for a large mask."""
    rows = k1.shape[0]
    out = torch.empty(rows, numel, dtype=dtype)
    if out.numel() == 0:
        return out
    cols = min(numel, _BLOCK)
    step = max(1, _BLOCK // cols)  # rows per block
    h = torch.empty(min(rows, step), cols, dtype=torch.int64)
    spare = torch.empty_like(h)
    for c0 in range(0, numel, cols):
        c1 = min(numel, c0 + cols)
        index = torch.arange(c0, c1, dtype=torch.int64)
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            x, y = h[: r1 - r0, : c1 - c0], spare[: r1 - r0, : c1 - c0]
            torch.bitwise_xor(index, k1[r0:r1], out=x)
            _fold_into(x, _ROUND_2, y)
            x.bitwise_xor_(k2[r0:r1])
            _fold_into(x, _ROUND_3, y)
            _fold_into(x, _ROUND_1, y)
            torch.mul(x >= threshold[r0:r1], scale[r0:r1], out=out[r0:r1, c0:c1])
    return out


@_multiplier_op.register_fake
def _multiplier_fake(
    seed: Tensor, calls: Tensor, p: Tensor, salt: int, numel: int, dtype: torch.dtype
) -> Tensor:
    keys = torch.broadcast_shapes(seed.shape, calls.shape, p.shape)
    return seed.new_empty((*keys, numel), dtype=dtype)


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

    def front(t: Tensor, dim: int | None) -> Tensor:
        return t.expand(info.batch_size, *t.shape) if dim is None else t.movedim(dim, 0)

    seed, calls, p = (front(t, d) for t, d in zip((seed, calls, p), in_dims[:3], strict=True))
    return _multiplier_op(seed, calls, p, salt, numel, dtype), 0


_multiplier_op.register_vmap(_multiplier_vmap)


def stream_multiplier(
    module: nn.Module, shape: tuple[int, ...], dtype: torch.dtype, *, only_if_dropping: bool = False
) -> Tensor:
    """The next mask of ``module``'s per-member stream, scaled (``0`` or ``1 / (1 - p)`` per
    element), in ``shape``; advances the member's call count (with ``only_if_dropping``, only
    for members whose ``p`` is above 0). ``module`` holds the stream (``member_p``,
    ``member_seed``, ``member_calls`` and ``_hfsweep_salt``): a fused dropout layer, or a fused
    ``MultiheadAttention`` for its attention weights."""
    numel = math.prod(shape)
    _check_numel(numel)
    multiplier = _multiplier_op(
        module.get_buffer("member_seed"),
        module.get_buffer("member_calls"),
        module.get_buffer("member_p"),
        int(getattr(module, "_hfsweep_salt", 0)),
        numel,
        dtype,
    )
    p = module.get_buffer("member_p")
    module.get_buffer("member_calls").add_((p > 0).to(torch.int64) if only_if_dropping else 1)
    return multiplier.view(shape)


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
        return input * stream_multiplier(self, tuple(shape), input.dtype)
