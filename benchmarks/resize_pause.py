"""The pause of an elastic array's resize, measured on a local Ray, phase by phase.

`hfsweep run` with ``ray.elastic`` trains every array through
:func:`hfsweep.executors._elastic.run_elastic_array` (k Ray actors in a placement group, rank 0's
hooks relayed to the driver). This script calls that function as the Ray executor does, with a
scripted policy in place of the allocator that resizes the array at every evaluation boundary,
1 -> 2 -> 1 -> 2 ... workers, and times every resize from the moment rank 0 starts writing the
checkpoint at the boundary where it stops until the first optimizer step at the new size (the
slowest worker's), split into phases by timestamps from every process
(``benchmarks/_resize_probe.py``):

- checkpoint: rank 0 writes the checkpoint (paid at every evaluation, resized or not);
- stop: the old launch ends (delivery, the workers return, actors killed or kept, placement
  group given back);
- relaunch decision: the relayed ``target`` (the driver's policy says how many workers);
- placement group: Ray reserves the new launch's bundles;
- actor start: the new actors' processes are up, hfsweep and torch imported;
- rendezvous: rank 0's address, and the train call reaching every worker;
- process group: ``torch.distributed.init_process_group`` (gloo, loopback);
- state load: the checkpoint read and unpacked;
- build: the fused array, optimizer and schedules built from it;
- first step: data, forward, backward, all-reduce and the optimizer step at the new size.

Each arm runs ``--repeats`` grows and as many shrinks; the table gives the medians. The arms,
in one run on one Ray: ``fresh``, new actors in a new placement group at every launch
(``keep_workers=False``: the launcher before issue 19's measurement); ``kept``, the actors that
go on kept across the resize, the added ones started at the boundary (a resize asked there);
``ahead``, kept, with the resize asked ``--lead-s`` before its boundary, as the allocator asks an
array to grow while it trains (the added actors start meanwhile). Every optimizer step but a
launch's first sleeps ``--delay-s`` (the step of a larger model, without its CPU time), so that
an evaluation interval (``--steps``) is long enough for that lead.
Run from the repository root: ``python benchmarks/resize_pause.py``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

PHASES = [
    ("checkpoint", "checkpoint"),
    ("stop", "stop"),
    ("relaunch", "relaunch decision"),
    ("place", "placement group"),
    ("actors", "actor start"),
    ("rendezvous", "warm-up, rendezvous"),
    ("pg_init", "process group"),
    ("load", "state load"),
    ("build", "build"),
    ("first_step", "first step"),
]


class ScriptedPolicy:
    """The allocator's part (:class:`~hfsweep.executors._elastic.WorkerPolicy`): start on one
    worker and resize ``resizes`` times, to 2, then 1, and so on: each asked at a report, so
    at the boundary being reached (``lead_s`` None), or ``lead_s`` before the boundary after
    it (a timer ``interval_s - lead_s`` after the report), as the allocator asks an array to
    grow when another array's workers free up, while it trains."""

    def __init__(self, resizes: int, lead_s: float | None, interval_s: float) -> None:
        self.left, self.workers = resizes, 1
        self.lead_s, self.interval_s, self.armed = lead_s, interval_s, False

    def started(self, folder: str, *args: Any, **kwargs: Any) -> int:
        return 1

    def admits(self) -> int | None:
        return None

    def relaunch(self, folder: str, workers: int, lost: int, total: int) -> int:
        return workers

    def waiting(self, folder: str, total: int) -> int:
        return self.workers

    def _ask(self, folder: str) -> None:
        from hfsweep.parallel import request_resize

        self.workers = 3 - self.workers
        request_resize(folder, self.workers)

    def reported(self, folder: str, evaluations: Sequence[Any], live: int) -> None:
        if self.left <= 0 or not live:
            return
        if self.lead_s is None:
            self.left -= 1
            self._ask(folder)
        elif self.armed:  # the resize asked ahead happens at this boundary
            self.armed = False
        else:
            self.armed, self.left = True, self.left - 1
            wait = max(0.0, self.interval_s - self.lead_s)
            threading.Timer(wait, self._ask, args=(folder,)).start()

    def ended(self, folder: str, total: int) -> None:
        pass


def _first(events: list[dict[str, Any]], name: str, after: float, **match: Any) -> float:
    """The time of the first ``name`` event at or after ``after`` whose fields match."""
    for e in events:
        if e["event"] == name and e["t"] >= after and all(e.get(k) == v for k, v in match.items()):
            return float(e["t"])
    raise ValueError(f"no {name} event after {after} matching {match}")


def resizes_of(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each resize's phases (seconds) from the probe's events (sorted by time). A phase ends
    when its last worker is through it."""
    out = []
    launches = [e for e in events if e["event"] == "launch_start"]
    for stop in events:
        if not (stop["event"] == "boundary_end" and stop.get("raised") and stop["rank"] == 0):
            continue
        t_stop = float(stop["t"])
        ckpt = max(
            float(e["t"])
            for e in events
            if e["event"] == "checkpoint_start" and e["rank"] == 0 and e["t"] <= t_stop
        )
        ckpt_end = _first(events, "checkpoint_end", ckpt, rank=0)
        old = [e for e in launches if e["t"] <= t_stop][-1]
        launch_end = _first(events, "launch_end", t_stop)
        new = next(e for e in launches if e["t"] >= launch_end)
        t_launch, k = float(new["t"]), int(new["workers"])
        ranks = range(k)
        train = max(_first(events, "train_start", t_launch, rank=r) for r in ranks)
        window = [e for e in events if t_launch <= e["t"] <= train]
        placed = [e["t"] for e in window if e["event"] == "place_end"]
        place = max(placed) if placed else t_launch
        up = [e["t"] for e in window if e["event"] == "actor_up"]
        actors = max([place, *up])
        pg = max(_first(events, "pg_init_end", t_launch, rank=r) for r in ranks) if k > 1 else train
        load = max(_first(events, "load_end", t_launch, rank=r) for r in ranks)
        build = max(_first(events, "build_end", t_launch, rank=r) for r in ranks)
        step = max(_first(events, "first_step", t_launch, rank=r) for r in ranks)
        spans = {
            "checkpoint": ckpt_end - ckpt,
            "stop": launch_end - ckpt_end,
            "relaunch": t_launch - launch_end,
            "place": place - t_launch,
            "actors": actors - place,
            "rendezvous": train - actors,
            "pg_init": pg - train,
            "load": load - pg,
            "build": build - load,
            "first_step": step - build,
        }
        row = {"from": int(old["workers"]), "to": k, "total": step - ckpt, "new_actors": len(up)}
        out.append({**row, **spans})
    return out


def run_arm(arm: str, resizes: int, args: Any) -> list[dict[str, Any]]:
    """One array resized ``resizes`` times in ``arm``; each resize's phases."""
    import _resize_probe as probe

    from hfsweep.executors._elastic import run_elastic_array
    from hfsweep.executors.base import ArrayHooks
    from hfsweep.training import Member

    task = probe.make_task()
    events_file = Path(os.environ[probe.ENV])  # set before Ray started: the actors have it
    events_file.unlink(missing_ok=True)
    lead = args.lead_s if arm == "ahead" else None
    with tempfile.TemporaryDirectory(prefix="hfsweep-resize-") as tmp:
        folder = str(Path(tmp) / "array")
        cfg = task.resolve({"width": args.width})
        ms = [
            Member(f"m{i}", {**cfg, "lr": 0.01 * (i + 1), "seed": i}) for i in range(args.members)
        ]
        # the boundary after the last resize ends the members
        left = {"n": (2 * resizes if lead is not None else resizes) + 1}

        def report(evaluations: Sequence[Any]) -> Mapping[str, bool]:
            left["n"] -= 1
            return {e.member: left["n"] > 0 for e in evaluations}

        hooks = ArrayHooks(report=report, refill=lambda: None, on_finish=lambda r: None)
        policy = ScriptedPolicy(resizes, lead, args.steps * args.delay_s)
        options = {
            "dtype": torch.float32,
            "eval_every": args.steps,
            "keep_states": False,
            "final_states": "completed",
            "device": "cpu",
            "keep_workers": arm != "fresh",
        }
        run_elastic_array(
            task,
            folder,
            ms,
            hooks,
            resume=False,
            policy=policy,
            total=lambda: 2,
            closed=lambda: False,
            bundle={"CPU": 1.0},
            threads=1,
            options=options,
        )
        events = [json.loads(line) for line in events_file.read_text().splitlines()]
    events.sort(key=lambda e: e["t"])
    return resizes_of(events)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="grows (and shrinks) per arm")
    parser.add_argument("--members", type=int, default=4)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--steps", type=int, default=12, help="training steps between evaluations")
    parser.add_argument(
        "--delay-s",
        type=float,
        default=0.5,
        help="seconds each training step sleeps (not the first)",
    )
    parser.add_argument(
        "--lead-s", type=float, default=5.0, help="`ahead`: seconds the resize is asked early"
    )
    parser.add_argument("--arms", default="fresh,kept,ahead")
    parser.add_argument("--out", default="resize_pause_cpu")
    args = parser.parse_args(argv)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    for a in arms:
        if a not in ("fresh", "kept", "ahead"):
            raise SystemExit(f"--arms: {a!r} is not one of fresh, kept, ahead")

    import ray

    from hfsweep.executors._connect import on_loopback

    # the probe's file, and this folder on the workers' path, before Ray starts (its workers
    # inherit the environment it starts with)
    path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(HERE) + (os.pathsep + path if path else "")
    events = Path(tempfile.mkdtemp(prefix="hfsweep-resize-probe-")) / "events.jsonl"
    os.environ["HFSWEEP_RESIZE_PROBE"] = str(events)
    os.environ["HFSWEEP_RESIZE_PROBE_DELAY_S"] = str(args.delay_s)
    import _resize_probe  # noqa: F401  (the driver's wrappers)

    logging.basicConfig(level=logging.WARNING)
    with on_loopback():
        ray.init(
            address="local",
            num_cpus=2,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            logging_level=logging.WARNING,
            log_to_driver=False,
        )
    rows: list[dict[str, Any]] = []
    try:
        time.sleep(2.0)  # Ray's prestarted workers up before the first launch
        for arm in arms:
            got = run_arm(arm, 2 * args.repeats, args)
            for r in got:
                r["arm"] = arm
                print(
                    f"{arm:6s} {r['from']} -> {r['to']}: {r['total']:.2f} s "
                    + " ".join(f"{k}={r[k]:.2f}" for k, _ in PHASES)
                )
            rows += got
    finally:
        ray.shutdown()
        shutil.rmtree(events.parent, ignore_errors=True)
    write(rows, args, arms, argv)


def write(rows: list[dict[str, Any]], args: Any, arms: list[str], argv: list[str] | None) -> None:
    from _results import RESULTS, write_results

    columns = ["arm", "resize", "repeats", "total s", *(label for _, label in PHASES)]
    cells = []
    medians = []
    for arm in arms:
        for src, dst in ((1, 2), (2, 1)):
            got = [r for r in rows if r["arm"] == arm and r["from"] == src and r["to"] == dst]
            if not got:
                continue
            med = {k: statistics.median(r[k] for r in got) for k in ["total", *dict(PHASES)]}
            medians.append({"arm": arm, "from": src, "to": dst, "repeats": len(got), **med})
            cells.append(
                [arm, f"{src} -> {dst}", str(len(got)), f"{med['total']:.2f}"]
                + [f"{med[k]:.2f}" for k, _ in PHASES]
            )
    notes = [
        f"- array: {args.members} members of a 32-{args.width}-4 MLP, batches of 64 rows, float32, "
        f"evaluated every {args.steps} steps; local Ray, 2 CPUs, one CPU per worker, gloo on loopback",
        "- a resize's pause: from rank 0's checkpoint write at the boundary where it stops to the "
        "slowest worker's first optimizer step at the new size; medians over the repeats, seconds",
        "- arms: `fresh` starts new actors (processes importing torch and hfsweep) in a new "
        "placement group at every launch (before); `kept` keeps the actors that go on across a "
        "resize and starts the added ones at the boundary; `ahead` is `kept` with the resize "
        f"asked {args.lead_s:g} s before its boundary (the added actors start meanwhile); "
        f"every step but a launch's first sleeps {args.delay_s:g} s",
        "- phases end when their slowest worker is through; `warm-up, rendezvous` is the added "
        "actors' import of torch._dynamo (kept, ahead) and the train call reaching every worker; "
        "the checkpoint is written at every evaluation, resized or not",
        "- a CPU machine with a tiny model: a GPU worker's start (CUDA context, NCCL "
        "communicator) and a large checkpoint are not measured here",
    ]
    write_results(
        RESULTS / args.out,
        "resize_pause.py",
        argv,
        torch.device("cpu"),
        "Resize pause of an elastic array (local Ray)",
        notes,
        columns,
        cells,
        [{"kind": "median", **m} for m in medians] + [{"kind": "resize", **r} for r in rows],
    )


if __name__ == "__main__":
    main()
