"""What a fused array's peak of live tensor bytes is made of, on the CPU, op by op.

    python benchmarks/peak_breakdown.py [--model lora_bert] [--sizes 1 16]
        [--gradient-checkpointing] [--base HIDDEN LAYERS] [--batch N] [--out STEM]

For one model of ``fusion_throughput.py`` (default ``lora_bert``: a BERT-style encoder with peft
LoRA r=8 on a frozen base that every member shares), this trains the plain model alone
(``torch.optim.SGD``) and fused arrays of each size (``hs.fuse``, one SGD over the stacked
parameters), all on ``fusion_throughput.py``'s batch, and follows one training step after two of
warm-up with a dispatch mode like the profiler's CPU tracker (the bytes of live tensor storages,
op by op). At the step's peak it records every live storage with the op that made it and its
shape, and reports:

- the state alive before the step, split into the frozen tensors the array keeps once
  (``array.shared_frozen``) and the rest (trainable parameters, optimizer state, the batch);
- the tensors made during the step, grouped by the op that made them and their shape (the
  activations autograd saved for backward, and the backward's temporaries at the peak);
- ``per member``: (peak - the frozen tensors) / B, against the plain model's
  peak - its frozen tensors.

It also lists any tensor made during the step whose shape is ``[B, *shape of a shared frozen
tensor]`` for B > 1 (a per-member copy of a frozen weight; expected: none). With
``--gradient-checkpointing`` every model (the plain one and each member) has its Hugging Face
gradient checkpointing on (``gradient_checkpointing_enable(use_reentrant=False)``), which the
array honours by recomputing each checkpointed layer for all members at once in the backward.
``--base 768 12`` gives ``lora_bert`` a wider and deeper base (BERT-base's shape), ``--batch``
another batch per member. Writes ``results/peak_breakdown_cpu_<model>[_base<H>x<L>][_batch<N>]
[_checkpointed].{md,json}``, or ``STEM.{md,json}`` with ``--out``.
"""

from __future__ import annotations

import argparse
import collections
import functools
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from _results import RESULTS, markdown_table, write_results
from fusion_throughput import MODELS, LoraBert, _batch
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef

import hfsweep as hs
from hfsweep._compat import TorchDispatchMode, pytree
from hfsweep._malloc import retain_freed_memory

_MIB = 2**20


class _PeakSnapshot(TorchDispatchMode):
    """Live storages (op that made each, shape, bytes) followed op by op; a snapshot at the peak."""

    def __init__(self, existing: Any) -> None:
        super().__init__()
        self.held: dict[int, tuple[StorageWeakRef, int, str, tuple[int, ...]]] = {}
        self.live = 0
        self.made: list[tuple[str, tuple[int, ...]]] = []
        for t in pytree.tree_leaves(existing):
            if isinstance(t, Tensor):
                self._hold(t, "(before the step)")
        self.peak = self.live
        self.peak_op = ""
        self.snapshot = [(v[2], v[3], v[1]) for v in self.held.values()]

    def _hold(self, t: Tensor, op: str) -> None:
        storage = t.untyped_storage()
        key, size = storage.data_ptr(), storage.nbytes()
        if size and key not in self.held:
            self.held[key] = (StorageWeakRef(storage), size, op, tuple(t.shape))
            self.live += size
            self.made.append((op, tuple(t.shape)))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for key in [k for k, v in self.held.items() if v[0].expired()]:
            self.live -= self.held.pop(key)[1]
        for t in pytree.tree_leaves(out):
            if isinstance(t, Tensor) and t.device.type != "meta":
                self._hold(t, str(func.overloadpacket.__name__))
        if self.live > self.peak:
            self.peak, self.peak_op = self.live, str(func.overloadpacket.__name__)
            self.snapshot = [(v[2], v[3], v[1]) for v in self.held.values()]
        return out


def _with_checkpointing(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with the gradient checkpointing of its Hugging Face model turned on."""
    for m in model.modules():
        if getattr(m, "supports_gradient_checkpointing", False):
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            return model
    raise SystemExit(f"--gradient-checkpointing: {type(model).__name__} has no Hugging Face model")


def _wider_lora_bert(hidden: int, layers: int) -> Callable[[], torch.nn.Module]:
    """``lora_bert`` with a base of ``hidden`` width (``4 * hidden`` feed-forward, ``hidden //
    64`` heads) and ``layers`` layers, built in-process like it (nothing downloaded)."""
    return functools.partial(LoraBert, hidden, layers)


def measure(
    model: str,
    size: int,
    checkpointing: bool = False,
    base: tuple[int, int] | None = None,
    batch: int | None = None,
) -> dict[str, Any]:
    """One row: ``size`` 0 is the plain model alone, else a fused array of ``size`` members."""
    spec_build = MODELS[model].build if base is None else _wider_lora_bert(*base)

    def build() -> torch.nn.Module:
        return _with_checkpointing(spec_build()) if checkpointing else spec_build()

    torch.manual_seed(0)
    x, y = _batch(model, batch or MODELS[model].batch, torch.device("cpu"))
    if size == 0:
        plain = build().train()
        opt = torch.optim.SGD(plain.parameters(), lr=0.01)
        frozen_bytes = sum(
            t.untyped_storage().nbytes()
            for t in [*plain.parameters(), *plain.buffers()]
            if not t.requires_grad
        )
        frozen_shapes: set[tuple[int, ...]] = set()
        state = dict(plain.state_dict(keep_vars=True))

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(plain(x), y).backward()
            opt.step()

    else:
        array = hs.fuse([build() for _ in range(size)])
        opt = torch.optim.SGD(array.parameters(), lr=0.01)
        buffers = dict(array.named_buffers())
        shared = [buffers[f"module.{n}"] for n in array.shared_frozen]
        frozen_bytes = sum(t.untyped_storage().nbytes() for t in shared)
        trained = {tuple(p.shape[1:]) for p in array.parameters()}
        frozen_shapes = {tuple(t.shape) for t in shared if t.dim()} - trained
        state = dict(array.state_dict(keep_vars=True))

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            hs.member_losses(array(x), y).sum().backward()
            opt.step()

    for _ in range(2):
        step()
    with _PeakSnapshot([state, opt.state, x, y]) as tracker:
        step()
    groups: dict[tuple[str, tuple[int, ...]], list[int]] = collections.defaultdict(lambda: [0, 0])
    before = 0
    for op, shape, nbytes in tracker.snapshot:
        if op == "(before the step)":
            before += nbytes
            continue
        groups[(op, shape)][0] += 1
        groups[(op, shape)][1] += nbytes
    members = max(size, 1)
    # at B = 1 a leading 1 is no member dimension (BERT's position embedding lookup is
    # [1, tokens, hidden] by itself): copies are looked for where B > 1
    copies = sorted(
        {
            f"{op} {list(s)}"
            for op, s in tracker.made
            if size > 1 and s[:1] == (size,) and s[1:] in frozen_shapes
        }
    )
    return {
        "members": size,
        "way": "plain model" if size == 0 else "fused array",
        "peak_bytes": tracker.peak,
        "peak_at_op": tracker.peak_op,
        "frozen_bytes": frozen_bytes,
        "other_state_bytes": before - frozen_bytes,
        "per_member_bytes": (tracker.peak - frozen_bytes) / members,
        "made_in_step": [
            {"op": op, "shape": list(shape), "count": c, "bytes": n}
            for (op, shape), (c, n) in sorted(groups.items(), key=lambda kv: -kv[1][1])
        ],
        "frozen_copies": copies,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="lora_bert", choices=sorted(MODELS))
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="turn on the Hugging Face model's gradient checkpointing (non-reentrant)",
    )
    parser.add_argument(
        "--base",
        type=int,
        nargs=2,
        metavar=("HIDDEN", "LAYERS"),
        default=None,
        help="lora_bert only: a base of this width and depth instead of 256 x 4",
    )
    parser.add_argument("--batch", type=int, default=None, help="batch per member")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.base is not None and args.model != "lora_bert":
        parser.error(f"--base {args.base} applies to --model lora_bert, not {args.model}")
    warnings.filterwarnings("ignore")
    retain_freed_memory()  # as the trainer and fusion_throughput.py run
    checkpointing = args.gradient_checkpointing
    rows = [
        measure(args.model, size, checkpointing, args.base, args.batch) for size in [0, *args.sizes]
    ]
    cells = [
        [
            r["way"],
            str(r["members"]) if r["members"] else "-",
            f"{r['peak_bytes'] / _MIB:.1f}",
            f"{r['frozen_bytes'] / _MIB:.1f}",
            f"{r['other_state_bytes'] / _MIB:.1f}",
            f"{(r['peak_bytes'] - r['frozen_bytes'] - r['other_state_bytes']) / _MIB:.1f}",
            f"{r['per_member_bytes'] / _MIB:.1f}",
            r["peak_at_op"],
            str(len(r["frozen_copies"])) if r["members"] > 1 else "-",
        ]
        for r in rows
    ]
    after: list[str] = []
    for r in rows:
        after += [
            "",
            f"## Made during the step and alive at the peak: {r['way']}"
            + (f", B={r['members']}" if r["members"] else ""),
            "",
            *markdown_table(
                ["op that made it", "shape", "tensors", "MiB", "MiB per member"],
                [
                    [
                        g["op"],
                        str(tuple(g["shape"])),
                        str(g["count"]),
                        f"{g['bytes'] / _MIB:.2f}",
                        f"{g['bytes'] / max(r['members'], 1) / _MIB:.2f}",
                    ]
                    for g in r["made_in_step"]
                    if g["bytes"] >= _MIB // 64
                ],
            ),
        ]
    suffix = "" if args.base is None else f"_base{args.base[0]}x{args.base[1]}"
    suffix += "" if args.batch is None else f"_batch{args.batch}"
    suffix += "_checkpointed" if checkpointing else ""
    stem = args.out or RESULTS / f"peak_breakdown_cpu_{args.model}{suffix}"
    write_results(
        stem,
        "peak_breakdown.py",
        argv,
        torch.device("cpu"),
        f"What the peak of live tensor bytes is made of: {args.model}"
        + (", gradient checkpointing on" if checkpointing else ""),
        [
            f"- model: `{args.model}` {MODELS[args.model].about}"
            + (
                ""
                if args.base is None
                else f", base widened to hidden {args.base[0]}, {args.base[1]} layers"
            )
            + f" (batch {args.batch or MODELS[args.model].batch}"
            " per member); one SGD training step after two of warm-up"
            + (
                "; Hugging Face gradient checkpointing on (use_reentrant=False) in every model"
                if checkpointing
                else ""
            ),
            "- frozen: the tensors the array keeps once (`array.shared_frozen`; in the plain "
            "model, its tensors that do not require grad); other state: trainable parameters, "
            "optimizer state and the batch; step: tensors made during the step alive at the peak; "
            "per member: (peak - frozen) / B; frozen copies: tensors made during the step shaped "
            "[B, *a shared frozen tensor's shape], B > 1",
        ],
        [
            "way",
            "B",
            "peak MiB",
            "frozen MiB",
            "other state MiB",
            "step MiB",
            "per member MiB",
            "peak at op",
            "frozen copies",
        ],
        cells,
        rows,
        after,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
