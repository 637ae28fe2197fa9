"""Members that hold configuration objects and bound methods: compared field by field and by
function, so that a difference is named and identical members are not refused."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from _tiny_hf import BERT, GPT2, LLAMA, VOCAB
from torch import Tensor, nn

import hfsweep as hs
from hfsweep.testing import assert_fusion_matches

transformers = pytest.importorskip("transformers")


def _bert(**changes: object) -> nn.Module:
    return transformers.BertModel(transformers.BertConfig(**{**BERT, **changes}))


def test_configs_differing_in_a_setting_are_refused_naming_the_field() -> None:
    with pytest.raises(
        hs.FusionError,
        match=r"the root model: attribute 'config' \(BertConfig\) differs in field 'hidden_act': "
        r"'gelu' in member 0 but 'relu' in member 1\. .*different arrays",
    ):
        hs.fuse([_bert(), _bert(hidden_act="relu")])


def test_configs_differing_in_a_dropout_probability_point_to_dropout_argument() -> None:
    with pytest.raises(hs.FusionError) as info:
        hs.fuse([_bert(), _bert(hidden_dropout_prob=0.3)])
    text = str(info.value)
    assert "field 'hidden_dropout_prob': 0.1 in member 0 but 0.3 in member 1" in text, text
    assert "may differ between members" in text and "hs.fuse(models, dropout=" in text, text
    assert "different arrays" not in text, text


def test_gpt2_dropout_fields_are_recognised_and_other_differences_counted() -> None:
    def gpt2(**changes: object) -> nn.Module:
        return transformers.GPT2Model(transformers.GPT2Config(**GPT2, **changes))

    with pytest.raises(hs.FusionError, match=r"field 'resid_pdrop'.*dropout="):
        hs.fuse([gpt2(), gpt2(resid_pdrop=0.2)])
    # a dropout field and a structural one: not only dropout, so no dropout= advice
    with pytest.raises(hs.FusionError) as info:
        hs.fuse([gpt2(), gpt2(resid_pdrop=0.2, layer_norm_epsilon=1e-3)])
    text = str(info.value)
    assert "(and 1 other field: " in text and "different arrays" in text, text


def test_configs_differing_only_in_where_they_were_loaded_from_fuse() -> None:
    a, b = _bert(), _bert()
    b.config._name_or_path = "checkpoints/trial-7"
    array = hs.fuse([a, b])
    assert array.size == 2


@dataclasses.dataclass
class _Settings:
    width: int
    scale: float


class _Scaled(nn.Module):
    def __init__(self, settings: _Settings) -> None:
        super().__init__()
        self.settings = settings
        self.linear = nn.Linear(settings.width, settings.width)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x) * self.settings.scale


def test_dataclass_settings_are_compared_field_by_field() -> None:
    hs.fuse([_Scaled(_Settings(3, 0.5)), _Scaled(_Settings(3, 0.5))])  # equal, distinct objects
    with pytest.raises(
        hs.FusionError,
        match=r"attribute 'settings' \(_Settings\) differs in field 'scale': 0\.5 in member 0 "
        r"but 2\.0 in member 1",
    ):
        hs.fuse([_Scaled(_Settings(3, 0.5)), _Scaled(_Settings(3, 2.0))])


class _WithHelper(nn.Module):
    """Keeps a bound method of one of its submodules, as peft's causal-LM wrapper does."""

    def __init__(self, bind_to: str = "first") -> None:
        super().__init__()
        self.first = nn.Linear(2, 2)
        self.second = nn.Linear(2, 2)
        self.helper = getattr(self, bind_to).extra_repr

    def forward(self, x: Tensor) -> Tensor:
        return self.second(self.first(x))


def test_methods_of_one_function_bound_to_corresponding_submodules_are_equal() -> None:
    array = hs.fuse([_WithHelper(), _WithHelper()])
    assert array.size == 2
    with pytest.raises(hs.FusionError, match=r"attribute 'helper' is <bound method"):
        hs.fuse([_WithHelper("first"), _WithHelper("second")])


def _lora_llama() -> nn.Module:
    peft = pytest.importorskip("peft")
    base = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**LLAMA))
    lora = peft.LoraConfig(
        r=2,
        lora_alpha=4,
        target_modules=["q_proj", "v_proj"],
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
    )
    model = peft.get_peft_model(base, lora)
    for name, p in model.named_parameters():  # LoRA's B starts at 0: give it weights to train
        if "lora_B" in name:
            nn.init.normal_(p, std=0.1)
    return model


class _Logits(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: Tensor) -> Tensor:
        return self.model(input_ids=ids).logits


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_peft_lora_causal_lm_members_fuse_and_match_alone() -> None:
    """peft's ``PeftModelForCausalLM`` binds ``prepare_inputs_for_generation`` per member; the
    members fuse and train (forward, backward, two steps) as they do alone."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="replaying the traced forward")
        array = assert_fusion_matches(
            lambda: _Logits(_lora_llama()),
            lambda g: (torch.randint(0, VOCAB, (2, 5), generator=g),),
            size=2,
            steps=2,
        )
    assert array._last_call_traced
    trained = [n for n, p in array.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n for n in trained), trained
