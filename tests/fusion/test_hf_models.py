"""Hugging Face text models fuse through the default (traced) path and train as they do alone.

Their forwards index tensors with tensors (``padding_mask[batch_idx, kv_idx]`` in the attention
mask, ``h[arange, pos]``), which the replay of a traced forward once called through the wrong
function. Models are built from tiny configs (nothing is downloaded), in float64 with dropout off
(per-member dropout is tested elsewhere).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from _tiny_hf import BERT, GPT2, LLAMA, NO_DROPOUT, T5, VOCAB
from torch import Tensor, nn

from hfsweep.testing import assert_fusion_matches

transformers = pytest.importorskip("transformers")


def _bert() -> nn.Module:
    return transformers.BertModel(transformers.BertConfig(**BERT, **NO_DROPOUT["bert"]))


def _gpt2() -> nn.Module:
    config = transformers.GPT2Config(**GPT2, **NO_DROPOUT["gpt2"], bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def _t5() -> nn.Module:
    return transformers.T5Model(transformers.T5Config(**T5, **NO_DROPOUT["t5"]))


def _llama() -> nn.Module:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA, **NO_DROPOUT["llama"]))


class _FirstOutput(nn.Module):
    """The model's first output (logits or last hidden state) for token ids and a padding mask;
    T5 decodes the same ids."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.seq2seq = bool(getattr(model.config, "is_encoder_decoder", False))

    def forward(self, ids: Tensor, mask: Tensor) -> Tensor:
        if self.seq2seq:
            return self.model(input_ids=ids, attention_mask=mask, decoder_input_ids=ids)[0]
        return self.model(input_ids=ids, attention_mask=mask)[0]


def _tokens(g: torch.Generator) -> tuple[Tensor, Tensor]:
    ids = torch.randint(0, VOCAB, (2, 5), generator=g)
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[1, 3:] = 0  # a padded sequence: the mask is built with tensor indexing
    return ids, mask


MODELS: dict[str, Callable[[], nn.Module]] = {
    "bert": _bert,
    "gpt2": _gpt2,
    "t5": _t5,
    "llama": _llama,
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
def test_hf_model_fused_through_the_trace_matches_each_model_alone(name: str) -> None:
    """Outputs, gradients and two SGD steps, train and eval mode, rtol 1e-7 (float64), from
    replayed traces; then ``member(i)`` loads into a fresh model."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="replaying the traced forward")
        array = assert_fusion_matches(
            lambda: _FirstOutput(MODELS[name]()), _tokens, size=2, steps=2, trace=True
        )
    assert array._last_call_traced, "the default path should replay a trace for this model"


@pytest.mark.slow
@pytest.mark.timeout(900)  # compiling on a shared 2-core CPU
@pytest.mark.parametrize("name", ["gpt2", "llama", "t5"])
def test_hf_model_with_its_key_value_cache_compiles_and_matches_each_model_alone(
    name: str,
) -> None:
    """``compile=True`` on the models with a key-value cache (on, as in training by default):
    GPT-2's keys are concatenated to an empty tensor, which compiled used to change the layout
    the attention's view needs, and every signature ran uncompiled. Each compiles, with no
    fallback, and trains as each model alone (float64, train mode, two SGD steps). Llama's and
    T5's norms compute in float32 whatever the model's dtype, where the compiled reductions'
    order differs from eager's: the fusion rules' float32 tolerance for them."""
    from hfsweep.fusion._compile import CompileFallbackWarning

    tolerance = {} if name == "gpt2" else {"rtol": 1e-4, "atol": 1e-5}

    with warnings.catch_warnings():
        warnings.simplefilter("error", CompileFallbackWarning)
        array = assert_fusion_matches(
            lambda: _FirstOutput(MODELS[name]()),
            _tokens,
            size=2,
            steps=2,
            modes=("train",),
            compile=True,
            **tolerance,
        )
    assert array._compile_seconds > 0
