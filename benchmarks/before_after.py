"""One benchmark run on two revisions of hfsweep, alternating, so a change is measured side by side.

A restructuring must not slow anything down; measuring the old and the new code minutes apart on a
shared machine mixes the change with the machine's mood. This runs the same benchmark script in
two source trees (``--before`` and ``--after``, each a checkout with its own virtualenv, e.g. made
with ``git worktree add``), alternating ``before, after, before, after, ...`` for ``--repeats``
pairs, and reports for every row the median of each side's timing fields and the ratio
after / before (below 1: the new code is faster). The scripts must write ``<stem>.json`` with a
``rows`` list (``optimizer_step.py``, ``fusion_throughput.py`` ... do). Usage::

    git worktree add --detach ../hfsweep-before <old commit>   # plus a virtualenv there
    python benchmarks/before_after.py --before ../hfsweep-before --after . \\
        --script optimizer_step.py --field fused_ms -- --rounds 9

Writes ``benchmarks/results/before_after_<script stem>_<device>.md``/``.json`` unless ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch
from _results import RESULTS, machine, markdown_table


def _git_rev(tree: Path) -> str:
    out = subprocess.run(
        ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return out.stdout.strip() or "unknown"


def _run(tree: Path, script: str, extra: list[str], stem: Path) -> list[dict[str, Any]]:
    python = tree / ".venv" / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"{tree}: no .venv/bin/python there; make a virtualenv in that checkout")
    cmd = [str(python), str(tree / "benchmarks" / script), *extra, "--out", str(stem)]
    # the tree's own hfsweep first: a virtualenv shared between checkouts (or one whose editable
    # install points elsewhere) would otherwise import the same code on both sides
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]),
    }
    subprocess.run(cmd, cwd=tree, check=True, stdout=subprocess.DEVNULL, env=env)
    rows: list[dict[str, Any]] = json.loads(stem.with_suffix(".json").read_text())["rows"]
    return rows


def _labels(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The columns that name a row (model, B, ...): the plain values every run agrees on."""
    first = rows[0]
    return {
        k: v
        for k, v in first.items()
        if isinstance(v, (str, int)) and all(r.get(k) == v for r in rows)
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", type=Path, required=True, help="checkout of the old revision")
    parser.add_argument("--after", type=Path, default=Path("."), help="checkout of the new one")
    parser.add_argument("--script", required=True, help="benchmark script in benchmarks/")
    parser.add_argument(
        "--field", action="append", required=True, help="timing field(s) to compare"
    )
    parser.add_argument("--repeats", type=int, default=3, help="before/after pairs (default 3)")
    parser.add_argument("--device", default="cpu", help="only names the results file")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("extra", nargs="*", help="arguments for the script (after --)")
    args = parser.parse_args(argv)
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    runs: dict[str, list[list[dict[str, Any]]]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for side in ("before", "after"):
                print(f"repeat {i + 1}/{args.repeats}: {side}", flush=True)
                stem = Path(tmp) / f"{side}{i}"
                runs[side].append(_run(trees[side], args.script, args.extra, stem))
    table = []
    n = len(runs["after"][0])
    if any(len(rows) != n for side in runs.values() for rows in side):
        raise SystemExit("the two revisions' runs gave different rows; compare them by hand")
    for i in range(n):
        same_row = [rows[i] for side in runs.values() for rows in side]
        entry: dict[str, Any] = _labels(same_row)
        for field in args.field:
            for side in ("before", "after"):
                values = [rows[i][field] for rows in runs[side] if field in rows[i]]
                entry[f"{field}_{side}"] = statistics.median(values) if values else None
            b, a = entry[f"{field}_before"], entry[f"{field}_after"]
            entry[f"{field}_ratio"] = a / b if a and b else None
        table.append(entry)
    stem = args.out or RESULTS / f"before_after_{Path(args.script).stem}_{args.device}"
    meta = {
        "script": args.script,
        "script_args": args.extra,
        "repeats": args.repeats,
        "before": _git_rev(trees["before"]),
        "after": _git_rev(trees["after"]),
        "machine": machine(torch.device(args.device)),
    }
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": table}, indent=1))
    cols = list(table[0])
    lines = [
        f"# Before / after: `{args.script}`",
        "",
        f"- machine: {meta['machine']}",
        f"- before: {meta['before']}, after: {meta['after']}; {args.repeats} alternating pairs, "
        "median per side; ratio = after / before (below 1: faster now)",
        f"- command: `python benchmarks/before_after.py --before BEFORE_TREE --after . --script "
        f"{args.script} {' '.join('--field ' + f for f in args.field)} -- {' '.join(args.extra)}`",
        "",
        *markdown_table(
            cols,
            [[f"{v:.3f}" if isinstance(v, float) else str(v) for v in e.values()] for e in table],
        ),
    ]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
