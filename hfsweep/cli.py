"""The ``hfsweep`` command line."""

from __future__ import annotations

import argparse
import contextlib
import shlex
import sys
from pathlib import Path
from typing import NoReturn


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


def _parse_sets(items: list[str]) -> dict[str, object]:
    """``--set KEY=VALUE`` items as a config, each value read as YAML like a sweep file's (a key
    given twice inside a value is refused); a bad item raises ``ValueError`` naming it."""
    import yaml

    from .search_spaces import DuplicateKeyError, YamlLimitError, yaml_loader

    config: dict[str, object] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set {item!r}: write KEY=VALUE, e.g. --set hidden=128")
        try:
            config[key] = yaml.load(value, Loader=yaml_loader())  # a SafeLoader subclass
        except (DuplicateKeyError, YamlLimitError, yaml.YAMLError) as exc:
            problem = str(exc).replace("\n", " ")
            raise ValueError(f"--set {item!r}: the value is not valid YAML ({problem})") from None
    return config


def _profile(args: argparse.Namespace) -> int:
    import torch

    from . import profiler
    from .config.entry import load_task
    from .sizing.device import resolve_device
    from .sizing.task import profile_task
    from .training.task import TaskError

    try:
        device_name, dtype_name = args.device, args.dtype
        share_frozen = True
        if args.task.endswith((".yaml", ".yml")):
            from .config import load_sweep

            sweep = load_sweep(args.task)
            task = sweep.task
            # the sweep's shared values; each compatibility key is profiled when the sweep runs
            config = {**sweep.config, **sweep.space.fixed, **_parse_sets(args.set)}
            device_name = device_name or sweep.fusion.device
            dtype_name = dtype_name or sweep.fusion.dtype
            share_frozen = sweep.fusion.share_frozen  # its arrays' memory, as the sweep builds them
        else:
            task = load_task(args.task)
            config = _parse_sets(args.set)
        task.resolve(config)
        sizes = [int(v) for v in args.sizes.split(",")] if args.sizes else None
        dtype_name = dtype_name or "float32"
        dtype = getattr(torch, dtype_name, None)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"--dtype {dtype_name!r} is not a floating torch dtype (float32...)")
        device_name = resolve_device(device_name or "auto")
        args.device, args.dtype = device_name, dtype_name
        device = torch.device(device_name)
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"--device {args.device}: hfsweep profiles on cpu or cuda[:N]")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"--device {args.device}: CUDA is not available on this machine")
        if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
            raise ValueError(
                f"--device {args.device}: this machine has {torch.cuda.device_count()} CUDA "
                "device(s)"
            )
    except (TaskError, ValueError, RuntimeError) as e:
        print(f"hfsweep profile: {e}", file=sys.stderr)
        return 2
    cache = None if args.no_cache else profiler.ProfileCache(args.cache)
    print(f"Profiling task {task.name!r} on {device} ({args.dtype})", flush=True)

    def progress(m: profiler.Measurement) -> None:
        print(
            f"  B={m.size:<4d} {m.step_s * 1e3:8.2f} ms/step  "
            f"{m.samples_per_s:12,.0f} member-samples/s  peak {m.peak_bytes / 2**20:9.1f} MiB",
            flush=True,
        )

    try:
        profile = profile_task(
            task,
            config,
            device=device,
            dtype=dtype,
            sizes=sizes,
            max_size=args.max_size,
            budget_fraction=args.memory_fraction,
            knee=args.knee,
            cache=cache,
            refresh=args.refresh,
            min_seconds=args.seconds,
            on_measure=progress,
            share_frozen=share_frozen,
        )
    except (TaskError, ValueError) as e:
        print(f"hfsweep profile: {e}", file=sys.stderr)
        return 2
    print()
    print(profile.table())
    print(f"\nchosen B = {profile.chosen}: {profile.reason}")
    if cache is not None and profile.cached_from is None:
        print(f"measured now; cached in {cache.path} (--refresh measures again)")
    if args.plot is not None:
        try:
            profiler.plot(profile, args.plot)
            print(f"plot: {args.plot}")
        except ImportError as e:
            print(f"no plot: {e}", file=sys.stderr)
    return 0


def _validate(args: argparse.Namespace) -> int:
    sys.dont_write_bytecode = True  # importing a task's .py file must not write __pycache__
    from .config import ConfigError, check_sweep_file, load_sweep

    if args.file_only:  # the file alone: neither the task nor torch is imported
        try:
            checked = check_sweep_file(args.sweep)
        except ConfigError as e:
            _error("validate", e, args)
            return 2
        print(f"{args.sweep} is valid:")  # as far as a file is, alone: its summary says so
        for line in checked.summary().splitlines():
            print(f"  {line}")
        return 0
    try:
        sweep = load_sweep(args.sweep)  # the file's own checks first, then against the task
    except ConfigError as e:
        _error("validate", e, args)
        return 2
    from .config.tracking import check_trackers
    from .core import dry_run, preflight, refuse_a_second_start, runs_on_the_driver
    from .core.result import SweepError

    try:  # the rule `hfsweep run` applies first: a run directory that holds a sweep already
        refuse_a_second_start(sweep.output, sweep.storage, sweep.source, resume=False)
    except SweepError as e:
        _error("validate", e, args)
        return 2
    try:
        preflight(sweep)
        check_trackers(sweep)  # a tracker's library that is installed but fails to import
    except ConfigError as e:
        print(
            f"hfsweep validate: {e} (this machine cannot run it; --file-only checks the "
            "file alone, for a sweep meant for another machine)",
            file=sys.stderr,
        )
        return 2
    try:
        if runs_on_the_driver(sweep):  # as in a run: not for a cluster's workers' data
            dry_run(sweep)  # the task's code, once: after the machine's checks
    except ConfigError as e:
        _error("validate", e, args)
        return 2
    print(f"{args.sweep} is valid:")
    for line in sweep.summary().splitlines():
        print(f"  {line}")
    return 0


def _run(args: argparse.Namespace) -> int:
    from .config import ConfigError, load_sweep

    try:  # the file's own checks come first, before the task (and torch) is imported
        config = load_sweep(args.sweep)
        if args.output is not None:
            import dataclasses

            config = dataclasses.replace(config, output=args.output.resolve())
    except ConfigError as e:
        print(f"hfsweep run: {e}", file=sys.stderr)
        return 2
    from .core import preflight, refuse_a_second_start
    from .core.loop import SweepError, TrainingError, sweep
    from .core.result import RunDirUnwritable
    from .core.status import Status
    from .searchers import SearcherError
    from .storage.database import StorageUnavailable

    try:  # sweep() checks both again; here so that a problem comes before the summary
        refuse_a_second_start(config.output, config.storage, config.source, resume=args.resume)
        preflight(config)
    except (ConfigError, SweepError) as e:
        print(f"hfsweep run: {e}", file=sys.stderr)
        return 2
    if not args.quiet:
        print(f"Sweep {args.sweep}:", flush=True)
        for line in config.summary().splitlines():
            print(f"  {line}", flush=True)
    try:
        result = sweep(config, resume=args.resume, progress=not args.quiet)
    # the task's code, the database or the run directory's disk failed at run time
    except (TrainingError, StorageUnavailable, RunDirUnwritable) as e:
        _error("run", e, args)
        return 1
    except (ConfigError, SweepError, SearcherError) as e:
        _error("run", e, args)
        return 2
    except KeyboardInterrupt as stop:  # Ctrl-C, or SIGTERM (hfsweep._signals.Terminated)
        from ._signals import exit_code, settle

        settle()  # a signal from now on waits for the message
        resume = ["hfsweep", "run", str(args.sweep)]
        if args.output is not None:
            resume += ["--output", str(args.output)]
        print(
            f"\nhfsweep run: {_stopped(stop)}. Every finished trial is recorded in "
            f"{_shown(config.output)}; continue with: {shlex.join([*resume, '--resume'])}\n"
            f"See the trials finished so far: {_report_command(config.output)}",
            file=sys.stderr,
        )
        return exit_code(stop)
    if not args.quiet:
        print(result.summary())
        if result.counts.get(Status.COMPLETED) or result.counts.get(Status.STOPPED):
            print(
                f"Look at the results: {_report_command(result.run_dir)} (PNG plots into "
                f"{_shown(result.run_dir / 'report')})"
            )
    return 0


def _stopped(stop: BaseException) -> str:
    """How a run ended by ``stop`` ended: ``interrupted`` (Ctrl-C), ``stopped by SIGTERM``."""
    from ._signals import Terminated

    return str(stop) if isinstance(stop, Terminated) else "interrupted"


def _end_now(code: int) -> NoReturn:
    """End this process with ``code`` now that a signal stopped its sweep and the message is
    out: the threads still running get a bounded wait, the ``atexit`` functions run (logging's
    flush among them), and the interpreter's own teardown, which frees every object of torch,
    Optuna and Ray one by one (seconds, tens of seconds on a loaded machine), is skipped.
    Everything the run keeps was written and flushed as it happened."""
    import atexit
    import os
    import threading
    import time

    deadline = time.monotonic() + _THREADS_WAIT_S
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join(max(0.0, deadline - time.monotonic()))
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


#: how long a stopped run waits for its threads still running before it ends
_THREADS_WAIT_S = 5.0


def _shown(path: Path) -> str:
    """``path`` as the user would type it here: relative to the working directory when it is
    under it (``examples/runs/digits_quick``), else absolute."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except (ValueError, OSError):
        return str(path)


def _report_command(run_dir: Path) -> str:
    return shlex.join(["hfsweep", "report", _shown(run_dir)])


def _report(args: argparse.Namespace) -> int:
    from .report import NothingToReport, ReportError, write_report

    try:
        paths = write_report(args.run_dir, args.out)
    except NothingToReport as e:  # a sweep that has not got far enough: not a usage error
        print(f"hfsweep report: {e}", file=sys.stderr)
        return 1
    except ReportError as e:
        print(f"hfsweep report: {e}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0


def _error(command: str, exc: BaseException, args: argparse.Namespace) -> None:
    """Print ``exc`` as ``hfsweep COMMAND: message``, one paragraph; with ``--debug``, first
    the traceback of the exception behind it (the task's own, where the task raised)."""
    from ._usercode import format_traceback

    if getattr(args, "debug", False):
        cause = exc.__cause__ if exc.__cause__ is not None else exc
        print(format_traceback(cause), file=sys.stderr)
    print(f"hfsweep {command}: {exc}", file=sys.stderr)


_DEBUG_HELP = "on an error, print the Python traceback behind the message too"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``hfsweep`` and its subcommands."""
    from ._version import __version__

    parser = argparse.ArgumentParser(
        prog="hfsweep",
        description="Hyperparameter sweeps of PyTorch models trained as horizontally fused arrays.",
    )
    parser.add_argument("--version", action="version", version=f"hfsweep {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser(
        "run",
        help="run a sweep (the main job): trials trained as fused arrays, results in a run dir",
        description="Run the sweep SWEEP describes: ask the searcher for trials, train "
        "compatible ones together as fused arrays, stop trials early with the scheduler, and "
        "record everything in the run directory (the Optuna study, trials.csv, histories/, "
        "the best trials' checkpoints, best.json, sweep.log). Interrupted or killed, the same "
        "command with --resume finishes it without losing or retraining a finished trial.",
    )
    run.add_argument("sweep", type=Path, metavar="SWEEP")
    run.add_argument(
        "--resume",
        action="store_true",
        help="continue the sweep in its output directory (or start it if there is none)",
    )
    run.add_argument(
        "--output", type=Path, default=None, help="run directory (default: the sweep's output)"
    )
    run.add_argument("--quiet", action="store_true", help="no progress line or summary")
    run.set_defaults(func=_run)
    rep = sub.add_parser(
        "report",
        help="draw a sweep's plots (history, importance, parallel coordinates, curves) as PNG",
        description="Draw PNG plots of the sweep in RUN_DIR (the sweep's output, by default "
        "runs/<sweep file's name> next to the sweep file): optimization history, parameter "
        "importance, parallel coordinates and learning curves. Exits 1 when no trial has "
        "finished yet, 2 when RUN_DIR is not a run directory.",
    )
    rep.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    rep.add_argument("--out", type=Path, default=None, help="folder (default RUN_DIR/report)")
    rep.set_defaults(func=_report)
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

    prof = sub.add_parser(
        "profile",
        help="measure a task's throughput and memory at several array sizes and choose B",
        description="Measure member-samples/s and peak memory of TASK's training step at array "
        "sizes 1, 2, 4, ... (or --sizes), fit memory against B, and print the table and the "
        "array size hfsweep would use. TASK_OR_SWEEP is a ready task (digits_mlp, digits_cnn, "
        "cifar_resnet, token_transformer), module:attribute, path/to/file.py:attribute, or a "
        "sweep.yaml (its task with its fixed config values and fusion settings).",
    )
    prof.add_argument("task", metavar="TASK_OR_SWEEP")
    prof.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config value (YAML syntax), repeatable: --set hidden=256 --set batch_size=128",
    )
    prof.add_argument("--sizes", help="comma-separated array sizes to measure (default: doubling)")
    prof.add_argument("--max-size", type=int, default=64, help="largest B tried (default 64)")
    prof.add_argument(
        "--device",
        default=None,
        help="auto, cpu, cuda or cuda:N (default: the sweep's fusion.device, else auto: cuda if "
        "available)",
    )
    prof.add_argument("--dtype", default=None, help="default: the sweep's, else float32")
    prof.add_argument(
        "--memory-fraction",
        type=float,
        default=0.8,
        help="share of the device's memory an array may use (GPU memory, or available RAM)",
    )
    prof.add_argument(
        "--knee",
        type=float,
        default=0.9,
        help="choose the smallest B reaching this share of the best throughput (default 0.9)",
    )
    prof.add_argument("--seconds", type=float, default=0.5, help="timing per size (default 0.5)")
    prof.add_argument(
        "--plot",
        type=Path,
        default=Path("profile.png"),
        help="PNG of throughput and memory against B (default profile.png)",
    )
    prof.add_argument("--no-plot", dest="plot", action="store_const", const=None)
    prof.add_argument(
        "--cache",
        type=Path,
        default=None,
        help="profile cache file (default: $HFSWEEP_CACHE_DIR/profiles.json, else "
        "$XDG_CACHE_HOME/hfsweep/profiles.json, else ~/.cache/hfsweep/profiles.json)",
    )
    prof.add_argument("--no-cache", action="store_true", help="neither read nor write the cache")
    prof.add_argument(
        "--refresh",
        action="store_true",
        help="measure again even if cached, and cache the new profile (a sweep's size: auto: "
        "HFSWEEP_PROFILE_REFRESH=1)",
    )
    prof.set_defaults(func=_profile)

    val = sub.add_parser(
        "validate",
        help="check a sweep file without training or writing anything",
        description="Read SWEEP (a sweep.yaml), check every key, the task, the search space, "
        "the searcher and the scheduler, and that this machine can run it (the output folder "
        "can be created and written, CUDA is there if it asks for CUDA, the storage URL's "
        "database driver is installed and its database answers: what `hfsweep run` checks "
        "before it writes anything), "
        "then run the task's code once (a dry run: its model for the corner configs of the "
        "space, one training step of an array of two on one batch, one validation batch), "
        "and print a summary of the resolved sweep. Exits 2 with a message naming the YAML "
        "path, or the part of the task that failed, on the first problem. Writes nothing.",
    )
    val.add_argument("sweep", type=Path, metavar="SWEEP")
    val.add_argument(
        "--file-only",
        action="store_true",
        help="check the file alone, not whether this machine can run it (its output folder, "
        "CUDA, the storage's database) nor the task's code (the dry run): for a sweep "
        "meant for another machine",
    )
    val.set_defaults(func=_validate)
    for command in sub.choices.values():
        command.add_argument("--debug", action="store_true", help=_DEBUG_HELP)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``hfsweep`` command."""
    args = build_parser().parse_args(argv)
    from ._signals import stopped_by, stopping_on_signals

    try:
        # `run`: SIGTERM stops the sweep as Ctrl-C does (see hfsweep._signals)
        with stopping_on_signals() if args.command == "run" else contextlib.nullcontext():
            try:
                code = int(args.func(args))
            except KeyboardInterrupt as stop:  # before the sweep started: nothing written
                if args.command != "run":
                    raise
                from ._signals import exit_code

                print(f"\nhfsweep run: {_stopped(stop)} before the sweep started", file=sys.stderr)
                code = exit_code(stop)
            stopped = stopped_by() is not None
    except Exception as exc:  # not an error hfsweep foresaw: one paragraph, unless --debug
        if getattr(args, "debug", False):
            raise
        from ._usercode import describe

        resume = (
            f" Every finished trial is recorded: once it is fixed, continue with `hfsweep run "
            f"{args.sweep} --resume`."
            if args.command == "run"
            else ""
        )
        print(
            f"hfsweep {args.command}: unexpected {describe(exc)}. This is a bug in hfsweep or "
            "in code it called; run the command again with --debug for the traceback, and "
            f"report it.{resume}",
            file=sys.stderr,
        )
        return 1
    if stopped and argv is None:  # the command line's process, not a call from Python
        _end_now(code)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
