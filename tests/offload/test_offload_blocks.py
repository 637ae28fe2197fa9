"""Offload of models ``torch.fx`` cannot cut, streamed between their repeated blocks while their
own forward runs (``hfsweep.offload._units``, ``_streamed``): a transformers BERT classifier
(small config, built in-process), with and without peft LoRA, and a GPT-2 causal LM with its
output layer tied to its embeddings. Each trains exactly as the same array without offload
(float64: forward, backward, several AdamW steps, dropout streams), within a budget whose
quarter the whole encoder is over (refused before this way existed), the ledger under it."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from _offload_toy import Counting
from torch import Tensor, nn

import hfsweep as hs
from hfsweep.offload import CpuTransfer, OffloadedArray, OffloadError

transformers = pytest.importorskip("transformers")

B = 3
VOCAB, LENGTH = 40, 10


def _bert(layers: int = 3) -> Any:
    return transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=LENGTH,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,  # drawn inside attention from the layer's streams
        num_labels=3,
    )


class Classifier(nn.Module):
    """A BERT sequence classifier taking token ids (0 is padding, masked out)."""

    def __init__(self, seed: int, lora: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same "pretrained" encoder in every member
        model = transformers.BertForSequenceClassification(_bert())
        torch.manual_seed(seed)
        if lora:
            import peft

            config = peft.LoraConfig(
                r=2,
                lora_alpha=4.0,
                lora_dropout=0.1,
                target_modules=["query", "value"],
                task_type="SEQ_CLS",
            )
            model = peft.get_peft_model(model, config)
            for name, p in model.named_parameters():  # LoRA's B starts at 0: give it weights
                if "lora_B" in name:
                    nn.init.normal_(p, std=0.1)
        else:
            for p in model.parameters():  # each member its own weights
                p.data.add_(0.05 * torch.randn_like(p))
        self.model = model

    def forward(self, ids: Tensor) -> Tensor:
        logits: Tensor = self.model(input_ids=ids, attention_mask=(ids != 0).long()).logits
        return logits


class CausalLM(nn.Module):
    """A GPT-2 language model (its output layer tied to its token embeddings)."""

    def __init__(self, seed: int, use_cache: bool = False) -> None:
        super().__init__()
        torch.manual_seed(seed)
        config = transformers.GPT2Config(
            vocab_size=VOCAB,
            n_embd=16,
            n_layer=3,
            n_head=2,
            n_positions=LENGTH,
            resid_pdrop=0.1,
            embd_pdrop=0.1,
            attn_pdrop=0.1,
            use_cache=use_cache,
            bos_token_id=1,
            eos_token_id=1,
        )
        self.lm = transformers.GPT2LMHeadModel(config)

    def forward(self, ids: Tensor) -> Tensor:
        logits: Tensor = self.lm(input_ids=ids).logits
        return logits


def _ids(seed: int) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (4, LENGTH), generator=gen)
    ids[1, 6:] = 0  # padding
    return ids


def _pair(models: list[nn.Module]) -> tuple[hs.FusedArray, hs.FusedArray]:
    whole, host = hs.fuse(copy.deepcopy(models)), hs.fuse(models)
    for i in range(len(models)):
        whole.manual_seed(i, 100 + i)
        host.manual_seed(i, 100 + i)
    return whole, host


def _stacked(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def _budget(host: hs.FusedArray, largest: nn.Module) -> int:
    """A budget whose quarter holds ``largest`` (the largest unit) and no more."""
    return 4 * (_stacked(largest) + 64)


def _train_side_by_side(
    whole: hs.FusedArray, host: hs.FusedArray, engine: OffloadedArray, steps: int = 3
) -> None:
    """AdamW, ``steps`` steps on both: outputs, gradients, then state dicts and dropout
    streams equal (float64); nothing left on the compute side after each step."""
    lrs = [1e-2, 3e-3, 1e-3][: host.size]
    opts = [hs.optim.AdamW(a, lr=lrs, weight_decay=0.01) for a in (whole, host)]
    for step in range(steps):
        ids = _ids(step)
        out_w, out_h = whole(ids), engine(ids)
        torch.testing.assert_close(out_h, out_w, rtol=1e-7, atol=1e-12)
        out_w.square().mean().backward()
        out_h.square().mean().backward()
        for (name, pw), ph in zip(whole.named_parameters(), host.parameters(), strict=True):
            if pw.grad is None:
                assert ph.grad is None, name
                continue
            torch.testing.assert_close(ph.grad, pw.grad, rtol=1e-7, atol=1e-12, msg=name)
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        assert engine.ledger.resident == 0
    for (name, tw), th in zip(whole.state_dict().items(), host.state_dict().values(), strict=True):
        torch.testing.assert_close(th, tw, rtol=1e-7, atol=1e-12, msg=name)
    assert all(host.rng_state(i) == whole.rng_state(i) for i in range(host.size))


def test_an_encoder_over_a_quarter_of_the_budget_streams_block_by_block() -> None:
    """The whole BERT encoder is over the shard limit (fx cannot cut inside it: refused
    before); each block, the embeddings, the pooler and the head are under it, so the engine
    streams them, and the array trains as without offload within the budget."""
    whole, host = _pair([Classifier(i).double() for i in range(B)])
    bert = host.module.model.bert
    budget = _budget(host, bert.encoder.layer[0])
    assert _stacked(bert.encoder) > budget // 4  # the one-layer-call shard of the fx cut
    engine = OffloadedArray(host, budget_bytes=budget)  # refused before: "over the shard limit"
    with pytest.raises(OffloadError, match="over the shard limit"):
        OffloadedArray(host, budget_bytes=budget, cut="graph")  # the fx cut alone
    # each block a shard of its own (two do not fit the limit); the small modules after the
    # encoder fetched together
    assert [s.nodes for s in engine.shards] == [
        ["model.bert.embeddings"],
        *[[f"model.bert.encoder.layer.{i}"] for i in range(3)],
        ["model.bert.pooler", "model.dropout", "model.classifier"],
    ]
    assert max(s.nbytes for s in engine.shards) <= budget // 4
    _train_side_by_side(whole, host, engine)
    assert 0 < engine.ledger.peaks["forward"] <= budget
    assert 0 < engine.ledger.peaks["backward"] <= budget
    # boundary activations (hidden states, the attention mask) were kept and counted
    assert engine.ledger.peak > 2 * max(s.nbytes for s in engine.shards)


def test_lora_adapters_on_a_frozen_bert_stream_with_the_base_kept_once() -> None:
    """peft LoRA on a frozen BERT: the frozen weights are kept once and copied in once per
    unit for all members; the embeddings, frozen and in front of every trained tensor, are
    fetched in the forward only, never in the backward."""
    pytest.importorskip("peft")
    whole, host = _pair([Classifier(i, lora=True).double() for i in range(B)])
    assert host.shared_frozen
    transfer = Counting()
    units = {u.nodes[0]: u for s in OffloadedArray(host, cut="blocks").shards for u in s.units}
    prefix = "model.base_model.model.bert"
    embeddings, first = units[f"{prefix}.embeddings"], units[f"{prefix}.encoder.layer.0"]
    base = first.array.module.attention.self.query.base_layer.weight
    assert base.dim() == 2  # kept once: not stacked per member
    # shards that fetch the embeddings with the first block: that group's backward fetch
    # takes the block's tensors only
    limit = embeddings.nbytes + first.nbytes
    engine = OffloadedArray(host, transfer=transfer, cut="blocks", shard_bytes=limit)
    assert engine.shards[0].nodes == [embeddings.nodes[0], first.nodes[0]]
    # one forward copies every unit in once; the backward all but the embeddings
    total = sum(s.nbytes for s in engine.shards)
    for run in (whole, engine):  # the same step on both: their dropout streams stay level
        run(_ids(0)).square().mean().backward()
    assert transfer.fetched == 2 * total - embeddings.nbytes
    whole.zero_grad(set_to_none=True)
    host.zero_grad(set_to_none=True)
    _train_side_by_side(whole, host, engine)


@pytest.mark.parametrize("together", [False, True], ids=["tied-in-two-shards", "one-shard"])
def test_a_gpt2_causal_lm_with_tied_embeddings_streams_its_blocks(together: bool) -> None:
    """GPT-2's ``h`` blocks streamed, its output layer (tied to the token embeddings, trained
    per member) fetched by both units that use it, their gradients added up on the host; with
    a transfer in a background thread (prefetch overlapping compute). With a shard limit over
    the whole model, every unit is one shard, the tied tensor in it once."""
    whole, host = _pair([CausalLM(i).double() for i in range(2)])
    limit = 10**9 if together else None
    engine = OffloadedArray(
        host, transfer=CpuTransfer(delay=0.001), cut="blocks", shard_bytes=limit
    )
    units = [u.nodes[0] for s in engine.shards for u in s.units]
    assert [n for n in units if ".h." in n] == [f"lm.transformer.h.{i}" for i in range(3)]
    holding = [s for s in engine.shards if {"lm.transformer.wte", "lm.lm_head"} & set(s.nodes)]
    assert len(holding) == (1 if together else 2)
    if together:
        assert holding[0].nbytes < sum(u.nbytes for u in holding[0].units)  # tied: counted once
    _train_side_by_side(whole, host, engine)
    engine.close()


def test_one_member_streams_without_vmap() -> None:
    whole, host = _pair([Classifier(7).double()])
    _train_side_by_side(whole, host, OffloadedArray(host, cut="blocks"), steps=2)


def test_a_model_with_no_repeated_blocks_and_no_trace_is_refused_by_name() -> None:
    class Uneven(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 2)])  # not repeated

        def forward(self, x: Tensor) -> Tensor:
            for layer in self.layers:
                x = layer(x) if x.sum() > 0 else -layer(x)  # fx cannot trace this
            return x

    array = hs.fuse([Uneven(), Uneven()], share_frozen=False)
    with pytest.raises(
        OffloadError,
        match=r"needs its forward traceable by torch.fx.symbolic_trace; Uneven is not .*"
        r"nor can it be streamed by its blocks: .*Uneven has none",
    ):
        OffloadedArray(array)


def test_a_block_given_a_cache_is_refused() -> None:
    """GPT-2 with ``use_cache=True`` hands its blocks a cache object, which a block would fill
    with one member's keys in a recomputation: refused, naming the block and the fix."""
    array = hs.fuse([CausalLM(i, use_cache=True).double() for i in range(2)])
    engine = OffloadedArray(array, cut="blocks")
    with pytest.raises(
        OffloadError, match=r"lm.transformer.h.0 is called with a .*use_cache=False"
    ):
        engine(_ids(0))
    assert engine.ledger.resident == 0


def test_a_backward_through_an_earlier_forward_is_refused() -> None:
    _, host = _pair([Classifier(i).double() for i in range(2)])
    engine = OffloadedArray(host, cut="blocks")
    first = engine(_ids(0))
    engine(_ids(1))  # releases what the first kept
    with pytest.raises(OffloadError, match="keeps one forward for backward at a time"):
        first.sum().backward()


def test_gradient_checkpointing_inside_a_block_is_refused() -> None:
    model = Classifier(0)
    model.model.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": False}
    )
    array = hs.fuse([model, copy.deepcopy(model)])
    with pytest.raises(OffloadError, match="turn gradient checkpointing off"):
        OffloadedArray(array, cut="blocks")


def test_an_evaluation_forward_keeps_nothing() -> None:
    whole, host = _pair([Classifier(i).double() for i in range(2)])
    engine = OffloadedArray(host, cut="blocks")
    whole.eval()
    host.eval()
    with torch.no_grad():
        torch.testing.assert_close(engine(_ids(3)), whole(_ids(3)), rtol=1e-7, atol=1e-12)
    assert engine.ledger.resident == 0
    assert engine.ledger.by_kind["boundary activations"] == 0


@pytest.mark.slow
def test_the_trainer_streams_text_lora_blocks_within_a_budget_the_encoder_is_over() -> None:
    """``text_lora`` with ``offload: host`` and a ``device_memory`` whose quarter holds each
    unit but not the encoder (``BertModel``, one layer call for fx): the trainer's members end
    as without offload."""
    pytest.importorskip("peft")
    from _same_results import assert_same, members

    from hfsweep.tasks import text_lora

    configs = [
        {"lr": lr, "lora_alpha": alpha, "lora_dropout": p, "epochs": 1}
        | {"n_train": 32, "n_val": 32, "batch_size": 4}
        for lr, alpha, p in [(3e-3, 8.0, 0.0), (1e-2, 4.0, 0.1), (1e-3, 16.0, 0.2)]
    ]
    resolved = [text_lora.resolve(c) for c in configs]
    array = hs.fuse(
        [text_lora.build_model({**c, "seed": i}).double() for i, c in enumerate(resolved)]
    )
    units = OffloadedArray(array, cut="blocks").shards
    bert = sum(s.nbytes for s in units if ".bert." in s.nodes[0])  # fx's one layer call
    budget = 4 * ((max(s.nbytes for s in units) + bert) // 2)
    with pytest.raises(OffloadError, match="over the shard limit"):
        OffloadedArray(array, budget_bytes=budget, cut="graph")
    plain = hs.ArrayTrainer(text_lora, dtype=torch.float64).run(members(configs))
    off = hs.ArrayTrainer(text_lora, dtype=torch.float64, offload="host", device_memory=budget).run(
        members(configs)
    )
    assert [r.status for r in plain] == ["completed"] * 3
    for a, b in zip(off, plain, strict=True):
        assert_same(a, b, rng=True)
