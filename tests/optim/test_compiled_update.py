"""``FusedOptimizer.compile()``: the update compiled by ``torch.compile`` steps exactly as the
eager update and as ``torch.optim`` per member (float64, 12 steps, a learning-rate schedule,
a member frozen and a member with a non-finite gradient on the way), shares its graphs between
optimizers of one kind, and falls back to the eager update, once and with a warning, where
dynamo refuses.

The compiling tests are marked ``slow`` (inductor takes seconds to minutes per graph on a
2-core CPU); the fallback tests stub the compiler and run in the default suite.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_optimizers import B, assert_members_match, build, train

import hfsweep as hs
from hfsweep import _compat
from hfsweep.fusion import CompileFallbackWarning
from hfsweep.optim import _compiled

#: one case per update function and path: SGD per parameter (dampening: the first-step rule)
#: and multi-tensor (nesterov), Adam with AMSGrad and L2 decay, AdamW with per-member beta2,
#: RMSprop centered with momentum, Adagrad
COMPILED_CASES = [
    "SGD",
    "SGD-nesterov-maximize",
    "Adam-amsgrad",
    "AdamW",
    "RMSprop-centered",
    "Adagrad",
]


def _steps_both(name: str, steps: int = 12) -> None:
    """Train an eager and a compiled copy of case ``name`` and ``torch.optim`` references on
    the same batches: a cosine schedule, member 1 frozen after 4 steps, member 2's gradient
    made NaN at step 8 (isolated by the optimizer); all three must agree."""
    array, opt, refs, ref_opts = build(name)
    twin = copy.deepcopy(array)
    twin_opt = type(opt)(twin, **_same_hyperparameters(opt))
    twin_opt.compile()
    scheds = [hs.optim.lr_scheduler.CosineAnnealingLR(o, T_max=[6, 9, 12]) for o in (opt, twin_opt)]
    ref_scheds = [
        torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=t)
        for o, t in zip(ref_opts, (6, 9, 12), strict=True)
    ]
    active = [True] * B
    gen = torch.Generator().manual_seed(3)
    for step in range(steps):
        if step == 4:
            for o in (opt, twin_opt):
                o.set_active(1, False)
            active[1] = False
        x = torch.randn(5, 6, generator=gen, dtype=torch.float64)
        y = torch.randint(0, 3, (5,), generator=gen)
        sign = -1.0 if opt.param_groups[0].get("maximize") else 1.0
        for a, o in ((array, opt), (twin, twin_opt)):
            o.zero_grad()
            (sign * hs.member_losses(a(x), y).sum()).backward()
            if step == 8:
                next(iter(a.parameters())).grad[2].fill_(float("nan"))
        for i, (r, o) in enumerate(zip(refs, ref_opts, strict=True)):
            if not active[i]:
                continue
            o.zero_grad()
            (sign * torch.nn.functional.cross_entropy(r(x), y)).backward()
            o.step()
        if step == 8:
            active[2] = False
        opt.step()
        twin_opt.step()
        for s in scheds:
            s.step()
        for s in ref_scheds:
            s.step()
    assert opt.nonfinite_members == twin_opt.nonfinite_members == [2]
    for p, q in zip(array.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-7, atol=1e-12)
    for p, q in zip(opt.state.values(), twin_opt.state.values(), strict=True):
        for key in p:
            torch.testing.assert_close(q[key].to(p[key].dtype), p[key], rtol=1e-7, atol=1e-12)
    for i in (0, 1):  # member 2 stopped at its NaN; torch's copy took that step
        for p, q in zip(refs[i].parameters(), twin.member(i).parameters(), strict=True):
            torch.testing.assert_close(q, p, rtol=1e-7, atol=1e-10, msg=f"member {i}")
    assert twin_opt._compiled is not None and twin_opt._compiled.fallback is None


def _same_hyperparameters(opt: hs.optim.FusedOptimizer) -> dict[str, object]:
    """The constructor arguments that rebuild ``opt``'s one param group (per-member lists)."""
    group = opt.param_groups[0]
    out: dict[str, object] = {n: group[n].tolist() for n in opt.numeric}
    if "beta1" in out:
        out["betas"] = (out.pop("beta1"), out.pop("beta2"))
    out.update({n: group[n] for n in opt.options})
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", COMPILED_CASES)
def test_compiled_update_equals_eager_and_torch(name: str) -> None:
    _steps_both(name)


@pytest.mark.slow
def test_a_second_optimizer_of_the_same_kind_compiles_nothing_new() -> None:
    """The graphs belong to the update function, not to one optimizer: a new array of the same
    model and size (a sweep's next array) reuses them."""
    array, opt, refs, ref_opts = build("AdamW")
    opt.compile()
    train(array, opt, refs, ref_opts, steps=2)
    before = _compat.dynamo_graphs_compiled()
    again, again_opt, again_refs, again_ref_opts = build("AdamW", seed=5)
    again_opt.compile()
    train(again, again_opt, again_refs, again_ref_opts, steps=3)
    assert _compat.dynamo_graphs_compiled() == before
    assert_members_match(again, again_opt, again_refs, again_ref_opts)


class _Refuses:
    """A stand-in for ``torch.compile``'s result that refuses every call as dynamo does."""

    calls = 0

    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    def __call__(self, *args: object) -> None:
        type(self).calls += 1
        raise self.exc


def test_a_refused_update_runs_eagerly_once_warned(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch._dynamo.exc as dynamo_exc

    refusal = _Refuses(dynamo_exc.Unsupported("no such construct"))
    monkeypatch.setattr(_compiled, "_compiled", lambda update, mode: refusal)
    array, opt, refs, ref_opts = build("AdamW")
    opt.compile()
    with pytest.warns(CompileFallbackWarning, match=r"AdamW.compile\(\).*Unsupported"):
        train(array, opt, refs, ref_opts, steps=1)
    assert opt._compiled is not None and "no such construct" in str(opt._compiled.fallback)
    calls = _Refuses.calls
    with _no_warnings():
        train(array, opt, refs, ref_opts, steps=3, seed=2)
    assert _Refuses.calls == calls  # not asked again
    assert_members_match(array, opt, refs, ref_opts)


def test_an_error_inside_the_update_is_not_hidden(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only dynamo's refusals fall back: any other error (the update's own) reaches the user."""
    monkeypatch.setattr(
        _compiled, "_compiled", lambda update, mode: _Refuses(RuntimeError("kernel failed"))
    )
    array, opt, refs, ref_opts = build("SGD")
    opt.compile()
    with pytest.raises(RuntimeError, match="kernel failed"):
        train(array, opt, refs, ref_opts, steps=1)


def test_the_recompile_limit_counts_as_a_refusal() -> None:
    import torch._dynamo.exc as dynamo_exc

    assert _compat.dynamo_refused(dynamo_exc.Unsupported("x"))
    assert _compat.dynamo_refused(dynamo_exc.FailOnRecompileLimitHit("limit"))
    assert not _compat.dynamo_refused(RuntimeError("x"))


class _no_warnings:
    def __enter__(self) -> None:
        import warnings

        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("error", CompileFallbackWarning)

    def __exit__(self, *exc: object) -> None:
        self._catch.__exit__(*exc)
