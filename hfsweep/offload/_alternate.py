"""Several offloaded arrays stepped together, their shards alternating on the compute side
(:class:`AlternatingArrays`; Hydra's shard alternation, Nagrecha & Kumar).

One array alone with prefetch hides a shard's fetch behind the compute of the shard before it,
so its step takes about the sum over its shards of the larger of the two. Where one array's
shards wait on their transfers (large weights, little compute: a small batch) and another's on
their compute, each alone leaves one side idle: the first the compute, the second the link.
Stepped together, array ``a``'s shard ``k`` computes while array ``b``'s shard ``k`` is
copied in, then ``b``'s shard ``k`` while ``a``'s shard ``k + 1`` is, and so on, in the
forward and again in the backward: the copies go through one transfer (one side stream or
thread, in the order they are started) and the computes through the calling thread, so the
step takes about the larger of the sum of every array's transfers and the sum of every
array's computes, not the sum of each array's step alone
(``benchmarks/offload_alternate.py``).

Each array trains exactly as it would alone: its shards compute the same values in the same
order, only other arrays' shards run in between; each keeps its own dropout streams, buffers
and gradients. The arrays share one budget and one :class:`~hfsweep.offload.ResidentLedger`:
each array's shards hold at most a quarter of the budget divided by the number of arrays,
so the two shards each array may hold at once (computing, prefetched) take at most half of
it, and the boundary activations of all the arrays the other half.

What this is not yet: the trainer (``hs.ArrayTrainer``) and ``hfsweep run``'s executor step
one array at a time and do not use it; arrays cut between their blocks (``cut="blocks"``, whose
own forward calls the units) are not alternated (they are cut along the graph here, or
refused).
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import Any

import torch
from torch import Tensor

from ..fusion import FusedArray
from ._engine import OffloadedArray
from ._errors import OffloadError
from ._ledger import ResidentLedger
from ._transfer import Transfer, default_transfer

__all__ = ["AlternatingArrays"]


def _alternate(steps: Sequence[Generator[None, None, Any]]) -> list[Any]:
    """Run ``steps`` (one per array) in turn, one shard each, until all are done; their
    results in order. Where one fails, the others are closed (what they held is released)."""
    results: list[Any] = [None] * len(steps)
    running = list(range(len(steps)))
    try:
        while running:
            for i in list(running):
                try:
                    next(steps[i])
                except StopIteration as done:
                    results[i] = done.value
                    running.remove(i)
    except BaseException:
        for i in running:
            steps[i].close()
        raise
    return results


class AlternatingArrays:
    """``arrays`` (:class:`~hfsweep.fusion.FusedArray`\\ s) offloaded to ``device`` within
    one budget of ``budget_bytes`` (``None``: recorded only), stepped together with their
    shards alternating (see the module's docstring).

    ``engines`` are their :class:`~hfsweep.offload.OffloadedArray`\\ s, cut along the traced
    graph, sharing :attr:`ledger` and one ``transfer`` (default:
    :func:`~hfsweep.offload.default_transfer` for ``device``); ``shard_bytes`` sets every
    array's shard limit itself (default: a quarter of the budget over the number of arrays,
    or without a budget a quarter of each array's state). A training step::

        outs = arrays.forward([x_a, x_b])
        arrays.backward([loss_a(outs[0]), loss_b(outs[1])])
        # then each array's optimizer steps on its host parameters, as alone

    An engine may also be called alone (``arrays.engines[0](x)``), as any offloaded array.
    """

    def __init__(
        self,
        arrays: Sequence[FusedArray],
        *,
        device: str | torch.device = "cpu",
        budget_bytes: int | None = None,
        transfer: Transfer | None = None,
        prefetch: bool = True,
        shard_bytes: int | None = None,
    ) -> None:
        if not arrays:
            raise OffloadError("AlternatingArrays needs at least one array")
        if len({id(a) for a in arrays}) != len(arrays):
            raise OffloadError("AlternatingArrays got the same array twice")
        self.ledger = ResidentLedger(budget_bytes)
        self.transfer = transfer if transfer is not None else default_transfer(device)
        limit = shard_bytes
        if limit is None and budget_bytes is not None:
            limit = max(budget_bytes // (4 * len(arrays)), 1)
        self.engines = [
            OffloadedArray(
                a,
                device=device,
                transfer=self.transfer,
                prefetch=prefetch,
                shard_bytes=limit,
                cut="graph",
                ledger=self.ledger,
            )
            for a in arrays
        ]
        self._outputs: list[Tensor | None] = []
        self._generations: list[int] = []

    def forward(self, inputs: Sequence[Tensor]) -> list[Tensor]:
        """Every array's output (``[B, N, ...]``) on its input, their shards alternating.
        With autograd on, each output is a leaf that requires a gradient: compute the losses
        from them and hand them to :meth:`backward`. The inputs take no gradient."""
        if len(inputs) != len(self.engines):
            raise OffloadError(f"forward takes one input per array ({len(self.engines)})")
        for x in inputs:
            if not isinstance(x, Tensor):
                raise OffloadError(f"an offloaded array takes one tensor input, got {type(x)}")
            if x.requires_grad:
                raise OffloadError(
                    "AlternatingArrays trains the arrays' parameters and gives their inputs no "
                    "gradient; an input requires one: step that array alone (its engine)"
                )
        keep = torch.is_grad_enabled()
        outs: list[Tensor] = _alternate(
            [e._forward_steps(x, keep) for e, x in zip(self.engines, inputs, strict=True)]
        )
        if not keep:
            return outs
        outs = [o.requires_grad_(True) for o in outs]
        self._outputs = list(outs)
        self._generations = [e._generation for e in self.engines]
        return outs

    def backward(self, losses: Sequence[Tensor]) -> None:
        """Each array's backward from its loss (a scalar computed from its output of the
        latest :meth:`forward`), their shards alternating; the parameter gradients are added
        to each array's host parameters' ``.grad``, as ``loss.backward()`` on the array alone
        would."""
        if len(losses) != len(self.engines) or len(self._outputs) != len(self.engines):
            raise OffloadError(
                f"backward takes one loss per array ({len(self.engines)}), after a forward "
                "with autograd on"
            )
        outputs = [o for o in self._outputs if o is not None]
        if len(outputs) != len(self.engines):
            raise OffloadError("backward ran already for the latest forward")
        for out in outputs:
            out.grad = None
        torch.autograd.backward(list(losses))  # the losses' own code, down to the outputs
        steps = []
        for engine, out, generation in zip(self.engines, outputs, self._generations, strict=True):
            if out.grad is None:  # its loss does not depend on it: nothing to train
                engine._release()
                continue
            steps.append(engine._backward_steps(out.grad, generation))
        self._outputs = [None] * len(self.engines)
        _alternate(steps)

    def close(self) -> None:
        """Drop what the engines hold on the compute side and stop the transfer."""
        for engine in self.engines:
            engine.close()
