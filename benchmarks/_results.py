"""Writing benchmark results: the JSON rows and a Markdown table, with machine and command; and
the byte count the memory benchmarks share."""

from __future__ import annotations

import json
import os
import platform
import sys
from collections.abc import Iterable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

import hfsweep as hs

RESULTS = Path(__file__).resolve().parent / "results"


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a storage shared by several counts
    once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def machine(device: torch.device) -> str:
    """The device in words: GPU name and CUDA version, or CPU model, cores and torch threads."""
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda})"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"


def markdown_table(columns: Sequence[str], cells: Sequence[Sequence[str]]) -> list[str]:
    """The lines of a Markdown table: the first column left-aligned, the others right-aligned."""
    return [
        "| " + " | ".join(columns) + " |",
        "|" + "|".join("---" if i == 0 else "---:" for i in range(len(columns))) + "|",
        *("| " + " | ".join(c) + " |" for c in cells),
    ]


def write_results(
    stem: Path,
    script: str,
    argv: list[str] | None,
    device: torch.device,
    title: str,
    notes: list[str],
    columns: list[str],
    cells: list[list[str]],
    rows: list[dict[str, Any]],
    after: Sequence[str] = (),
) -> None:
    """Write ``stem``.json (metadata and raw rows) and ``stem``.md (the table, then the lines of
    ``after``: a second table, say) and say where."""
    command = f"python benchmarks/{script} " + " ".join(argv if argv is not None else sys.argv[1:])
    meta = {
        "machine": machine(device),
        "torch": torch.__version__,
        "hfsweep": hs.__version__,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "command": command.strip(),
    }
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    lines = [
        f"# {title}",
        "",
        f"- machine: {meta['machine']}",
        f"- torch {meta['torch']}, hfsweep {meta['hfsweep']}, {meta['date']}",
        f"- command: `{meta['command']}`",
        *notes,
        "",
        *markdown_table(columns, cells),
        *after,
    ]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {stem.with_suffix('.md')}")
