"""Per-member clipping, AMP loss scaling and isolation of members that go non-finite."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import hfsweep as hs
from hfsweep.testing import MLP, LeNet

B = 3


def models(dtype=torch.float64, seed: int = 0):
    torch.manual_seed(seed)
    ms = [MLP(d_in=6, hidden=8, d_out=3).to(dtype) for _ in range(B)]
    return ms, [copy.deepcopy(m) for m in ms]


def batch(gen: torch.Generator, dtype=torch.float64):
    return torch.randn(5, 6, generator=gen, dtype=dtype), torch.randint(0, 3, (5,), generator=gen)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_clip_grad_norm_matches_torch_per_member(norm_type: float) -> None:
    ms, refs = models()
    array = hs.fuse(ms)
    max_norm = [0.05, 1.0, 100.0]  # clips hard, a little, not at all
    opt = hs.optim.SGD(array, lr=0.1, momentum=0.9)
    ref_opts = [torch.optim.SGD(r.parameters(), lr=0.1, momentum=0.9, foreach=False) for r in refs]
    gen = torch.Generator().manual_seed(1)
    for _ in range(30):
        x, y = batch(gen)
        opt.zero_grad()
        hs.member_losses(array(x), y).sum().backward()
        norms = hs.optim.clip_grad_norm_(array, max_norm, norm_type)
        opt.step()
        for i, (r, o) in enumerate(zip(refs, ref_opts, strict=True)):
            o.zero_grad()
            F.cross_entropy(r(x), y).backward()
            expected = torch.nn.utils.clip_grad_norm_(r.parameters(), max_norm[i], norm_type)
            o.step()
            torch.testing.assert_close(norms[i], expected, rtol=1e-10, atol=0)
    for i, r in enumerate(refs):
        for p, q in zip(r.parameters(), array.member(i).parameters(), strict=True):
            torch.testing.assert_close(q, p, rtol=1e-7, atol=1e-10)


def test_clip_grad_value_per_member() -> None:
    ms, refs = models()
    array = hs.fuse(ms)
    x, y = batch(torch.Generator().manual_seed(2))
    hs.member_losses(array(x), y).sum().backward()
    hs.optim.clip_grad_value_(array, [0.001, 0.01, 10.0])
    for i, (r, limit) in enumerate(zip(refs, [0.001, 0.01, 10.0], strict=True)):
        F.cross_entropy(r(x), y).backward()
        torch.nn.utils.clip_grad_value_(r.parameters(), limit)
        for p, q in zip(r.parameters(), array.parameters(), strict=True):
            torch.testing.assert_close(q.grad[i], p.grad)


def test_clip_rejects_wrong_number_of_values() -> None:
    array = hs.fuse(models()[0])
    x, y = batch(torch.Generator().manual_seed(2))
    hs.member_losses(array(x), y).sum().backward()
    with pytest.raises(ValueError, match="2 values for 3 members"):
        hs.optim.clip_grad_norm_(array, [1.0, 2.0])


def test_grad_scaler_matches_torch_per_member_with_overflow_in_one_member() -> None:
    """Member 1's gradients overflow under the scale; only it skips steps and backs off."""
    ms, refs = models(torch.float32)
    with torch.no_grad():
        for m in (ms[1], refs[1]):
            m.head.weight.mul_(1e12)  # huge logits: huge gradients that overflow when scaled
    array = hs.fuse(ms)
    kw = {"init_scale": 2.0**100, "growth_interval": 3}
    scaler = hs.optim.GradScaler(B, **kw)
    opt = hs.optim.Adam(array, lr=[1e-3, 2e-3, 3e-3])
    ref_scalers = [torch.amp.GradScaler("cpu", **kw) for _ in range(B)]
    ref_opts = [
        torch.optim.Adam(r.parameters(), lr=1e-3 * (i + 1), foreach=False)
        for i, r in enumerate(refs)
    ]
    gen = torch.Generator().manual_seed(3)
    skipped = 0
    for _ in range(12):
        x, y = batch(gen, torch.float32)
        opt.zero_grad()
        scaler.scale(hs.member_losses(array(x), y)).sum().backward()
        scaler.step(opt)
        skipped += int(scaler._found_inf[1])
        scaler.update()
        for r, o, s in zip(refs, ref_opts, ref_scalers, strict=True):
            o.zero_grad()
            s.scale(F.cross_entropy(r(x), y)).backward()
            s.step(o)
            s.update()
        expected = torch.tensor([s.get_scale() for s in ref_scalers], dtype=torch.float32)
        torch.testing.assert_close(scaler.get_scale(), expected)
    assert skipped > 0 and opt.nonfinite_members == []  # overflow is skipped, not isolated
    for i, r in enumerate(refs):
        for p, q in zip(r.parameters(), array.member(i).parameters(), strict=True):
            torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5)


def test_grad_scaler_checks_its_arguments() -> None:
    with pytest.raises(ValueError, match="growth_factor > 1"):
        hs.optim.GradScaler(2, growth_factor=0.5)
    scaler = hs.optim.GradScaler(2)
    with pytest.raises(ValueError, match="2 members in dimension 0"):
        scaler.scale(torch.ones(3))
    with pytest.raises(RuntimeError, match="needs a step"):
        scaler.update()


def run_with_lrs(lrs: list[float], steps: int = 15):
    torch.manual_seed(0)
    array = hs.fuse([LeNet() for _ in range(B)])
    opt = hs.optim.SGD(array, lr=lrs, momentum=0.9)
    gen = torch.Generator().manual_seed(4)
    for _ in range(steps):
        x = torch.randn(6, 1, 8, 8, generator=gen)
        y = torch.randint(0, 10, (6,), generator=gen)
        opt.zero_grad()
        losses = hs.member_losses(array(x), y)
        opt.deactivate_nonfinite(losses)
        losses.sum().backward()
        opt.step()
    return array, opt


def test_a_member_that_diverges_is_isolated_and_the_others_are_bit_identical() -> None:
    diverging, opt = run_with_lrs([0.01, float("inf"), 0.02])
    healthy, _ = run_with_lrs([0.01, 0.05, 0.02])
    assert opt.nonfinite_members == [1]
    assert opt.active.tolist() == [True, False, True]
    for (name, a), b in zip(
        diverging.state_dict().items(), healthy.state_dict().values(), strict=True
    ):
        for i in (0, 2):
            assert torch.equal(a[i], b[i]), f"member {i} {name}"


def test_nonfinite_gradients_are_isolated_at_step() -> None:
    array = hs.fuse(models()[0])
    opt = hs.optim.Adam(array, lr=1e-2)
    x, y = batch(torch.Generator().manual_seed(5))
    hs.member_losses(array(x), y).sum().backward()
    before = [p.detach().clone() for p in array.parameters()]
    array.module.head.weight.grad[2, 0, 0] = float("nan")
    opt.step()
    assert opt.nonfinite_members == [2]
    for p, q in zip(before, array.parameters(), strict=True):
        assert torch.equal(p[2], q[2])  # untouched
        assert not torch.equal(p[0], q[0])  # the others stepped
    assert opt.member_state_dict(2)["state"] == {}  # it never took a step
    # next step: member 2 stays out (its gradients are still NaN) and is not counted again;
    # member 0 goes non-finite now and leaves too; member 1 steps on
    opt.zero_grad()
    hs.member_losses(array(x), y).sum().backward()
    array.module.head.weight.grad[2, 0, 0] = float("nan")
    array.module.head.bias.grad[0, 1] = float("-inf")
    before = [p.detach().clone() for p in array.parameters()]
    opt.step()
    assert opt.nonfinite_members == [2, 0]
    assert opt.active.tolist() == [False, True, False]
    for p, q in zip(before, array.parameters(), strict=True):
        assert torch.equal(p[0], q[0]) and torch.equal(p[2], q[2])
        assert not torch.equal(p[1], q[1])


def test_isolation_can_be_turned_off() -> None:
    array = hs.fuse(models()[0])
    opt = hs.optim.SGD(array, lr=0.1)
    opt.isolate_nonfinite = False
    x, y = batch(torch.Generator().manual_seed(5))
    hs.member_losses(array(x), y).sum().backward()
    array.module.head.weight.grad[1, 0, 0] = float("inf")
    opt.step()
    assert opt.nonfinite_members == [] and bool(opt.active.all())


def test_bf16_autocast_trains_every_member_close_to_float32() -> None:
    """CPU autocast to bfloat16: forward, backward and a step run; each member stays close to its
    float32 twin (bf16 keeps about 3 significant digits)."""
    torch.manual_seed(0)
    models32 = [LeNet() for _ in range(B)]
    array16 = hs.fuse(copy.deepcopy(models32))
    array32 = hs.fuse(models32)
    opts = [hs.optim.SGD(a, lr=[0.01, 0.02, 0.03], momentum=0.9) for a in (array16, array32)]
    gen = torch.Generator().manual_seed(6)
    for _ in range(5):
        x = torch.randn(8, 1, 8, 8, generator=gen)
        y = torch.randint(0, 10, (8,), generator=gen)
        for array, opt, bf16 in ((array16, opts[0], True), (array32, opts[1], False)):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                out = array(x)
            assert out.dtype == (torch.bfloat16 if bf16 else torch.float32)
            hs.member_losses(out.float(), y).sum().backward()
            opt.step()
    assert opts[0].nonfinite_members == []
    for p16, p32 in zip(array16.parameters(), array32.parameters(), strict=True):
        assert p16.dtype == torch.float32  # master weights stay float32
        torch.testing.assert_close(p16, p32, rtol=0.05, atol=0.02)
