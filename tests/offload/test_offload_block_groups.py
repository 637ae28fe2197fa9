"""Units streamed between blocks, grouped into shards (``hfsweep.offload._units``): a model of
many small blocks that ``torch.fx`` cannot trace, cut between its blocks, makes one fetch per
group of consecutive units the shard limit holds, not one per block; under a tight budget each
block is a shard of its own. Each way trains exactly as the same array without offload
(float64: forward, gradients, many steps of several optimizers with schedules, dropout streams),
the engine's ledger within the budget."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from _offload_toy import Counting
from torch import Tensor, nn

import hfsweep as hs
from hfsweep.offload import OffloadedArray

B = 3
BLOCKS = 8
WIDTH = 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.drop = nn.Dropout(0.2)  # per-member streams: buffers each call writes

    def forward(self, h: Tensor) -> Tensor:
        return self.drop(torch.tanh(self.fc(self.norm(h))))


class ManyBlocks(nn.Module):
    """A stem, eight small residual blocks and a head; its forward branches on its input's
    rank (fx cannot trace it: offload's ``auto`` cuts it between its blocks) and calls the
    first block a second time at the end (one unit called twice in a step)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.stem = nn.Linear(6, WIDTH)
        self.blocks = nn.ModuleList([Block() for _ in range(BLOCKS)])
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() == 3:  # control flow on a traced value: torch.fx cannot trace this
            x = x.flatten(0, 1)
        h = self.stem(x)
        for block in self.blocks:
            h = h + block(h)
        h = h + self.blocks[0](h)
        return self.head(h)


#: the units a forward calls, in order: the stem, the blocks, block 0 again, the head
CALLS = ["stem", *[f"blocks.{i}" for i in range(BLOCKS)], "blocks.0", "head"]


def _runs(engine: OffloadedArray) -> int:
    """How many runs of consecutive calls of one shard's units a forward makes: a shard stays
    on the compute side while the model's code calls its units, so each run is one fetch in
    the forward and one in the backward (which reaches the calls in reverse)."""
    shard = {n: k for k, s in enumerate(engine.shards) for n in s.nodes}
    held = [shard[n] for n in CALLS]
    return 1 + sum(a != b for a, b in itertools.pairwise(held))


def _pair() -> tuple[hs.FusedArray, hs.FusedArray]:
    models = [ManyBlocks(i).double() for i in range(B)]
    whole, host = hs.fuse(copy.deepcopy(models)), hs.fuse(models)
    for i in range(B):
        whole.manual_seed(i, 100 + i)
        host.manual_seed(i, 100 + i)
    return whole, host


def _unit_bytes(name: str | None = None) -> int:
    """The bytes of one unit's stacked state (``None``: the whole array's) as the engine
    counts them (each member's tensors, the dropout streams' counters)."""
    _, host = _pair()
    units = [u for s in OffloadedArray(host, cut="blocks").shards for u in s.units]
    return sum(u.nbytes for u in units if name is None or u.nodes == [name])


def _optimizers(kind: str, array: hs.FusedArray) -> tuple[object, object]:
    if kind == "sgd":
        opt = hs.optim.SGD(array, lr=[0.1, 0.05, 0.02], momentum=[0.0, 0.5, 0.9], nesterov=False)
        sched = hs.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=[4, 6, 8])
    elif kind == "adamw":
        opt = hs.optim.AdamW(array, lr=[1e-2, 3e-3, 1e-3], weight_decay=[0.0, 0.01, 0.1])
        sched = hs.optim.lr_scheduler.StepLR(opt, step_size=[1, 2, 3], gamma=[0.5, 0.7, 0.9])
    else:
        opt = hs.optim.RMSprop(array, lr=[1e-3, 3e-3, 1e-2], alpha=[0.9, 0.99, 0.95])
        sched = hs.optim.lr_scheduler.StepLR(opt, step_size=[2, 2, 2], gamma=[0.5, 0.6, 0.7])
    return opt, sched


def _train(
    kind: str, budget: int | None, steps: int = 6
) -> tuple[OffloadedArray, Counting, list[int]]:
    """``steps`` steps of the offloaded array and the whole one side by side, compared; the
    engine, its transfer and the fetches of each step."""
    whole, host = _pair()
    transfer = Counting()
    engine = OffloadedArray(host, transfer=transfer, budget_bytes=budget)
    (opt_w, sched_w), (opt_h, sched_h) = _optimizers(kind, whole), _optimizers(kind, host)
    gen = torch.Generator().manual_seed(1)
    fetches = []
    for _ in range(steps):
        x = torch.randn(3, 6, generator=gen, dtype=torch.float64)
        before = transfer.fetches
        out_w, out_h = whole(x), engine(x)
        torch.testing.assert_close(out_h, out_w, rtol=1e-7, atol=1e-12)
        out_w.square().mean().backward()
        out_h.square().mean().backward()
        fetches.append(transfer.fetches - before)
        for (name, pw), ph in zip(whole.named_parameters(), host.parameters(), strict=True):
            torch.testing.assert_close(ph.grad, pw.grad, rtol=1e-7, atol=1e-12, msg=name)
        for opt, sched in ((opt_w, sched_w), (opt_h, sched_h)):
            opt.step()  # type: ignore[attr-defined]
            opt.zero_grad(set_to_none=True)  # type: ignore[attr-defined]
            sched.step()  # type: ignore[attr-defined]
        assert engine.ledger.resident == 0
    for (name, tw), th in zip(whole.state_dict().items(), host.state_dict().values(), strict=True):
        torch.testing.assert_close(th, tw, rtol=1e-7, atol=1e-12, msg=name)
    assert all(host.rng_state(i) == whole.rng_state(i) for i in range(B))
    return engine, transfer, fetches


def _check_ledger(engine: OffloadedArray, budget: int) -> None:
    """The engine's own accounting: every shard within a quarter of the budget, the peaks of
    the forward and the backward within the budget, two shards held at once (prefetch)."""
    shards = engine.shards
    assert max(s.nbytes for s in shards) <= budget // 4
    for phase in ("forward", "backward"):
        assert 0 < engine.ledger.peaks[phase] <= budget, phase
    pairs = [a.nbytes + b.nbytes for a, b in itertools.pairwise(shards)]
    assert engine.ledger.peaks["forward"] >= min(pairs)


@pytest.mark.parametrize("kind", ["sgd", "adamw", "rmsprop"])
def test_a_tight_budget_streams_one_block_per_shard(kind: str) -> None:
    """A shard limit that holds one block and not two: every block a shard of its own, one
    fetch per unit call in the forward and in the backward."""
    block = _unit_bytes("blocks.1")
    budget = 4 * (block + block // 2)
    engine, _, fetches = _train(kind, budget)
    assert engine._blocks is not None  # cut between its blocks (fx cannot trace it)
    held = [[n for n in s.nodes if n.startswith("blocks.")] for s in engine.shards]
    assert [b for b in held if b] == [[f"blocks.{i}"] for i in range(BLOCKS)]
    # after the first step (whose prefetch does not know the order of the calls yet): every
    # block's call fetches its shard, in the forward and again in the backward
    assert _runs(engine) >= BLOCKS + 2
    assert fetches[1:] == [2 * _runs(engine)] * (len(fetches) - 1)
    _check_ledger(engine, budget)


@pytest.mark.parametrize("kind", ["sgd", "adamw", "rmsprop"])
def test_a_generous_budget_groups_the_blocks_into_fewer_fetches(kind: str) -> None:
    """A shard limit that holds three blocks: consecutive units grouped up to it, each group
    fetched once per direction while the model's code calls its units; block 0, called again
    at the end, fetched again with its group. A limit over the whole model: one shard, two
    fetches a step."""
    block = _unit_bytes("blocks.1")
    budget = 4 * 3 * block
    engine, _, fetches = _train(kind, budget)
    groups = [s.nodes for s in engine.shards]
    assert [n for g in groups for n in g] == ["stem", *CALLS[1 : 1 + BLOCKS], "head"]
    blocks = [[n for n in g if n.startswith("blocks.")] for g in groups]
    assert max(len(b) for b in blocks) == 3
    # per direction: one fetch per group, and block 0's group again for its second call
    assert _runs(engine) == len(groups) + 1 < len(CALLS)
    assert fetches[1:] == [2 * _runs(engine)] * (len(fetches) - 1)
    _check_ledger(engine, budget)

    engine, _, fetches = _train(kind, 4 * _unit_bytes(), steps=3)
    assert len(engine.shards) == 1 and len(engine.shards[0].units) == 2 + BLOCKS
    assert fetches == [2, 2, 2]


def test_without_a_budget_the_units_are_grouped_into_about_four_shards() -> None:
    """No budget: the shard limit is a quarter of the array's state, as for the graph cut."""
    _, host = _pair()
    engine = OffloadedArray(host, cut="blocks")
    assert 3 <= len(engine.shards) <= 6
    assert sum(len(s.units) for s in engine.shards) == 2 + BLOCKS
