"""Memory of a LoRA fine-tuning array: the frozen base kept once against B copies.

    python benchmarks/shared_frozen_memory.py [--device cpu] [--members 16] [--out STEM]

A BERT-style encoder for sequence classification (hidden 256, 4 layers, vocabulary 8000; built
from a config, nothing downloaded), wrapped with peft LoRA (r=8 on query/value). For an array of
one member and of ``--members`` members, with ``share_frozen`` on and off, one AdamW training step
on a batch of 8 sequences of 32 tokens; reported per array:

- ``state``: bytes of the array's parameters and buffers, gradients and optimizer state after the
  step (distinct storages);
- ``peak``: on a GPU, ``torch.cuda.max_memory_allocated`` over building the array from models
  already on the device and the step, minus the member models themselves.

The ratio column is against the array of one member. Writes
``results/shared_frozen_memory_<device>.{md,json}``, or ``STEM.{md,json}`` with ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import warnings
from pathlib import Path
from typing import Any

import torch
from _results import RESULTS, storage_bytes, write_results
from torch import Tensor, nn

import hfsweep as hs


def _members(count: int, device: torch.device) -> list[nn.Module]:
    import peft
    import transformers

    config = transformers.BertConfig(
        vocab_size=8000,
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=1024,
        max_position_embeddings=128,
        num_labels=2,
    )
    torch.manual_seed(0)
    base = transformers.BertForSequenceClassification(config)
    out = []
    for i in range(count):
        torch.manual_seed(i + 1)
        lora = peft.LoraConfig(
            r=8,
            lora_alpha=16,
            target_modules=["query", "value"],
            lora_dropout=0.1,
            task_type="SEQ_CLS",
        )
        out.append(peft.get_peft_model(copy.deepcopy(base), lora).to(device))
    return out


def _measure(size: int, share: bool, device: torch.device) -> dict[str, Any]:
    models = _members(size, device)
    inputs = storage_bytes(t for m in models for t in [*m.parameters(), *m.buffers()])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    array = hs.fuse(models, share_frozen=share)
    opt = hs.optim.AdamW(array, lr=[1e-3] * size)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 8000, (8, 32), generator=gen).to(device)
    labels = torch.randint(0, 2, (8,), generator=gen).to(device)
    array.train()
    out = array(input_ids=ids, labels=labels)
    out.loss.sum().backward()
    opt.step()
    state = storage_bytes(
        [
            *array.parameters(),
            *array.buffers(),
            *(p.grad for p in array.parameters() if p.grad is not None),
            *(v for s in opt.state.values() for v in s.values() if isinstance(v, Tensor)),
        ]
    )
    row: dict[str, Any] = {"members": size, "share_frozen": share, "state_bytes": state}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        row["peak_bytes"] = torch.cuda.max_memory_allocated(device) - inputs
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--members", type=int, default=16)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    warnings.filterwarnings("ignore")
    rows = [_measure(1, True, device)]
    for share in (True, False):
        rows.append(_measure(args.members, share, device))
    one = rows[0]
    cells = []
    for r in rows:
        cell = [
            str(r["members"]),
            "on" if r["share_frozen"] else "off",
            f"{r['state_bytes'] / 2**20:.1f} MiB",
            f"{r['state_bytes'] / one['state_bytes']:.2f}x",
        ]
        if "peak_bytes" in r:
            cell += [
                f"{r['peak_bytes'] / 2**20:.1f} MiB",
                f"{r['peak_bytes'] / one['peak_bytes']:.2f}x",
            ]
        cells.append(cell)
    columns = ["members", "share_frozen", "state", "state vs 1"]
    if device.type == "cuda":
        columns += ["peak", "peak vs 1"]
    stem = args.out or RESULTS / f"shared_frozen_memory_{device.type}"
    write_results(
        stem,
        "shared_frozen_memory.py",
        argv,
        device,
        "LoRA fine-tuning array: memory with the frozen base kept once",
        [
            "BERT-style classifier (hidden 256, 4 layers, vocab 8000) with peft LoRA r=8 on "
            "query/value; one AdamW step on 8 x 32 tokens.",
            "state: parameters, buffers, gradients and optimizer state of the array.",
        ],
        columns,
        cells,
        rows,
    )


if __name__ == "__main__":
    main()
