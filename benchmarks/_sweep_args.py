"""Command-line options shared by the Ray sweep benchmarks (``tune_vs_fractional.py`` and
``sweep_end_to_end.py``): the sweep file and its budget, the device and Ray's CPUs, the arms,
rounds, output stem and a quick smoke run."""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Sequence

import optuna


def add_sweep_options(parser: argparse.ArgumentParser, arms: Sequence[str], name: str) -> None:
    """The shared options; ``name`` is the script's results stem (``results/<name>_<device>``)."""
    parser.add_argument("--sweep", default="examples/digits_asha.yaml")
    parser.add_argument("--trials", type=int, help="override budget.trials")
    parser.add_argument("--epochs", type=int, help="override budget.epochs")
    parser.add_argument("--cpu-per-trial", type=float, default=0.25)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--num-cpus", type=int, help="CPUs Ray may use (default: all)")
    parser.add_argument("--only", default=",".join(arms), help=f"arms among {', '.join(arms)}")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every arm")
    parser.add_argument("--out", help=f"results stem (default results/{name}_<device>)")
    parser.add_argument("--quick", action="store_true", help="8 trials of 2 epochs, 1 round")


def parse_sweep_options(
    parser: argparse.ArgumentParser, argv: list[str] | None, arms: Sequence[str]
) -> tuple[argparse.Namespace, list[str]]:
    """Parse ``argv``, apply ``--quick``, check the arms, rounds and CPU share, and quiet
    Optuna's logging; returns the arguments and the arms to run."""
    args = parser.parse_args(argv)
    if args.quick:
        args.trials, args.epochs, args.rounds = args.trials or 8, args.epochs or 2, 1
    chosen = [a.strip() for a in args.only.split(",") if a.strip()]
    if not chosen or any(a not in arms for a in chosen):
        parser.error(f"--only {args.only!r}: arms are {', '.join(arms)}")
    if args.rounds < 1 or not 0 < args.cpu_per_trial <= 1:
        parser.error("give --rounds >= 1 and 0 < --cpu-per-trial <= 1")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    return args, chosen
