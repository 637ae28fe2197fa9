"""Per-member dropout streams: each member's dropout layers and attention draw masks from its own
deterministic stream (a seed and a call count per layer); the checks and writes behind
``FusedArray.manual_seed``, ``rng_state``, ``set_rng_state`` and ``set_dropout``."""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from .._errors import FusionError
from ._check import describe_path

_STREAM_LIMIT = 1 << 63  # seeds and call counts are non-negative int64


def _is_attention(module: nn.Module) -> bool:
    from ..nn import FusedMultiheadAttentionMixin

    return isinstance(module, FusedMultiheadAttentionMixin)


#: attention layers' stream salts start here (dropout layers' are their index, from 0)
_ATTENTION_SALTS = 1 << 20


def _stream_probability(module: nn.Module, attr: str, path: str) -> float:
    """A stream layer's probability, checked: torch's dropout layers refuse one outside
    [0, 1] when built, but ``MultiheadAttention`` keeps any float."""
    p = float(getattr(module, attr))
    if not 0.0 <= p <= 1.0:
        raise FusionError(
            f"{describe_path(path)} ({type(module).__name__}): {attr}={p} is not a probability "
            "in [0, 1]"
        )
    return p


def _update_attention_masks(attention: nn.Module) -> None:
    """Whether a fused attention layer draws masks: only while some member's ``p`` is above 0,
    so arrays without attention dropout skip the masks (a plain attribute: part of the trace
    key, so a change is traced anew)."""
    attention.__dict__["hfsweep_masks"] = bool((attention.get_buffer("member_p") > 0).any())


def _check_stream_value(what: str, value: Any) -> int:
    """``value`` as a dropout-stream int in ``[0, 2**63)``, or an error naming it.

    Anything integer-like (``int``, NumPy integers) is accepted; ``bool`` and floats are not.
    """
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(f"{what} must be an int in [0, 2**63), got {value!r}")
    number = operator.index(value)
    if not 0 <= number < _STREAM_LIMIT:
        raise ValueError(f"{what} must be an int in [0, 2**63), got {number}")
    return number


def _stream_entry(path: str, entry: Any) -> tuple[int, int]:
    """``(seed, calls)`` of one entry of an rng state, checked."""
    if isinstance(entry, str | bytes) or not isinstance(entry, Sequence) or len(entry) != 2:
        raise ValueError(f"rng state for {path!r} must be [seed, calls], got {entry!r}")
    seed = _check_stream_value(f"seed of {path!r}", entry[0])
    return seed, _check_stream_value(f"calls of {path!r}", entry[1])


def _write_stream(dropout: nn.Module, i: int, seed: int, calls: int) -> None:
    """Set member ``i``'s seed and call count in one fused dropout layer."""
    with torch.no_grad():
        dropout.get_buffer("member_seed")[i] = seed
        dropout.get_buffer("member_calls")[i] = calls


def _assign_dropout(
    dropouts: list[tuple[str, nn.Module]],
    size: int,
    p: Sequence[float] | Mapping[str, Sequence[float]],
) -> None:
    if isinstance(p, Mapping):
        known = dict(dropouts)
        targets = []
        for path, values in p.items():
            if path not in known:
                raise FusionError(
                    f"dropout[{path!r}]: no per-member dropout layer at that path; dropout layers "
                    f"are {sorted(known) or 'none'}"
                )
            targets.append((path, known[path], values))
    else:
        if not dropouts:
            raise FusionError(
                "dropout= was given but the model has no nn.Dropout/Dropout1d/2d/3d layer"
            )
        targets = [(path, m, p) for path, m in dropouts]
    for path, m, values in targets:
        vals = [float(v) for v in values]
        if len(vals) != size:
            raise FusionError(
                f"dropout for {describe_path(path)}: got {len(vals)} values for {size} members; "
                "give one probability per member"
            )
        bad = [v for v in vals if not 0.0 <= v <= 1.0]
        if bad:
            raise FusionError(
                f"dropout for {describe_path(path)}: {bad[0]} is not a probability in [0, 1]"
            )
        buf = m.get_buffer("member_p")
        with torch.no_grad():
            buf.copy_(torch.tensor(vals, dtype=buf.dtype))


def _peeked_seeds(size: int) -> Tensor:
    """Default seeds for a model whose only random draws are its forward's own calls: what
    ``torch.randint`` would draw, read from a copy of torch's generator, which stays as it was
    (fusing a model without dropout layers never moved it)."""
    generator = torch.Generator()
    generator.set_state(torch.get_rng_state())
    return torch.randint(0, _STREAM_LIMIT - 1, (size,), generator=generator)
