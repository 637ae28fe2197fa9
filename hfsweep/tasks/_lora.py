"""``text_lora``: LoRA fine-tuning of a small "pretrained" BERT-style encoder, offline.

A fine-tuning sweep's shape on a CPU in seconds: a tiny ``transformers`` BERT encoder is
pretrained in-process (masked-token prediction on generated token sequences, from a fixed seed,
once per process and settings: :func:`pretrained_state`), then each trial wraps it with peft's
LoRA (``LoraConfig``/``get_peft_model``) and fine-tunes the adapters and the classifier head on a
generated text-classification set (:func:`keyword_texts`). The encoder is frozen and identical
in every trial, so a fused array keeps it once (``share_frozen``) and trains B adapters on it;
``lr``, ``weight_decay``, ``lora_alpha`` and ``lora_dropout`` vary per member, ``lora_r`` and
``lora_targets`` (the adapter's shapes) are part of the compatibility key. With
``gradient_checkpointing: true`` the encoder recomputes each layer in the backward instead of
keeping its activations (Hugging Face's ``gradient_checkpointing_enable`` with
``use_reentrant=False``, which a fused array honours for all members at once): less memory per
member, the same training. Nothing is downloaded; transformers and peft are imported when a model
is built.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from ..training.task import Config, Task, TaskError, fork_rng, manual_seed
from ._data import TensorBatches

__all__ = ["LoraClassifier", "keyword_texts", "pretrained_state", "text_lora"]

#: token ids: padding, the [CLS] token every text starts with, the [MASK] of pretraining; then
#: each class's keywords, then filler words
PAD, CLS, MASK = 0, 1, 2
_KEYWORDS = 3  # keywords per class


def keyword_texts(
    seed: int, n: int, *, vocab: int, length: int, classes: int
) -> tuple[Tensor, Tensor]:
    """``n`` generated texts ``[n, length]`` (token ids, padded with :data:`PAD`) and their
    classes ``[n]``: a text is [CLS] and filler words of random length (half to all of
    ``length``) with two to four keywords of its class and, in a third of the texts, one of
    another class (the model has to count). Deterministic in ``seed``."""
    first_filler = 3 + classes * _KEYWORDS
    if vocab <= first_filler:
        raise ValueError(
            f"vocab={vocab} leaves no filler words: {classes} classes need more than "
            f"{first_filler} token ids"
        )
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, classes, (n,), generator=gen)
    texts = torch.full((n, length), PAD, dtype=torch.long)
    lengths = torch.randint(length // 2, length + 1, (n,), generator=gen)
    for i in range(n):
        size = int(lengths[i])
        text = torch.randint(first_filler, vocab, (size,), generator=gen)
        text[0] = CLS
        count = int(torch.randint(2, 5, (), generator=gen))
        words = [
            int(labels[i]) * _KEYWORDS + int(k)
            for k in torch.randint(0, 3, (count,), generator=gen)
        ]
        if float(torch.rand((), generator=gen)) < 1 / 3:
            other = (int(labels[i]) + int(torch.randint(1, classes, (), generator=gen))) % classes
            words.append(other * _KEYWORDS + int(torch.randint(0, 3, (), generator=gen)))
        places = torch.randperm(size - 1, generator=gen)[: len(words)] + 1
        for place, word in zip(places.tolist(), words, strict=False):
            text[place] = 3 + word
        texts[i, :size] = text
    return texts, labels


def _imports() -> tuple[Any, Any]:
    try:
        import peft
        import transformers
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "task 'text_lora' fine-tunes a transformers model with peft's LoRA: "
            "pip install transformers peft"
        ) from e
    return transformers, peft


def _bert_config(c: Mapping[str, Any]) -> Any:
    transformers, _ = _imports()
    return transformers.BertConfig(
        vocab_size=c["vocab"],
        hidden_size=c["d_model"],
        num_hidden_layers=c["layers"],
        num_attention_heads=c["heads"],
        intermediate_size=2 * c["d_model"],
        max_position_embeddings=c["length"],
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=c["classes"],
        pad_token_id=PAD,
    )


@functools.lru_cache(maxsize=4)
def pretrained_state(
    vocab: int,
    length: int,
    classes: int,
    d_model: int,
    layers: int,
    heads: int,
    steps: int,
    seed: int,
) -> dict[str, Tensor]:
    """The "pretrained" encoder: the ``state_dict`` of a ``BertForSequenceClassification``
    whose encoder was trained ``steps`` Adam steps on masked-token prediction (15% of the
    words of generated texts, unlabelled) from ``seed``. Its pooler and classifier come from
    ``seed`` too, so the frozen weights are the same in every trial; computed once per process
    and settings (the same seed gives the same weights)."""
    transformers, _ = _imports()
    config = _bert_config(
        {
            "vocab": vocab,
            "length": length,
            "classes": classes,
            "d_model": d_model,
            "layers": layers,
            "heads": heads,
        }
    )
    with fork_rng():
        manual_seed(seed)
        mlm = transformers.BertForMaskedLM(config)
        model = transformers.BertForSequenceClassification(config)
        texts, _ = keyword_texts(seed + 1, 512, vocab=vocab, length=length, classes=classes)
        gen = torch.Generator().manual_seed(seed + 2)
        opt = torch.optim.Adam(mlm.parameters(), lr=3e-3)
        mlm.train()
        for _ in range(steps):
            ids = texts[torch.randint(0, len(texts), (32,), generator=gen)]
            words = ids > MASK
            masked = words & (torch.rand(ids.shape, generator=gen) < 0.15)
            labels = torch.where(masked, ids, torch.full_like(ids, -100))
            opt.zero_grad()
            out = mlm(
                input_ids=torch.where(masked, torch.full_like(ids, MASK), ids),
                attention_mask=(ids != PAD).long(),
                labels=labels,
            )
            out.loss.backward()
            opt.step()
    encoder = {k: v.detach().clone() for k, v in mlm.bert.state_dict().items()}
    missing, _ = model.bert.load_state_dict(encoder, strict=False)
    assert all(k.startswith("pooler.") for k in missing), missing
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class LoraClassifier(nn.Module):
    """A peft model for sequence classification taking token ids ``[N, T]`` (padded with
    :data:`PAD`, which the attention mask leaves out) and returning its logits ``[N, classes]``:
    the one-input, one-output shape the trainer feeds. ``model`` is the peft model itself;
    ``member(i).model.save_pretrained(path)`` writes member ``i``'s adapter."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: Tensor) -> Tensor:
        """Logits of the texts ``ids``."""
        out = self.model(input_ids=ids, attention_mask=(ids != PAD).long())
        logits: Tensor = out.logits
        return logits


def _targets(c: Mapping[str, Any]) -> list[str]:
    value = c["lora_targets"]
    names = value.split(",") if isinstance(value, str) else list(value)
    return [n.strip() for n in names if n.strip()]


def _model(c: Mapping[str, Any]) -> nn.Module:
    """A trial's model: the pretrained encoder with LoRA adapters (``lora_A`` and the
    classifier head from the trial's seed, ``lora_B`` zero as peft starts it)."""
    transformers, peft = _imports()
    base = transformers.BertForSequenceClassification(_bert_config(c))
    state = pretrained_state(
        c["vocab"],
        c["length"],
        c["classes"],
        c["d_model"],
        c["layers"],
        c["heads"],
        c["pretrain_steps"],
        c["pretrain_seed"],
    )
    base.load_state_dict(state)
    if c["gradient_checkpointing"]:
        # on the transformers model itself, before peft wraps it: the non-reentrant form, the
        # one a fused array recomputes for every member at once (no input-require-grads hook)
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = peft.LoraConfig(
        r=c["lora_r"],
        lora_alpha=c["lora_alpha"],
        lora_dropout=c["lora_dropout"],
        target_modules=_targets(c),
        task_type="SEQ_CLS",
    )
    model = peft.get_peft_model(base, lora)
    for name, module in model.named_modules():
        # the trained copy of the classifier head starts from the trial's seed (the frozen
        # original stays the pretrained one, the same in every trial, so it is shared)
        if name.endswith("modules_to_save.default") and isinstance(module, nn.Linear):
            module.reset_parameters()
        # peft builds nn.Identity for lora_dropout=0: an nn.Dropout(0.0) is the same function,
        # and fuses beside members with lora_dropout > 0
        drops = getattr(module, "lora_dropout", None)
        if isinstance(drops, nn.ModuleDict):
            for adapter, layer in list(drops.items()):
                if isinstance(layer, nn.Identity):
                    drops[adapter] = nn.Dropout(0.0)
    return LoraClassifier(model)


def _data(config: Mapping[str, Any]) -> tuple[TensorBatches, TensorBatches]:
    n_train, n_val = config["n_train"], config["n_val"]
    x, y = keyword_texts(
        config["data_seed"],
        n_train + n_val,
        vocab=config["vocab"],
        length=config["length"],
        classes=config["classes"],
    )
    return (
        TensorBatches(x[:n_train], y[:n_train], config["batch_size"], shuffle=True),
        TensorBatches(x[n_train:], y[n_train:], 256, shuffle=False),
    )


class _LoraTask(Task):
    """:class:`~hfsweep.training.task.Task` whose ``resolve`` also checks the task's own
    switch (``gradient_checkpointing``), so that ``hfsweep validate`` names a bad value before
    any model is built."""

    def resolve(self, config: Config) -> dict[str, Any]:
        out = super().resolve(config)
        value = out["gradient_checkpointing"]
        if not isinstance(value, bool):
            raise TaskError(
                f"config gradient_checkpointing={value!r} must be true or false (a YAML or "
                "Python boolean): whether the encoder recomputes its layers in the backward"
            )
        return out


text_lora = _LoraTask(
    name="text_lora",
    model=_model,
    data=_data,
    defaults={
        "vocab": 64,
        "length": 24,
        "classes": 4,
        "d_model": 32,
        "layers": 2,
        "heads": 2,
        "pretrain_steps": 60,
        "pretrain_seed": 0,
        "lora_r": 4,
        "lora_targets": "query,value",
        "lora_alpha": 8.0,
        "lora_dropout": 0.0,
        "gradient_checkpointing": False,
        "n_train": 384,
        "n_val": 256,
        "batch_size": 32,
        "optimizer": "adamw",
        "lr": 3e-3,
        "weight_decay": 0.0,
        "epochs": 3,
    },
)
