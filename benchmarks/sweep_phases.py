"""Where a sweep's wall-clock goes: the time of each phase of ``hs.sweep``, by self time.

    python benchmarks/sweep_phases.py [--sweep examples/digits_asha.yaml] [--scheduler sh]
        [--rounds R] [--out STEM]

Runs the sweep file as ``sweep_vs_optuna.py``'s ``hfsweep-sh`` arm does (``--scheduler sh``, the
default: Optuna's SuccessiveHalving pruner; ``--scheduler file``: the file's own scheduler),
with the profile cache filled before timing, ``R`` times (round r with the sweep's seed + r),
and times the engine's and trainer's phases with ``time.perf_counter`` around their functions.
Each phase counts its self time (nested timed phases are left to themselves), so the phases and
"the rest" add up to the wall-clock. The wrappers cost a few microseconds per call, which the
rest absorbs. This is a diagnostic: it times hfsweep's internal functions, whose names may
change with the code. Only ``backend: local`` (the trainer runs in this process); a key the
profile cache does not hold is profiled inside the sweep, and that time counts in the rest.

Writes ``results/sweep_phases_<device>.{md,json}``, or ``STEM.{md,json}`` with ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import optuna
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import RESULTS, write_results
from optuna.storages.journal import JournalFileSymlinkLock
from sweep_vs_optuna import PRUNER_OPTIONS, _device, log, prefill_profiles, run_hfsweep, warm_up

from hfsweep.config import parse_sweep
from hfsweep.core import loop as _engine
from hfsweep.core._hooks import _Hooks
from hfsweep.fusion._tracing import _Tracing
from hfsweep.searchers import _source
from hfsweep.storage.journal import GroupedJournalFileBackend
from hfsweep.training import run

#: (owner, function name, phase): what is timed, in the order the table lists the phases
PHASES: list[tuple[Any, str, str]] = [
    (run, "backward", "training: forward and backward"),
    (run, "update", "training: optimizer step"),
    (_Tracing, "_trace", "tracing array forwards"),
    (run.ArrayRun, "_evaluate", "evaluation"),
    (run.ArrayRun, "_save_checkpoint", "trainer checkpoints"),
    (run.ArrayRun, "_build", "building arrays"),
    (run.ArrayRun, "_compacted", "building arrays"),
    (_source.OptunaSource, "ask", "searcher: asking for trials"),
    (_source.CustomSource, "ask", "searcher: asking for trials"),
    (_Hooks, "_report", "scheduler decisions"),
    (_Hooks, "_on_finish", "ending trials (study, histories)"),
    (_engine._Engine, "_save_state", "the ledger (state.json, state.jsonl)"),
]
REST = "the rest (data batches, refills, the trainer's loop, the study's set-up)"

#: (owner, function name, what): calls counted per sweep, not timed
COUNTED: list[tuple[Any, str, str]] = [
    (GroupedJournalFileBackend, "append_logs", "journal appends"),
    (JournalFileSymlinkLock, "acquire", "acquisitions of the journal's lock"),
]


class PhaseClock:
    """Self time per phase: a timed call's elapsed time minus that of the timed calls inside it."""

    def __init__(self) -> None:
        self.seconds: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self.events: Counter[str] = Counter()
        self._local = threading.local()  # per thread: the open timed calls' inner time

    def wrap(self, fn: Callable[..., Any], phase: str) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            stack: list[float] = self._local.__dict__.setdefault("stack", [])
            stack.append(0.0)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                inner = stack.pop()
                self.seconds[phase] += elapsed - inner
                self.calls[phase] += 1
                if stack:
                    stack[-1] += elapsed

        return timed

    def count(self, fn: Callable[..., Any], what: str) -> Callable[..., Any]:
        @functools.wraps(fn)
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.events[what] += 1
            return fn(*args, **kwargs)

        return counted

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Every function of :data:`PHASES` timed, and of :data:`COUNTED` counted, while the
        block runs."""
        saved = [(owner, name, owner.__dict__[name]) for owner, name, _ in PHASES + COUNTED]
        try:
            for owner, name, phase in PHASES:
                setattr(owner, name, self.wrap(getattr(owner, name), phase))
            for owner, name, what in COUNTED:
                setattr(owner, name, self.count(getattr(owner, name), what))
            yield
        finally:
            for owner, name, original in saved:
                setattr(owner, name, original)


def _round(mapping: dict[str, Any], seed: int, r: int, cache: Path) -> dict[str, Any]:
    """One timed sweep with seed ``seed``: its wall-clock and each phase's self time."""
    clock = PhaseClock()
    with clock.installed():
        run = run_hfsweep({**mapping, "seed": seed}, f"round {r + 1} seed {seed}", cache)
    phases = dict(clock.seconds)
    phases[REST] = run["wall_s"] - sum(phases.values())
    log(f"[round {r + 1}] wall {run['wall_s']:.2f} s")
    return {
        "round": r + 1,
        "seed": seed,
        "wall_s": run["wall_s"],
        "phases_s": phases,
        "calls": dict(clock.calls),
        "events": dict(clock.events),
        "counts": run["counts"],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", default="examples/digits_asha.yaml")
    parser.add_argument(
        "--scheduler",
        choices=("sh", "file"),
        default="sh",
        help="sh: Optuna's SuccessiveHalving pruner (as sweep_vs_optuna's hfsweep-sh arm); "
        "file: the sweep file's scheduler",
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", help="results stem (default results/sweep_phases_<device>)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        sys.exit(f"--rounds must be at least 1, got {args.rounds}")
    path = Path(args.sweep)
    mapping = yaml.safe_load(path.read_text())
    if args.scheduler == "sh":
        mapping["scheduler"] = {"name": "optuna:successive_halving", "options": PRUNER_OPTIONS}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        sweep = parse_sweep(mapping, source=path)
    if sweep.backend != "local":
        sys.exit(f"{path}: the phases are timed in this process; use backend: local")
    device = _device(sweep)
    warm_up(sweep, device)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="sweep_phases_profiles_") as folder:
        cache = Path(folder)
        prefill_profiles(sweep, cache)
        for r in range(args.rounds):
            rows.append(_round(mapping, sweep.seed + r, r, cache))

    names = list(dict.fromkeys([p for _, _, p in PHASES] + [REST]))
    cells = []
    for name in names:
        seconds = [row["phases_s"].get(name, 0.0) for row in rows]
        shares = [row["phases_s"].get(name, 0.0) / row["wall_s"] for row in rows]
        calls = [row["calls"].get(name, 0) for row in rows]
        cells.append(
            [
                name,
                f"{statistics.median(seconds):.3f}",
                f"{100 * statistics.median(shares):.0f}%",
                str(int(statistics.median(calls))) if name != REST else "-",
            ]
        )
    walls = [row["wall_s"] for row in rows]
    cells.append(["wall-clock", f"{statistics.median(walls):.3f}", "100%", "-"])
    scheduler = (
        f"Optuna SuccessiveHalving ({', '.join(f'{k}={v}' for k, v in PRUNER_OPTIONS.items())})"
        if args.scheduler == "sh"
        else f"{sweep.scheduler.name} {sweep.scheduler.options}"
    )
    notes = [
        f"- `hs.sweep` of `{args.sweep}` (task {sweep.task.name}, {sweep.budget.trials} trials, "
        f"sampler {sweep.searcher.name}) with scheduler {scheduler}, the profile cache filled "
        f"before timing, on {device}; round r uses the sweep's seed + r.",
        "- Self time per phase (`time.perf_counter` around the engine's and trainer's functions; "
        "a phase's time leaves out the timed phases inside it), median over "
        f"{args.rounds} round(s); the share is the median of the per-round shares, so the "
        "shares need not add up to exactly 100%. Calls: median per sweep.",
        "- Training: `training.step.backward` (forward, losses, backward, clipping) and "
        "`training.step.update` (optimizer and schedule steps). Evaluation includes the validation "
        "forwards and metrics, not the scheduler's decisions or tracing. Asking for trials "
        "includes the sampler (TPE) and the study's storage; ending trials includes telling "
        "the study and the searcher, the histories and the best trials' checkpoints.",
        "- Per sweep (median): "
        + ", ".join(
            f"{int(statistics.median(row['events'].get(what, 0) for row in rows))} {what}"
            for _, _, what in COUNTED
        )
        + ".",
    ]
    stem = Path(args.out) if args.out else RESULTS / f"sweep_phases_{device.type}"
    write_results(
        stem,
        "sweep_phases.py",
        argv,
        device,
        f"Where a {sweep.budget.trials}-trial sweep's time goes",
        notes,
        ["phase", "seconds", "share of the wall-clock", "calls"],
        cells,
        rows,
    )


if __name__ == "__main__":
    main()
