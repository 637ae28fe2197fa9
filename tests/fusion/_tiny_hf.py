"""The tiny Hugging Face models the fusion tests build (nothing is downloaded): each one's shape
as its config's settings, and the settings that turn its dropout off. A test builds a config from
them, adding what it needs (``BertConfig(**BERT, **NO_DROPOUT["bert"], num_labels=3)``)."""

from __future__ import annotations

from typing import Any

#: the vocabulary of every tiny model (token ids are drawn below it)
VOCAB = 40

BERT: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 16,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "intermediate_size": 24,
    "max_position_embeddings": 16,
}
GPT2: dict[str, Any] = {
    "vocab_size": VOCAB,
    "n_embd": 16,
    "n_layer": 1,
    "n_head": 2,
    "n_positions": 16,
}
T5: dict[str, Any] = {
    "vocab_size": VOCAB,
    "d_model": 16,
    "d_kv": 8,
    "d_ff": 24,
    "num_layers": 1,
    "num_heads": 2,
}
LLAMA: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 16,
    "intermediate_size": 24,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 16,
}

#: each model's dropout settings, off (per-member dropout is tested on its own)
NO_DROPOUT: dict[str, dict[str, float]] = {
    "bert": {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0},
    "gpt2": {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
    "t5": {"dropout_rate": 0.0},
    "llama": {"attention_dropout": 0.0},
}
