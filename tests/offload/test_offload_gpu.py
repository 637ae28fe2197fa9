"""The offload engine on a CUDA device (skipped where none is present): pinned host storage, a
side stream for the copies; exact against the array run whole, and the device's peak memory
within the budget for an array whose state is over twice that budget."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import hfsweep as hs
from hfsweep.offload import AlternatingArrays, CudaTransfer, OffloadedArray

pytestmark = pytest.mark.gpu


def _random_inputs() -> Iterator[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    while True:
        yield torch.randn(8, 16, generator=gen, dtype=torch.float64).cuda()


def _train_side_by_side(
    whole: hs.FusedArray,
    host: hs.FusedArray,
    engine: OffloadedArray,
    opt_w: hs.optim.FusedOptimizer,
    opt_h: hs.optim.FusedOptimizer,
    inputs: Iterator[torch.Tensor] | None = None,
) -> None:
    """Three steps of ``whole`` on CUDA and of ``host`` run by ``engine`` on ``inputs``
    (default: random ``[8, 16]``): the same outputs and, at the end, the same state
    (float64)."""
    inputs = _random_inputs() if inputs is None else inputs
    for _ in range(3):
        x = next(inputs)
        out_w, out_h = whole(x), engine(x)
        torch.testing.assert_close(out_h, out_w, rtol=1e-7, atol=1e-12)
        out_w.square().mean().backward()
        out_h.square().mean().backward()
        for o in (opt_w, opt_h):
            o.step()
            o.zero_grad(set_to_none=True)
    for (name, tw), th in zip(whole.state_dict().items(), host.state_dict().values(), strict=True):
        torch.testing.assert_close(th.cuda(), tw, rtol=1e-7, atol=1e-12, msg=name)


def _peak_of_two_steps(
    engine: OffloadedArray, opt: hs.optim.FusedOptimizer, x: torch.Tensor, stepped: bool = False
) -> int:
    """The CUDA allocator's peak over two training steps, above what was allocated before
    (``stepped``: the engine steps ``opt`` on the device in the backward)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(2):
        engine(x).square().mean().backward()
        if not stepped:
            opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated() - base)


def test_offloaded_on_cuda_trains_as_the_whole_array_float64() -> None:
    models = [
        nn.Sequential(
            nn.Linear(16, 32),
            nn.BatchNorm1d(32),
            nn.ReLU(),
            nn.Dropout(0.2),
            nn.Linear(32, 32),
            nn.Tanh(),
            nn.Linear(32, 4),
        ).double()
        for _ in range(3)
    ]
    whole = hs.fuse(copy.deepcopy(models)).to("cuda")
    host = hs.fuse(models, share_frozen=False)
    for i in range(3):
        whole.manual_seed(i, i + 1)
        host.manual_seed(i, i + 1)
    engine = OffloadedArray(host, device="cuda")
    assert isinstance(engine.transfer, CudaTransfer) and len(engine.shards) >= 3
    assert all(p.device.type == "cpu" and p.is_pinned() for p in host.parameters())
    opt_w = hs.optim.SGD(whole, lr=[0.1, 0.05, 0.01], momentum=[0.0, 0.5, 0.9])
    opt_h = hs.optim.SGD(host, lr=[0.1, 0.05, 0.01], momentum=[0.0, 0.5, 0.9])
    _train_side_by_side(whole, host, engine, opt_w, opt_h)


def test_an_array_over_twice_the_budget_trains_within_it_on_cuda() -> None:
    layers, width, size = 8, 1024, 8
    models = [nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]) for _ in range(size)]
    host = hs.fuse(models, share_frozen=False)
    params = sum(p.numel() * p.element_size() for p in host.parameters())
    state = 4 * params  # weights, gradients, two AdamW moments
    budget = int(0.6 * params)
    assert state >= 2 * budget
    engine = OffloadedArray(host, device="cuda", budget_bytes=budget)
    opt = hs.optim.AdamW(host, lr=[1e-3] * size)
    x = torch.randn(32, width, device="cuda")
    peak = _peak_of_two_steps(engine, opt, x)
    transient = 16 * 2**20  # activations inside one shard's recomputation ([8, 32, 1024] floats)
    assert engine.ledger.peak <= budget
    assert peak <= budget + transient, (peak, budget)


class _FineTune(nn.Module):
    """A frozen backbone (the same "pretrained" weights in every member) and a member's head."""

    def __init__(self, seed: int, width: int, layers: int) -> None:
        super().__init__()
        torch.manual_seed(1234)
        blocks: list[nn.Module] = [nn.Linear(16, width), nn.Tanh()]
        for _ in range(layers):
            blocks += [nn.Linear(width, width), nn.Tanh()]
        self.backbone = nn.Sequential(*blocks).requires_grad_(False)
        torch.manual_seed(seed)
        self.head = nn.Sequential(nn.Linear(width, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


def test_a_shared_frozen_backbone_on_cuda_trains_as_the_whole_array_float64() -> None:
    models = [_FineTune(i, 64, 3).double() for i in range(3)]
    whole = hs.fuse(copy.deepcopy(models)).to("cuda")
    host = hs.fuse(models)
    assert host.shared_frozen
    engine = OffloadedArray(host, device="cuda", shard_bytes=1)
    frozen = [name for name, t in host.module.named_buffers() if "backbone" in name]
    assert frozen and all(t.is_pinned() for _, t in host.module.named_buffers())
    assert any(s.shared_output for s in engine.shards)
    opt_w = hs.optim.AdamW(whole, lr=[1e-2, 3e-3, 1e-3])
    opt_h = hs.optim.AdamW(host, lr=[1e-2, 3e-3, 1e-3])
    _train_side_by_side(whole, host, engine, opt_w, opt_h)


def test_a_backbone_of_b_copies_over_the_budget_streams_once_within_it_on_cuda() -> None:
    """8 members on a frozen backbone of 6 layers of 2048 x 2048 (16 MiB each in float32): its
    B copies would be 8 x 100 MiB, over twice the budget; kept once, one copy streams through
    the device within the budget and the peak stays under it."""
    size, width, layers = 8, 2048, 6
    host = hs.fuse([_FineTune(i, width, layers) for i in range(size)])
    layer = (width * width + width) * 4
    backbone = layers * layer
    budget = 4 * (layer + 2**20)  # shards of one backbone layer and a little more
    assert size * backbone >= 2 * budget
    engine = OffloadedArray(host, device="cuda", budget_bytes=budget)
    opt = hs.optim.AdamW(host, lr=[1e-3] * size)
    x = torch.randn(64, 16, device="cuda")
    peak = _peak_of_two_steps(engine, opt, x)
    transient = 16 * 2**20  # activations inside one shard's computation
    assert engine.ledger.peak <= budget
    assert peak <= budget + transient, (peak, budget)


def test_a_bert_classifier_streamed_between_its_blocks_on_cuda_trains_as_the_whole_array() -> None:
    """transformers' BERT (fx cannot cut it) streamed unit by unit on CUDA: its own forward on
    the device, each block's tensors copied in from pinned host storage (float64, exact)."""
    pytest.importorskip("transformers")
    from test_offload_blocks import Classifier, _ids

    models = [Classifier(i).double() for i in range(3)]
    whole = hs.fuse(copy.deepcopy(models)).to("cuda")
    host = hs.fuse(models)
    for i in range(3):
        whole.manual_seed(i, i + 1)
        host.manual_seed(i, i + 1)
    engine = OffloadedArray(host, device="cuda", cut="blocks")
    assert any(".encoder.layer.0" in n for s in engine.shards for n in s.nodes)
    assert any(len(s.units) > 1 for s in engine.shards)  # units grouped (no budget)
    opt_w = hs.optim.AdamW(whole, lr=[1e-2, 3e-3, 1e-3])
    opt_h = hs.optim.AdamW(host, lr=[1e-2, 3e-3, 1e-3])
    ids = (_ids(step).cuda() for step in range(3))
    _train_side_by_side(whole, host, engine, opt_w, opt_h, ids)
    assert engine.ledger.resident == 0


def test_two_arrays_alternated_on_cuda_train_as_each_whole() -> None:
    """Two arrays stepped together by ``AlternatingArrays`` on CUDA (one side stream for both
    arrays' copies, one ledger): each exact against its whole array on the device (float64)."""
    made = [
        [
            nn.Sequential(*[nn.Linear(16, w) if i == 0 else nn.Linear(w, w) for i in range(4)])
            for _ in range(3)
        ]
        for w in (16, 24)
    ]
    made = [[m.double() for m in ms] for ms in made]
    wholes = [hs.fuse(copy.deepcopy(ms)).to("cuda") for ms in made]
    hosts = [hs.fuse(ms) for ms in made]
    pair = AlternatingArrays(hosts, device="cuda", budget_bytes=4 * 2**20)
    assert isinstance(pair.transfer, CudaTransfer)
    opts = [hs.optim.AdamW(a, lr=[1e-2, 3e-3, 1e-3]) for a in [*wholes, *hosts]]
    inputs = _random_inputs()
    for _ in range(3):
        x = next(inputs)
        outs = pair.forward([x, x])
        for out, whole in zip(outs, wholes, strict=True):
            out_w = whole(x)
            torch.testing.assert_close(out, out_w, rtol=1e-7, atol=1e-12)
            out_w.square().mean().backward()
        pair.backward([o.square().mean() for o in outs])
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)
    for whole, host in zip(wholes, hosts, strict=True):
        pairs = zip(whole.state_dict().items(), host.state_dict().values(), strict=True)
        for (name, tw), th in pairs:
            torch.testing.assert_close(th.cuda(), tw, rtol=1e-7, atol=1e-12, msg=name)
    assert pair.ledger.peak <= 4 * 2**20 and pair.ledger.resident == 0
    pair.close()


def test_the_device_step_on_cuda_trains_as_the_whole_array_float64() -> None:
    """``step_on_device``: each shard's AdamW update on the GPU right after its backward, its
    state fetched there; the same outputs and end state as the whole array stepped on CUDA,
    and no gradient back on the host."""
    models = [
        nn.Sequential(
            nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)
        ).double()
        for _ in range(3)
    ]
    whole = hs.fuse(copy.deepcopy(models)).to("cuda")
    host = hs.fuse(models, share_frozen=False)
    engine = OffloadedArray(host, device="cuda")
    assert len(engine.shards) >= 3
    lr = [1e-2, 5e-3, 1e-3]
    opt_w, opt_h = hs.optim.AdamW(whole, lr=lr), hs.optim.AdamW(host, lr=lr)
    engine.step_on_device(opt_h)
    inputs = _random_inputs()
    for _ in range(3):
        x = next(inputs)
        out_w, out_h = whole(x), engine(x)
        torch.testing.assert_close(out_h, out_w, rtol=1e-7, atol=1e-12)
        out_w.square().mean().backward()
        out_h.square().mean().backward()
        assert all(p.grad is None for p in host.parameters())
        opt_w.step()
        for o in (opt_w, opt_h):
            o.zero_grad(set_to_none=True)
    for (name, tw), th in zip(whole.state_dict().items(), host.state_dict().values(), strict=True):
        torch.testing.assert_close(th.cuda(), tw, rtol=1e-7, atol=1e-12, msg=name)


def test_the_device_step_of_an_array_over_twice_the_budget_stays_within_it_on_cuda() -> None:
    """The AdamW state fetched shard by shard for the device step counts in the budget: the
    CUDA allocator's peak stays under it, as with the host step."""
    layers, width, size = 8, 1024, 8
    models = [nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]) for _ in range(size)]
    host = hs.fuse(models, share_frozen=False)
    params = sum(p.numel() * p.element_size() for p in host.parameters())
    budget = int(0.6 * params)
    assert 4 * params >= 2 * budget  # weights, gradients, two AdamW moments
    engine = OffloadedArray(host, device="cuda", budget_bytes=budget)
    opt = hs.optim.AdamW(host, lr=[1e-3] * size)
    engine.step_on_device(opt)
    x = torch.randn(32, width, device="cuda")
    peak = _peak_of_two_steps(engine, opt, x, stepped=True)
    transient = 16 * 2**20  # activations inside one shard's recomputation ([8, 32, 1024] floats)
    assert engine.ledger.peak <= budget
    assert peak <= budget + transient, (peak, budget)
