"""What a fused array's peak of live tensor bytes is made of, on the CPU, op by op.

    python benchmarks/peak_breakdown.py [--model lora_bert] [--sizes 1 16]
        [--gradient-checkpointing] [--base HIDDEN LAYERS] [--batch N]
        [--warmup N] [--processes N [--concurrent]] [--out STEM]

For one model of ``fusion_throughput.py`` (default ``lora_bert``: a BERT-style encoder with peft
LoRA r=8 on a frozen base that every member shares), this trains the plain model alone
(``torch.optim.SGD``) and fused arrays of each size (``hs.fuse``, one SGD over the stacked
parameters; each new member's frozen base shares the first one's storage as it is built, as
the trainer builds arrays), all on ``fusion_throughput.py``'s batch, and follows one training
step after two of warm-up (``--warmup``) with a dispatch mode like the profiler's CPU tracker (the bytes of live tensor storages,
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
another batch per member.

``--processes N`` measures the other side, N separate processes, each a fresh Python process
(forked from a server that has imported torch, transformers and peft) training one plain model (member i's seed) exactly as the ``plain model`` row does, with
the same tracker; each reports its peak of live tensor bytes, its peak resident set (``getrusage``)
and its private (anonymous) memory at its end. By default they run one after another (``in
turn``) and their peaks are summed: what N processes hold at once if their peaks meet, which
the machine need not have room for. With ``--concurrent`` all N hold their model at the same
time (each waits, its step done, until the last one is); their anonymous memory is then read
together from ``/proc``: the memory N processes occupy at one moment. Writes
``results/peak_breakdown_cpu_<model>[_base<H>x<L>][_batch<N>][_checkpointed][_procs<N>]
.{md,json}``, or ``STEM.{md,json}`` with ``--out``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import resource
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from _results import RESULTS, markdown_table, write_results
from fusion_throughput import MODELS, LoraBert, _batch
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef

import hfsweep as hs
from hfsweep._compat import TorchDispatchMode, pytree
from hfsweep._malloc import retain_freed_memory
from hfsweep.training._frozen import share_frozen_storage

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
    seed: int = 0,
    keep: list[Any] | None = None,
    warmup: int = 2,
) -> dict[str, Any]:
    """One row: ``size`` 0 is the plain model alone, else a fused array of ``size`` members;
    ``seed`` seeds the batch and the models; ``keep`` (a list) is given what the row trained,
    so that it outlives the call."""
    spec_build = MODELS[model].build if base is None else _wider_lora_bert(*base)

    def build() -> torch.nn.Module:
        return _with_checkpointing(spec_build()) if checkpointing else spec_build()

    torch.manual_seed(seed)
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
        models = [build()]
        for _ in range(size - 1):
            # each new member's frozen base takes the first one's storage as it is built, as
            # the trainer builds an array (one base alive at a time, not B at fuse time)
            models.append(build())
            share_frozen_storage(models[-1], models[0])
        array = hs.fuse(models)
        del models
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

    for _ in range(warmup):
        step()
    with _PeakSnapshot([state, opt.state, x, y]) as tracker:
        step()
    if keep is not None:
        keep.extend([state, opt, x, y])
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


def _anonymous(pid: int | str = "self") -> int:
    """Private (anonymous) resident bytes of process ``pid`` now (Linux ``smaps_rollup``)."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Anonymous:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/{pid}/smaps_rollup has no Anonymous line")


def _process(conn: Any, args: tuple[Any, ...], seed: int, hold: bool) -> None:
    """A separate process: one plain model's row (``measure(..., size=0)``), its peak RSS and
    anonymous memory, sent to the parent; with ``hold``, the model is kept until the parent
    says ``stop``."""
    warnings.filterwarnings("ignore")
    retain_freed_memory()
    kept: list[Any] = []
    row = measure(*args[:5], seed=seed, keep=kept, warmup=args[5])
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    conn.send({**row, "peak_rss_bytes": peak_rss, "anonymous_bytes": _anonymous()})
    if hold:
        conn.recv()
    conn.close()


def processes(args: tuple[Any, ...], count: int, concurrent: bool) -> dict[str, Any]:
    """``count`` separate processes of one plain model each (see the module docstring)."""
    ctx = mp.get_context("forkserver")
    # the server imports torch, transformers and peft once; each process forks from it, so it
    # pays no imports of its own (its tensors, models and steps are its own)
    ctx.set_forkserver_preload([__name__, "torch", "transformers", "peft"])
    started: list[tuple[Any, Any]] = []
    rows: list[dict[str, Any]] = []
    together = None
    try:
        for i in range(count):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_process, args=(child, args, i, concurrent), daemon=True)
            proc.start()
            child.close()
            started.append((parent, proc))
            if not concurrent:
                rows.append(parent.recv())
                proc.join()
        if concurrent:
            rows = [conn.recv() for conn, _ in started]
            together = sum(_anonymous(proc.pid) for _, proc in started)
    finally:
        for conn, proc in started:
            if proc.is_alive():
                with contextlib.suppress(OSError):
                    conn.send("stop")
            proc.join(timeout=30)
            if proc.is_alive():
                proc.terminate()
                proc.join()
            conn.close()
    return {
        "processes": count,
        "concurrent": concurrent,
        "peak_bytes_each": [r["peak_bytes"] for r in rows],
        "frozen_bytes_each": [r["frozen_bytes"] for r in rows],
        "peak_rss_bytes_each": [r["peak_rss_bytes"] for r in rows],
        "anonymous_bytes_each": [r["anonymous_bytes"] for r in rows],
        "anonymous_bytes_together": together,
        "peak_bytes_sum": sum(r["peak_bytes"] for r in rows),
        "frozen_bytes_sum": sum(r["frozen_bytes"] for r in rows),
    }


def _process_lines(result: dict[str, Any], array: dict[str, Any] | None) -> list[str]:
    """The markdown section of :func:`processes`' result, against the largest array's row."""
    n = result["processes"]
    how = (
        "all holding their model at once (each waited, its step done, for the last)"
        if result["concurrent"]
        else "one after another, each measured in its own fresh process, summed"
    )
    each = result["peak_bytes_each"]
    cells = [
        [
            f"{n} processes ({'concurrent' if result['concurrent'] else 'in turn'})",
            f"{result['peak_bytes_sum'] / _MIB:.1f}",
            f"{result['frozen_bytes_sum'] / _MIB:.1f}",
            f"{min(each) / _MIB:.1f}-{max(each) / _MIB:.1f}",
            f"{sum(result['peak_rss_bytes_each']) / _MIB:,.1f}",
            f"{sum(result['anonymous_bytes_each']) / _MIB:,.1f}",
            "-"
            if result["anonymous_bytes_together"] is None
            else f"{result['anonymous_bytes_together'] / _MIB:,.1f}",
        ]
    ]
    lines = [
        "",
        f"## {n} separate processes, one plain model each",
        "",
        f"Each a fresh process (forked from a server that imported torch, transformers and "
        f"peft) training one plain model (its own seed) as the `plain "
        f"model` row does, {how}. Tensor peaks are the same tracker's; peak RSS (`getrusage`) "
        "counts shared library pages in every process; anonymous memory is each process's "
        "private resident memory at the end of its step (the framework runtime, its model, "
        "the allocator's cache).",
        "",
        *markdown_table(
            [
                "way",
                "tensor peaks summed MiB",
                "frozen summed MiB",
                "tensor peak each MiB",
                "peak RSS summed MiB",
                "anonymous summed MiB",
                "anonymous at one moment MiB",
            ],
            cells,
        ),
    ]
    if array is not None:
        ratio = result["peak_bytes_sum"] / array["peak_bytes"]
        lines += [
            "",
            f"Tensor peaks: {n} processes {result['peak_bytes_sum'] / _MIB:.1f} MiB against "
            f"{array['peak_bytes'] / _MIB:.1f} MiB for the fused array of B={array['members']} "
            f"({ratio:.2f}x).",
        ]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="lora_bert", choices=sorted(MODELS))
    parser.add_argument(
        "--sizes", type=int, nargs="*", default=[1, 16], help="array sizes (none: the plain model)"
    )
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
    parser.add_argument(
        "--warmup", type=int, default=2, help="training steps before the one measured"
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=0,
        metavar="N",
        help="also measure N separate processes of one plain model each (in turn)",
    )
    parser.add_argument(
        "--concurrent",
        action="store_true",
        help="with --processes: all N hold their model at the same time",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.base is not None and args.model != "lora_bert":
        parser.error(f"--base {args.base} applies to --model lora_bert, not {args.model}")
    warnings.filterwarnings("ignore")
    retain_freed_memory()  # as the trainer and fusion_throughput.py run
    checkpointing = args.gradient_checkpointing
    if args.concurrent and not args.processes:
        parser.error("--concurrent applies to --processes N")
    rows = [
        measure(args.model, size, checkpointing, args.base, args.batch, warmup=args.warmup)
        for size in [0, *args.sizes]
    ]
    separate = (
        processes(
            (args.model, 0, checkpointing, args.base, args.batch, args.warmup),
            args.processes,
            args.concurrent,
        )
        if args.processes
        else None
    )
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
    suffix += "" if not args.processes else f"_procs{args.processes}"
    suffix += "_concurrent" if args.concurrent else ""
    if separate is not None:
        after += _process_lines(separate, rows[-1] if rows[-1]["members"] else None)
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
            f" per member); one SGD training step after {args.warmup} of warm-up"
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
        rows if separate is None else [*rows, {"way": "separate processes", **separate}],
        after,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
