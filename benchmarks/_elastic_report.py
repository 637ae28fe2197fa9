"""The Markdown file of ``elastic_sim.py``: the results table, the assumptions, and where each
arm's accelerator-time went with the makespan's lower bounds (:mod:`_elastic_account`)."""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from _elastic_account import ACCOUNT_COLUMNS, ARMS, PHASE_COLUMNS, account_rows, phase_rows
from _results import markdown_table

from hfsweep.profiler import AllReduceCost

RESULTS = Path(__file__).resolve().parent / "results"


def _measured_on() -> str:
    """Where the step times in ``profile_tasks_cpu.json`` were measured (machine, date)."""
    try:
        meta = json.loads((RESULTS / "profile_tasks_cpu.json").read_text())["meta"]
    except (OSError, KeyError, ValueError):
        return "`profile_tasks_cpu.json`"
    return f"`profile_tasks_cpu.json`: {meta['machine']}, {meta['date']}"


def markdown(
    rows: list[dict[str, Any]], args: argparse.Namespace, mix: dict[str, float], command: str
) -> str:
    """The results table (medians over seeds, per cluster size) and the assumptions."""
    profiles = json.loads(args.profiles.read_text())
    cost = AllReduceCost.from_dict(profiles["allreduce"])
    lines = [
        "# Elastic vs static arrays: a simulated sweep at cluster scale",
        "",
        f"- command: `{command}`",
        f"- profiles: `{args.profiles.name}` ({profiles.get('command', 'see scaling_profile.py')})",
        f"- seeds: {', '.join(map(str, args.seeds))} (medians shown; every seed in the JSON)",
        *(f"- {note}" for note in getattr(args, "note", None) or []),
        "",
        "| accelerators | arm | makespan h | accelerator-h idle | trials ended / h "
        "| time to final best trial h | resizes | static/elastic makespan |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for workers in args.workers:
        arms = {}
        for arm in ARMS:
            sel = [r for r in rows if r["workers"] == workers and r["arm"] == arm]
            if not sel:
                continue
            arms[arm] = {
                k: statistics.median(r[k] for r in sel)
                for k, v in sel[0].items()
                if k != "arm" and isinstance(v, int | float)
            }
        for arm, m in arms.items():
            ratios = sorted(
                s["makespan_s"] / e["makespan_s"]
                for s, e in zip(
                    [r for r in rows if r["workers"] == workers and r["arm"] == "static"],
                    [r for r in rows if r["workers"] == workers and r["arm"] == arm],
                    strict=True,
                )
            )
            ratio = (
                f"{statistics.median(ratios):.2f}x (seeds: {', '.join(f'{x:.2f}' for x in ratios)})"
                if arm != "static"
                else ""
            )
            lines.append(
                f"| {workers} | {arm} | {m['makespan_s'] / 3600:.3f} | "
                f"{m['idle_accelerator_h']:.2f} | {m['trials_per_h']:,.0f} | "
                f"{m['best_trial_s'] / 3600:.3f} | {m['resizes']:.0f} | {ratio} |"
            )
    per_model = ", ".join(
        f"{t['task']} (batch {t['batch_size']}, "
        f"{t['gradient_bytes_per_member'] / 1024:.0f} KiB of gradients per member, step "
        f"{1e3 * t['sizes']['1']:.1f} ms at B=1)"
        for t in profiles["tasks"]
        if t["task"] in mix
    )
    lines += [
        "",
        "## Assumptions",
        "",
        f"- {args.trials} trials; model mix {mix} (each trial's model drawn with these weights); "
        f"{per_model}. Step times are measured ones ({_measured_on()}) at each array size, "
        "interpolated between sizes.",
        "- Arrays of the profiler's chosen size per model (`choose_size` on those measurements), "
        "formed as `hfsweep run` forms them, in both arms: hfsweep's packer "
        "(`hfsweep.core.packer.Packer`) asks the trials one at a time, in order, into one pool "
        "per model and forms an array from the first pool that holds its size (the fullest "
        "once every trial is asked), whenever a slot is free; freed slots are refilled at the "
        "array's next evaluation from its model's pool, then from up to 3 more trials asked "
        "(hfsweep's refill). Elastic: each formed array is a pool of waiting trials to the "
        "allocator, which starts it or leaves it waiting while its workers save more in the "
        "running arrays; while it waits no other array is formed (the engine's rule).",
        f"- Each trial trains {args.max_epochs} epochs of {args.steps_per_epoch} steps; ASHA "
        f"(asynchronous, reduction factor {args.eta}, rungs at 1, {args.eta}, ... epochs): a "
        "trial stops at a rung if its metric is below the top 1/eta of the values recorded "
        "there so far. Metrics are synthetic: a trial's quality ~ N(model offset, 1) plus "
        "noise N(0, 0.5/sqrt(epoch)); same trials and qualities in both arms.",
        f"- An array on k workers runs at `model_scaling`'s rate: one worker's step / k plus a "
        f"ring all-reduce of all members' gradients at latency {cost.latency_s * 1e6:.0f} us "
        f"per hop and {cost.bandwidth_bytes_per_s / 1e9:.2f} GB/s ({cost.source}), no overlap "
        "with the backward pass. `scaling_profile.py` measured this model "
        "to be optimistic on this shared 2-core CPU (k = 2 ran slower than k = 1 there), so "
        "these figures say what the allocator does given profiles, not what this CPU would get.",
        f"- Elastic: the allocator with resize_every_s={args.resize_every_s:g}, "
        f"resize_cost_s={args.resize_cost_s:g} (every resize stops the array that long: "
        "checkpoint and restart), min 1 worker, no max; it runs when an array ends, when members "
        "stop, when the engine forms an array, and on a timer every resize_every_s. A resize "
        "takes effect at once (the real design resizes at the next evaluation boundary; "
        "resizes of one array asked at one instant are one resize, as the engine's latest "
        "request replaces a pending one). Starting an array costs nothing in "
        "either arm. No node failures. Both elastic arms tell the allocator about how many "
        "arrays the queued trials would form (`Packer.queued_arrays`, as `hfsweep run` does). "
        "elastic-before is the allocator before issue 19's end estimate: the plain mix's count "
        "of the queue (`bounded=False`) and each array's remaining budget. elastic is given, "
        "as `hfsweep run` gives it with ASHA, the count bounded one standard error below the "
        "mix's and each array's expected end and member-seconds from ASHA's rungs "
        "(`hfsweep.elastic.survival`: a member survives each rung ahead with probability 1/eta, "
        "independently). A plan's "
        "requests that return an array to the workers it had at the same instant cost nothing "
        "(the trainer drops a request for the workers it has).",
        "- Static: every array gets one accelerator for life; a freed accelerator starts the next "
        "array at once.",
        "- Makespan: until the last trial ends. Idle: accelerators without an array, integrated "
        "over the makespan (resize pauses count as busy). Time to the final best trial: when the "
        "trial with the best quality among those that trained the full budget completed.",
        *_where_the_time_goes(rows, args.workers),
    ]
    return "\n".join(lines) + "\n"


def _where_the_time_goes(rows: Sequence[Mapping[str, Any]], sizes: Sequence[int]) -> list[str]:
    """The accounting table and, per cluster size, what the bounds allow (medians over seeds)."""
    lines = [
        "",
        "## Where the accelerator-time goes, and the bounds",
        "",
        "Every accelerator-second of an arm (accelerators x makespan), median over the seeds, "
        "in accelerator-hours: **useful** (the steps trained, at the seconds they take the array "
        "on one worker), **parallel** (the rest of the time training on k > 1 workers: the "
        "modelled all-reduce and split batch), **resize** (held in resize pauses), **idle**; "
        "the tail's share in brackets (the tail: after the last trial started). The bounds, "
        "from the simulator's workload and cost model only: **work**, the arm's useful seconds "
        "over the accelerators; **packed**, the same member-steps at each model's cheapest "
        "per-member step; **path**, one full-budget trial's steps at the fastest step its model "
        "allows (one member, the best worker count); **tail**, when the arm's last trial started "
        "plus the larger of its tail's useful seconds over the accelerators and the longest "
        "critical path left then. Every arm's makespan is at least work, packed and path "
        "(`_elastic_account.py`); tail bounds what any allocation could do after the arm's own "
        "queue phase.",
        "",
        *markdown_table(ACCOUNT_COLUMNS, [c for w in sizes for c in account_rows(rows, w)]),
        "",
        "Where each elastic arm's makespan went, by phase (medians over the seeds; the queue: "
        "until the last trial started; the tail: after; accelerator-seconds, acc-s): a resize "
        "in the queue phase delays every trial still queued, one in the tail delays its array's "
        "end, and the array that ended last is on the sweep's critical path.",
        "",
        *markdown_table(PHASE_COLUMNS, [c for w in sizes for c in phase_rows(rows, w)]),
        "",
    ]
    for workers, arm in ((w, a) for w in sizes for a in ARMS[1:]):
        pairs = _pairs(rows, workers, arm)
        if not pairs:
            continue
        useful = {
            name: statistics.median(
                r["useful_s"] / (workers * r["makespan_s"]) for r in (p[i] for p in pairs)
            )
            for i, name in enumerate(("static", "elastic"))
        }
        work = statistics.median(
            s["makespan_s"] / max(e["bounds"]["work"], e["bounds"]["path"]) for s, e in pairs
        )
        tail = statistics.median(s["makespan_s"] / e["bounds"]["tail"] for s, e in pairs)
        got = statistics.median(s["makespan_s"] / e["makespan_s"] for s, e in pairs)
        slack = statistics.median(s["makespan_s"] / 1.5 - e["bounds"]["tail"] for s, e in pairs)
        last = [e["account"].get("last_array", {}) for _, e in pairs]
        resized = statistics.median(a.get("resizes", 0) for a in last)
        paused = statistics.median(a.get("paused_s", 0.0) for a in last)
        lines.append(
            f"- {workers} accelerators, {arm}: useful share of the accelerator-time "
            f"{useful['elastic']:.0%} elastic, {useful['static']:.0%} static. Static's makespan "
            "over elastic's work "
            f"bound: {work:.2f}x (the most any schedule of elastic's trained steps could gain "
            f"over static); over elastic's tail bound: {tail:.2f}x (the most after elastic's own "
            f"queue phase); elastic reached {got:.2f}x. "
            + (
                f"A makespan 1.5x shorter than static's leaves elastic's tail {slack:.0f} s over "
                "its tail bound (median)"
                if slack >= 0
                else f"1.5x is {-slack:.0f} s below elastic's tail bound (median): out of reach "
                "after its queue phase"
            )
            + f"; the array that ended last was resized {resized:g} time(s) and paused "
            f"{paused:.0f} s by them (medians)."
        )
    return lines


def _pairs(
    rows: Sequence[Mapping[str, Any]], workers: int, arm: str = "elastic"
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(static, ``arm``) rows of each seed at ``workers``, each with its useful seconds."""
    out = []
    for seed in sorted({r["seed"] for r in rows if r["workers"] == workers}):
        arms = {}
        for r in rows:
            if r["workers"] == workers and r["seed"] == seed:
                seconds = r["account"]["seconds"]
                arms[r["arm"]] = {
                    **r,
                    "useful_s": sum(p["useful"] for p in seconds.values()),
                }
        if {"static", arm} <= set(arms):
            out.append((arms["static"], arms[arm]))
    return out
