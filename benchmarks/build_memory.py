"""Memory the trainer holds while it builds a fine-tuning array: the members' models at fuse time.

    python benchmarks/build_memory.py [--members 1 4 16] [--out STEM]

The ready task ``text_lora`` (a BERT-style encoder "pretrained" in-process, wrapped with peft
LoRA r=4 on query/value) at ``d_model`` 256, 4 layers, vocabulary 4,000, through
``hs.ArrayTrainer`` for one optimizer step. For each array size and ``share_frozen`` on and off:

- ``models``: bytes of the distinct storages of every member model the trainer hands to ``fuse``
  (all alive at that moment: the build's memory before fusing);
- ``array``: bytes of the distinct storages of the fused array's parameters and buffers.

With ``share_frozen`` on, each new member's frozen tensors point at the first member's storage
as it is built (``hfsweep/training/_frozen.py``), so ``models`` is one backbone plus B adapters
and heads; off, every member keeps its own backbone. Counted, not timed: the same on any machine
with this torch. Writes ``results/build_memory_cpu.{md,json}``, or ``STEM.{md,json}``.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from _results import RESULTS, storage_bytes, write_results
from torch import Tensor, nn

import hfsweep as hs
import hfsweep.training.live as live
from hfsweep.tasks import text_lora

SETTINGS = {
    "d_model": 256,
    "layers": 4,
    "heads": 4,
    "vocab": 4000,
    "pretrain_steps": 2,
    "n_train": 64,
    "n_val": 32,
    "batch_size": 8,
    "max_steps": 1,
}


def _state(models: Iterable[nn.Module]) -> list[Tensor]:
    return [t for m in models for t in [*m.parameters(), *m.buffers()]]


def measure(members: int, share_frozen: bool) -> dict[str, Any]:
    """One array of ``members`` LoRA members trained one step; the bytes at fuse time."""
    seen: dict[str, int] = {}
    fuse = live.fuse

    def recording(models: list[nn.Module], *args: Any, **kwargs: Any) -> Any:
        seen["models"] = storage_bytes(_state(models))
        array = fuse(models, *args, **kwargs)
        seen["array"] = storage_bytes(_state([array]))
        return array

    live.fuse = recording  # type: ignore[assignment]
    try:
        trainer = hs.ArrayTrainer(text_lora, share_frozen=share_frozen)
        configs = [{**SETTINGS, "seed": i, "lr": 1e-3 * (i + 1)} for i in range(members)]
        trainer.run([hs.Member(f"m{i}", c) for i, c in enumerate(configs)])
    finally:
        live.fuse = fuse  # type: ignore[assignment]
    return {"members": members, "share_frozen": share_frozen, **seen}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--members", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--out", type=Path, default=RESULTS / "build_memory_cpu")
    args = parser.parse_args(argv)
    rows = [measure(b, share) for b in args.members for share in (False, True)]
    one = {r["share_frozen"]: r["models"] for r in rows if r["members"] == 1}
    cells = [
        [
            str(r["members"]),
            "on" if r["share_frozen"] else "off",
            f"{r['models'] / 2**20:.1f}",
            f"{r['models'] / one.get(r['share_frozen'], r['models']):.2f}",
            f"{r['array'] / 2**20:.1f}",
        ]
        for r in rows
    ]
    write_results(
        args.out,
        "build_memory.py",
        argv,
        torch.device("cpu"),
        "Memory held while a LoRA array is built: the member models at fuse time",
        [
            "- task `text_lora` at d_model 256, 4 layers, vocabulary 4,000, peft LoRA r=4 on "
            "query/value; `hs.ArrayTrainer` (float32), one optimizer step",
            "- models: distinct storages of every member model handed to `fuse` (all alive then); "
            "x one: against one member; array: distinct storages of the fused array",
            "- counted, not timed: the same on any machine with this torch",
        ],
        ["B", "share_frozen", "models MiB", "x one", "array MiB"],
        cells,
        rows,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
