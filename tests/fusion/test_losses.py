"""member_losses equals each member's own mean loss, and its sum trains members independently."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import hfsweep as hs

B, N, C = 3, 7, 5


@pytest.fixture
def outputs() -> torch.Tensor:
    return torch.randn(B, N, C, dtype=torch.float64, requires_grad=True)


def per_member(outputs, target, fn, shared=True, **kw):
    return torch.stack([fn(outputs[i], target if shared else target[i], **kw) for i in range(B)])


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"label_smoothing": 0.1},
        {"ignore_index": 2},
        {"ignore_index": 2, "label_smoothing": 0.2},
    ],
)
def test_cross_entropy_fast_path(outputs, kw) -> None:
    target = torch.randint(0, C, (N,))
    target[0] = 2
    torch.testing.assert_close(
        hs.member_losses(outputs, target, **kw), per_member(outputs, target, F.cross_entropy, **kw)
    )


def test_cross_entropy_with_per_member_targets(outputs) -> None:
    target = torch.randint(0, C, (B, N))
    torch.testing.assert_close(
        hs.member_losses(outputs, target, shared_target=False),
        per_member(outputs, target, F.cross_entropy, shared=False),
    )


def test_cross_entropy_with_class_weights_uses_the_generic_path(outputs) -> None:
    target = torch.randint(0, C, (N,))
    w = torch.rand(C, dtype=torch.float64)
    torch.testing.assert_close(
        hs.member_losses(outputs, target, weight=w),
        per_member(outputs, target, F.cross_entropy, weight=w),
    )


def test_cross_entropy_for_sequences(outputs) -> None:
    out = torch.randn(B, 4, C, 6, dtype=torch.float64)  # [B, N, C, T]
    target = torch.randint(0, C, (4, 6))
    torch.testing.assert_close(
        hs.member_losses(out, target), per_member(out, target, F.cross_entropy)
    )


@pytest.mark.parametrize(
    "fn", [F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.binary_cross_entropy_with_logits]
)
def test_elementwise_losses(outputs, fn) -> None:
    target = torch.rand(N, C, dtype=torch.float64)
    torch.testing.assert_close(
        hs.member_losses(outputs, target, fn), per_member(outputs, target, fn)
    )


def test_module_loss_runs_per_member(outputs) -> None:
    loss = torch.nn.KLDivLoss(reduction="batchmean")
    target = torch.softmax(torch.randn(N, C, dtype=torch.float64), -1)
    logp = outputs.log_softmax(-1)
    torch.testing.assert_close(hs.member_losses(logp, target, loss), per_member(logp, target, loss))


def test_sum_gives_each_member_the_gradient_of_its_own_loss(outputs) -> None:
    target = torch.randint(0, C, (N,))
    hs.member_losses(outputs, target).sum().backward()
    for i in range(B):
        x = outputs[i].detach().clone().requires_grad_()
        F.cross_entropy(x, target).backward()
        torch.testing.assert_close(outputs.grad[i], x.grad)


def test_bad_shapes() -> None:
    with pytest.raises(hs.FusionError, match="member dimension first"):
        hs.member_losses(torch.randn(5), torch.randint(0, 2, (5,)))
    with pytest.raises(hs.FusionError, match=r"needs 3 members.*\(7,\)"):
        hs.member_losses(torch.randn(B, N, C), torch.randint(0, C, (N,)), shared_target=False)
