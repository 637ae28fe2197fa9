"""Two offloaded arrays stepped together with their shards alternating, against each stepped
alone with prefetch, with an injected transfer delay (CPU).

As in ``offload_pipeline.py``, every shard fetch sleeps ``delay`` seconds in the transfer's
background thread, standing in for a slow link. Array *a* trains on a small batch, so its
shards wait on their fetches (transfer-bound); array *b*, the same architecture on a large
batch, waits on its compute (compute-bound). Alone with prefetch, each hides what it can of
its own fetches: its step takes about the sum over its shards of the larger of fetch and
compute, so the two steps one after another take about a's transfers plus b's compute.
Alternated (``hfsweep.offload.AlternatingArrays``: one transfer thread, one ledger, a's shard k
computing while b's is copied in and the other way round), the two together should take about
the larger of the sum of both arrays' transfers and the sum of both arrays' computes.

Three schedules of the alternated step (``AlternatingArrays.step``): ``lockstep`` (both
forwards, then both backwards), ``shifted`` with b first (a's step starts once b is in its
backward: b's backward compute against a's forward fetches; a first, measured worse in
``results/offload_alternate_cpu_run2.md``, is no longer timed) and ``ready`` (both steps at
once, each turn to an array whose next shard is in), the last also with deeper prefetch
(``--depths A,B ...``: ``prefetch_depth=(A, B)``, by default 3,1 and 2,2): with a deeper, the
one transfer may copy several of a's shards in while b computes one, and a then takes
several turns in a row; the 2,2 arm gives b a shard of slack too. With ``--urgent``, each
ready arm is timed again with b's fetches urgent (``urgent=(1,)``: ahead of a's not started
on the one transfer, so a's deeper prefetch fills the link's gaps instead of queueing ahead
of b's next shard), its queue model on the two-class link beside it.

Each round times, alternating: a and b without delay (their computes), a and b alone with
the delay and prefetch, and the two alternated with the delay under each arm. The
delay is a factor times the delay at which the sum of transfers equals the sum of computes
(measured first), where alternation has the most to gain. A step is a forward and backward (the optimizer step, on
the host, left out).

    python benchmarks/offload_alternate.py --rounds 3 --threads 1
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
from pathlib import Path

import torch
from _offload import median_step
from _queue_model import queue_model
from _results import RESULTS, write_results
from torch import nn

import hfsweep as hs
from hfsweep.offload import AlternatingArrays, CpuTransfer, OffloadedArray
from hfsweep.offload._alternate import Schedule


def _array(layers: int, width: int, size: int) -> hs.FusedArray:
    torch.manual_seed(0)
    models = [nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]) for _ in range(size)]
    return hs.fuse(models, share_frozen=False)


class _Alone:
    """One array offloaded on its own, one layer per shard."""

    def __init__(self, array: hs.FusedArray, delay: float, layer: int, x: torch.Tensor) -> None:
        self.array = copy.deepcopy(array)
        self.engine = OffloadedArray(self.array, transfer=CpuTransfer(delay), shard_bytes=layer)
        self.x = x

    def step(self) -> None:
        self.engine(self.x).square().mean().backward()
        for p in self.array.parameters():
            p.grad = None

    def forward(self) -> None:
        with torch.no_grad():
            self.engine(self.x)

    def close(self) -> None:
        self.engine.close()


def _square_mean(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


class _Together:
    """The arrays alternated under ``schedule``, in the order of ``xs``, each with its
    ``depths`` of prefetch: one transfer, one ledger."""

    def __init__(
        self,
        array: hs.FusedArray,
        delay: float,
        layer: int,
        xs: list[torch.Tensor],
        schedule: Schedule,
        depths: tuple[int, ...] | int = 1,
        urgent: tuple[int, ...] = (),
    ) -> None:
        self.arrays = [copy.deepcopy(array) for _ in xs]
        self.alt = AlternatingArrays(
            self.arrays,
            transfer=CpuTransfer(delay),
            shard_bytes=layer,
            schedule=schedule,
            prefetch_depth=depths,
            urgent=urgent,
        )
        self.xs = xs

    def step(self) -> None:
        self.alt.step(self.xs, [_square_mean] * len(self.xs))
        for a in self.arrays:
            for p in a.parameters():
                p.grad = None

    def close(self) -> None:
        self.alt.close()


def _shifted_phases(
    n: int, delay: float, forward_1: float, backward_1: float, forward_2: float, backward_2: float
) -> float:
    """The shifted schedule's phase model (seconds) for arrays of ``n`` shards, the first
    array's forward and backward computes ``forward_1``, ``backward_1`` and the second's:
    three stretches, each the larger of its fetches and its computes. The first's forward
    runs alone (n fetches); its backward (n - 1 fetches) against the second's forward (n);
    then the second's backward alone (n - 1). The backward's compute is the no-delay step's
    less the forward's (the forward without autograd)."""
    return (
        max(n * delay, forward_1)
        + max((2 * n - 1) * delay, backward_1 + forward_2)
        + max((n - 1) * delay, backward_2)
    )


def _lockstep_turns(n: int, delay: float, forwards: float, backwards: float) -> float:
    """The lockstep's turn model (seconds): ``n`` forward rounds, each waiting on both
    arrays' fetches (two delays) or their computes (``forwards`` over ``n``); the first
    backward round (its shards kept from the forward) only computes; ``n - 1`` backward
    rounds, each two delays or ``backwards`` over ``n``."""
    return (
        n * max(2 * delay, forwards / n) + backwards / n + (n - 1) * max(2 * delay, backwards / n)
    )


def _shifted_turns(
    n: int, delay: float, forward_1: float, backward_1: float, forward_2: float, backward_2: float
) -> float:
    """The shifted schedule's turn model (seconds), the first array's forward and backward
    computes ``forward_1``, ``backward_1``, then the second's: the first's ``n`` forward
    rounds alone (one delay or a shard's compute); its first backward round (kept shard;
    the second's first turn only starts a fetch); ``n - 1`` rounds of its backward against
    the second's forward (two delays, or both shards' computes); the second's last forward
    shard alone; its first backward round; ``n - 1`` rounds of its backward alone."""
    return (
        n * max(delay, forward_1 / n)
        + backward_1 / n
        + (n - 1) * max(2 * delay, (backward_1 + forward_2) / n)
        + max(delay, forward_2 / n)
        + backward_2 / n
        + (n - 1) * max(delay, backward_2 / n)
    )


def _pair(text: str) -> tuple[int, int]:
    """``"A,B"`` as the two arrays' prefetch depths."""
    a, b = (int(v) for v in text.split(","))
    return a, b


def _deep(depths: tuple[int, int]) -> str:
    """The name of the ready arm with ``depths``."""
    return f"ready {depths[0]},{depths[1]}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--size", type=int, default=4, help="array size B of each array")
    parser.add_argument("--batch-a", type=int, default=8, help="array a's batch (small)")
    parser.add_argument("--batch-b", type=int, default=1024, help="array b's batch (large)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per arm and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--factors", type=float, nargs="+", default=[0.5, 0.75, 1.0, 1.5])
    parser.add_argument(
        "--depths",
        type=_pair,
        nargs="+",
        default=[(3, 1), (2, 2)],
        help="a's and b's prefetch depths (A,B) of each deeper 'ready' arm",
    )
    parser.add_argument(
        "--urgent",
        action="store_true",
        help="also time each ready arm with b's fetches urgent on the link (urgent=(1,))",
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's own)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "offload_alternate_cpu")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    n = args.layers
    array = _array(n, args.width, args.size)
    layer = args.size * (args.width * args.width + args.width) * 4
    xs = [torch.randn(args.batch_a, args.width), torch.randn(args.batch_b, args.width)]
    fetches = 2 * (2 * n - 1)  # per array: n in the forward, n - 1 in the backward
    # the ready arms timed again with b's fetches urgent (None: depth 1)
    urgent_depths: list[tuple[int, int] | None] = [None, *args.depths] if args.urgent else []
    urgent_arms = [f"{_deep(ds) if ds else 'ready'} b urgent" for ds in urgent_depths]

    # the computes, to set the delays (measured again in every round)
    plain = [_Alone(array, 0.0, layer, x) for x in xs]
    for p in plain:
        assert len(p.engine.shards) == n
        p.step()
    calibration = max(5, args.steps)  # the delays rest on it: more steps than a round's
    balanced = sum(median_step(p.step, calibration) for p in plain) / fetches
    for p in plain:
        p.close()

    load = [os.getloadavg()]
    rows, cells = [], []
    for factor in args.factors:
        delay = factor * balanced
        arms: dict[str, _Alone | _Together] = {
            "compute a": _Alone(array, 0.0, layer, xs[0]),
            "compute b": _Alone(array, 0.0, layer, xs[1]),
            "alone a": _Alone(array, delay, layer, xs[0]),
            "alone b": _Alone(array, delay, layer, xs[1]),
            "lockstep": _Together(array, delay, layer, xs, "lockstep"),
            "shifted b first": _Together(array, delay, layer, xs[::-1], "shifted"),
            "ready": _Together(array, delay, layer, xs, "ready"),
            **{_deep(ds): _Together(array, delay, layer, xs, "ready", ds) for ds in args.depths},
            **{
                f"{_deep(ds) if ds else 'ready'} b urgent": _Together(
                    array, delay, layer, xs, "ready", ds or 1, (1,)
                )
                for ds in urgent_depths
            },
        }
        for arm in arms.values():
            arm.step()  # warm-up (traces)
        times: dict[str, list[float]] = {name: [] for name in [*arms, "forward a", "forward b"]}
        for _ in range(args.rounds):
            for name, arm in arms.items():
                times[name].append(median_step(arm.step, args.steps))
                if name.startswith("compute") and isinstance(arm, _Alone):
                    times[f"forward {name[-1]}"].append(median_step(arm.forward, args.steps))
        for arm in arms.values():
            arm.close()
        load.append(os.getloadavg())
        t = {name: statistics.median(v) for name, v in times.items()}
        computes = t["compute a"] + t["compute b"]
        transfers = fetches * delay
        alone = t["alone a"] + t["alone b"]
        # the arrays alternate in lockstep: both forwards, then both backwards; per phase the
        # larger of its transfers and its computes (the backward's: the step's less the
        # forward's, without an autograd graph)
        forwards = t["forward a"] + t["forward b"]
        phases = max(2 * n * delay, forwards) + max(
            2 * (n - 1) * delay, max(computes - forwards, 0.0)
        )
        fa, fb = t["forward a"], t["forward b"]
        ba, bb = max(t["compute a"] - fa, 0.0), max(t["compute b"] - fb, 0.0)
        shifted_b = _shifted_phases(n, delay, fb, bb, fa, ba)
        turns = {
            "lockstep": _lockstep_turns(n, delay, fa + fb, ba + bb),
            "shifted b first": _shifted_turns(n, delay, fb, bb, fa, ba),
        }
        bound = max(computes, transfers)
        # the queue model per arm, from each array's forward and backward per shard
        per_a, per_b = (fa / n, ba / n), (fb / n, bb / n)
        queue = {
            "lockstep": queue_model("lockstep", n, delay, [per_a, per_b]),
            "shifted b first": queue_model("shifted", n, delay, [per_b, per_a]),
            "ready": queue_model("ready", n, delay, [per_a, per_b]),
            **{_deep(ds): queue_model("ready", n, delay, [per_a, per_b], ds) for ds in args.depths},
            **{
                name: queue_model("ready", n, delay, [per_a, per_b], ds, urgent={1})
                for name, ds in zip(urgent_arms, urgent_depths, strict=True)
            },
        }
        row = {
            "factor": factor,
            "delay_ms": delay * 1e3,
            "compute_a_ms": t["compute a"] * 1e3,
            "compute_b_ms": t["compute b"] * 1e3,
            "sum_of_computes_ms": computes * 1e3,
            "sum_of_transfers_ms": transfers * 1e3,
            "max_model_ms": max(computes, transfers) * 1e3,
            "forward_a_ms": t["forward a"] * 1e3,
            "forward_b_ms": t["forward b"] * 1e3,
            "phase_model_ms": phases * 1e3,
            "alone_a_ms": t["alone a"] * 1e3,
            "alone_b_ms": t["alone b"] * 1e3,
            "alone_sum_ms": alone * 1e3,
            "lockstep_ms": t["lockstep"] * 1e3,
            "lockstep/alone": t["lockstep"] / alone,
            "turn_model_lockstep_ms": turns["lockstep"] * 1e3,
            "lockstep/max_model": t["lockstep"] / bound,
            "turn_model_shifted_b_first_ms": turns["shifted b first"] * 1e3,
            "shifted_phase_model_b_first_ms": shifted_b * 1e3,
            "shifted_b_first_ms": t["shifted b first"] * 1e3,
            "shifted_b_first/lockstep": t["shifted b first"] / t["lockstep"],
            "ready_ms": t["ready"] * 1e3,
            "ready/lockstep": t["ready"] / t["lockstep"],
            "ready/max_model": t["ready"] / bound,
            **{f"{_deep(ds).replace(' ', '_')}_ms": t[_deep(ds)] * 1e3 for ds in args.depths},
            **{
                f"{_deep(ds).replace(' ', '_')}/lockstep": t[_deep(ds)] / t["lockstep"]
                for ds in args.depths
            },
            **{
                f"{_deep(ds).replace(' ', '_')}/max_model": t[_deep(ds)] / bound
                for ds in args.depths
            },
            **{
                key: value
                for arm in urgent_arms
                for key, value in (
                    (f"{arm.replace(' ', '_')}_ms", t[arm] * 1e3),
                    (f"{arm.replace(' ', '_')}/lockstep", t[arm] / t["lockstep"]),
                    (f"{arm.replace(' ', '_')}/max_model", t[arm] / bound),
                )
            },
            "queue_model_ms": {k: v * 1e3 for k, v in queue.items()},
            "ranges_ms": {k: [min(v) * 1e3, max(v) * 1e3] for k, v in times.items()},
        }
        rows.append(row)
        cells.append(
            [
                f"{factor:g}",
                f"{delay * 1e3:.1f}",
                f"{t['compute a'] * 1e3:.0f}",
                f"{t['compute b'] * 1e3:.0f}",
                f"{transfers * 1e3:.0f}",
                f"{bound * 1e3:.0f}",
                f"{alone * 1e3:.0f}",
                f"{queue['lockstep'] * 1e3:.0f}",
                f"{t['lockstep'] * 1e3:.0f}",
                f"{t['lockstep'] / alone:.2f}",
                f"{t['lockstep'] / bound:.2f}",
                *[
                    cell
                    for arm in ["shifted b first", "ready", *map(_deep, args.depths), *urgent_arms]
                    for cell in (
                        f"{queue[arm] * 1e3:.0f}",
                        f"{t[arm] * 1e3:.0f}",
                        f"{t[arm] / t['lockstep']:.2f}",
                        f"{t[arm] / bound:.2f}",
                    )
                ],
            ]
        )
    notes = [
        f"- two arrays of {n} x Linear({args.width}, {args.width}), one layer per shard, B = "
        f"{args.size} each, float32, {torch.get_num_threads()} torch threads; a on a batch of {args.batch_a} (transfer-bound), b on "
        f"{args.batch_b} (compute-bound)",
        f"- delay per fetch: the factor times {balanced * 1e3:.1f} ms, where the sum of both "
        f"arrays' transfers ({fetches} fetches a step together: per array {n} in the forward, "
        f"{n - 1} in the backward) equals the sum of their computes as measured first",
        "- compute a, b: each alone without delay; sum of transfers: fetches x delay; max "
        "model: the larger of the sum of transfers and the sum of computes (a + b); alone: "
        "each with the delay and prefetch, one after the other (their sum); lockstep, "
        "shifted, ready: both stepped together by AlternatingArrays.step with one delayed "
        "transfer, schedule 'lockstep' (a's and b's forwards, then their backwards), "
        "'shifted' (b first: a's step starts once b is in its backward) or 'ready' (both "
        "steps at once, each turn to an array whose next shard is in, else to the one whose "
        "fetch started first), each array one shard fetched ahead; 'ready A,B': the ready "
        "schedule with a fetching A shards ahead and b B (prefetch_depth=(A, B)); '... b urgent': "
        "the same arm with b's fetches urgent on the link (urgent=(1,): taken before a's not "
        "started, a copy under way not interrupted)",
        f"- phase model: the arrays alternate in lockstep (both forwards, then both "
        f"backwards), so per phase the larger of its transfers ({2 * n} fetches in the "
        f"forward, {2 * (n - 1)} in the backward) and its computes (the forward: each array's "
        "forward without autograd, timed in the rounds; the backward: the no-delay steps less "
        "those forwards), added up",
        "- phase model shifted (in the JSON, b first): b's forward alone, max(n fetches, b's "
        "forward), then b's backward against a's forward, max(2n - 1 fetches, b's backward + "
        "a's forward), then a's backward alone, max(n - 1 fetches, a's backward), added up",
        "- turn model: the schedule as it runs, one shard per array per round of turns, each "
        "array with one fetch in flight (the next shard's, started when its shard starts "
        "computing); per round the larger of the delays of the fetches its shards wait for "
        "(one per array computing, none for the backward's first shard, kept from the "
        "forward) and the computes of its shards (each array's forward or backward over "
        f"its {n} shards), added up: a round in which both arrays fetch takes two delays "
        "however little the transfer-bound array computes",
        "- queue model (benchmarks/_queue_model.py): the arm's turns and fetches replayed on "
        "one clock, the link one first-in-first-out queue (each fetch a delay, started once "
        "the link is free and the turns have asked for it), the compute one thread (each "
        "array's forward or backward over its shards, as timed in the rounds): what the "
        "order of turns and fetches costs, copies and overheads left out; for the 'b urgent' arms "
        "the link is a two-class queue (b's fetches asked for by then first, else a's)",
        "- alone a, b (each alone with the delay), the lockstep's phase and turn models and "
        "the shifted schedule's are in the JSON",
        f"- medians of {args.steps} steps per arm and round, {args.rounds} alternating rounds; "
        "a step is forward and backward (no optimizer step)",
        "- load average (1, 5, 15 min) before and after each factor: "
        + "; ".join(", ".join(f"{v:.1f}" for v in la) for la in load)
        + " (other jobs shared the 2 cores: compute times are noisy, the injected delays are "
        "not)",
        "- on a CPU a transfer is a copy in one memory: the delay stands in for a link",
    ]
    columns = [
        "factor",
        "delay ms",
        "compute a ms",
        "compute b ms",
        "sum of transfers ms",
        "max model ms",
        "alone a + b ms",
        "lockstep: queue model ms",
        "measured ms",
        "/ alone",
        "/ max model",
        *[
            cell
            for arm in ["shifted b first", "ready", *map(_deep, args.depths), *urgent_arms]
            for cell in (f"{arm}: queue model ms", "measured ms", "/ lockstep", "/ max model")
        ],
    ]
    write_results(
        args.out,
        "offload_alternate.py",
        argv,
        torch.device("cpu"),
        "Offload: two arrays' shards alternated (lockstep, shifted, ready, ready with a deeper prefetch) against each alone with prefetch (CPU)",
        notes,
        columns,
        cells,
        rows,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
