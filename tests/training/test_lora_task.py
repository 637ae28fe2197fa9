"""The ready LoRA task (``text_lora``) through the trainer: ``lora_alpha`` and ``lora_dropout``
vary inside one array while the rank and target modules split arrays; each member trains as the
same trial alone; the shared encoder is stored once in the trainer's checkpoints (measured
against ``share_frozen=False``), a resume from one is exact, and a member's saved adapter loads
with peft into the plain model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from _same_results import Crash, assert_same, crashing_report, members

import hfsweep as hs
from hfsweep.tasks import get, text_lora
from hfsweep.training.packed import load as load_packed
from hfsweep.training.task import TaskError

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

pytestmark = pytest.mark.filterwarnings(
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"
)

#: a small run: 4 steps an epoch, evaluations every 2 steps, 6 steps per member
SMALL = {"n_train": 64, "n_val": 32, "batch_size": 16, "max_steps": 6, "pretrain_steps": 10}
CONFIGS: list[dict[str, Any]] = [
    {**SMALL, "seed": 1, "lr": 1e-2, "weight_decay": 0.0, "lora_alpha": 4.0, "lora_dropout": 0.0},
    {**SMALL, "seed": 2, "lr": 3e-3, "weight_decay": 0.1, "lora_alpha": 16.0, "lora_dropout": 0.2},
    {**SMALL, "seed": 3, "lr": 2e-2, "weight_decay": 0.01, "lora_alpha": 8.0, "lora_dropout": 0.1},
]


def test_lora_alpha_and_dropout_vary_per_member_rank_and_targets_split_arrays() -> None:
    assert get("text_lora") is text_lora
    assert {"lora_alpha", "lora_dropout", "lr", "weight_decay"} <= text_lora.per_member_keys
    assert text_lora.model_settings == ("lora_alpha", "lora_dropout")
    keys = {text_lora.compatibility_key(c) for c in CONFIGS}
    assert len(keys) == 1
    member, _ = text_lora.split(CONFIGS[1])
    assert member["lora_alpha"] == 16.0 and member["lora_dropout"] == 0.2
    for shape in ({"lora_r": 8}, {"lora_targets": "query,key,value"}):
        assert text_lora.compatibility_key({**CONFIGS[0], **shape}) not in keys
    for bad in ({"lora_dropout": 1.0}, {"lora_alpha": 0.0}, {"lora_alpha": float("nan")}):
        with pytest.raises(TaskError, match=next(iter(bad))):
            text_lora.resolve({**CONFIGS[0], **bad})


def test_gradient_checkpointing_is_a_checked_switch_of_the_compatibility_key() -> None:
    assert text_lora.resolve(CONFIGS[0])["gradient_checkpointing"] is False
    on = {**CONFIGS[0], "gradient_checkpointing": True}
    assert text_lora.compatibility_key(on) != text_lora.compatibility_key(CONFIGS[0])
    for bad in ("yes", 1, None):
        with pytest.raises(TaskError, match=r"gradient_checkpointing=.* must be true or false"):
            text_lora.resolve({**CONFIGS[0], "gradient_checkpointing": bad})


@pytest.mark.slow
def test_gradient_checkpointing_trains_exactly_as_without() -> None:
    """The encoder's layers are recomputed in the backward (Hugging Face's non-reentrant
    checkpointing, inside the fused array), the members' lora_dropout masks with them: every
    member ends with the history, weights and optimizer state of the run without it."""
    on = [{**c, "gradient_checkpointing": True} for c in CONFIGS]
    array = hs.fuse([text_lora.build_model(text_lora.resolve(c)) for c in on[:1]])
    assert any(getattr(m, "gradient_checkpointing", False) for m in array.module.modules())
    plain = _trainer().run(members(CONFIGS))
    checkpointed = _trainer().run(members(on))
    for a, b in zip(plain, checkpointed, strict=True):
        assert_same(a, b)


def _trainer(**kw: Any) -> hs.ArrayTrainer:
    return hs.ArrayTrainer(text_lora, dtype=torch.float64, eval_every=2, **kw)


def test_the_encoder_is_shared_and_the_adapters_are_trained() -> None:
    configs = [text_lora.resolve(c) for c in CONFIGS]
    array = hs.fuse([text_lora.build_model(c) for c in configs])
    assert any("word_embeddings" in n for n in array.shared_frozen)
    trained = [n for n, _ in array.named_parameters()]
    assert trained and all("lora_" in n or "modules_to_save" in n for n in trained)
    assert array.dropout[
        "model.base_model.model.bert.encoder.layer.0.attention.self.query.lora_dropout.default"
    ] == pytest.approx([0.0, 0.2, 0.1])


@pytest.fixture(scope="module")
def full(tmp_path_factory: pytest.TempPathFactory) -> list[hs.MemberResult]:
    """The three members trained as one array, uninterrupted, with checkpoints."""
    results: list[hs.MemberResult] = _run(tmp_path_factory.mktemp("full"))
    return results


@pytest.mark.slow
def test_lora_members_train_as_alone_and_their_adapters_load_with_peft(
    tmp_path: Path, full: list[hs.MemberResult]
) -> None:
    for i, config in enumerate(CONFIGS):
        alone = _trainer().run([hs.Member(f"t{i}", config)])[0]
        assert_same(full[i], alone)
    # a member's saved state is the whole model; its adapter saves and loads with peft
    config = text_lora.resolve(CONFIGS[1])
    model = text_lora.build_model(config).double()
    state = full[1].state
    assert state is not None
    model.load_state_dict(state["model"])
    model.eval()
    model.model.save_pretrained(tmp_path / "adapter")
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["lora_alpha"] == 16 and saved["lora_dropout"] == pytest.approx(0.2)
    plain = _pretrained(config)
    loaded = peft.PeftModel.from_pretrained(plain, tmp_path / "adapter").double().eval()
    ids = text_lora.build_data(config)[1].x[:8]
    mask = (ids != 0).long()
    torch.testing.assert_close(
        loaded(input_ids=ids, attention_mask=mask).logits, model(ids), rtol=1e-7, atol=1e-10
    )


def _pretrained(config: dict[str, Any]) -> Any:
    """The plain pretrained ``BertForSequenceClassification`` (no peft), float64."""
    import transformers

    from hfsweep.tasks._lora import _bert_config, pretrained_state

    model = transformers.BertForSequenceClassification(_bert_config(config))
    keys = ("vocab", "length", "classes", "d_model", "layers", "heads", "pretrain_steps")
    model.load_state_dict(pretrained_state(*(config[k] for k in keys), config["pretrain_seed"]))
    return model.double()


def _run(
    directory: Path, *, crash_at: int | None = None, resume: bool = False, share: bool = True
) -> Any:
    return _trainer(checkpoint_dir=directory, share_frozen=share).run(
        members(CONFIGS), report=crashing_report(crash_at), resume=resume
    )


def _buffer_bytes(path: Path) -> int:
    """Bytes of the tensors a checkpoint holds (every member's state), checked to load."""
    assert len(load_packed(path)["arrays"][0]["slots"]) == 3
    saved = torch.load(path, weights_only=True)
    return sum(b.numel() * b.element_size() for b in saved["buffers"])


@pytest.mark.slow
def test_checkpoints_store_the_shared_encoder_once_and_resume_exactly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], full: list[hs.MemberResult]
) -> None:
    with pytest.raises(Crash):
        _run(tmp_path / "crashed", crash_at=2)
    with pytest.raises(Crash):
        _run(tmp_path / "stacked", crash_at=2, share=False)
    shared = _buffer_bytes(tmp_path / "crashed" / "array.pt")
    stacked = _buffer_bytes(tmp_path / "stacked" / "array.pt")
    # every member's adapter, head and optimizer state, but the encoder once instead of 3 times
    assert stacked - shared >= 2 * _encoder_bytes()
    with capsys.disabled():
        print(
            f"\n[checkpoint of 3 text_lora members, float64] array.pt buffers: "
            f"{stacked} bytes with the encoder per member, {shared} bytes with it once "
            f"({shared / stacked:.2f}x)"
        )
    resumed = _run(tmp_path / "crashed", resume=True)
    for a, b in zip(resumed, full, strict=True):
        assert_same(a, b)


def _encoder_bytes() -> int:
    """Bytes of the frozen pretrained encoder in one member's state (float64)."""
    model = text_lora.build_model(text_lora.resolve(SMALL))
    names = ("lora_", "modules_to_save", "classifier")
    return sum(
        p.numel() * 8 for n, p in model.state_dict().items() if not any(s in n for s in names)
    )
