"""An offloaded LoRA fine-tuning array of a transformers BERT classifier, cut between its
encoder blocks against the encoder as one layer call.

``torch.fx`` cannot trace transformers' ``BertModel``, so offload's graph cut keeps the whole
encoder in one shard (``cut="graph"``); the engine can instead run the model's own forward and
stream the encoder's blocks, the embeddings, the pooler and the head (``cut="blocks"``, what
``auto`` does where the encoder is over the shard limit), each unit a shard of its own (a
shard limit below every unit: what a tight budget gives, and all the engine did before it
grouped units) or consecutive units grouped into shards up to the limit (without a budget, a
quarter of the array's state, as for the graph cut). Side by side, in alternating rounds,
with the array on the device (not offloaded) as a fourth arm: the largest shard (the
smallest shard limit, a quarter of the budget, each way can run within), the shards, the
fetches and the bytes copied to the compute side per training step (a counting
``CpuTransfer``), the
ledger's peak in the forward and the backward, the peak of every live tensor's bytes in a
forward and backward beyond the state (the profiler's CPU measure, which also sees the
activations the ledger leaves out), and a step's median time. Every arm keeps the
frozen BERT weights once (``share_frozen``) and trains B members' LoRA adapters and heads.

On a CPU the "device" and the host are one memory: a transfer is a copy, so the times say
nothing of a GPU's link; shard bytes, bytes copied and ledger peaks are exact.

    python benchmarks/offload_blocks.py
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import statistics
import sys
from pathlib import Path

import torch
from _offload import Counting, median_step
from _results import RESULTS, write_results
from torch import nn

import hfsweep as hs
from hfsweep.offload import OffloadedArray
from hfsweep.sizing.timing import _LiveTensorBytes  # the profiler's CPU peak, op by op


class LoraBert(nn.Module):
    """A BERT classifier (the same frozen "pretrained" weights in every member) with peft LoRA
    on its attention's query and value, and a head of the member's own seed."""

    def __init__(self, seed: int, args: argparse.Namespace) -> None:
        super().__init__()
        import peft
        import transformers

        config = transformers.BertConfig(
            vocab_size=args.vocab,
            hidden_size=args.width,
            num_hidden_layers=args.layers,
            num_attention_heads=args.heads,
            intermediate_size=4 * args.width,
            max_position_embeddings=args.length,
            hidden_dropout_prob=0.1,
            attention_probs_dropout_prob=0.0,
            num_labels=4,
        )
        torch.manual_seed(0)
        base = transformers.BertForSequenceClassification(config)
        torch.manual_seed(seed)
        lora = peft.LoraConfig(
            r=8, lora_alpha=16.0, target_modules=["query", "value"], task_type="SEQ_CLS"
        )
        self.model = peft.get_peft_model(base, lora)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.model(input_ids=ids, attention_mask=(ids != 0).long()).logits
        return logits


class Arm:
    """One way to train the array: ``step()`` runs a training step (forward, backward, AdamW)."""

    def __init__(
        self, models: list[nn.Module], cut: str | None, shard_bytes: int | None = None
    ) -> None:
        self.array = hs.fuse(copy.deepcopy(models))
        self.transfer = Counting()
        self.engine = (
            None
            if cut is None
            else OffloadedArray(
                self.array, transfer=self.transfer, cut=cut, shard_bytes=shard_bytes
            )
        )
        self.opt = hs.optim.AdamW(self.array, lr=[1e-3] * self.array.size)

    def step(self, ids: torch.Tensor) -> None:
        out = self.array(ids) if self.engine is None else self.engine(ids)
        out.square().mean().backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def _step_peak(arm: Arm, ids: torch.Tensor) -> int:
    """Peak bytes of live tensors during one forward and backward, beyond those alive before
    (the array's state, its optimizer's): on a CPU, where the ledger's shards and kept inputs
    and the activations it does not count (those inside the unit or shard computing) are all
    tensors of one memory, what a step needs beyond the state."""
    before = [*arm.array.state_dict().values(), ids]
    before += [t for st in arm.opt.state.values() for t in st.values() if torch.is_tensor(t)]
    tracker = _LiveTensorBytes(before)
    with tracker:
        out = arm.array(ids) if arm.engine is None else arm.engine(ids)
        out.square().mean().backward()
    arm.opt.zero_grad(set_to_none=True)
    return tracker.peak - _LiveTensorBytes(before).peak


def _mib(n: float) -> str:
    return f"{n / 2**20:.3f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2000)
    parser.add_argument("--length", type=int, default=32)
    parser.add_argument("--size", type=int, default=4, help="array size B")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per arm and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "offload_blocks_cpu")
    args = parser.parse_args(argv)
    models = [LoraBert(i, args) for i in range(args.size)]
    arms = {
        "on the device": Arm(models, None),
        "offloaded, encoder one layer call (graph cut)": Arm(models, "graph"),
        # a limit of one byte, without a budget: every unit over it, a shard of its own
        "offloaded, between blocks, one unit per shard": Arm(models, "blocks", shard_bytes=1),
        "offloaded, between blocks, grouped": Arm(models, "blocks"),
    }
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, args.vocab, (args.batch, args.length), generator=gen)
    ids[:, args.length // 2 :] *= torch.rand(args.batch, 1, generator=gen) < 0.5  # padding
    fetched: dict[str, int] = {}
    fetches: dict[str, int] = {}
    for name, arm in arms.items():
        arm.step(ids)  # warm-up: optimizer state, traces, the order of the units' calls
        before, count = arm.transfer.fetched, arm.transfer.fetches
        arm.step(ids)
        fetched[name] = arm.transfer.fetched - before
        fetches[name] = arm.transfer.fetches - count
    peaks = {name: _step_peak(arm, ids) for name, arm in arms.items()}
    times: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(args.rounds):
        for name, arm in arms.items():
            times[name].append(median_step(functools.partial(arm.step, ids), args.steps))
    rows, cells = [], []
    for name, arm in arms.items():
        step = statistics.median(times[name])
        spread = [min(times[name]), max(times[name])]
        engine = arm.engine
        shards = [] if engine is None else engine.shards
        row = {
            "way": name,
            "step_ms": step * 1e3,
            "step_ms_range": [s * 1e3 for s in spread],
            "shards": len(shards) if engine is not None else None,
            "largest_shard_bytes": max(s.nbytes for s in shards) if shards else None,
            "fetches_per_step": fetches[name] if engine is not None else None,
            "fetched_bytes_per_step": fetched[name] if engine is not None else None,
            "ledger_peak_forward_bytes": engine.ledger.peaks["forward"] if engine else None,
            "ledger_peak_backward_bytes": engine.ledger.peaks["backward"] if engine else None,
            "step_live_peak_bytes": peaks[name],
        }
        rows.append(row)
        dash = engine is None
        cells.append(
            [
                name,
                "-" if dash else str(len(shards)),
                "-" if dash else _mib(row["largest_shard_bytes"]),  # type: ignore[arg-type]
                "-" if dash else str(fetches[name]),
                "-" if dash else _mib(fetched[name]),
                "-" if dash else _mib(row["ledger_peak_forward_bytes"]),  # type: ignore[arg-type]
                "-" if dash else _mib(row["ledger_peak_backward_bytes"]),  # type: ignore[arg-type]
                _mib(peaks[name]),
                f"{step * 1e3:.1f} [{spread[0] * 1e3:.1f}-{spread[1] * 1e3:.1f}]",
            ]
        )
    for arm in arms.values():
        if arm.engine is not None:
            arm.engine.close()
    notes = [
        f"- model: transformers BertForSequenceClassification, {args.layers} layers of width "
        f"{args.width} ({args.heads} heads, feed-forward {4 * args.width}), vocabulary "
        f"{args.vocab}, frozen and kept once; peft LoRA r = 8 on query and value and the "
        f"classifier head per member; B = {args.size}, batch {args.batch} x {args.length} "
        "tokens, float32, AdamW",
        "- no budget (the graph cut's encoder shard is over any budget the blocks need): the "
        "shard limit is a quarter of the array's state, but 1 byte for one unit per shard "
        "(every unit over it, as under a tight budget); the largest shard is the smallest "
        "shard limit, a quarter of the budget, each way runs in",
        "- fetches per step: the copies to the compute side a training step starts, forward "
        "and backward (a shard prefetched counts once), after a warm-up step",
        "- the ledger counts what the engine holds (shards, their gradients, kept inputs), not "
        "the activations inside the unit or shard computing; the step's live peak counts "
        "every tensor a forward and backward make beyond the state (on this CPU one memory), "
        "with the gradients left on the host: the graph cut recomputes the whole encoder at "
        "once in its backward",
        f"- bytes copied in and peaks are of one training step, exact; step times are "
        f"medians of {args.steps} steps per round, {args.rounds} alternating rounds (range over "
        "rounds in brackets)",
        f"- load average while it ran (1, 5, 15 min): "
        f"{', '.join(f'{v:.1f}' for v in os.getloadavg())} (other jobs shared the cores: times "
        "are noisy, bytes are not)",
        "- on a CPU a transfer is a copy in one memory: the times say nothing of a GPU's link",
    ]
    columns = [
        "way",
        "shards",
        "largest shard MiB",
        "fetches per step",
        "MiB copied in per step",
        "ledger peak forward MiB",
        "ledger peak backward MiB",
        "step's live peak MiB",
        "step ms [range]",
    ]
    write_results(
        args.out,
        "offload_blocks.py",
        argv,
        torch.device("cpu"),
        "Offload of a BERT LoRA array: cut between its blocks against one encoder shard (CPU)",
        notes,
        columns,
        cells,
        rows,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
