"""hfsweep's custom operators pass ``torch.library.opcheck``: schema, autograd registration,
fake (meta) kernels against the real ones, and AOTAutograd, on contiguous and on permuted
(non-contiguous) inputs.

A fake kernel whose outputs' strides differ from the real kernel's is what a compiled graph
(``compile=True``) trips on at run time: inductor checks every custom op's output against its
fake one. ``dropout_apply``'s fake once gave a contiguous product where the real one follows a
permuted input's layout (a Transformer's attention output), and every compiled Transformer ran
uncompiled.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import hfsweep.nn  # noqa: F401  (registers the operators)

ops = torch.ops.hfsweep


def _activations(permuted: bool) -> torch.Tensor:
    """``[2, 4, 8, 16]`` in float64, contiguous or with its two middle dimensions swapped in
    memory (as an attention output is)."""
    if permuted:
        return torch.randn(2, 8, 4, 16, dtype=torch.float64).transpose(1, 2)
    return torch.randn(2, 4, 8, 16, dtype=torch.float64)


def _keys(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.arange(n, dtype=torch.int64) + 11, torch.arange(n, dtype=torch.int64)


def _multiplier(shape: tuple[int, ...]) -> torch.Tensor:
    keep = torch.rand(shape, generator=torch.Generator().manual_seed(0)) > 0.3
    return keep.double() * 1.25


CASES: dict[str, Callable[[bool], tuple[Any, tuple[Any, ...]]]] = {
    "dropout_apply": lambda permuted: (
        ops.dropout_apply.default,
        (
            _activations(permuted).requires_grad_(),
            _multiplier((2, 1, 1, 16)),
            1,
        ),
    ),
    "dropout_apply_backward": lambda permuted: (
        ops.dropout_apply_backward.default,
        (
            _activations(permuted),
            _multiplier((2, 4, 8, 16)) != 0,
            torch.full((2, 1, 1, 1), 1.25, dtype=torch.float64),
        ),
    ),
    "dropout_apply_backward_float32": lambda permuted: (
        ops.dropout_apply_backward.default,
        (
            _activations(permuted).float(),
            _multiplier((2, 4, 8, 16)) != 0,
            torch.full((2, 1, 1, 1), 1.25),
        ),
    ),
    # bfloat16 (no NumPy type): torch's product, whose layout follows the gradient's
    "dropout_apply_backward_bfloat16": lambda permuted: (
        ops.dropout_apply_backward.default,
        (
            _activations(permuted).bfloat16(),
            _multiplier((2, 4, 8, 16)) != 0,
            torch.full((2, 1, 1, 1), 1.25, dtype=torch.bfloat16),
        ),
    ),
    "dropout_multiplier": lambda permuted: (
        ops.dropout_multiplier.default,
        (*_keys(3), torch.tensor([0.1, 0.5, 0.0], dtype=torch.float64), 7, 40, torch.float32),
    ),
    "uniform": lambda permuted: (ops.uniform.default, (*_keys(3), 7, 40, torch.float32)),
    "linear": lambda permuted: (
        ops.linear.default,
        (
            _activations(permuted).requires_grad_(),
            torch.randn(32, 16, dtype=torch.float64, requires_grad=True),
            torch.randn(32, dtype=torch.float64, requires_grad=True),
        ),
    ),
}


@pytest.mark.parametrize("permuted", [False, True], ids=["contiguous", "permuted"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_custom_op_passes_opcheck(name: str, permuted: bool) -> None:
    op, args = CASES[name](permuted)
    torch.library.opcheck(op, args)
