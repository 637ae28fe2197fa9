"""What a sweep costs besides training: many one-step trials of a tiny model, hfsweep against
plain Optuna with the same sampler and the same kind of storage.

    python benchmarks/bench_bookkeeping.py [--trials 512 2048 8192] [--fusion-size B]
        [--rounds R] [--baseline DIR] [--profile] [--quick] [--out STEM]

Both arms run N trials of one training step each of a 4 -> 2 linear model on 8 samples
(one batch), with Optuna's random sampler (seed 0) and a journal file as storage, so their
wall-clocks differ by the bookkeeping around the step:

- ``plain``: ``optuna.create_study(storage=JournalStorage(JournalFileBackend(file)),
  sampler=RandomSampler(seed=0))`` and ``study.optimize(objective, n_trials=N)``: each trial
  samples ``lr``, builds the model, takes one ``torch.optim.SGD`` step on the batch, evaluates
  the validation accuracy and returns it.
- ``hfsweep``: ``hs.sweep`` of the same space and task with ``searcher: random`` (seed 0), the
  default journal in its run directory, ``scheduler: fifo``, a budget of one epoch (one step)
  and arrays of ``--fusion-size`` members (16): everything a sweep writes (the journal,
  its own state, histories, trials.csv, best.json, checkpoints of the best trials).

- ``baseline`` (with ``--baseline DIR``): the ``hfsweep`` arm run by another hfsweep source
  tree (``DIR`` first on ``PYTHONPATH``; e.g. ``git archive <commit>`` unpacked, with
  ``hfsweep/schedulers`` and ``hfsweep/search_spaces`` linked to its top-level folders): the
  same machine and moment for a before/after comparison.

Every measurement runs in a fresh Python process (after an untimed warm-up sweep of 8 trials
there); its wall-clock is ``time.perf_counter`` around the whole sweep, not the imports. Rounds
interleave the arms and the median round is reported, with ``hfsweep / plain`` per N (the
curve shows how bookkeeping grows with the number of trials). ``--profile`` also runs hfsweep's largest N once
under ``cProfile`` and prints the 25 functions with the most cumulative time. Writes
``results/bench_bookkeeping_<device>.{md,json}``, or ``STEM.{md,json}`` with ``--out``.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import math
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import optuna
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import RESULTS, write_results

import hfsweep as hs
from hfsweep.core.status import FINAL
from hfsweep.tasks import TensorBatches

ARMS = ("plain", "hfsweep", "baseline")
LABELS = {"plain": "plain Optuna", "hfsweep": "hfsweep", "baseline": "hfsweep (baseline tree)"}
SPACE = {"lr": {"type": "float", "low": 1e-3, "high": 0.5, "log": True}}


def _model(config: Mapping[str, Any]) -> nn.Module:
    return nn.Linear(4, 2)


def _data(config: Mapping[str, Any]) -> tuple[TensorBatches, TensorBatches]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, 4, generator=gen)
    y = (x[:, 0] > 0).long()
    return TensorBatches(x[:8], y[:8], 8, shuffle=False), TensorBatches(
        x[8:], y[8:], 8, shuffle=False
    )


TASK = hs.Task(name="tiny", model=_model, data=_data, defaults={"batch_size": 8, "epochs": 1})


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run_plain(trials: int, folder: Path) -> float:
    """Seconds for plain Optuna's ``trials`` one-step trials on a journal file."""
    from optuna.storages.journal import JournalFileBackend

    train, val = _data({})
    (x, y), (vx, vy) = next(iter(train)), next(iter(val))

    def objective(trial: optuna.Trial) -> float:
        lr = trial.suggest_float("lr", 1e-3, 0.5, log=True)
        model = _model({})
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            return float((model(vx).argmax(1) == vy).double().mean())

    start = time.perf_counter()
    storage = optuna.storages.JournalStorage(JournalFileBackend(str(folder / "optuna.journal")))
    study = optuna.create_study(
        storage=storage, sampler=optuna.samplers.RandomSampler(seed=0), direction="maximize"
    )
    study.optimize(objective, n_trials=trials)
    return time.perf_counter() - start


def sweep_config(trials: int, folder: Path, size: int) -> dict[str, Any]:
    return {
        "task": TASK,
        "search_space": SPACE,
        "searcher": {"name": "random"},
        "scheduler": "fifo",
        "budget": {"trials": trials, "epochs": 1},
        "metric": "val_accuracy",
        "mode": "max",
        "fusion": {"size": size, "device": "cpu"},
        "output": str(folder / "run"),
        "seed": 0,
    }


def run_hfsweep(trials: int, folder: Path, size: int) -> float:
    """Seconds for ``hs.sweep`` of ``trials`` one-step trials (its run directory in ``folder``)."""
    config = sweep_config(trials, folder, size)
    start = time.perf_counter()
    result = hs.sweep(config, progress=False)
    wall = time.perf_counter() - start
    done = sum(result.counts.get(s, 0) for s in FINAL)
    if done != trials:
        raise RuntimeError(f"hfsweep finished {done} of {trials} trials: {result.counts}")
    return wall


def profile_hfsweep(trials: int, size: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        config = sweep_config(trials, Path(tmp), size)
        profiler = cProfile.Profile()
        profiler.enable()
        hs.sweep(config, progress=False)
        profiler.disable()
    pstats.Stats(profiler, stream=sys.stderr).sort_stats("cumulative").print_stats(25)


def measure(arm: str, trials: int, size: int, baseline: Path | None) -> float:
    """Seconds of one ``arm`` run of ``trials`` trials, measured in a fresh process."""
    env = dict(os.environ)
    if arm == "baseline":
        assert baseline is not None
        env["PYTHONPATH"] = os.pathsep.join([str(baseline), env.get("PYTHONPATH", "")])
    kind = "plain" if arm == "plain" else "hfsweep"
    out = subprocess.run(
        [sys.executable, __file__, "--one", kind, str(trials), "--fusion-size", str(size)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{arm} at {trials} trials failed:\n{out.stderr[-3000:]}")
    return float(json.loads(out.stdout.strip().splitlines()[-1])["wall_s"])


def one(kind: str, trials: int, size: int) -> None:
    """Run one measurement in this process and print ``{"wall_s": ...}``."""
    with tempfile.TemporaryDirectory() as tmp:  # warm-up: imports, first calls (not timed)
        run_plain(8, Path(tmp)) if kind == "plain" else run_hfsweep(8, Path(tmp), size)
    with tempfile.TemporaryDirectory() as tmp:
        if kind == "plain":
            wall = run_plain(trials, Path(tmp))
        else:
            wall = run_hfsweep(trials, Path(tmp), size)
    print(json.dumps({"wall_s": wall, "hfsweep": hs.__file__}))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--fusion-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--baseline", type=Path, default=None)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 32 and 64 trials")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--one", nargs=2, metavar=("ARM", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
    torch.set_num_threads(1)
    if args.one:
        one(args.one[0], int(args.one[1]), args.fusion_size)
        return 0
    if args.quick:
        args.trials = [32, 64]
    arms = [a for a in ARMS if a != "baseline" or args.baseline is not None]
    rows: list[dict[str, Any]] = []
    for n in args.trials:
        times: dict[str, list[float]] = {arm: [] for arm in arms}
        for r in range(args.rounds):
            for arm in arms if r % 2 == 0 else arms[::-1]:
                wall = measure(arm, n, args.fusion_size, args.baseline)
                times[arm].append(wall)
                log(f"N={n} round {r + 1}: {arm} {wall:.2f} s")
        row: dict[str, Any] = {"trials": n, "rounds": times}
        for arm in arms:
            row[f"{arm}_s"] = statistics.median(times[arm])
            if arm != "plain":
                ratios = [h / p for h, p in zip(times[arm], times["plain"], strict=True)]
                row[f"{arm}/plain"] = statistics.median(ratios)
                row[f"{arm}/plain rounds"] = ratios
        rows.append(row)
    columns = ["trials", *(f"{LABELS[a]} s" for a in arms)]
    columns += [f"{LABELS[a]} / plain" for a in arms if a != "plain"]
    columns += [f"{LABELS[a]} ms/trial" for a in arms]
    cells = [
        [
            str(row["trials"]),
            *(f"{row[f'{a}_s']:.2f}" for a in arms),
            *(_ratio(row[f"{a}/plain rounds"]) for a in arms if a != "plain"),
            *(f"{1e3 * row[f'{a}_s'] / row['trials']:.2f}" for a in arms),
        ]
        for row in rows
    ]
    print("  ".join(columns))
    for line in cells:
        print("  ".join(c.rjust(12) for c in line))
    stem = args.out or RESULTS / "bench_bookkeeping_cpu"
    write_results(
        stem,
        "bench_bookkeeping.py",
        argv,
        torch.device("cpu"),
        "Bookkeeping: many one-step trials, hfsweep vs plain Optuna",
        [
            f"- {args.rounds} round(s), median; one training step per trial of a 4 -> 2 linear "
            f"model, random sampler (seed 0), journal file storage; hfsweep arrays of "
            f"{args.fusion_size}, scheduler fifo; each measurement in a fresh process",
            *([f"- baseline tree: `{args.baseline}`"] if args.baseline is not None else []),
        ],
        columns,
        cells,
        rows,
    )
    if args.profile:
        profile_hfsweep(max(args.trials), args.fusion_size)
    return 0 if all(math.isfinite(r["hfsweep/plain"]) for r in rows) else 1


def _ratio(rounds: list[float]) -> str:
    median = statistics.median(rounds)
    spread = f" [{min(rounds):.2f}-{max(rounds):.2f}]" if len(rounds) > 1 else ""
    return f"{median:.2f}x{spread}"


if __name__ == "__main__":
    raise SystemExit(main())
