"""A picture of a profile: throughput and memory against the array size B (:func:`plot`)."""

from __future__ import annotations

import os

from ._units import _GIB, _MIB, _fmt_bytes
from .cache import Profile
from .model import _fits

__all__ = ["plot"]


def plot(profile: Profile, path: str | os.PathLike[str]) -> None:
    """Write a PNG of ``profile``: throughput and memory against the array size B.

    Top panel: member-samples/s per measured B, the chosen B marked. Bottom panel: measured peak
    memory, the memory model's line and the budget. The x axis (B) is log2 and shared. Uses
    matplotlib's Agg canvas directly (no pyplot, no global backend change); matplotlib is imported
    here only, and a missing one raises ImportError saying how to install it.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError(
            "hfsweep.profiler.plot() needs matplotlib: pip install matplotlib"
        ) from exc

    ms = profile.measurements
    sizes = [m.size for m in ms]
    model = profile.memory
    # The model's line runs from B=1 to past the largest size measured, and on to where it crosses
    # the budget when that is near; it is sampled densely because the x axis is logarithmic.
    upper = max(*sizes, profile.chosen)
    crossing = model.max_size(profile.budget_bytes)
    if upper < crossing <= 2 * upper:
        upper = crossing + 1
    xs = [upper ** (i / 64) for i in range(65)]
    line = [model.base_bytes + model.per_member_bytes * x for x in xs]
    shown = max(max(m.peak_bytes for m in ms), max(line), 1)
    # A budget far above everything measured would squash the data to the floor: name it instead.
    budget_on_scale = profile.budget_bytes <= 3 * shown
    top_bytes = max(shown, profile.budget_bytes) if budget_on_scale else shown
    unit, scale = ("GiB", _GIB) if top_bytes >= _GIB else ("MiB", _MIB)

    fig = Figure(figsize=(7.0, 6.5), layout="constrained")
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, sharex=True)

    top.plot(sizes, [m.samples_per_s for m in ms], "o-", color="tab:blue", label="measured")
    over = [m for m in ms if not _fits(m, profile.budget_bytes)]
    if over:
        top.plot(
            [m.size for m in over], [m.samples_per_s for m in over], "x", color="tab:red",
            markersize=10, label="over the budget",
        )  # fmt: skip
    chosen = [m for m in ms if m.size == profile.chosen]
    if chosen:
        top.plot(
            [chosen[0].size], [chosen[0].samples_per_s], "*", color="tab:red", markersize=16,
            label=f"chosen B={profile.chosen}",
        )  # fmt: skip
    top.axvline(profile.chosen, color="tab:red", linestyle=":", linewidth=1)
    top.set_ylabel("member-samples/s")
    top.set_ylim(bottom=0)
    top.legend(loc="best")
    top.set_title(f"{profile.device}, batch {profile.batch_size}, {profile.dtype}", fontsize=10)

    bottom.plot(
        sizes, [m.peak_bytes / scale for m in ms], "o", color="tab:green", label="measured peak"
    )
    bottom.plot(
        xs, [y / scale for y in line], "-", color="tab:gray",
        label=f"model: {_fmt_bytes(model.base_bytes)} + {_fmt_bytes(model.per_member_bytes)} x B",
    )  # fmt: skip
    budget_label = f"budget {_fmt_bytes(profile.budget_bytes)}"
    if budget_on_scale:
        bottom.axhline(
            profile.budget_bytes / scale, color="tab:red", linestyle="--", label=budget_label
        )
    else:
        bottom.plot([], [], " ", label=f"{budget_label} (off the scale)")
    bottom.axvline(profile.chosen, color="tab:red", linestyle=":", linewidth=1)
    bottom.set_ylabel(f"peak memory ({unit})")
    bottom.set_xlabel("array size B")
    bottom.set_xscale("log", base=2)
    ticks = sorted({*sizes, profile.chosen})
    bottom.set_xticks(ticks, labels=[str(t) for t in ticks])
    bottom.minorticks_off()
    bottom.set_ylim(0, top_bytes * 1.1 / scale)
    bottom.legend(loc="best")
    fig.suptitle(f"Chosen: {profile.reason}", fontsize=8, wrap=True)
    fig.savefig(os.fspath(path), format="png", dpi=100)
