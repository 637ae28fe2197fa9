"""The fused optimizer's fixed per-step costs (issue 21), and that removing them changed nothing.

``benchmarks/step_breakdown.py`` showed two costs of ``hs.optim``'s step that do not depend on
the model's size: the per-parameter ``step`` counts, added to with a multi-tensor add over every
parameter (on a CPU one ``add_`` per tensor inside it), and torch's ``zero_grad``, which opens a
profiler range around a loop that only drops gradients. Now a group's counts are rows of one
``[P, B]`` tensor, counted with one ``add_``, and ``zero_grad(set_to_none=True)`` is the loop.
Checked here by the calls made (not timings), and against ``torch.optim`` per member: inactive
members, parameters without a gradient, AMP skips and a ``load_state_dict`` keep their counts.
"""

from __future__ import annotations

import copy
from typing import Any
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

import hfsweep as hs

B = 3


def _models() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3)) for _ in range(B)]


def _steps(opt: hs.optim.FusedOptimizer) -> list[list[float]]:
    return [opt.state[p]["step"].tolist() for g in opt.param_groups for p in g["params"]]


def _train(array: hs.FusedArray, opt: hs.optim.FusedOptimizer, steps: int, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(6, 5, generator=gen), torch.randint(0, 3, (6,), generator=gen)
        opt.zero_grad()
        hs.member_losses(array(x), y).sum().backward()
        opt.step()


def test_a_step_counts_with_one_add_not_a_multi_tensor_add_per_parameter() -> None:
    array = hs.fuse(_models())
    opt = hs.optim.SGD(array, lr=0.1)  # no momentum: SGD adds nothing else with _foreach_add_
    _train(array, opt, 1)
    real = torch._foreach_add_
    with mock.patch.object(torch, "_foreach_add_", side_effect=real) as foreach_add:
        _train(array, opt, 3)
    assert foreach_add.call_count == 0  # was one per step
    block = opt._step_blocks[0][0]
    assert block.shape == (4, B)  # four parameters, B members: one tensor
    for g in opt.param_groups:
        for p in g["params"]:
            assert opt.state[p]["step"].untyped_storage().data_ptr() == (
                block.untyped_storage().data_ptr()
            )
    assert _steps(opt) == [[4.0] * B] * 4


def test_inactive_members_and_parameters_without_gradients_keep_their_counts() -> None:
    array = hs.fuse(_models())
    opt = hs.optim.Adam(array, lr=0.01)
    _train(array, opt, 2)
    opt.set_active(1, False)
    _train(array, opt, 2)
    assert _steps(opt) == [[4.0, 2.0, 4.0]] * 4
    opt.set_active(1, True)
    # a step where the first Linear has no gradient: only the others count
    first = [p for name, p in array.named_parameters() if name.startswith("module.0.")]
    gen = torch.Generator().manual_seed(5)
    x, y = torch.randn(6, 4, generator=gen), torch.randint(0, 3, (6,), generator=gen)
    opt.zero_grad()
    w, b = (p for name, p in array.named_parameters() if name.startswith("module.2."))
    # the second Linear alone, on x as its input: the first gets no gradient this step
    logits = torch.einsum("mi,boi->bmo", x, w) + b.unsqueeze(1)
    F.cross_entropy(logits.flatten(0, 1), y.repeat(B)).backward()
    assert all(p.grad is None for p in first)
    opt.step()
    assert _steps(opt) == [[4.0, 2.0, 4.0]] * 2 + [[5.0, 3.0, 5.0]] * 2


def test_counts_match_torch_per_member_through_skips_and_a_reload() -> None:
    """Adam's bias correction reads the counts: each member's parameters after steps with an
    AMP-style skip of one member and a state-dict reload match torch's Adam on that member."""
    models = _models()
    array = hs.fuse(copy.deepcopy(models))
    opt = hs.optim.Adam(array, lr=0.05)
    plain = [copy.deepcopy(m) for m in models]
    plain_opts = [torch.optim.Adam(m.parameters(), lr=0.05) for m in plain]
    gen = torch.Generator().manual_seed(3)
    for step in range(6):
        x, y = torch.randn(6, 5, generator=gen), torch.randint(0, 3, (6,), generator=gen)
        skip = torch.tensor([False, step in (1, 2), False])
        opt.zero_grad()
        hs.member_losses(array(x), y).sum().backward()
        opt.step(skip=skip)
        for i, (m, o) in enumerate(zip(plain, plain_opts, strict=True)):
            if skip[i]:
                continue
            o.zero_grad()
            F.cross_entropy(m(x), y).backward()
            o.step()
        if step == 3:  # the counts are new tensors after a reload: the block is made again
            opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    for i, m in enumerate(plain):
        for (name, p), q in zip(m.named_parameters(), array.member(i).parameters(), strict=True):
            torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=name)
    assert _steps(opt) == [[6.0, 4.0, 6.0]] * 4


def test_zero_grad_drops_gradients_without_a_profiler_range() -> None:
    array = hs.fuse(_models())
    opt = hs.optim.SGD(array, lr=0.1)
    _train(array, opt, 1)
    assert all(p.grad is not None for p in array.parameters())
    with mock.patch.object(torch.autograd.profiler, "record_function") as record:
        opt.zero_grad()
    assert record.call_count == 0  # torch's zero_grad opens one
    assert all(p.grad is None for p in array.parameters())


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_keeps_torchs_meaning(set_to_none: bool) -> None:
    array = hs.fuse(_models())
    opt = hs.optim.SGD(array, lr=0.1)
    _train(array, opt, 1)
    grads = [p.grad for p in array.parameters()]
    opt.zero_grad(set_to_none=set_to_none)
    for p, g in zip(array.parameters(), grads, strict=True):
        if set_to_none:
            assert p.grad is None
        else:
            assert p.grad is g and not bool(g.any())


def test_a_step_opens_no_profiler_range_while_nothing_watches_it() -> None:
    """torch wraps every optimizer's ``step`` in a profiler range and its hook loops; with no
    hook registered and no profiler running, ``hs.optim``'s step skips that wrapper."""
    array = hs.fuse(_models())
    opt = hs.optim.SGD(array, lr=0.1)
    real = torch.autograd.profiler.record_function
    with mock.patch.object(torch.autograd.profiler, "record_function", side_effect=real) as rf:
        _train(array, opt, 3)
    assert rf.call_count == 0  # was one per step
    assert _steps(opt) == [[3.0] * B] * 4


def test_a_profiled_step_is_in_the_profilers_trace() -> None:
    array = hs.fuse(_models())
    opt = hs.optim.SGD(array, lr=0.1)
    _train(array, opt, 1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        opt.step()
    assert "Optimizer.step#SGD.step" in {e.key for e in prof.key_averages()}


def test_step_hooks_see_every_step_as_torchs() -> None:
    """The optimizer's own step pre- and post-hooks and every optimizer's run as for a
    ``torch.optim`` optimizer, and a pre-hook's new arguments are the step's (here an AMP-style
    ``skip`` of member 1, whose parameters then stay as they were)."""
    array = hs.fuse(_models())
    opt = hs.optim.SGD(array, lr=0.1)
    calls: list[str] = []

    def skip_member_1(o: Any, args: Any, kwargs: Any) -> Any:
        calls.append("pre")
        return args, {**kwargs, "skip": torch.tensor([False, True, False])}

    handles = [
        opt.register_step_pre_hook(skip_member_1),
        opt.register_step_post_hook(lambda o, a, k: calls.append("post")),
        register_optimizer_step_pre_hook(lambda o, a, k: calls.append("global pre")),
        register_optimizer_step_post_hook(lambda o, a, k: calls.append("global post")),
    ]
    try:
        before = [p.detach().clone() for p in array.parameters()]
        _train(array, opt, 2)
    finally:
        for handle in handles:
            handle.remove()
    assert calls == ["global pre", "pre", "post", "global post"] * 2
    for p, q in zip(before, array.parameters(), strict=True):
        assert torch.equal(p[1], q[1]) and not torch.equal(p[0], q[0])
    calls.clear()
    _train(array, opt, 1)  # removed: not called, and the step goes on without the wrapper
    assert calls == []


def test_a_subclass_that_overrides_step_runs_each_hook_once() -> None:
    """torch wraps a subclass's own ``step``; the fused step it calls through ``super()`` then
    runs no hook a second time."""

    class Counted(hs.optim.SGD):
        def step(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
            return super().step(*args, **kwargs)

    array = hs.fuse(_models())
    opt = Counted(array, lr=0.1)
    calls: list[str] = []
    handle = opt.register_step_post_hook(lambda o, a, k: calls.append("post"))
    try:
        _train(array, opt, 2)
    finally:
        handle.remove()
    assert calls == ["post", "post"]
