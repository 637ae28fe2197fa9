"""Conformance check: a fused array against B independent torch modules, step by step.

:func:`assert_fusion_matches` builds B independently initialised models, keeps untouched copies
as references, fuses the originals and then, for several training steps in train and in eval
mode, compares outputs, every parameter gradient and every buffer (BatchNorm running statistics)
of each member with its reference. Between steps both sides take the same plain SGD update, so
later steps run on trained, member-specific weights. Finally ``array.member(i)`` is exported and
its ``state_dict`` loaded into a fresh instance, which must reproduce member i's outputs.

Random layers (dropout) cannot match their references mask for mask; by default their
probabilities are set to 0 on both sides for the comparison (``zero_dropout=True``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from .._compat import pytree
from ..fusion import FusedArray, fuse

__all__ = ["assert_fusion_matches", "assert_trees_close"]

InputFactory = Callable[[torch.Generator], Sequence[Any]]


def assert_trees_close(actual: Any, expected: Any, *, rtol: float, atol: float, what: str) -> None:
    """Assert two output structures are equal: same structure, close floating tensors."""
    a_leaves, a_spec = pytree.tree_flatten(actual)
    e_leaves, e_spec = pytree.tree_flatten(expected)
    if a_spec != e_spec:
        raise AssertionError(f"{what}: output structure differs: {a_spec} vs {e_spec}")
    for k, (a, e) in enumerate(zip(a_leaves, e_leaves, strict=True)):
        if isinstance(e, Tensor):
            _close(a, e, rtol=rtol, atol=atol, what=f"{what} (output leaf {k})")
        elif a != e:
            raise AssertionError(f"{what} (output leaf {k}): {a!r} != {e!r}")


def _close(actual: Tensor, expected: Tensor, *, rtol: float, atol: float, what: str) -> None:
    if actual.shape != expected.shape:
        raise AssertionError(
            f"{what}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}"
        )
    if not expected.is_floating_point():
        if not torch.equal(actual, expected):
            raise AssertionError(f"{what}: integer values differ")
        return
    if not torch.allclose(actual, expected, rtol=rtol, atol=atol, equal_nan=True):
        diff = (actual - expected).abs()
        rel = diff / expected.abs().clamp_min(atol)
        raise AssertionError(
            f"{what}: max abs error {diff.max().item():.3e}, max rel error "
            f"{rel.max().item():.3e} (rtol={rtol}, atol={atol})"
        )


def _zero_dropout(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            m.p = 0.0
        if isinstance(m, nn.MultiheadAttention):
            m.dropout = 0.0
        if isinstance(m, nn.modules.rnn.RNNBase):
            m.dropout = 0.0


def _projection(out: Any, gen: torch.Generator) -> list[Tensor | None]:
    """Fixed random weights for each floating output leaf: the loss is sum(w * out)."""
    leaves = pytree.tree_leaves(out)
    return [
        torch.randn(x.shape, generator=gen, dtype=x.dtype).to(x.device)
        if isinstance(x, Tensor) and x.is_floating_point()
        else None
        for x in leaves
    ]


def _loss(out: Any, proj: list[Tensor | None]) -> Tensor:
    total: Tensor | None = None
    for x, w in zip(pytree.tree_leaves(out), proj, strict=True):
        if w is not None:
            term = (x * w).sum()
            total = term if total is None else total + term
    assert total is not None, "the model produced no floating output to differentiate"
    return total


def _member_tree(out: Any, i: int) -> Any:
    return pytree.tree_map(lambda x: x[i] if isinstance(x, Tensor) else x, out)


def assert_fusion_matches(
    make_model: Callable[[], nn.Module],
    make_input: InputFactory,
    *,
    size: int = 3,
    steps: int = 3,
    dtype: torch.dtype = torch.float64,
    rtol: float = 1e-7,
    atol: float = 1e-10,
    modes: Sequence[str] = ("train", "eval"),
    shared: bool = True,
    zero_dropout: bool = True,
    lr: float = 0.05,
    seed: int = 0,
    trace: bool = True,
    device: str | torch.device = "cpu",
    compile: bool | str = False,
) -> FusedArray:
    """Assert that a fused array of ``size`` models trains exactly like the models alone.

    Args:
        make_model: builds one model; called ``size`` times under different seeds, so members
            start from different weights, and once more for the state-dict round trip.
        make_input: ``generator -> positional args`` of one forward call (one member's input).
        shared: feed one input to all members (``array(x)``) or a different one to each
            (``array(xs, shared=False)``).
        zero_dropout: set every dropout probability to 0 on both sides (random masks cannot
            match); eval-mode comparisons are exact either way.
        rtol, atol: tolerances for outputs, gradients and buffers.
        trace, compile: passed to :func:`hfsweep.fuse` (the compiled path is checked against
            the same plain modules).

    Returns the array after the checks, for further assertions.
    """
    device = torch.device(device)
    models = []
    for i in range(size):
        torch.manual_seed(seed * 1000 + i)
        models.append(make_model().to(device=device, dtype=dtype))
    if zero_dropout:
        for m in models:
            _zero_dropout(m)
    refs = [copy.deepcopy(m) for m in models]
    array = fuse(models, trace=trace, compile=compile)
    gen = torch.Generator().manual_seed(seed + 17)

    def cast(x: Any) -> Any:
        if isinstance(x, Tensor):
            x = x.to(device)
            return x.to(dtype) if x.is_floating_point() else x
        return x

    def new_inputs() -> tuple[list[Any], list[list[Any]]]:
        if shared:
            one = [cast(a) for a in make_input(gen)]
            return one, [one] * size
        per = [[cast(a) for a in make_input(gen)] for _ in range(size)]
        stacked = [
            torch.stack([p[k] for p in per]) if isinstance(per[0][k], Tensor) else per[0][k]
            for k in range(len(per[0]))
        ]
        return stacked, per

    last_args: list[Any] = []
    for mode in modes:
        array.train(mode == "train")
        for r in refs:
            r.train(mode == "train")
        for step in range(steps):
            args, per_member = new_inputs()
            last_args = per_member[0]
            out = array(*args, shared=shared)
            # read after the call: a tensor kept once becomes per member when a module that
            # writes it (BatchNorm) is switched to training
            params = dict(array.module.named_parameters())
            buffers = dict(array.module.named_buffers())
            kept_once = set(array.shared_frozen)  # unstacked
            proj = None
            for i, ref in enumerate(refs):
                expected = ref(*per_member[i])
                where = f"{mode} step {step}, member {i}"
                assert_trees_close(
                    _member_tree(out, i), expected, rtol=rtol, atol=atol, what=f"output, {where}"
                )
                if proj is None:
                    proj = _projection(expected, gen)
                ref_total = _loss(expected, proj)
                if ref_total.requires_grad:
                    ref_total.backward()
            assert proj is not None
            member_total = _loss_array(out, proj)
            if member_total is not None and member_total.requires_grad:
                member_total.backward()
            for i, ref in enumerate(refs):
                where = f"{mode} step {step}, member {i}"
                for name, p in ref.named_parameters():
                    # a frozen parameter all members share is a buffer of the array, gradless
                    fused_grad = params[name].grad if name in params else None
                    if p.grad is None:
                        if fused_grad is not None and fused_grad[i].abs().max() > 0:
                            raise AssertionError(f"grad of {name}, {where}: expected none")
                        continue
                    if fused_grad is None:
                        raise AssertionError(f"grad of {name}, {where}: missing in the array")
                    _close(
                        fused_grad[i], p.grad, rtol=rtol, atol=atol, what=f"grad of {name}, {where}"
                    )
                for name, b in ref.named_buffers():
                    row = buffers[name] if name in kept_once else buffers[name][i]
                    _close(row, b, rtol=rtol, atol=atol, what=f"buffer {name}, {where}")
            with torch.no_grad():
                for ref in refs:
                    for p in ref.parameters():
                        if p.grad is not None:
                            p.sub_(lr * p.grad)
                            p.grad = None
                for p in array.parameters():
                    if p.grad is not None:
                        p.sub_(lr * p.grad)
                        p.grad = None

    # Export: member(i).state_dict() loads into a fresh model and reproduces member i.
    array.eval()
    out = array(
        *(
            [
                a.unsqueeze(0).expand(size, *a.shape) if isinstance(a, Tensor) else a
                for a in last_args
            ]
            if not shared
            else last_args
        ),
        shared=shared,
    )
    for i in range(size):
        exported = array.member(i)
        fresh = make_model().to(device=device, dtype=dtype)
        fresh.load_state_dict(exported.state_dict())
        fresh.eval()
        if zero_dropout:
            _zero_dropout(fresh)
        with torch.no_grad():
            assert_trees_close(
                fresh(*last_args),
                _member_tree(out, i),
                rtol=rtol,
                atol=atol,
                what=f"member({i}) exported and reloaded",
            )
    return array


def _loss_array(out: Any, proj: list[Tensor | None]) -> Tensor | None:
    total: Tensor | None = None
    for x, w in zip(pytree.tree_leaves(out), proj, strict=True):
        if w is not None and isinstance(x, Tensor) and x.requires_grad:
            term = (x * w).sum()  # w broadcasts over the member dimension
            total = term if total is None else total + term
    return total
