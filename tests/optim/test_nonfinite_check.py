"""The fused optimizers' check for non-finite gradients: one multi-tensor operator per step.

With every member active, ``FusedOptimizer.step`` asks one multi-tensor reduction over all
gradients (their 2-norms, read-only) whether any value is inf or NaN, and only then sums each
member's gradients to find which. Checked here: the gradients are left as they were, the members
found are the ones with a non-finite value in any dtype, the others step as ``torch.optim``
does for them alone, and the operators a step dispatches do not depend on the parameters'
count.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hfsweep as hs
from hfsweep.testing._op_counts import OpCounter

B = 3


def _models(layers: int = 2) -> list[nn.Module]:
    torch.manual_seed(0)
    return [
        nn.Sequential(*[nn.Linear(5, 5) for _ in range(layers)], nn.Linear(5, 3)) for _ in range(B)
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_the_member_with_a_nonfinite_gradient_is_found_in_any_dtype(
    dtype: torch.dtype, value: float
) -> None:
    array = hs.fuse(_models()).to(dtype)
    opt = hs.optim.SGD(array, lr=0.1)
    x, y = torch.randn(4, 5, dtype=dtype), torch.tensor([0, 1, 2, 0])
    hs.member_losses(array(x).float(), y).sum().backward()
    grads = [p.grad for p in array.parameters()]
    grads[-1][1, 0] = value  # type: ignore[index]
    kept = [g.clone() for g in grads]  # type: ignore[union-attr]
    before = [p.detach().clone() for p in array.parameters()]
    opt.step()
    assert opt.nonfinite_members == [1]
    for g, k in zip(grads, kept, strict=True):
        assert torch.equal(g, k) or (g.isnan() == k.isnan()).all()  # type: ignore[union-attr]
    for p, q in zip(before, array.parameters(), strict=True):
        assert torch.equal(p[1], q[1]) and not torch.equal(p[0], q[0])


def test_finite_steps_match_torch_and_leave_the_gradients_alone() -> None:
    """Five Adam steps, all members finite: the check changes nothing, the members step as
    ``torch.optim.Adam`` alone."""
    refs = [m.double() for m in _models()]  # float64: tight comparisons
    array = hs.fuse(copy.deepcopy(refs))
    lrs = [0.01, 0.02, 0.03]
    opt = hs.optim.Adam(array, lr=lrs)
    ref_opts = [torch.optim.Adam(r.parameters(), lr=lr) for r, lr in zip(refs, lrs, strict=True)]
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        x = torch.randn(4, 5, generator=gen, dtype=torch.float64)
        y = torch.randint(0, 3, (4,), generator=gen)
        opt.zero_grad()
        hs.member_losses(array(x), y).sum().backward()
        grads = [p.grad.clone() for p in array.parameters()]  # type: ignore[union-attr]
        opt.step()
        for p, g in zip(array.parameters(), grads, strict=True):
            assert torch.equal(p.grad, g)  # type: ignore[arg-type]
        for r, o in zip(refs, ref_opts, strict=True):
            o.zero_grad()
            F.cross_entropy(r(x), y).backward()
            o.step()
    for i, r in enumerate(refs):
        for name, p in r.named_parameters():
            fused = dict(array.named_parameters())[f"module.{name}"]
            torch.testing.assert_close(fused[i], p, rtol=1e-7, atol=1e-10)
    assert opt.nonfinite_members == []


def test_the_check_is_one_operator_whatever_the_parameter_count() -> None:
    """No per-parameter reduction: a model with 3 or 9 layers dispatches the same check."""

    def step_ops(layers: int) -> OpCounter:
        array = hs.fuse(_models(layers))
        opt = hs.optim.SGD(array, lr=0.1)
        hs.member_losses(array(torch.randn(4, 5)), torch.tensor([0, 1, 2, 0])).sum().backward()
        opt.step()  # the first step makes the optimizer's state
        with OpCounter() as c:
            opt.step()
        return c

    small, large = step_ops(2), step_ops(8)
    assert small.ops == large.ops
    assert small.ops["_foreach_norm"] == 1
    assert small.ops["sum"] == 1 and small.host_reads == ["_local_scalar_dense"]  # the norms'


def test_the_check_reads_the_gradients_and_writes_none() -> None:
    """The check is read-only: no operator of it writes a gradient, whose version counters stay
    as they were (torch's AMP check, used before, multiplied every gradient by 1.0 in place: a
    pass that writes all of them, and a new version of each)."""
    array = hs.fuse(_models())
    opt = hs.optim.SGD(array, lr=0.1)
    hs.member_losses(array(torch.randn(4, 5)), torch.tensor([0, 1, 2, 0])).sum().backward()
    grads = [p.grad for p in array.parameters()]
    versions = [g._version for g in grads]  # type: ignore[union-attr]
    with OpCounter() as c:
        assert opt._nonfinite_members(None) == []
    assert [g._version for g in grads] == versions  # type: ignore[union-attr]
    assert not [op for op in c.ops if op.endswith("_")], dict(c.ops)  # nothing in place
    assert c.ops["_foreach_norm"] == 1 and c.host_reads == ["_local_scalar_dense"]


def test_a_sparse_gradient_still_raises_at_the_step() -> None:
    """A sparse gradient is left out of the check, and the step names it."""
    p = nn.Parameter(torch.zeros(B, 5, 2))
    opt = hs.optim.SGD([p], lr=0.1)
    p.grad = torch.zeros(B, 5, 2).to_sparse()
    with pytest.raises(RuntimeError, match="SGD does not support sparse gradients"):
        opt.step()
