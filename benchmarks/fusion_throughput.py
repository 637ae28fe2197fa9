"""Training throughput and memory of B models: one after another, B processes, one fused array.

For each model and array size B this measures member-samples per second (B x batch / step time)
of one full training step (forward, backward, SGD update) done these ways, side by side in one run:

* ``serial``: B independent models, each with its own ``torch.optim.SGD``, stepped one after another
  in this process (what a sweep does when it runs one trial at a time on the device);
* ``concurrent``: B separate OS processes (spawned), each training its own model with its own
  optimizer on the same device at the same time: what Ray Tune's fractional resources (or several
  jobs per GPU) do. Member-samples/s is the samples all processes completed inside one common timed
  window divided by the window's length; start-up and warm-up are outside the window;
* ``fused``: ``hs.fuse`` of the same B models, per-member losses summed, one SGD over the stacked
  parameters (the same update as B separate SGDs with one learning rate): the *plain* path, the
  ``nn.Module`` that ``hs.fuse`` returns trained by the user's own loop;
* ``trainer``: the *trainer's* path, the fused step that ``hfsweep run`` and ``hs.ArrayTrainer``
  take (``hfsweep.training.step.backward`` and ``update``: forward, the task's per-member loss,
  backward, ``hs.optim.SGD`` with per-member learning rates and its non-finite check, and the
  losses' running sum), on the same B models and batch, its arguments captured from an
  ``hs.ArrayTrainer`` run. Tables show one row per path: the ``fused`` columns are that path's;
* ``ideal``: one model trained on a batch B times larger, the same arithmetic with no fusion
  overhead at all; fused can approach but not beat it;
* ``hand`` (the MLPs and the LeNet-style CNN): the same B models written by hand as one
  (``_hand_written.py``): one ``baddbmm`` per Linear over stacked weights, each convolution one
  convolution over ``B * C`` channels; the HFTA-style implementation the engine is meant to
  match without being written. Below the bound, it says how much of the gap hand-written fusion
  itself has on the device.

Rounds interleave the ways and the median round is reported, so a slow moment of the machine hits
all of them alike. The concurrent processes wait idle while this process times its ways, and this
one sleeps through their window. On a CPU each process gets ``max(1, T // B)`` torch threads, T
being the threads this process's ways use (Ray's fractional CPUs); on a GPU the B processes share
the device by time-slicing (no MPS).

Peak memory is measured alongside, each in a fresh spawned process over one training step: one
process training the fused array of B against the B processes of the concurrent way. Tensor bytes
are the CUDA allocator's ``max_memory_allocated`` on a GPU, and on a CPU the peak of live tensor
bytes followed op by op (the profiler's tracker); each process also reports its peak RSS
(``getrusage``), its private memory before it holds a model (what the framework alone costs each
process) and, on a GPU, the device memory it uses outside the allocator (its CUDA context).

On a CPU this process and every spawned one set the allocator as hfsweep's trainer does
(``hfsweep._malloc``: glibc keeps freed memory for the next step), so all ways run with the
same allocator; ``HFSWEEP_MALLOC=system`` runs them all on glibc's defaults.

Writes ``<stem>.md``/``.json`` and the plots ``<stem>_throughput.png`` and ``<stem>_memory.png``
(default stem ``benchmarks/results/fusion_throughput_<device>``). Usage::

    python benchmarks/fusion_throughput.py                 # CPU, writes benchmarks/results/
    python benchmarks/fusion_throughput.py --device cuda
    python benchmarks/fusion_throughput.py --models tiny_mlp --sizes 1 32 --rounds 3
    python benchmarks/fusion_throughput.py --quick --out /tmp/ft   # smoke run: does it work?

On a CPU the default models leave out ``resnet18`` (seconds per step per model there): name it
with a few small sizes, ``--models resnet18 --sizes 1 2 4``. ``lora_bert`` (a LoRA fine-tuning
member whose frozen base every member shares; needs ``peft`` and ``transformers``) runs only when
named: ``--models lora_bert --sizes 1 16``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import os
import resource
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager, suppress
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, NamedTuple
from unittest import mock

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from _hand_written import hand_written
from _results import RESULTS, machine, markdown_table, write_results
from torch import Tensor, nn

import hfsweep as hs
from hfsweep._malloc import retain_freed_memory
from hfsweep.sizing.timing import _LiveTensorBytes
from hfsweep.tasks import TensorBatches
from hfsweep.tasks._models import BasicBlock, ResNet
from hfsweep.training import run as _trainer_run

# --------------------------------------------------------------------------------------------
# models


def tiny_mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10)
    )


def medium_mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10)
    )


class SmallCNN(nn.Module):
    """LeNet-style CNN on 1x28x28 inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 5)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 4 * 4, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x: Tensor) -> Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = x.flatten(1)
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


class ResNet18(nn.Module):
    """ResNet-18 in its CIFAR form (11.2M parameters): a 3x3 stride-1 stem without max pooling,
    four stages of two basic blocks (64, 128, 256, 512 channels), global average pooling and a
    linear head, for 3x32x32 inputs.

    The ready ``cifar_resnet`` task's :class:`~hfsweep.tasks._models.ResNet` has three stages (a
    ResNet-20-like shape), so only its basic block is reused here.
    """

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU()
        )
        blocks: list[nn.Module] = []
        c = 64
        for k, width in enumerate((64, 128, 256, 512)):
            for b in range(2):
                blocks.append(BasicBlock(c, width, 2 if k > 0 and b == 0 else 1))
                c = width
        self.stages = nn.Sequential(*blocks)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, classes))

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.stages(self.stem(x)))


class TransformerClassifier(nn.Module):
    """A small Transformer encoder classifier (0.53M parameters): token and learned position
    embeddings, two post-norm ``nn.TransformerEncoderLayer`` (d_model 128, 4 heads, feed-forward
    512, dropout 0.1), mean pooling over positions and a linear head; ``[N, 64]`` token ids.

    Attention-weight dropout is 0, as in the runs whose results are committed; a fused array
    could give each member its own (``hfsweep.nn.FusedMultiheadAttentionMixin``).
    """

    vocab, length = 1000, 64

    def __init__(self, d_model: int = 128, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(self.vocab, d_model)
        self.position = nn.Parameter(torch.zeros(self.length, d_model))
        nn.init.normal_(self.position, std=0.02)
        layer = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, 0.1, batch_first=True)
        layer.self_attn.dropout = 0.0
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, 10)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.embed(tokens) + self.position[: tokens.shape[-1]]
        return self.head(self.encoder(h).mean(-2))


class LoraBert(nn.Module):
    """A LoRA fine-tuning member: a BERT-style encoder for sequence classification (hidden 256,
    4 layers, 4 heads, vocabulary 1000, 64 tokens; 3.4M parameters, built from a config, nothing
    downloaded) wrapped with peft LoRA (r=8 on query/value, ``lora_dropout`` 0.1), returning
    the logits. Every member holds the same "pretrained" base (built under a fixed seed, frozen)
    and its own adapter and classifier head (initialised from the caller's random state), so a
    fused array keeps the base once (``share_frozen``) where serial models and separate
    processes hold one each. ``hidden`` and ``layers`` change the base's shape (``4 * hidden``
    feed-forward, ``hidden // 64`` heads; ``peak_breakdown.py --base``)."""

    def __init__(self, hidden: int = 256, layers: int = 4) -> None:
        super().__init__()
        import peft
        import transformers

        config = transformers.BertConfig(
            vocab_size=TransformerClassifier.vocab,
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=max(1, hidden // 64),
            intermediate_size=4 * hidden,
            max_position_embeddings=TransformerClassifier.length,
            num_labels=10,
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1234)
            base = transformers.BertForSequenceClassification(config)
        lora = peft.LoraConfig(
            r=8,
            lora_alpha=16,
            target_modules=["query", "value"],
            lora_dropout=0.1,
            task_type="SEQ_CLS",
        )
        self.model = peft.get_peft_model(base, lora)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.model(input_ids=tokens).logits


def _features(*shape: int) -> Callable[[int, torch.Generator], Tensor]:
    def make(batch: int, gen: torch.Generator) -> Tensor:
        return torch.randn(batch, *shape, generator=gen)

    return make


def _tokens(batch: int, gen: torch.Generator) -> Tensor:
    v, t = TransformerClassifier.vocab, TransformerClassifier.length
    return torch.randint(0, v, (batch, t), generator=gen)


class ModelSpec(NamedTuple):
    """A benchmarked model: its constructor first (``MODELS[name][0]``, which
    ``optimizer_step.py`` uses), a function making one CPU input batch, its default batch size
    and a description for the results."""

    build: Callable[[], nn.Module]
    example: Callable[[int, torch.Generator], Tensor]
    batch: int
    about: str


MODELS: dict[str, ModelSpec] = {
    "tiny_mlp": ModelSpec(tiny_mlp, _features(64), 64, "MLP 64-32-32-10"),
    "medium_mlp": ModelSpec(medium_mlp, _features(64), 64, "MLP 64-128-128-10"),
    "small_cnn": ModelSpec(SmallCNN, _features(1, 28, 28), 64, "LeNet-style CNN, 1x28x28"),
    "resnet18": ModelSpec(ResNet18, _features(3, 32, 32), 128, "ResNet-18 (CIFAR form), 3x32x32"),
    "cifar_resnet": ModelSpec(
        lambda: ResNet(8, 1, 10, 0.0),
        _features(3, 32, 32),
        64,
        "the cifar_resnet task's ResNet (width 8, 1 block per stage, BatchNorm), 3x32x32",
    ),
    "transformer": ModelSpec(
        TransformerClassifier, _tokens, 32, "Transformer encoder, 2 layers d128, 64 tokens"
    ),
    "lora_bert": ModelSpec(
        LoraBert, _tokens, 8, "BERT-style encoder (4 layers d256) with peft LoRA r=8, frozen base"
    ),
}

# the ways, in the order rounds run them and tables show them
ARMS = ("serial", "concurrent", "fused", "trainer", "ideal", "hand")
#: the fused ways, one table row each: the plain path (``fused``) and the trainer's
PATHS = {"plain": "fused", "trainer": "trainer"}


def _batch(name: str, batch: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """The one input batch every way trains on, identical in every process."""
    gen = torch.Generator().manual_seed(1)
    x = MODELS[name].example(batch, gen)
    y = torch.randint(0, 10, (batch,), generator=gen)
    return x.to(device), y.to(device)


# --------------------------------------------------------------------------------------------
# the in-process ways


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(step: Callable[[], None], iters: int, device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        step()
    _sync(device)
    return (time.perf_counter() - start) / iters


def make_steps(
    name: str, size: int, batch: int, device: torch.device
) -> dict[str, Callable[[], None]]:
    """One training step of each in-process way (serial, fused, ideal; hand for the MLPs, CNN)."""
    build = MODELS[name].build
    torch.manual_seed(0)
    models = [build().to(device) for _ in range(size)]
    x, y = _batch(name, batch, device)

    opts = [torch.optim.SGD(m.parameters(), lr=0.01) for m in models]

    def serial() -> None:
        for m, o in zip(models, opts, strict=True):
            o.zero_grad(set_to_none=True)
            F.cross_entropy(m(x), y).backward()
            o.step()

    array = hs.fuse(models)
    fused_opt = torch.optim.SGD(array.parameters(), lr=0.01)

    def fused() -> None:
        fused_opt.zero_grad(set_to_none=True)
        hs.member_losses(array(x), y).sum().backward()
        fused_opt.step()

    big = build().to(device)
    big_opt = torch.optim.SGD(big.parameters(), lr=0.01)
    xb = x.repeat(size, *([1] * (x.dim() - 1)))
    yb = y.repeat(size)

    def ideal() -> None:
        big_opt.zero_grad(set_to_none=True)
        F.cross_entropy(big(xb), yb).backward()
        big_opt.step()

    steps = {"serial": serial, "fused": fused, "trainer": trainer_step(name, models, x, y)}
    steps["ideal"] = ideal
    hand = hand_written(models, x, y)
    if hand is not None:
        steps["hand"] = hand.step
    return steps


class _Captured(Exception):
    """Ends the trainer run that :func:`trainer_step` captures its step from."""


def trainer_step(name: str, models: list[nn.Module], x: Tensor, y: Tensor) -> Callable[[], None]:
    """The trainer's fused step on copies of ``models`` and the batch ``(x, y)``.

    The step calls the trainer's ``backward`` and ``update`` with the arguments
    :func:`trainer_calls` captured, and adds the losses to a running sum as the trainer's loop
    does. The array, optimizer and loss are the trainer's own objects."""
    (b_args, b_kwargs), (u_args, u_kwargs) = trainer_calls(name, models, x, y)
    backward, update = _trainer_run.backward, _trainer_run.update
    loss_sum = torch.zeros(len(models), dtype=torch.float64, device=x.device)
    add_losses = trainer_add_losses()

    def trainer() -> None:
        losses = backward(*b_args, **b_kwargs)
        update(*u_args, **u_kwargs)
        add_losses(loss_sum, losses)

    return trainer


def _add_losses_before(loss_sum: Tensor, losses: Tensor) -> None:
    with torch.no_grad():
        loss_sum.add_(losses.detach().to(torch.float64))


def trainer_add_losses() -> Callable[[Tensor, Tensor], None]:
    """How the trainer's loop adds a step's losses to its running sum: ``step.add_losses``, or
    on a revision without it (``before_after.py`` runs this script on older trees) the
    conversion to float64 and add it made then."""
    from hfsweep.training import step

    return getattr(step, "add_losses", _add_losses_before)


Call = tuple[tuple[Any, ...], dict[str, Any]]


def trainer_calls(name: str, models: list[nn.Module], x: Tensor, y: Tensor) -> tuple[Call, Call]:
    """The ``(args, kwargs)`` of the trainer's ``backward`` and ``update`` for copies of
    ``models`` trained on the batch ``(x, y)``.

    An ``hs.ArrayTrainer`` run of one task that trains these models on this batch (SGD, lr 0.01
    per member) is stopped at its second step; the arguments its ``backward`` and ``update``
    (``hfsweep/training/step.py``, what ``hfsweep run`` calls every step) were given are kept.
    ``step_breakdown.py`` times their parts."""
    batch = x.shape[0]
    copies = iter([copy.deepcopy(m) for m in models])
    device = x.device

    def data(config: Mapping[str, Any]) -> tuple[TensorBatches, TensorBatches]:
        cpu = (x.cpu(), y.cpu())
        return TensorBatches(*cpu, batch, shuffle=False), TensorBatches(*cpu, batch, shuffle=False)

    task = hs.Task(
        name=f"throughput_{name}",
        model=lambda config: next(copies),
        data=data,
        defaults={"batch_size": batch, "lr": 0.01, "optimizer": "sgd"},
    )
    members = [
        hs.Member(id=str(i), config=task.resolve({"max_steps": 1000})) for i in range(len(models))
    ]
    captured: dict[str, Any] = {}
    backward, update = _trainer_run.backward, _trainer_run.update

    def capture_backward(*args: Any, **kwargs: Any) -> Tensor:
        captured.setdefault("backward", (args, kwargs))
        return backward(*args, **kwargs)

    def capture_update(*args: Any, **kwargs: Any) -> None:
        update(*args, **kwargs)
        if "update" in captured:
            raise _Captured
        captured["update"] = (args, kwargs)

    with (
        mock.patch.object(_trainer_run, "backward", capture_backward),
        mock.patch.object(_trainer_run, "update", capture_update),
        suppress(_Captured),
    ):
        hs.ArrayTrainer(task, device=str(device), eval_every=10**6).run(members)
    return captured["backward"], captured["update"]


# --------------------------------------------------------------------------------------------
# worker processes: the concurrent way, and every memory measurement


@dataclasses.dataclass(frozen=True)
class Job:
    """What one spawned process trains: one model (``size=1``, the plain ``torch.nn`` module and
    ``torch.optim.SGD`` of the serial way) or a fused array of ``size`` members (the fused way's
    code); ``serve`` keeps it training in the timed windows the parent opens."""

    model: str
    size: int
    batch: int
    device: str
    threads: int
    seed: int
    serve: bool
    warmup: int = 3
    # CUDA: the device memory in use just before this process started, when it starts alone:
    # then it can tell how much device memory it takes outside the allocator (its context...)
    device_used_before: int | None = None


def _rss_now() -> int | None:
    """Resident set size of this process now, in bytes (Linux ``/proc``; None elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _anonymous_now() -> int | None:
    """Anonymous (private heap) bytes of this process now: resident memory no other process
    shares, unlike the library code pages RSS also counts (Linux ``smaps_rollup``)."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("Anonymous:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _rss_peak() -> int:
    """Peak resident set size of this process so far (``getrusage``), in bytes."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def _build_job(job: Job, device: torch.device) -> tuple[Callable[[], None], list[Any]]:
    """The training step of ``job`` and the tensors alive between steps (for the CPU tracker)."""
    build = MODELS[job.model].build
    torch.manual_seed(job.seed)
    x, y = _batch(job.model, job.batch, device)
    if job.size == 1:
        model = build().to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            opt.step()

        return step, [dict(model.state_dict(keep_vars=True)), opt.state, x, y]
    array = hs.fuse([build() for _ in range(job.size)]).to(device)
    fused_opt = torch.optim.SGD(array.parameters(), lr=0.01)

    def fused() -> None:
        fused_opt.zero_grad(set_to_none=True)
        hs.member_losses(array(x), y).sum().backward()
        fused_opt.step()

    return fused, [dict(array.state_dict(keep_vars=True)), fused_opt.state, x, y]


def _peak_memory(step: Callable[[], None], alive: list[Any], device: torch.device) -> dict:
    """Peak bytes of one training step: the CUDA allocator's peak allocated (and reserved) bytes,
    or on CPU the peak of live tensor bytes followed op by op (the profiler's tracker)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return {
            "tensor_peak": int(torch.cuda.max_memory_allocated(device)),
            "reserved_peak": int(torch.cuda.max_memory_reserved(device)),
        }
    with _LiveTensorBytes(alive) as tracker:
        step()
    return {"tensor_peak": int(tracker.peak), "reserved_peak": None}


def _worker(conn: Connection, job: Job) -> None:
    """A spawned process: build ``job``, warm up, measure memory, report ``ready``; then, if it
    serves, train through every window the parent opens (``("run", start, end)``) and answer
    with the samples completed inside it, until ``("stop",)`` or the parent goes away."""
    try:
        torch.set_num_threads(job.threads)
        device = torch.device(job.device)
        if device.type == "cpu":
            retain_freed_memory()  # as in the parent, for every way alike
        if device.type == "cuda":
            if device.index is not None:
                torch.cuda.set_device(device)
            torch.cuda.init()
        # the framework alone: torch imported, its context up, and a first optimizer built
        # (which loads torch._dynamo): what every process pays before it holds a model
        torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
        memory: dict[str, Any] = {"rss_base": _rss_now(), "anon_base": _anonymous_now()}
        step, alive = _build_job(job, device)
        for _ in range(job.warmup):
            step()
        # the steps each window times are chunks that end in a sync on CUDA: about 2 ms of work
        step_s = _time(step, 2, device)
        chunk = max(1, int(0.002 / max(step_s, 1e-9))) if device.type == "cuda" else 1
        memory.update(_peak_memory(step, alive, device))
        memory["rss_peak"] = _rss_peak()
        memory["cuda_context"] = None
        if device.type == "cuda" and job.device_used_before is not None:
            # device memory this process uses outside the allocator's reserve: the CUDA context,
            # the kernels loaded so far, the libraries' handles
            free, total = torch.cuda.mem_get_info(device)
            outside = total - free - job.device_used_before - torch.cuda.memory_reserved(device)
            memory["cuda_context"] = max(0, int(outside))
        conn.send(("ready", {**memory, "step_s": step_s}))
        while job.serve:
            msg = conn.recv()
            if msg[0] == "stop":
                break
            _, start, end = msg
            conn.send(("done", _train_window(step, chunk, job.batch, start, end, device)))
            if device.type == "cuda":
                torch.cuda.empty_cache()  # give the device back to the parent's ways between
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass
    except torch.cuda.OutOfMemoryError as exc:
        _send_quietly(conn, ("oom", str(exc).splitlines()[0]))
    except BaseException:
        _send_quietly(conn, ("error", traceback.format_exc()))
    finally:
        conn.close()


def _send_quietly(conn: Connection, msg: tuple) -> None:
    with suppress(OSError, EOFError):
        conn.send(msg)


def _train_window(
    step: Callable[[], None],
    chunk: int,
    batch: int,
    start: float,
    end: float,
    device: torch.device,
) -> float:
    """Train from now until a chunk of steps starts after ``end``; return the samples completed
    inside ``[start, end]``. A chunk straddling an edge counts by the fraction of its time inside,
    so no process gains or loses a whole step at the edges. ``time.monotonic`` is one clock for
    every process of the machine."""
    done = 0.0
    while True:
        a = time.monotonic()
        if a >= end:
            return done
        for _ in range(chunk):
            step()
        _sync(device)
        b = time.monotonic()
        inside = min(b, end) - max(a, start)
        if inside > 0:
            done += chunk * batch * inside / (b - a)


class WorkerFailed(RuntimeError):
    """A spawned process died, timed out or raised; ``oom`` says it ran out of device memory."""

    def __init__(self, message: str, oom: bool = False) -> None:
        super().__init__(message)
        self.oom = oom


def _recv(conn: Connection, proc: Any, timeout: float) -> tuple:
    """The next message of one process, failing if it dies or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while not conn.poll(0.2):
        if not proc.is_alive() and not conn.poll(0):
            raise WorkerFailed(f"worker {proc.pid} exited with code {proc.exitcode}")
        if time.monotonic() > deadline:
            raise WorkerFailed(f"worker {proc.pid} sent nothing in {timeout:.0f} s")
    try:
        msg = conn.recv()
    except EOFError as exc:
        raise WorkerFailed(f"worker {proc.pid} closed its pipe (code {proc.exitcode})") from exc
    if msg[0] == "oom":
        raise WorkerFailed(f"worker {proc.pid}: {msg[1]}", oom=True)
    if msg[0] == "error":
        raise WorkerFailed(f"worker {proc.pid} failed:\n{msg[1]}")
    return msg


@contextmanager
def workers(jobs: Sequence[Job]) -> Iterator[list[tuple[Connection, Any]]]:
    """Spawn one process per job and yield each one's pipe and handle; on exit, whatever
    happened, ask each to stop, then join it, terminate it or kill it, by its own handle."""
    ctx = mp.get_context("spawn")
    started: list[tuple[Connection, Any]] = []
    try:
        for job in jobs:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(child, job), daemon=True)
            proc.start()
            child.close()
            started.append((parent, proc))
        yield started
    finally:
        for conn, proc in started:
            if proc.is_alive():
                _send_quietly(conn, ("stop",))
        for conn, proc in started:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
            conn.close()


def _device_used(device: torch.device) -> int | None:
    """CUDA: device memory in use now (all processes), after giving back this one's cache."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return int(total - free)


def _ready(entry: tuple[Connection, Any], timeout: float) -> dict | None:
    """The ``ready`` message of one spawned process (its memory), or None if it ran out of
    device memory; any other failure raises."""
    try:
        return _recv(*entry, timeout)[1]
    except WorkerFailed as exc:
        if not exc.oom:
            raise
        return None


# --------------------------------------------------------------------------------------------
# one model at one size


def _try_warm(step: Callable[[], None], warmup: int, device: torch.device) -> float | None:
    """Warm ``step`` up and time one call; None when it runs out of device memory."""
    try:
        for _ in range(warmup):
            step()
        return _time(step, 1, device)
    except torch.cuda.OutOfMemoryError:
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return None


def measure(
    name: str,
    size: int,
    batch: int,
    device: torch.device,
    rounds: int,
    min_time: float,
    processes: bool = True,
    threads: int = 1,
    warmup: int = 3,
) -> dict[str, Any]:
    """Median member-samples/s of each way, per-round ratios of fused to the others, and memory.

    ``processes=False`` skips the concurrent way (and the memory of B processes). A way that runs
    out of device memory is reported as None with a note.
    """
    steps = make_steps(name, size, batch, device)
    arms = ["concurrent", *steps]
    iters: dict[str, int] = {}
    once: dict[str, float] = {}
    notes: dict[str, str] = {}
    for way in list(steps):
        t = _try_warm(steps[way], warmup, device)
        if t is None:
            notes[way] = "out of memory"
            del steps[way]
            continue
        once[way] = t
        iters[way] = max(1, int(min_time / max(t, 1e-6)))
    samples: dict[str, list[float]] = {way: [] for way in steps}
    concurrent: list[float] = []
    memory: dict[str, Any] = {"fused": None, "processes": None}
    # a contended process steps about as slowly as B models one after another
    contended = once.get("serial", max(once.values(), default=0.01))
    window = max(min_time, 2 * contended)
    lead = 0.05 + 2 * contended  # every process is stepping before the window opens
    # start-up: importing torch, building, warming up, all processes at once on shared cores
    start_timeout = 300 + 10 * (warmup + 4) * contended * max(1, size // threads)
    cuda = device.type == "cuda"
    fused_job = Job(
        name,
        size,
        batch,
        str(device),
        threads,
        seed=0,
        serve=False,
        warmup=1,
        device_used_before=_device_used(device),
    )
    jobs = [
        Job(name, 1, batch, str(device), threads, seed=i, serve=True, warmup=warmup)
        for i in range(size if processes else 0)
    ]
    if not processes:
        notes["concurrent"] = "not run (B above --max-processes)"
    if cuda:
        # alone on the device, beside this (idle) process: the only place a context's size shows
        with workers([fused_job]) as ws:
            memory["fused"] = _ready(ws[0], start_timeout)
    else:
        jobs.insert(0, fused_job)  # a CPU has room for all: start them together
    with ExitStack() as stack:
        _device_used(device)  # give this process's cached blocks back before they start
        ws = list(stack.enter_context(workers(jobs)))  # a copy: popping must not hide one
        if not cuda:
            memory["fused"] = _ready(ws.pop(0), start_timeout)
        ready = [_ready(entry, start_timeout) for entry in ws]
        if ws and all(r is not None for r in ready):
            memory["processes"] = ready
        elif ws:
            notes["concurrent"] = f"out of memory with {size} processes"
            stack.close()  # stop them now: they hold device memory the other ways need
            ws = []
        if memory["fused"] is None:
            notes["fused memory"] = "out of memory"
        for _ in range(rounds):
            for way, step in list(steps.items()):
                try:
                    if ws and cuda:
                        step()  # the processes emptied the allocator cache: refill it untimed
                    samples[way].append(_time(step, iters[way], device))
                except torch.cuda.OutOfMemoryError:
                    # the idle processes hold their models and contexts: a way that fitted
                    # alone may not fit beside them
                    notes[way] = f"out of memory beside the {size} processes"
                    del steps[way], samples[way]
                    torch.cuda.empty_cache()
            if ws:
                _device_used(device)  # hand the cache of this process's ways to the processes
                start = time.monotonic() + lead
                end = start + window
                for conn, _ in ws:
                    conn.send(("run", start, end))
                time.sleep(max(0.0, end - time.monotonic()))
                try:
                    done = [_recv(conn, proc, 120 + 20 * lead)[1] for conn, proc in ws]
                except WorkerFailed as exc:
                    if not exc.oom:
                        raise
                    notes["concurrent"] = f"out of memory with {size} processes"
                    stack.close()
                    ws, concurrent = [], []
                    continue
                concurrent.append(sum(done) / window)
    result: dict[str, Any] = {way: None for way in ARMS if way in arms}
    for way, ts in samples.items():
        result[way] = size * batch / statistics.median(ts)
    if concurrent:
        result["concurrent"] = statistics.median(concurrent)
    others = [
        ("serial", [size * batch / t for t in samples.get("serial", [])]),
        ("concurrent", concurrent),
        ("ideal", [size * batch / t for t in samples.get("ideal", [])]),
        ("hand", [size * batch / t for t in samples.get("hand", [])]),
    ]
    for way in PATHS.values():
        if way not in samples:
            continue
        fused_rates = [size * batch / t for t in samples[way]]
        for other, rates in others:
            if rates:
                result[f"{way}/{other} rounds"] = [
                    f / o for f, o in zip(fused_rates, rates, strict=True)
                ]
    if samples.get("hand") and samples.get("ideal"):
        result["hand/ideal rounds"] = [
            i / h for h, i in zip(samples["hand"], samples["ideal"], strict=True)
        ]
    result["memory"] = memory
    result["window_s"] = window if concurrent else None
    if notes:
        result["notes"] = notes
    return result


# --------------------------------------------------------------------------------------------
# output


def _ratio(row: dict, key: str) -> str:
    rounds = row.get(f"{key} rounds")
    if not rounds:
        return "-"
    return f"{statistics.median(rounds):.2f} ({min(rounds):.2f}-{max(rounds):.2f})"


#: what the hand-written version of a model does (``_hand_written.py``) where ideal does one op
HAND: dict[str, str] = {
    "tiny_mlp": "B small batched products (bmm) per layer, against one product over B times the "
    "rows",
    "small_cnn": "each convolution one over B * C channels, grouped, against one over B times "
    "the batch; the Linear layers as batched products",
}
HAND["medium_mlp"] = HAND["tiny_mlp"]


def below_ideal_reason(row: dict, way: str) -> str:
    """Why the fused way ``way`` of ``row`` stays below 0.9 of ideal, from this run's numbers:
    how far the hand-written version (no engine at all) is from ideal, and how far the engine
    is from it; empty at 0.9 or above, "not measured" for a model without a hand-written one."""
    rounds = row.get(f"{way}/ideal rounds")
    if not rounds or statistics.median(rounds) >= 0.9:
        return ""
    hand_ideal = row.get("hand/ideal rounds")
    by_hand = row.get(f"{way}/hand rounds")
    if hand_ideal and by_hand:
        return (
            f"the hand-written version reaches {statistics.median(hand_ideal):.2f} of ideal "
            f"({HAND.get(row['model'], 'no engine')}); this path reaches "
            f"{statistics.median(by_hand):.2f} of it"
        )
    return "not measured"


def _rate(row: dict, key: str) -> str:
    value = row.get(key)
    if value is None:
        note = row.get("notes", {}).get(key, "")
        return "OOM" if "memory" in note else "-"
    return f"{value:.0f}"


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**20:,.1f}"


def memory_summary(row: dict) -> dict[str, float | None]:
    """The memory row of the table: the fused process against the sum over B processes."""
    fused, procs = row["memory"]["fused"], row["memory"]["processes"]

    def total(key: str) -> float | None:
        if not procs or any(p.get(key) is None for p in procs):
            return None
        return float(sum(p[key] for p in procs))

    def one(key: str) -> float | None:
        return None if fused is None or fused.get(key) is None else float(fused[key])

    context = one("cuda_context")
    return {
        "fused tensors": one("tensor_peak"),
        "processes tensors": total("tensor_peak"),
        "fused reserved": one("reserved_peak"),
        "processes reserved": total("reserved_peak"),
        "fused rss": one("rss_peak"),
        "processes rss": total("rss_peak"),
        "fused anon base": one("anon_base"),
        "processes anon base": total("anon_base"),
        "fused context": one("cuda_context"),
        # a context is the same size in every process: measured once, where it can be isolated
        "processes context": None if not procs or context is None else len(procs) * context,
    }


def _div(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}"


def plot(rows: list[dict], stem: Path, title: str) -> list[Path]:
    """Write ``<stem>_throughput.png`` (member-samples/s against B, one panel per model, one line
    per way, log y) and ``<stem>_memory.png`` (peak memory against B: the fused process against
    B processes). Uses matplotlib's Agg canvas, imported here only; none installed: no plots."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        print("matplotlib is not installed: no plots (pip install matplotlib)")
        return []
    models = list(dict.fromkeys(r["model"] for r in rows))
    styles = {
        "serial": ("tab:gray", "o-"),
        "concurrent": ("tab:orange", "s-"),
        "fused": ("tab:blue", "D-"),
        "trainer": ("tab:purple", "v-"),
        "ideal": ("black", ":"),
        "hand": ("tab:green", "^--"),
    }
    paths = []
    for kind in ("throughput", "memory"):
        cols = min(3, len(models))
        nrows = math.ceil(len(models) / cols)
        fig = Figure(figsize=(4.6 * cols, 3.6 * nrows + 0.4), layout="constrained")
        FigureCanvasAgg(fig)
        axes = fig.subplots(nrows, cols, squeeze=False).flatten()
        for ax in axes[len(models) :]:
            ax.set_visible(False)
        for ax, model in zip(axes, models, strict=False):
            mine = [r for r in rows if r["model"] == model]
            if kind == "throughput":
                for way, (color, style) in styles.items():
                    pts = [(r["B"], r[way]) for r in mine if r.get(way)]
                    if pts:
                        ax.plot(*zip(*pts, strict=True), style, color=color, label=way)
                ax.set_ylabel("member-samples/s")
            else:
                lines = [
                    ("fused tensors", "tab:blue", "D-", "fused: tensors"),
                    ("processes tensors", "tab:orange", "s-", "B processes: tensors"),
                    ("fused rss", "tab:blue", "D--", "fused: peak RSS"),
                    ("processes rss", "tab:orange", "s--", "B processes: peak RSS"),
                    ("fused context", "tab:blue", ":", "fused: CUDA context"),
                    ("processes context", "tab:orange", ":", "B processes: CUDA contexts"),
                    ("processes anon base", "tab:red", "x:", "B processes: runtimes alone"),
                ]
                for key, color, style, label in lines:
                    pts = [(r["B"], memory_summary(r)[key]) for r in mine]
                    pts = [(b, v / 2**20) for b, v in pts if v]
                    if pts:
                        ax.plot(*zip(*pts, strict=True), style, color=color, label=label)
                ax.set_ylabel("peak memory (MiB)")
            ax.set_xscale("log", base=2)
            sizes = sorted({r["B"] for r in mine})
            ax.set_xticks(sizes, [str(b) for b in sizes])
            ax.minorticks_off()
            ax.set_yscale("log")
            ax.set_xlabel("B (models)")
            ax.set_title(f"{model}, batch {mine[0]['batch']}", fontsize=10)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7, loc="best")
        fig.suptitle(title, fontsize=10)
        path = stem.with_name(f"{stem.name}_{kind}.png")
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
        paths.append(path)
        print(f"wrote {path}")
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--models",
        nargs="+",
        default=None,
        choices=list(MODELS),
        help="default: all but lora_bert; on a CPU also not resnet18",
    )
    parser.add_argument("--sizes", nargs="+", type=int, default=None, help="default 1 2 ... 32")
    parser.add_argument(
        "--batch", type=int, default=None, help="per member; default per model (64, resnet18 128)"
    )
    parser.add_argument("--rounds", type=int, default=None, help="default 5")
    parser.add_argument("--min-time", type=float, default=None, help="seconds per timed round")
    parser.add_argument(
        "--max-processes",
        type=int,
        default=32,
        help="largest B the concurrent way runs (each process holds a whole framework runtime)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: B 1 2, one short round, one warm-up step"
    )
    parser.add_argument("--out", type=Path, default=None, help="results file stem")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        retain_freed_memory()
    models = args.models or [
        m for m in MODELS if m != "lora_bert" and (device.type == "cuda" or m != "resnet18")
    ]
    sizes = args.sizes or ([1, 2] if args.quick else [1, 2, 4, 8, 16, 32])
    rounds = args.rounds or (1 if args.quick else 5)
    min_time = args.min_time or (0.02 if args.quick else 0.2)
    warmup = 1 if args.quick else 3
    total_threads = torch.get_num_threads()
    stem = args.out or RESULTS / f"fusion_throughput_{device.type}"
    rows = []
    print(
        f"{'model':12s} {'B':>3s} {'path':7s} {'serial':>10s} {'concurrent':>10s} {'fused':>10s} "
        f"{'ideal':>10s} {'hand':>10s} {'fused/serial':>18s} {'fused/concurrent':>18s} "
        f"{'fused/ideal':>18s} {'fused/hand':>18s}",
        flush=True,
    )
    for name in models:
        batch = args.batch or MODELS[name].batch
        for size in sizes:
            threads = max(1, total_threads // size)
            r = measure(
                name,
                size,
                batch,
                device,
                rounds,
                min_time,
                processes=size <= args.max_processes,
                threads=threads,
                warmup=warmup,
            )
            row = {"model": name, "B": size, "batch": batch, "threads per process": threads, **r}
            rows.append(row)
            mem = memory_summary(row)
            for path, way in PATHS.items():
                print(
                    f"{name:12s} {size:3d} {path:7s} {_rate(row, 'serial'):>10s} "
                    f"{_rate(row, 'concurrent'):>10s} {_rate(row, way):>10s} "
                    f"{_rate(row, 'ideal'):>10s} {_rate(row, 'hand'):>10s} "
                    f"{_ratio(row, f'{way}/serial'):>18s} "
                    f"{_ratio(row, f'{way}/concurrent'):>18s} "
                    f"{_ratio(row, f'{way}/ideal'):>18s} {_ratio(row, f'{way}/hand'):>18s}",
                    flush=True,
                )
            print(
                f"{'':16s} memory MiB: tensors fused {_mib(mem['fused tensors'])} vs "
                f"{size} processes {_mib(mem['processes tensors'])}; peak RSS fused "
                f"{_mib(mem['fused rss'])} vs {_mib(mem['processes rss'])}",
                flush=True,
            )
    cuda = device.type == "cuda"
    about = ", ".join(
        f"`{n}` {MODELS[n].about} (batch {args.batch or MODELS[n].batch})" for n in models
    )
    threads_note = (
        f"each gets `torch.set_num_threads(max(1, {total_threads} // B))` threads, "
        f"{total_threads} being this process's torch threads, which the in-process ways use "
        "(Ray sets `OMP_NUM_THREADS=max(1, floor(num_cpus))` for a task with `num_cpus=T/B`)"
    )
    notes = [
        f"- models: {about}",
        f"- one step = forward + backward + SGD update, the batch per member above; median of "
        f"{rounds} interleaved rounds"
        + (" (`--quick`: a smoke run, not a measurement)" if args.quick else ""),
        f"- `concurrent`: B spawned processes training at once on the same "
        f"{'GPU (time-sliced, no MPS)' if cuda else 'CPU'}; {threads_note}. Its rate is the "
        "samples all processes completed inside one common timed window over the window's "
        "length, start-up and warm-up excluded",
        "- two rows per model and B, one per fused path, timed in the same rounds as the other "
        "ways (whose columns the two rows share): `plain` is the `nn.Module` that `hs.fuse` "
        "returns in a user's loop (`hs.member_losses(...).sum().backward()`, one "
        "`torch.optim.SGD` over `array.parameters()`); `trainer` is the fused step of "
        "`hs.ArrayTrainer` / `hfsweep run` (`hfsweep.training.step.backward` and `update`: the "
        "task's per-member loss, `hs.optim.SGD` with per-member learning rates and its "
        "non-finite check, the losses' running sum), its arguments captured from a trainer run",
        "",
        "Member-samples/s, median over rounds (higher is better). `hand` is the model written",
        "by hand as one (`_hand_written.py`; the MLPs and the CNN): one `baddbmm` per Linear,",
        "each convolution one convolution over B * C channels (what the engine must match",
        "without being written). The ratios are the median of the per-round ratios, with their range across",
        "rounds in parentheses: that range is how much this machine's speed moved while the",
        "ways ran side by side.",
    ]
    tensor_how = (
        "the CUDA allocator's `max_memory_allocated` (reserved: `max_memory_reserved`)"
        if cuda
        else "the peak of live tensor bytes followed op by op (the profiler's CPU tracker)"
    )
    mem_columns = ["model", "B", "fused tensors", "B procs tensors", "procs / fused"]
    if cuda:
        mem_columns += ["fused reserved", "B procs reserved", "fused context", "B procs contexts"]
    mem_columns += ["fused peak RSS", "B procs peak RSS", "B procs runtimes (anon at start)"]
    mem_cells = []
    for row in rows:
        m = memory_summary(row)
        cells = [
            row["model"],
            str(row["B"]),
            _mib(m["fused tensors"]),
            _mib(m["processes tensors"]),
            _div(m["processes tensors"], m["fused tensors"]),
        ]
        if cuda:
            cells += [
                _mib(m["fused reserved"]),
                _mib(m["processes reserved"]),
                _mib(m["fused context"]),
                _mib(m["processes context"]),
            ]
        cells += [_mib(m["fused rss"]), _mib(m["processes rss"]), _mib(m["processes anon base"])]
        mem_cells.append(cells)
    skipped = [
        f"- {row['model']} B={row['B']}: {way}: {note}"
        for row in rows
        for way, note in row.get("notes", {}).items()
    ]
    outside = (
        " 'context' is the device memory a process uses outside the allocator (CUDA context, "
        "kernels loaded, library handles), measured in the fused array's process, which starts "
        "alone beside this idle one (the GPU must be otherwise unused); B processes pay it B "
        "times."
    )
    after = [
        *(["", "Not measured:", "", *skipped] if skipped else []),
        "",
        "## Peak memory (MiB): one process training the fused array vs B processes",
        "",
        "Each measured in a fresh spawned process over one training step after warm-up (the "
        f"B processes are those of `concurrent`): tensors are {tensor_how}. Peak RSS is the "
        "process's `getrusage` maximum resident set; it counts the shared library code in "
        "every process, so its sum over B processes overstates their joint footprint. "
        "'Runtimes' is the sum over the B processes of each one's private (anonymous) memory "
        "once torch is imported and a first optimizer built, before its model exists: what "
        "every extra process pays for the framework alone." + (outside if cuda else ""),
        "",
        *markdown_table(mem_columns, mem_cells),
    ]
    write_results(
        stem,
        "fusion_throughput.py",
        argv,
        device,
        "Training throughput: serial vs concurrent processes vs fused vs ideal batching",
        notes,
        [
            "model",
            "B",
            "path",
            "serial",
            "concurrent",
            "fused",
            "ideal",
            "hand",
            "fused / serial",
            "fused / concurrent",
            "fused / ideal",
            "fused / hand",
            "why below 0.9 of ideal (measured)",
        ],
        [
            [
                row["model"],
                str(row["B"]),
                path,
                _rate(row, "serial"),
                _rate(row, "concurrent"),
                _rate(row, way),
                _rate(row, "ideal"),
                _rate(row, "hand"),
                *(_ratio(row, f"{way}/{w}") for w in ("serial", "concurrent", "ideal", "hand")),
                below_ideal_reason(row, way),
            ]
            for row in rows
            for path, way in PATHS.items()
            if row.get(way) is not None or way == "fused"
        ],
        rows,
        after=after,
    )
    plot(rows, stem, machine(device))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
