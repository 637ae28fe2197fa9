"""The ``hfsweep`` command line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _demo(args: argparse.Namespace) -> int:
    from ._demo import print_demo, run_demo

    if args.members < 1 or args.epochs < 1 or args.batch < 1:
        print("hfsweep demo: --members, --epochs and --batch must be at least 1", file=sys.stderr)
        return 2
    print(
        f"Training {args.members} MLPs on scikit-learn's digits for {args.epochs} epochs, "
        "fused into one array" + (", then one after another" if not args.no_serial else ""),
        flush=True,
    )
    result = run_demo(
        members=args.members,
        epochs=args.epochs,
        batch=args.batch,
        lr=args.lr,
        seed=args.seed,
        out=args.out,
        serial=not args.no_serial,
    )
    print_demo(result)
    if args.out is not None:
        print(f"saved the best member's state_dict to {args.out / 'best_member.pt'}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``hfsweep`` and its subcommands."""
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="hfsweep",
        description="Hyperparameter sweeps of PyTorch models trained as horizontally fused arrays.",
    )
    parser.add_argument("--version", action="version", version=f"hfsweep {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="train B MLPs on the bundled digits data fused, and one after another, and compare",
    )
    demo.add_argument("--members", type=int, default=16, help="array size B (default 16)")
    demo.add_argument("--epochs", type=int, default=20)
    demo.add_argument("--batch", type=int, default=64)
    demo.add_argument("--lr", type=float, default=0.05)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument(
        "--out", type=Path, default=None, help="save the best member's state_dict here"
    )
    demo.add_argument("--no-serial", action="store_true", help="skip the one-after-another timing")
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``hfsweep`` command."""
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
