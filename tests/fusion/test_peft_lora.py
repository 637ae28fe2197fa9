"""peft LoRA models fuse unmodified, with the frozen base model kept once.

Members are ``get_peft_model`` wrappers of one "pretrained" base (identical, frozen), each with its
own adapter initialisation, ``lora_alpha`` and ``lora_dropout``. Each member trains exactly as the
same peft model alone with ``torch.optim`` (float64, rtol 1e-7; forward, gradients, optimizer
state, many steps), and its trained adapter saves and loads with peft's own ``save_pretrained`` /
``PeftModel.from_pretrained``.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _side_by_side import ATOL, RTOL, SideBySide, trained
from _tiny_hf import BERT, GPT2, NO_DROPOUT, VOCAB
from torch import Tensor, nn

import hfsweep as hs

peft = pytest.importorskip("peft")


class Base(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def pretrained() -> Base:
    torch.manual_seed(1234)  # the same "pretrained" weights for every member
    return Base().double()


def lora_member(seed: int, alpha: float, dropout: float = 0.0, head: bool = True) -> nn.Module:
    config = peft.LoraConfig(
        r=4,
        lora_alpha=alpha,
        target_modules=["fc1", "fc2"],
        lora_dropout=dropout,
        modules_to_save=["head"] if head else None,
    )
    torch.manual_seed(seed)
    model = peft.get_peft_model(pretrained(), config)
    for name, p in model.named_parameters():  # LoRA's B starts at 0: give it weights to train
        if "lora_B" in name:
            nn.init.normal_(p, std=0.1)
    return model


ALPHAS = [4, 8, 16]
LRS = [1e-2, 3e-3, 2e-2]
BASE_NAMES = [
    f"base_model.model.{n}"
    for n in (
        "fc1.base_layer.weight",
        "fc1.base_layer.bias",
        "fc2.base_layer.weight",
        "fc2.base_layer.bias",
        "head.original_module.weight",
        "head.original_module.bias",
    )
]


def test_lora_members_train_as_alone_with_the_base_kept_once() -> None:
    models = [lora_member(10 + i, a) for i, a in enumerate(ALPHAS)]
    refs = [copy.deepcopy(m) for m in models]
    array = hs.fuse(models)
    assert array.shared_frozen == BASE_NAMES
    assert all("lora_" in n or "modules_to_save" in n for n, _ in array.named_parameters())
    wds = [0.0, 0.01, 0.1]
    run = SideBySide(
        array,
        hs.optim.AdamW(array, lr=LRS, weight_decay=wds),
        refs,
        [
            torch.optim.AdamW(trained(r), lr=lr, weight_decay=wd, foreach=False)
            for r, lr, wd in zip(refs, LRS, wds, strict=True)
        ],
    )
    array.train()
    gen = torch.Generator().manual_seed(0)
    for step in range(40):
        x = torch.randn(6, 8, generator=gen, dtype=torch.float64)
        y = torch.randint(0, 3, (6,), generator=gen)
        run.step(
            x,
            loss=lambda out, y=y: hs.member_losses(out, y),
            ref_loss=lambda out, y=y: F.cross_entropy(out, y),
            grads=step == 0,
        )
    run.assert_states()


def test_lora_dropout_differs_per_member() -> None:
    """Each member's ``lora_dropout`` is its own; masks come from the member's stream, so the
    reference is the same model alone in an array of one, with the same seed."""
    dropouts = [0.1, 0.3, 0.5]
    models = [
        lora_member(10 + i, a, d) for i, (a, d) in enumerate(zip(ALPHAS, dropouts, strict=True))
    ]
    alone = [hs.fuse([copy.deepcopy(m)]) for m in models]
    array = hs.fuse(models)
    assert array.shared_frozen == BASE_NAMES
    assert array.dropout["base_model.model.fc1.lora_dropout.default"] == pytest.approx(dropouts)
    for i, a in enumerate(alone):
        array.manual_seed(i, 100 + i)
        a.manual_seed(0, 100 + i)
    run = SideBySide(
        array,
        hs.optim.SGD(array, lr=LRS, momentum=[0.9] * 3),
        alone,
        [
            torch.optim.SGD(trained(a), lr=lr, momentum=0.9)
            for a, lr in zip(alone, LRS, strict=True)
        ],
        alone=True,
    )
    gen = torch.Generator().manual_seed(0)
    for step in range(20):
        x = torch.randn(6, 8, generator=gen, dtype=torch.float64)
        y = torch.randint(0, 3, (6,), generator=gen)
        run.step(x, loss=lambda out, y=y: hs.member_losses(out, y), grads=step == 0)
    run.assert_states(optimizer=False)


def test_a_members_adapter_saves_and_loads_with_peft(tmp_path: Any) -> None:
    models = [lora_member(10 + i, a, 0.1 * (i + 1), head=False) for i, a in enumerate(ALPHAS)]
    array = hs.fuse(models)
    opt = hs.optim.Adam(array, lr=LRS)
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        x = torch.randn(6, 8, generator=gen, dtype=torch.float64)
        y = torch.randint(0, 3, (6,), generator=gen)
        opt.zero_grad()
        hs.member_losses(array(x), y).sum().backward()
        opt.step()
    array.eval()
    x = torch.randn(4, 8, dtype=torch.float64)
    out = array(x)
    for i in range(3):
        member = array.member(i)
        member.save_pretrained(tmp_path / f"m{i}")
        saved = json.loads((tmp_path / f"m{i}" / "adapter_config.json").read_text())
        assert saved["lora_alpha"] == ALPHAS[i]
        assert saved["lora_dropout"] == pytest.approx(0.1 * (i + 1))
        loaded = peft.PeftModel.from_pretrained(pretrained(), tmp_path / f"m{i}").double().eval()
        assert loaded.base_model.model.fc1.scaling["default"] == ALPHAS[i] / 4
        torch.testing.assert_close(loaded(x), out[i], rtol=RTOL, atol=ATOL)


def test_members_that_differ_in_rank_do_not_fuse() -> None:
    a = lora_member(1, 8)
    torch.manual_seed(2)
    b = peft.get_peft_model(
        pretrained(), peft.LoraConfig(r=2, lora_alpha=8, target_modules=["fc1", "fc2"])
    )
    with pytest.raises(hs.FusionError):
        hs.fuse([a, b])


def test_lora_dropout_zero_beside_nonzero_is_refused_with_the_reason() -> None:
    with pytest.raises(hs.FusionError, match=r"peft builds nn\.Identity for lora_dropout=0"):
        hs.fuse([lora_member(1, 8, 0.0), lora_member(2, 8, 0.1)])


def test_a_refill_brings_its_own_lora_alpha() -> None:
    models = [lora_member(10 + i, a) for i, a in enumerate(ALPHAS)]
    array = hs.fuse(models)
    newcomer = lora_member(99, 32)
    array.load_member(1, newcomer)
    assert array.shared_frozen == BASE_NAMES
    x = torch.randn(4, 8, dtype=torch.float64)
    out = array(x)
    torch.testing.assert_close(out[1], newcomer(x), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(out[0], models[0](x), rtol=RTOL, atol=ATOL)
    assert array.member(1).peft_config["default"].lora_alpha == 32


def _lora_member(
    base: nn.Module, seed: int, alpha: float, targets: list[str], task_type: str
) -> nn.Module:
    """``base`` (the same "pretrained" model in every member) with a rank-2 LoRA adapter on
    ``targets``, drawn from ``seed``; its ``lora_B`` drawn too, so that the adapter acts."""
    lora = peft.LoraConfig(
        r=2, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, task_type=task_type
    )
    torch.manual_seed(seed)
    model = peft.get_peft_model(base, lora)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(p, std=0.1)
    return model


def _bert_member(seed: int, alpha: float) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(1234)  # the "pretrained" encoder, the same in every member
    config = transformers.BertConfig(**BERT, **NO_DROPOUT["bert"], num_labels=3)
    base = transformers.BertForSequenceClassification(config).double()
    return _lora_member(base, seed, alpha, ["query", "value"], "SEQ_CLS")


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_lora_bert_classifier_with_its_own_loss_trains_as_alone() -> None:
    """A tiny BERT for sequence classification with LoRA on query/value: padded batches with an
    attention mask, the model's own loss output ([B] from the array), per-member alpha and lr."""
    models = [_bert_member(10 + i, a) for i, a in enumerate([2, 4, 8])]
    refs = [copy.deepcopy(m) for m in models]
    array = hs.fuse(models)
    names = [n for n, _ in array.named_parameters()]
    assert names and all("lora_" in n or "modules_to_save" in n for n in names)
    assert any("word_embeddings" in n for n in array.shared_frozen)
    run = SideBySide(
        array,
        hs.optim.AdamW(array, lr=LRS),
        refs,
        [
            torch.optim.AdamW(trained(r), lr=lr, foreach=False)
            for r, lr in zip(refs, LRS, strict=True)
        ],
        outputs=lambda out: [out.logits, out.loss],
    )
    array.train()
    gen = torch.Generator().manual_seed(0)
    for step in range(8):
        ids = torch.randint(0, VOCAB, (4, 7), generator=gen)
        mask = torch.ones(4, 7, dtype=torch.long)
        mask[1, 5:] = 0
        mask[3, 3:] = 0
        labels = torch.randint(0, 3, (4,), generator=gen)
        run.step(
            input_ids=ids,
            attention_mask=mask,
            labels=labels,
            loss=lambda out: out.loss,
            ref_loss=lambda out: out.loss,
            grads=step == 0,
        )
    run.assert_states()


def _gpt2_member(seed: int, alpha: float) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(1234)  # the "pretrained" causal LM, the same in every member
    settings = {**GPT2, **NO_DROPOUT["gpt2"], "n_layer": 2, "bos_token_id": 0, "eos_token_id": 0}
    base = transformers.GPT2LMHeadModel(transformers.GPT2Config(**settings)).double()
    # GPT-2's Conv1D: peft sets fan_in_fan_out itself
    return _lora_member(base, seed, alpha, ["c_attn"], "CAUSAL_LM")


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
@pytest.mark.filterwarnings("ignore:fan_in_fan_out is set to False:UserWarning")
def test_lora_gpt2_causal_lm_with_its_own_loss_trains_as_alone() -> None:
    """A tiny GPT-2 with LoRA on its fused attention projection (a Conv1D), trained on its own
    next-token loss (``labels=``), per-member alpha and lr: each member equals the same peft
    model trained alone with torch.optim, forward, gradients, weights and optimizer state."""
    models = [_gpt2_member(20 + i, a) for i, a in enumerate([2, 4, 8])]
    refs = [copy.deepcopy(m) for m in models]
    array = hs.fuse(models)
    names = [n for n, _ in array.named_parameters()]
    assert names and all("lora_" in n for n in names)
    assert any("wte" in n for n in array.shared_frozen)
    run = SideBySide(
        array,
        hs.optim.AdamW(array, lr=LRS, weight_decay=[0.0, 0.01, 0.1]),
        refs,
        [
            torch.optim.AdamW(trained(r), lr=lr, weight_decay=wd, foreach=False)
            for r, lr, wd in zip(refs, LRS, [0.0, 0.01, 0.1], strict=True)
        ],
        outputs=lambda out: [out.logits, out.loss],
        # transformers computes the causal LM loss in float32 (it upcasts the logits), so the
        # losses and everything after them carry float32 rounding: the float32 tolerances
        rtol=1e-5,
        atol=1e-7,
    )
    array.train()
    gen = torch.Generator().manual_seed(0)
    for step in range(10):
        ids = torch.randint(1, VOCAB, (3, 9), generator=gen)
        run.step(
            input_ids=ids,
            labels=ids,
            loss=lambda out: out.loss,
            ref_loss=lambda out: out.loss,
            grads=step in (0, 9),
        )
    run.assert_states()
