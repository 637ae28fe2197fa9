"""What a fused LoRA array's training step holds in memory: the frozen base once and never a
per-member copy of it. Checked op by op on the CPU (every tensor an op returns during forward,
backward and the SGD update), for a peft LoRA model on a frozen embedding and frozen linears
(the shape of ``benchmarks/fusion_throughput.py``'s ``lora_bert``, small):

* no op returns a ``[B, *shape]`` tensor of a shared frozen tensor's shape (no ``expand`` +
  ``contiguous``, no broadcast ``bmm`` that materialises B copies of a frozen weight);
* the frozen embedding runs once on the shared batch, without a member dimension (its output
  is identical for every member until the first per-member op);
* the peak of live tensor bytes at B members is at most the frozen part once plus B times what
  one member's array holds beyond it (what grows with B is per-member state and activations).

``docs/fine-tuning.md`` ("What the array's peak is made of") has the measured breakdown.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

import hfsweep as hs
from hfsweep._compat import TorchDispatchMode, pytree
from hfsweep.sizing.timing import _LiveTensorBytes

peft = pytest.importorskip("peft")

VOCAB, TOKENS, DIM, BATCH = 200, 10, 64, 3  # BATCH * TOKENS is no width


class Encoder(nn.Module):
    """A frozen "pretrained" encoder: token embedding, two linears, a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)
        self.head = nn.Linear(DIM, 3)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.embed(tokens)
        h = h + self.down(torch.nn.functional.gelu(self.up(h)))
        return self.head(h.mean(1))


def member(seed: int) -> nn.Module:
    torch.manual_seed(1234)  # the same base for every member
    base = Encoder()
    config = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["up", "down"],
        lora_dropout=0.1,
        modules_to_save=["head"],
    )
    torch.manual_seed(seed)
    return peft.get_peft_model(base, config)


def _array(size: int, share: bool = True) -> tuple[hs.FusedArray, Any]:
    array = hs.fuse([member(i) for i in range(size)], share_frozen=share)
    opt = torch.optim.SGD(array.parameters(), lr=0.01)
    return array, opt


TOKENS_IN = torch.randint(0, VOCAB, (BATCH, TOKENS), generator=torch.Generator().manual_seed(0))
LABELS = torch.tensor([0, 1, 2])


def _step(array: hs.FusedArray, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad(set_to_none=True)
    hs.member_losses(array(TOKENS_IN), LABELS).sum().backward()
    opt.step()


class _Outputs(TorchDispatchMode):
    """Every op's name and the shapes of the tensors it returns."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, list[tuple[int, ...]]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        shapes = [tuple(t.shape) for t in pytree.tree_leaves(out) if isinstance(t, Tensor)]
        self.ops.append((str(func.overloadpacket.__name__), shapes))
        return out


def test_no_op_makes_a_per_member_copy_of_a_frozen_tensor() -> None:
    b = 5
    array, opt = _array(b)
    frozen = dict(array.named_buffers())
    shared = {tuple(frozen[f"module.{n}"].shape) for n in array.shared_frozen if "." in n}
    shared = {s for s in shared if len(s) == 2}  # the frozen weight matrices and the embedding
    assert (VOCAB, DIM) in shared and (4 * DIM, DIM) in shared and (DIM, 4 * DIM) in shared
    # the trained head (peft's modules_to_save) has the frozen head's shape: its per-member
    # weights and gradients are [B, 3, DIM] by right
    shared -= {tuple(p.shape[1:]) for p in array.parameters()}
    _step(array, opt)  # the trace is recorded; the second step replays it
    with _Outputs() as seen:
        _step(array, opt)
    copies = [
        (op, s) for op, shapes in seen.ops for s in shapes if s[:1] == (b,) and s[1:] in shared
    ]
    assert copies == []
    embedding = [shapes for op, shapes in seen.ops if op == "embedding"]
    assert embedding == [[(BATCH, TOKENS, DIM)]]  # once, on the shared batch


def _peak(size: int) -> int:
    array, opt = _array(size)
    for _ in range(2):
        _step(array, opt)
    existing = [dict(array.state_dict(keep_vars=True)), opt.state, TOKENS_IN, LABELS]
    with _LiveTensorBytes(existing) as tracker:
        _step(array, opt)
    return tracker.peak


def test_only_the_per_member_part_of_the_peak_grows_with_the_array() -> None:
    array, _ = _array(1)
    buffers = dict(array.named_buffers())
    frozen = sum(buffers[f"module.{n}"].untyped_storage().nbytes() for n in array.shared_frozen)
    one, many = _peak(1), _peak(8)
    assert frozen > 0 and one > frozen
    assert many <= frozen + 8 * (one - frozen)
