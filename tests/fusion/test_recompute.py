"""A fused array honours the model's own activation checkpointing (``torch.utils.checkpoint``
with ``use_reentrant=False``; Hugging Face's ``gradient_checkpointing_enable``): the regions the
model checkpoints are recomputed in the backward for all members at once, exactly (float64,
rtol 1e-7, forward, gradients, several optimizer steps; the same dropout masks; BatchNorm
statistics updated once), and what they compute inside is not saved for the backward. Forms that
cannot be honoured are refused, naming the submodule."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _tiny_hf import BERT, GPT2, NO_DROPOUT, VOCAB
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint as bound_checkpoint

import hfsweep as hs
from hfsweep import FusionError
from hfsweep.testing import assert_fusion_matches


class Block(nn.Module):
    def __init__(self, norm: bool, p: float, functional: bool) -> None:
        super().__init__()
        self.a = nn.Linear(6, 20)
        self.norm = nn.BatchNorm1d(20) if norm else nn.Identity()
        self.drop = nn.Dropout(p)
        self.b = nn.Linear(20, 6)
        self.functional = functional

    def forward(self, x: Tensor) -> Tensor:
        h = self.drop(torch.tanh(self.norm(self.a(x))))
        if self.functional:  # a random call of forward code: the member's functional stream
            h = F.dropout(h, 0.25, self.training) + 0.01 * torch.randn_like(h)
        return x + self.b(h)


class Net(nn.Module):
    """Three residual blocks, each checkpointed when ``checkpointed``; with ``functional``, forward
    code draws before the blocks too (so the regions start after the stream has drawn)."""

    def __init__(
        self, checkpointed: bool, norm: bool = False, p: float = 0.0, functional: bool = False
    ) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(norm, p, functional) for _ in range(3)])
        self.checkpointed = checkpointed
        self.functional = functional

    def forward(self, x: Tensor) -> Tensor:
        if self.functional:
            x = F.dropout(x, 0.1, self.training)
        for block in self.blocks:
            if self.checkpointed:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return x


def _x(g: torch.Generator) -> tuple[Tensor]:
    return (torch.randn(16, 6, generator=g, dtype=torch.float64),)


def _train_side_by_side(
    array: hs.FusedArray,
    refs: list[nn.Module],
    make_input: Callable[[torch.Generator], tuple[Any, ...]],
    loss: Callable[[Any], Tensor],
    steps: int = 3,
    lr: float = 0.05,
) -> None:
    """``steps`` SGD steps of ``array`` and of each reference alone on the same inputs, comparing
    outputs, gradients, weights and buffers (float64, rtol 1e-7) after each."""
    g = torch.Generator().manual_seed(0)
    opt = hs.optim.SGD(array, lr=lr)
    ref_opts = [
        torch.optim.SGD([p for p in r.parameters() if p.requires_grad], lr=lr) for r in refs
    ]
    for step in range(steps):
        args = make_input(g)
        opt.zero_grad()
        out = array(*args)
        loss(out).sum().backward()
        opt.step()
        for i, (r, o) in enumerate(zip(refs, ref_opts, strict=True)):
            o.zero_grad()
            expected = r(*args)
            loss(expected.unsqueeze(0)).sum().backward()
            torch.testing.assert_close(out[i], expected, rtol=1e-7, atol=1e-10)
            o.step()
            mine = array.member_state_dict(i)
            for name, value in r.state_dict().items():
                torch.testing.assert_close(
                    mine[name], value, rtol=1e-7, atol=1e-10, msg=f"step {step} member {i} {name}"
                )


def _square(out: Tensor) -> Tensor:
    return out.pow(2).flatten(1).mean(1)


@pytest.mark.parametrize("trace", [True, False])
def test_checkpointed_members_train_as_alone(trace: bool) -> None:
    """Against each checkpointed model alone (torch's own checkpoint): outputs, gradients,
    three SGD steps, train and eval."""
    assert_fusion_matches(lambda: Net(True), _x, size=3, steps=3, trace=trace)


@pytest.mark.parametrize("trace", [True, False])
def test_batchnorm_statistics_are_updated_once(trace: bool) -> None:
    """BatchNorm inside a checkpointed region: the statistics move once per step, as in the
    model without checkpointing (torch's own checkpoint moves them again when it recomputes)."""
    torch.manual_seed(3)
    refs = [Net(False, norm=True).double() for _ in range(3)]
    models = copy.deepcopy(refs)
    for m in models:
        m.checkpointed = True
    array = hs.fuse(models, trace=trace)
    _train_side_by_side(array, refs, _x, _square)


def _twin_arrays(
    make: Callable[[], nn.Module], set_checkpointing: Callable[[nn.Module], None], trace: bool
) -> tuple[hs.FusedArray, hs.FusedArray]:
    """The same members fused twice, with the same streams: without and with checkpointing."""
    plain = [make() for _ in range(3)]
    checkpointed = copy.deepcopy(plain)
    for m in checkpointed:
        set_checkpointing(m)
    torch.manual_seed(7)
    a = hs.fuse(plain, trace=trace)
    torch.manual_seed(7)
    b = hs.fuse(checkpointed, trace=trace)
    return a, b


def _assert_twins_train_alike(
    a: hs.FusedArray,
    b: hs.FusedArray,
    make_input: Callable[[torch.Generator], dict[str, Any]],
    loss: Callable[[Any], Tensor],
    steps: int = 3,
) -> None:
    """Outputs, every gradient and the weights after each AdamW step are equal (float64, rtol
    1e-7): each member's dropout masks are the same in the recomputation as in the forward."""
    g = torch.Generator().manual_seed(0)
    opts = [hs.optim.AdamW(x, lr=[1e-2, 3e-3, 2e-2]) for x in (a, b)]
    a.train()
    b.train()
    for step in range(steps):
        kwargs = make_input(g)
        outs = []
        for x, opt in zip((a, b), opts, strict=True):
            opt.zero_grad()
            out = x(**kwargs)
            loss(out).sum().backward()
            outs.append(loss(out).detach())
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-7, atol=1e-10)
        grads = dict(a.named_parameters())
        for name, p in b.named_parameters():
            assert p.grad is not None, name
            torch.testing.assert_close(
                p.grad, grads[name].grad, rtol=1e-7, atol=1e-10, msg=f"step {step} {name}"
            )
        for opt in opts:
            opt.step()
    for name, value in a.state_dict().items():
        torch.testing.assert_close(b.state_dict()[name], value, rtol=1e-7, atol=1e-10, msg=name)


@pytest.mark.parametrize("trace", [True, False])
def test_dropout_masks_are_the_same_when_recomputed(trace: bool) -> None:
    """Fused dropout layers with per-member p, ``F.dropout`` and ``torch.randn_like`` in forward
    code inside and before the checkpointed regions: the checkpointed array trains exactly as the
    same array without checkpointing (a mask drawn anew, or a count advanced twice, would not)."""

    def make() -> nn.Module:
        return Net(False, p=0.3, functional=True).double()

    def enable(m: nn.Module) -> None:
        m.checkpointed = True  # type: ignore[assignment]

    a, b = _twin_arrays(make, enable, trace)
    a.set_dropout([0.1, 0.3, 0.5])
    b.set_dropout([0.1, 0.3, 0.5])
    _assert_twins_train_alike(
        a, b, lambda g: {"x": torch.randn(16, 6, generator=g, dtype=torch.float64)}, _square
    )


def _saved(array: hs.FusedArray, x: Tensor) -> tuple[int, set[tuple[int, ...]]]:
    """Bytes and shapes of the tensors autograd saves for one training step's backward, less
    the array's own parameters (saved by reference, not made by the step)."""
    params = {p.data_ptr() for p in array.parameters()}
    total = [0]
    shapes: set[tuple[int, ...]] = set()

    def pack(t: Tensor) -> Tensor:
        if t.data_ptr() not in params:
            total[0] += t.numel() * t.element_size()
            shapes.add(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = array(x)
    _square(out).sum().backward()
    return total[0], shapes


@pytest.mark.parametrize("trace", [True, False])
def test_checkpointed_regions_save_nothing_inside(trace: bool) -> None:
    """The saved-tensor bytes of a step fall with checkpointing, and no tensor of the blocks'
    inside (the 20-wide hidden layer, ``[B, 16, 20]``) is saved; without it they are."""
    torch.manual_seed(0)
    plain = [Net(False).double() for _ in range(3)]
    checkpointed = copy.deepcopy(plain)
    for m in checkpointed:
        m.checkpointed = True
    x = torch.randn(16, 6, dtype=torch.float64)
    arrays = [hs.fuse(plain, trace=trace), hs.fuse(checkpointed, trace=trace)]
    for a in arrays:
        _saved(a, x)  # the first call traces
    (full, full_shapes), (less, less_shapes) = (_saved(a, x) for a in arrays)
    inside = (3, 16, 20)
    assert inside in full_shapes
    assert inside not in less_shapes, less_shapes
    assert less < full / 2, (less, full)


def _hf_config(name: str) -> Any:
    transformers = pytest.importorskip("transformers")
    if name == "bert":
        return transformers.BertModel(transformers.BertConfig(**BERT, **NO_DROPOUT["bert"]))
    config = transformers.GPT2Config(**GPT2, **NO_DROPOUT["gpt2"], bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


class _First(nn.Module):
    """The model's first output for token ids and a padding mask."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: Tensor, mask: Tensor) -> Tensor:
        return self.model(input_ids=ids, attention_mask=mask)[0]


def _tokens(g: torch.Generator) -> tuple[Tensor, Tensor]:
    ids = torch.randint(0, VOCAB, (2, 5), generator=g)
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[1, 3:] = 0
    return ids, mask


def _checkpointing(model: nn.Module, reentrant: bool = False) -> nn.Module:
    model.gradient_checkpointing_enable(  # type: ignore[operator]
        gradient_checkpointing_kwargs={"use_reentrant": reentrant}
    )
    return model


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_hf_gradient_checkpointing_matches_each_model_alone(name: str) -> None:
    """``gradient_checkpointing_enable(use_reentrant=False)`` (which also adds HF's
    input-require-grads hook): each member as the same checkpointed model alone, two SGD steps,
    train and eval."""
    array = assert_fusion_matches(
        lambda: _First(_checkpointing(_hf_config(name))), _tokens, size=2, steps=2
    )
    module = array.module.model
    hooks = module.get_input_embeddings()._forward_hooks
    assert len(hooks) == 1  # HF's hook is still there, for member(i) and after the calls


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_hf_reentrant_checkpointing_is_refused_naming_the_layer() -> None:
    models = [_First(_checkpointing(_hf_config("bert"), reentrant=True)) for _ in range(2)]
    array = hs.fuse(models)
    array.train()
    with pytest.raises(FusionError, match=r"submodule 'model\.encoder\.layer\.0'.*use_reentrant"):
        array(*_tokens(torch.Generator().manual_seed(0)))


class _Bound(nn.Module):
    """Calls checkpoint through a name bound at import, which the array cannot see."""

    def __init__(self, **options: Any) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.options = options

    def forward(self, x: Tensor) -> Tensor:
        return bound_checkpoint(self.inner, x, **self.options)


def _no_contexts() -> tuple[Any, Any]:
    return contextlib.nullcontext(), contextlib.nullcontext()


class _Through(_Bound):
    def forward(self, x: Tensor) -> Tensor:
        return torch.utils.checkpoint.checkpoint(self.inner, x, **self.options)


@pytest.mark.parametrize(
    "model, match",
    [
        (lambda: _Bound(use_reentrant=False), "a name bound before"),
        (lambda: _Bound(use_reentrant=True), "a name bound before"),
        (lambda: _Through(use_reentrant=True), "use_reentrant=True"),
        (lambda: _Through(use_reentrant=False, context_fn=_no_contexts), "context_fn"),
    ],
)
@pytest.mark.parametrize("trace", [True, False])
def test_checkpoint_forms_an_array_cannot_honour_are_refused(
    model: Callable[[], nn.Module], match: str, trace: bool
) -> None:
    """Never a silently kept activation or a recomputation outside the array's vmap: the call
    is refused in the forward, naming the module and what works instead."""
    array = hs.fuse([model(), model()], trace=trace)
    with pytest.raises(FusionError, match=rf"the root model \((_Bound|_Through)\).*{match}"):
        array(torch.randn(3, 4))
    assert torch.utils.checkpoint.checkpoint.__module__ == "torch.utils.checkpoint"


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_peft_lora_bert_with_checkpointing_trains_as_without() -> None:
    """A peft LoRA BERT classifier with per-member ``lora_dropout`` and hidden dropout, its HF
    gradient checkpointing on: the array trains exactly as the same array without it (the
    same masks in the recomputation), and the frozen base is still kept once."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")

    def make() -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1234)  # the "pretrained" encoder, the same in every member
            config = transformers.BertConfig(
                **BERT, hidden_dropout_prob=0.2, attention_probs_dropout_prob=0.0, num_labels=3
            )
            base = transformers.BertForSequenceClassification(config).double()
        lora = peft.LoraConfig(
            r=2,
            lora_alpha=8,
            target_modules=["query", "value"],
            lora_dropout=0.3,
            task_type="SEQ_CLS",
        )
        model = peft.get_peft_model(base, lora)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                nn.init.normal_(p, std=0.1)
        return model

    def enable(model: nn.Module) -> None:
        model.get_base_model().gradient_checkpointing_enable(  # type: ignore[operator]
            gradient_checkpointing_kwargs={"use_reentrant": False}
        )

    torch.manual_seed(5)
    a, b = _twin_arrays(make, enable, trace=True)
    assert b.shared_frozen == a.shared_frozen
    assert any("word_embeddings" in n for n in b.shared_frozen)

    def batch(g: torch.Generator) -> dict[str, Any]:
        ids = torch.randint(0, VOCAB, (4, 7), generator=g)
        return {"input_ids": ids, "labels": torch.randint(0, 3, (4,), generator=g)}

    _assert_twins_train_alike(a, b, batch, lambda out: out.loss)


class _TrainingOnly(Net):
    """Checkpoints only in training, as Hugging Face's layers do."""

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            if self.training:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return x


def test_a_checkpointing_forward_runs_eagerly_and_others_stay_traced() -> None:
    """A trace would keep the regions' results for the backward: a training call that
    checkpoints runs eagerly; an evaluation call of the same array is still traced."""
    torch.manual_seed(0)
    array = hs.fuse([_TrainingOnly(True).double() for _ in range(2)])
    x = torch.randn(16, 6, dtype=torch.float64)
    for _ in range(2):
        array(x).sum().backward()
        assert not array._last_call_traced
    array.eval()
    with torch.no_grad():
        for _ in range(3):
            array(x)
    assert array._last_call_traced
