"""A sweep on a CPU other processes also want: hfsweep against a plain loop, quiet and contended.

    python benchmarks/contention.py [--sweep examples/digits_quick.yaml] [--rounds R]
        [--workers N] [--generator spin|matmul] [--only plain,hfsweep,hfsweep-torch-threads]
        [--out STEM]

Every arm runs the same sweep in a fresh process, so that environment variables read when torch
loads take effect and no arm inherits another's warmed state:

- ``plain``: plain Optuna training the sweep's trials one after another, one unfused model each
  (``sweep_vs_optuna.py``'s plain arm: the sweep's task, space, sampler, epochs; Optuna's
  SuccessiveHalving pruner), with torch's default thread count.
- ``hfsweep``: ``hfsweep run SWEEP --quiet``, as installed.
- ``hfsweep-torch-threads``: the same with ``HFSWEEP_CPU_THREADS=torch``: torch's intra-op
  threads left at torch's default (every core of the process's affinity), whatever the load,
  as hfsweep trained before it chose its CPU threads from the load.

Each arm runs twice per round: quiet (no generator) and contended (``--workers`` busy
processes started by this script before the arm and ended after it: a pure-Python spin loop,
or with ``--generator matmul`` a single-threaded NumPy matmul loop; none pinned). Rounds
interleave every arm and both conditions, alternating their order. Per run it records the
wall-clock, the child's CPU seconds and involuntary context switches (``os.wait4``), and the
1-minute load average before it starts. The table gives min and median per arm and condition
and the degradation ``contended / quiet`` of the medians; an arm degrades no worse than the
plain loop when its ratio is at most the plain arm's. The machine's other load is not under the
script's control; the load averages are in the results so that a reader can judge it.
Writes ``results/contention_cpu.{md,json}``, or ``STEM.{md,json}`` with ``--out``.

``--probe-ops`` measures the mechanism instead, in this process: one elementwise op
(``torch.tanh`` into a preallocated tensor) on one model's activations (64 x 64) and on 16
members' (16 x 64 x 64), with 1 and 2 torch threads, quiet and contended; median, 90th percentile and mean microseconds per op
(``results/contention_ops_cpu``, or ``--out``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

ARMS = ("plain", "hfsweep", "hfsweep-torch-threads")
LABELS = {
    "plain": "plain Optuna, one model at a time",
    "hfsweep": "hfsweep run",
    "hfsweep-torch-threads": "hfsweep run, HFSWEEP_CPU_THREADS=torch",
}
CONDITIONS = ("quiet", "contended")
ROOT = Path(__file__).resolve().parent.parent

_SPIN = "import time\nx = 0\nwhile True:\n    x += 1\n"
_MATMUL = (
    "import os\nos.environ['OMP_NUM_THREADS'] = os.environ['OPENBLAS_NUM_THREADS'] = '1'\n"
    "os.environ['MKL_NUM_THREADS'] = '1'\nimport numpy as np\n"
    "a = np.random.rand(256, 256)\nwhile True:\n    a = np.tanh(a @ a)\n"
)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class Generator:
    """``workers`` busy processes (a spin loop or a matmul loop), started on entry and killed on
    exit, by their process ids."""

    def __init__(self, workers: int, kind: str) -> None:
        self.workers, self.code = workers, _SPIN if kind == "spin" else _MATMUL
        self.procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> Generator:
        for _ in range(self.workers):
            self.procs.append(subprocess.Popen([sys.executable, "-c", self.code]))
        time.sleep(0.5)  # let them start before the arm does
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()
        self.procs.clear()


def _command(arm: str, sweep: Path, out: Path) -> tuple[list[str], dict[str, str]]:
    env = dict(os.environ)
    if arm == "plain":
        return [sys.executable, __file__, "--plain-child", str(sweep)], env
    if arm == "hfsweep-torch-threads":
        env["HFSWEEP_CPU_THREADS"] = "torch"
    else:
        env.pop("HFSWEEP_CPU_THREADS", None)
    command = [sys.executable, "-m", "hfsweep", "run", str(sweep), "--output", str(out)]
    return [*command, "--quiet"], env


def run_arm(arm: str, sweep: Path, scratch: Path) -> dict[str, Any]:
    """One run of ``arm`` in a fresh process: wall-clock, CPU seconds, involuntary context
    switches, the load average before it."""
    out = scratch / f"{arm}-run"
    shutil.rmtree(out, ignore_errors=True)
    command, env = _command(arm, sweep, out)
    load = os.getloadavg()[0]
    start = time.perf_counter()
    proc = subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{arm}: {' '.join(command)} exited {proc.returncode}")
    return {
        "wall_s": wall,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "involuntary_switches": usage.ru_nivcsw,
        "load_before": load,
    }


def plain_child(sweep_path: str) -> None:
    """The plain arm's process: the sweep as plain Optuna (``sweep_vs_optuna.run_plain``),
    with the allocator setting hfsweep's trainer uses, as ``sweep_vs_optuna.py`` runs it."""
    import warnings

    import optuna
    import yaml
    from sweep_vs_optuna import _device, run_plain

    from hfsweep._malloc import retain_freed_memory
    from hfsweep.config import parse_sweep

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    retain_freed_memory()
    path = Path(sweep_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sweep = parse_sweep(yaml.safe_load(path.read_text()), source=path)
        result = run_plain(sweep, _device(sweep), "plain")
    log(f"[plain] {result['wall_s']:.1f} s, best {result['best_value']}")


def probe_ops(workers: int, kind: str, reps: int = 300) -> list[dict[str, Any]]:
    """Microseconds per ``torch.tanh`` op by condition, tensor size and thread count."""
    import torch

    rows = []
    before = torch.get_num_threads()
    for cond in CONDITIONS:
        with Generator(workers if cond == "contended" else 0, kind):
            for label, n in (
                ("one model, 64 x 64", 64 * 64),
                ("16 members, 16 x 64 x 64", 16 * 64 * 64),
            ):
                for threads in (1, 2):
                    torch.set_num_threads(threads)
                    x, y = torch.randn(n), torch.empty(n)
                    for _ in range(20):
                        torch.tanh(x, out=y)
                    times = []
                    for _ in range(reps):
                        t = time.perf_counter()
                        torch.tanh(x, out=y)
                        times.append((time.perf_counter() - t) * 1e6)
                    times.sort()
                    rows.append(
                        {
                            "condition": cond,
                            "tensor": label,
                            "threads": threads,
                            "median_us": statistics.median(times),
                            "p90_us": times[int(0.9 * len(times))],
                            "mean_us": statistics.fmean(times),
                            "load_before": os.getloadavg()[0],
                        }
                    )
                    log(str(rows[-1]))
    torch.set_num_threads(before)
    return rows


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def summarize(runs: list[dict[str, Any]], arms: list[str]) -> list[dict[str, Any]]:
    """Per arm: min and median wall-clock, CPU seconds and switches per condition, and the
    ratio of the contended median to the quiet one."""
    rows = []
    for arm in arms:
        row: dict[str, Any] = {"arm": arm}
        for cond in CONDITIONS:
            mine = [r for r in runs if r["arm"] == arm and r["condition"] == cond]
            walls = [r["wall_s"] for r in mine]
            row[cond] = {
                "rounds": len(mine),
                "min_s": min(walls) if walls else float("nan"),
                "median_s": _median(walls),
                "median_cpu_s": _median([r["cpu_s"] for r in mine]),
                "median_involuntary_switches": _median(
                    [float(r["involuntary_switches"]) for r in mine]
                ),
                "load_before": [round(r["load_before"], 2) for r in mine],
            }
        row["contended/quiet"] = row["contended"]["median_s"] / row["quiet"]["median_s"]
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", default=str(ROOT / "examples" / "digits_quick.yaml"))
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--workers", type=int, default=2, help="busy processes when contended")
    parser.add_argument("--generator", choices=("spin", "matmul"), default="spin")
    parser.add_argument("--only", default=",".join(ARMS), help=f"arms among {', '.join(ARMS)}")
    parser.add_argument("--out", help="results stem (default results/contention_cpu)")
    parser.add_argument("--probe-ops", action="store_true", help="time one op (see above)")
    parser.add_argument("--plain-child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.plain_child:
        plain_child(args.plain_child)
        return 0
    if args.probe_ops:
        return _write_probe(args, argv)
    arms = [a.strip() for a in args.only.split(",") if a.strip()]
    if not arms or any(a not in ARMS for a in arms):
        parser.error(f"--only {args.only!r}: arms are {', '.join(ARMS)}")
    if args.rounds < 1 or args.workers < 1:
        parser.error("--rounds and --workers: give integers >= 1")
    sweep = Path(args.sweep).resolve()

    runs: list[dict[str, Any]] = []
    scratch = Path(tempfile.mkdtemp(prefix="contention_"))
    try:
        for r in range(args.rounds):
            order = CONDITIONS if r % 2 == 0 else CONDITIONS[::-1]
            for cond in order:
                for arm in arms if r % 2 == 0 else arms[::-1]:
                    if cond == "contended":
                        with Generator(args.workers, args.generator):
                            run = run_arm(arm, sweep, scratch)
                    else:
                        run = run_arm(arm, sweep, scratch)
                    run.update(arm=arm, condition=cond, round=r)
                    runs.append(run)
                    log(
                        f"round {r} {cond:9s} {arm:22s} {run['wall_s']:7.1f} s wall, "
                        f"{run['cpu_s']:6.1f} s CPU, {run['involuntary_switches']} "
                        f"involuntary switches, load {run['load_before']:.2f}"
                    )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    rows = summarize(runs, arms)
    import torch
    from _results import RESULTS, write_results

    stem = Path(args.out) if args.out else RESULTS / "contention_cpu"
    loads = [r["load_before"] for r in runs]
    cells = []
    for row in rows:
        q, c = row["quiet"], row["contended"]
        cells.append(
            [
                LABELS[row["arm"]],
                f"{q['min_s']:.1f} / {q['median_s']:.1f}",
                f"{c['min_s']:.1f} / {c['median_s']:.1f}",
                f"{row['contended/quiet']:.2f}",
                f"{q['median_cpu_s']:.1f} / {c['median_cpu_s']:.1f}",
                f"{q['median_involuntary_switches']:.0f} / {c['median_involuntary_switches']:.0f}",
            ]
        )
    notes = [
        f"- sweep: `{os.path.relpath(sweep, ROOT)}`, {args.rounds} interleaved rounds; contended: "
        f"{args.workers} {args.generator} processes started and ended around each run",
        f"- CPUs in this process's affinity: {len(os.sched_getaffinity(0))}; 1-minute load "
        f"average before the runs: min {min(loads):.2f}, median {_median(loads):.2f}, "
        f"max {max(loads):.2f} (other users' load included)",
    ]
    write_results(
        stem,
        "contention.py",
        argv,
        torch.device("cpu"),
        "A sweep under CPU contention: hfsweep against a plain loop",
        notes,
        [
            "arm",
            "quiet min / median (s)",
            "contended min / median (s)",
            "contended / quiet",
            "CPU s quiet / contended",
            "involuntary switches quiet / contended",
        ],
        cells,
        [{"summary": rows, "runs": runs}],
    )
    return 0


def _write_probe(args: argparse.Namespace, argv: list[str] | None) -> int:
    import torch
    from _results import RESULTS, write_results

    rows = probe_ops(args.workers, args.generator)
    stem = Path(args.out) if args.out else RESULTS / "contention_ops_cpu"
    cells = [
        [
            f"{r['condition']}, {r['tensor']}, {r['threads']} thread(s)",
            f"{r['median_us']:.1f}",
            f"{r['p90_us']:.1f}",
            f"{r['mean_us']:.1f}",
            f"{r['load_before']:.2f}",
        ]
        for r in rows
    ]
    notes = [
        f"- contended: {args.workers} {args.generator} processes; CPUs in this process's "
        f"affinity: {len(os.sched_getaffinity(0))} (other users' load included in the load)"
    ]
    columns = ["condition, tensor, torch threads", "median us", "p90 us", "mean us", "load"]
    title = "One elementwise op under CPU contention, by tensor size and torch threads"
    write_results(
        stem, "contention.py", argv, torch.device("cpu"), title, notes, columns, cells, rows
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
