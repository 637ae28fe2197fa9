"""One fused array trained beside the same models trained alone, compared as they go.

The fine-tuning tests (shared frozen backbones, peft LoRA, Hugging Face models) all run the same
loop: a step of the array on a shared batch (``losses.sum().backward()``, the fused optimizer),
and the same step of each reference model with its own optimizer; outputs, losses and gradients
must agree at every step, and weights and optimizer states at the end. :class:`SideBySide` is
that loop once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import hfsweep as hs
from hfsweep.fusion import FusedArray

RTOL, ATOL = 1e-7, 1e-10


def trained(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of ``model`` that its optimizer trains (``requires_grad``)."""
    return [p for p in model.parameters() if p.requires_grad]


def _logits(out: Any) -> list[Tensor]:
    return [out]


@dataclass
class SideBySide:
    """``array`` and its optimizer ``opt`` beside ``refs`` (member ``i`` alone) and their
    optimizers ``ref_opts``.

    ``outputs(out)`` lists the tensors of a model's output to compare (default: the output
    itself; e.g. ``[out.logits, out.loss]`` for a Hugging Face output), the array's with the
    member dimension first. ``alone`` marks references that are arrays of one member
    themselves (a model with dropout, whose masks come from the member's stream): their outputs
    and states are read at index 0.
    """

    array: FusedArray
    opt: Any
    refs: Sequence[nn.Module]
    ref_opts: Sequence[torch.optim.Optimizer]
    outputs: Callable[[Any], list[Tensor]] = _logits
    alone: bool = False
    rtol: float = RTOL
    atol: float = ATOL
    steps: int = field(default=0, init=False)

    def step(
        self,
        *args: Any,
        loss: Callable[[Any], Tensor],
        ref_loss: Callable[[Any], Tensor] | None = None,
        grads: bool = False,
        **kwargs: Any,
    ) -> None:
        """One training step of every model on ``(args, kwargs)``: ``loss(array output)`` gives
        the ``[B]`` member losses, ``ref_loss(reference output)`` a reference's loss (default
        ``loss`` of an array of one, ``[0]``). With ``grads`` the trained parameters' gradients
        are compared too."""
        self.opt.zero_grad()
        out = self.array(*args, **kwargs)
        losses = loss(out)
        assert losses.shape == (self.array.size,), losses.shape
        losses.sum().backward()
        mine = self.outputs(out)
        fused_grads = dict(self.array.named_parameters())
        for i, (r, o) in enumerate(zip(self.refs, self.ref_opts, strict=True)):
            r.train(self.array.training)
            o.zero_grad()
            expected = r(*args, **kwargs)
            theirs = (
                [t[0] for t in self.outputs(expected)] if self.alone else self.outputs(expected)
            )
            for a, b in zip(mine, theirs, strict=True):
                torch.testing.assert_close(a[i], b, rtol=self.rtol, atol=self.atol)
            value = ref_loss(expected) if ref_loss is not None else loss(expected)[0]
            value.backward()
            if grads:
                for name, p in r.named_parameters():
                    if not p.requires_grad:
                        continue
                    key = name if self.alone else f"module.{name}"
                    grad = fused_grads[key].grad
                    assert grad is not None and p.grad is not None, name
                    torch.testing.assert_close(
                        grad[i],
                        p.grad[0] if self.alone else p.grad,
                        rtol=self.rtol,
                        atol=self.atol,
                        msg=f"member {i} grad {name}",
                    )
            o.step()
        self.opt.step()
        self.steps += 1

    def assert_states(self, *, optimizer: bool = True) -> None:
        """Each member's weights (``member_state_dict``) equal its reference's, and, with
        ``optimizer``, its exported optimizer state equals the ``torch.optim`` one."""
        for i, r in enumerate(self.refs):
            mine = self.array.member_state_dict(i)
            theirs = r.member_state_dict(0) if isinstance(r, FusedArray) else r.state_dict()
            assert mine.keys() == theirs.keys()
            for k, v in theirs.items():
                torch.testing.assert_close(
                    mine[k], v, rtol=self.rtol, atol=self.atol, msg=f"member {i} {k}"
                )
            if not optimizer:
                continue
            exported, expected = self.opt.member_state_dict(i), self.ref_opts[i].state_dict()
            assert exported["state"].keys() == expected["state"].keys()
            for k, st in expected["state"].items():
                for key, value in st.items():
                    torch.testing.assert_close(
                        exported["state"][k][key],
                        value,
                        rtol=self.rtol,
                        atol=self.atol,
                        msg=f"member {i} optimizer {k} {key}",
                    )


def with_optimizer(
    array: FusedArray, refs: Sequence[nn.Module], lrs: Sequence[float], optimizer: str, **sgd: float
) -> SideBySide:
    """``array`` beside ``refs`` with ``optimizer``: ``"sgd"`` (``hs.optim.SGD`` and
    ``torch.optim.SGD`` with ``sgd``'s options) or ``"adam"``, at member ``i``'s ``lrs[i]``."""
    if optimizer == "sgd":
        opt: Any = hs.optim.SGD(array, lr=list(lrs), **sgd)
        ref_opts: list[Any] = [
            torch.optim.SGD(r.parameters(), lr=lr, **sgd) for r, lr in zip(refs, lrs, strict=True)
        ]
    else:
        opt = hs.optim.Adam(array, lr=list(lrs))
        ref_opts = [
            torch.optim.Adam(r.parameters(), lr=lr) for r, lr in zip(refs, lrs, strict=True)
        ]
    return SideBySide(array, opt, list(refs), ref_opts)


def classification_steps(
    run: SideBySide, gen: torch.Generator, shape: Sequence[int], classes: int, steps: int
) -> None:
    """``steps`` steps of ``run`` on float64 inputs of ``shape`` and labels of ``classes`` drawn
    from ``gen``, with the cross-entropy loss; every gradient compared."""
    for _ in range(steps):
        x = torch.randn(*shape, generator=gen, dtype=torch.float64)
        y = torch.randint(0, classes, (shape[0],), generator=gen)
        run.step(
            x,
            loss=lambda out, y=y: hs.member_losses(out, y),
            ref_loss=lambda out, y=y: F.cross_entropy(out, y),
            grads=True,
        )
