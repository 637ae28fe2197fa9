"""Operators, bytes and host reads of one fused training step, against one member's step.

A device-independent measure of the fused step's fixed cost: the ATen operators dispatched (a
``TorchDispatchMode`` count, the backward pass's included), the bytes of the tensors they
create, and the reads of a tensor's value into Python (each a synchronisation on a GPU), for one
training step (forward, loss, backward, optimizer step) of:

* ``one``: one member alone, a plain model with ``torch.optim.SGD`` and ``F.cross_entropy``
  (the reference every ratio is taken against);
* ``trainer``: the fused step of hfsweep's trainer (``hs.ArrayTrainer``; its ``backward`` and
  ``update``, counted around the trainer's own calls, with per-member learning rates);
* ``plain``: the ``nn.Module`` that ``hs.fuse`` returns, trained by a user's loop with
  ``hs.optim.SGD`` and ``hs.member_losses``.

For B = 1, 2, 8, 64 each. Operators per fused step should not grow with B (a per-member Python
loop on the step's path would make them grow) and should stay near one member's step; bytes are
given per member (fused bytes / B against one member's). Counts are taken on a step after warm-up
(the arrays are traced by then) and do not depend on the machine or its load: only what is
dispatched is counted, not how long it takes. Usage::

    python benchmarks/op_counts.py                  # writes benchmarks/results/op_counts_cpu.md
    python benchmarks/op_counts.py --models tiny_mlp --sizes 1 2 --out /tmp/oc   # smoke run
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F
from _results import RESULTS, markdown_table, write_results
from fusion_throughput import MODELS as THROUGHPUT_MODELS
from torch import Tensor, nn

import hfsweep as hs
from hfsweep.tasks import TensorBatches
from hfsweep.tasks._models import ResNet
from hfsweep.testing._op_counts import OpCounter
from hfsweep.training import run as _run

#: name -> (model constructor, input batch maker, description)
MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[int, torch.Generator], Tensor], str]] = {
    name: (THROUGHPUT_MODELS[name].build, THROUGHPUT_MODELS[name].example, about)
    for name, about in (
        ("tiny_mlp", "MLP 64-32-32-10"),
        ("medium_mlp", "MLP 64-128-128-10"),
        ("small_cnn", "LeNet-style CNN, 1x28x28"),
        ("transformer", "Transformer encoder, 2 layers d128, 64 tokens"),
    )
}
MODELS["cifar_resnet"] = (
    lambda: ResNet(8, 1, 10, 0.0),
    THROUGHPUT_MODELS["resnet18"].example,
    "the cifar_resnet task's ResNet (width 8, 1 block per stage, BatchNorm), 3x32x32",
)

#: why a model's fused step dispatches more operators than one member's, read from the table
#: of the largest differences this script writes (``fused - one`` by operator)
REASONS: dict[str, str] = {
    "tiny_mlp": (
        "within 1.2x. Of the 10 more: the batched Linear's transposes, bias unsqueezes, the "
        "bias gradients' squeezes and the input's expand, about 14 (the run of Linears is "
        "computed features-first with autograd's own products, hfsweep/fusion/"
        "_graph_features_first.py: 4 more than the stacked Linear's autograd.Function, a "
        "squeeze per later layer and the output's transpose_copy forward and transpose "
        "backward, and no Python); the per-member cross-entropy (trainer: gather, scatter_add, "
        "mean instead of nll_loss); the non-finite check, 4 (one multi-tensor norm over all "
        "gradients, which it does not write, the norms' stack and sum, one scalar read; "
        "hfsweep/optim); the optimizer 4 fewer (foreach) and 2 fewer for the profiler range "
        "torch's optimizers open around every step (hs.optim opens it only under a profiler or "
        "with step hooks). "
        "Was 1.46: one sum per parameter for the check (10) and each weight gradient copied "
        "into the weight's layout (new_empty_strided + copy_ and a transpose per weight; the "
        "stacked Linear now computes it in place, hfsweep/fusion/_graph_linear.py)"
    ),
    "medium_mlp": "as the tiny MLP (the same layers, wider)",
    "small_cnn": (
        "within 1.2x. As the MLPs, plus one view per convolution weight and bias gradient in "
        "the backward (the stacked parameter's shape; the forward reads them through views "
        "made once, hfsweep/fusion/_graph_fold.py) and one copy where the second pool's output "
        "is flattened for the first Linear, which reads the members first (clone forward; "
        "clone and _unsafe_view backward). The convolutions are one grouped convolution each, "
        "bias included (hfsweep/nn/_conv.py), and the pools run on their output as "
        "[N, B * C, H, W] (hfsweep/fusion/_graph_pool.py). Was 1.18 with a view of each "
        "convolution's weight and bias per forward, 1.37 with vmap's permute and copy "
        "(permute, clone, _unsafe_view) before each pool and before the next convolution"
    ),
    "cifar_resnet": (
        "within 1.2x. Of the 33 more views: the backward views each folded parameter's "
        "gradient as the stacked parameter, 27 (9 convolution weights, 9 BatchNorm weights and "
        "9 biases; a view launches no kernel on a GPU); the rest are the head's (the last "
        "block's output split by member, the pooled output and the dropout multiplier as "
        "[B, N, C]). The forward reads every convolution weight and BatchNorm weight, bias and "
        "running statistic through views made once per tensor's memory "
        "(hfsweep/fusion/_graph_fold.py), and a residual add of two [N, B * C, H, W] tensors "
        "runs on them as they are: the array's forward dispatches 3 views (was 57: 45 of the "
        "stacked state, 10 around the residual adds), its backward 30 (was 39). BatchNorm is "
        "one native batch_norm per layer (hfsweep/nn/_batchnorm.py); the non-finite check 4 "
        "operators; the optimizer 28 fewer (foreach) and 2 fewer for torch's profiler range "
        "around the step. Was 1.46"
    ),
    "transformer": (
        "attention as batched products, masked_fill and softmax per member in training (the "
        "path that takes per-member attention dropout) instead of torch's fused CPU attention "
        "kernel; the batched Linear's transposes; fewer for dropout (one "
        "hfsweep::dropout_multiplier per layer against torch's bernoulli_ + div_) and the "
        "optimizer (foreach). Was 1.30 with one sum per parameter for the non-finite check "
        "and a gradient copy per Linear weight"
    ),
}

#: the samples in a batch: counts do not depend on it, bytes scale with it
BATCH = 4
WARMUP = 3
LR = 0.01


def _data(name: str) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(1)
    x = MODELS[name][1](BATCH, gen)
    y = torch.randint(0, 10, (BATCH,), generator=gen)
    return x, y


def _counted(step: Callable[[], None], steps: int = WARMUP) -> list[OpCounter]:
    """Counters of ``steps`` steps after ``WARMUP`` uncounted ones."""
    for _ in range(WARMUP):
        step()
    counters = []
    for _ in range(steps):
        with OpCounter() as c:
            step()
        counters.append(c)
    return counters


def one_step(name: str) -> OpCounter:
    """One member alone: ``torch.optim.SGD`` and ``F.cross_entropy`` on a plain model."""
    torch.manual_seed(0)
    model = MODELS[name][0]()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = _data(name)

    def step() -> None:
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return _steady(_counted(step), f"{name}, one member")


def plain_step(name: str, size: int, **opt_kwargs: Any) -> OpCounter:
    """The fused array of ``size`` members in a user's loop: ``hs.member_losses(...).sum()``,
    backward, ``hs.optim.SGD`` with per-member learning rates."""
    torch.manual_seed(0)
    array = hs.fuse([MODELS[name][0]() for _ in range(size)])
    opt = hs.optim.SGD(array, lr=[LR * (1 + i / size) for i in range(size)], **opt_kwargs)
    x, y = _data(name)

    def step() -> None:
        hs.member_losses(array(x), y).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return _steady(_counted(step, 2), f"{name}, plain path, B={size}")


@contextmanager
def _trainer_counters() -> Iterator[list[OpCounter]]:
    """Counts each training step of the trainers run inside: its ``backward`` (forward, loss,
    backward, clipping) and ``update`` (optimizer and schedule), as the trainer calls them."""
    counters: list[OpCounter] = []
    backward, update = _run.backward, _run.update

    def counted_backward(*args: Any, **kwargs: Any) -> Tensor:
        counters.append(OpCounter())
        with counters[-1]:
            return backward(*args, **kwargs)

    def counted_update(*args: Any, **kwargs: Any) -> None:
        with counters[-1]:
            update(*args, **kwargs)

    with (
        mock.patch.object(_run, "backward", counted_backward),
        mock.patch.object(_run, "update", counted_update),
    ):
        yield counters


def make_task(name: str) -> hs.Task:
    """A task training ``name`` on one fixed batch of generated data."""

    def data(config: Mapping[str, Any]) -> tuple[TensorBatches, TensorBatches]:
        x, y = _data(name)
        return TensorBatches(x, y, BATCH, shuffle=False), TensorBatches(x, y, BATCH, shuffle=False)

    return hs.Task(
        name=f"op_counts_{name}",
        model=lambda config: MODELS[name][0](),
        data=data,
        defaults={"batch_size": BATCH, "lr": LR},
    )


def trainer_step(name: str, size: int, task: hs.Task | None = None, **config: Any) -> OpCounter:
    """A steady training step of ``hs.ArrayTrainer`` on an array of ``size`` members (``config``:
    what every member's config sets besides its own learning rate)."""
    task = task or make_task(name)
    steps = WARMUP + 3
    members = [
        hs.Member(
            id=str(i),
            config=task.resolve({**config, "lr": LR * (1 + i / size), "max_steps": steps}),
        )
        for i in range(size)
    ]
    with _trainer_counters() as counters:
        hs.ArrayTrainer(task, eval_every=10 * steps).run(members)
    return _steady(counters[WARMUP:-1], f"{name}, trainer, B={size}")


def _steady(counters: list[OpCounter], what: str) -> OpCounter:
    """The last counter, after checking that the steps counted dispatched the same operators."""
    last = counters[-1]
    for c in counters[:-1]:
        if c.ops != last.ops:
            raise RuntimeError(f"{what}: the counted steps differ: {c.ops - last.ops}")
    return last


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "-"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--sizes", nargs="+", type=int, default=[1, 2, 8, 64])
    parser.add_argument("--out", type=Path, default=None, help="results file stem")
    parser.add_argument(
        "--render",
        type=Path,
        default=None,
        help="write the tables again from a results .json (its rows and command), measuring "
        "nothing: after a change to the reasons or the layout",
    )
    parser.add_argument(
        "--before",
        type=Path,
        default=None,
        help="a results .json of an earlier revision: its operator counts go into the table as "
        "the 'before' columns (rows matched by model, path and B)",
    )
    args = parser.parse_args(argv)
    if args.render is not None:
        saved = json.loads(args.render.read_text())
        command = saved["meta"]["command"].split()[2:]
        models = list(dict.fromkeys(r["model"] for r in saved["rows"]))
        rows = saved["rows"]
        if args.before is not None:
            rows = with_before(rows, args.before)
        render(rows, models, command, args.out or args.render.with_suffix(""))
        return 0
    rows: list[dict[str, Any]] = []
    for name in args.models:
        one = one_step(name)
        for path, measure in (("trainer", trainer_step), ("plain", plain_step)):
            for size in args.sizes:
                c = measure(name, size)
                row = {
                    "model": name,
                    "path": path,
                    "B": size,
                    "ops": c.total,
                    "one_ops": one.total,
                    "bytes": c.bytes,
                    "one_bytes": one.bytes,
                    "host_reads": c.host_reads,
                    "one_host_reads": one.host_reads,
                    "ops_by_name": dict(sorted(c.ops.items())),
                    "one_ops_by_name": dict(sorted(one.ops.items())),
                }
                rows.append(row)
                print(
                    f"{name:13s} {path:8s} B={size:3d} ops {c.total:5d} (one {one.total}, "
                    f"{_ratio(c.total, one.total)}x) bytes/member "
                    f"{c.bytes / size / 1024:9.1f} KiB (one {one.bytes / 1024:.1f} KiB) "
                    f"host reads {len(c.host_reads)}",
                    flush=True,
                )
    if args.before is not None:
        rows = with_before(rows, args.before)
    render(rows, args.models, argv, args.out or RESULTS / "op_counts_cpu")
    return 0


def with_before(rows: list[dict[str, Any]], path: Path) -> list[dict[str, Any]]:
    """``rows`` with ``ops_before`` (and a ``before`` note naming the file) from the results
    .json of an earlier run at ``path``."""
    before = json.loads(path.read_text())
    earlier = {(r["model"], r["path"], r["B"]): r["ops"] for r in before["rows"]}
    note = f"`{path.name}`, {before['meta']['date']}, `{before['meta']['command']}`"
    return [
        {**r, "ops_before": earlier.get((r["model"], r["path"], r["B"])), "before": note}
        for r in rows
    ]


def render(
    rows: list[dict[str, Any]], models: list[str], argv: list[str] | None, stem: Path
) -> None:
    """Write the tables of ``rows`` to ``stem``.md/.json (``argv``: the measuring command's)."""
    device = torch.device("cpu")
    notes = [
        f"- one training step (forward, loss, backward, SGD step) after {WARMUP} warm-up steps, "
        f"batch {BATCH}; `one` is one member alone (`torch.optim.SGD`, `F.cross_entropy`); "
        "`trainer` is `hs.ArrayTrainer`'s step (its `backward` and `update`), `plain` an "
        "`hs.fuse` array in a user's loop with `hs.optim.SGD`",
        "- ops: ATen operators dispatched (views and the backward pass included); bytes: the "
        "sizes of the tensors the operators created; host reads: values read into Python "
        "(each a synchronisation on a GPU)",
        "- device-independent: counted, not timed; the same on any machine with this torch",
    ]
    before = any(r.get("ops_before") is not None for r in rows)
    if before:
        notes.append(
            "- ops before: what the same step dispatched before issue 21's batching rules for "
            "BatchNorm and convolutions, the view folding, the one-operator non-finite check, "
            "the stacked Linear's gradient in place, the pooling rule and the stacked state "
            f"read through views made once ({rows[0]['before']}, in benchmarks/results/); "
            "ops: this revision"
        )
    columns = [
        "model",
        "path",
        "B",
        *(["ops before", "ops / one before"] if before else []),
        "ops",
        "one member's ops",
        "ops / one",
        "KiB per member",
        "one member's KiB",
        "host reads",
    ]
    cells = [
        [
            r["model"],
            r["path"],
            str(r["B"]),
            *(
                [
                    str(r.get("ops_before", "-")),
                    _ratio(r["ops_before"], r["one_ops"]) if r.get("ops_before") else "-",
                ]
                if before
                else []
            ),
            str(r["ops"]),
            str(r["one_ops"]),
            _ratio(r["ops"], r["one_ops"]),
            f"{r['bytes'] / r['B'] / 1024:.1f}",
            f"{r['one_bytes'] / 1024:.1f}",
            f"{len(r['host_reads'])} (one: {len(r['one_host_reads'])})",
        ]
        for r in rows
    ]
    after = [
        "",
        "## Where the extra operators are (trainer path, B=2)",
        "",
        "Operators the fused step dispatches minus one member's, by name (a fused `bmm` where "
        "one member has `mm` shows as both), and the reason read from them.",
        "",
    ]
    diff_cells = []
    for name in models:
        fused = [r for r in rows if r["model"] == name and r["path"] == "trainer"]
        if not fused:
            continue
        # B=2 where measured (B=1 takes a path of its own), else the smallest B
        row = min(fused, key=lambda r: (r["B"] != 2, r["B"]))
        extra = {
            op: row["ops_by_name"].get(op, 0) - row["one_ops_by_name"].get(op, 0)
            for op in {*row["ops_by_name"], *row["one_ops_by_name"]}
        }
        top = sorted(extra.items(), key=lambda kv: (-abs(kv[1]), kv[0]))[:8]
        diff_cells.append(
            [
                name,
                _ratio(row["ops"], row["one_ops"]),
                ", ".join(f"{op} {n:+d}" for op, n in top if n),
                REASONS.get(name, ""),
            ]
        )
    after += markdown_table(
        ["model", "ops / one", "largest differences (fused - one)", "why"], diff_cells
    )
    write_results(
        stem,
        "op_counts.py",
        argv,
        device,
        "Operators, bytes and host reads per fused training step, against one member's step",
        notes,
        columns,
        cells,
        rows,
        after,
    )


if __name__ == "__main__":
    raise SystemExit(main())
