"""The figures of ``autopar report``, drawn with matplotlib (Agg, no display): the step's
timeline per pipeline rank, memory per stage against capacity, the step's breakdown, and a
run's measured step time and memory against the plan's.

Each function takes plain data (a Plan, its events, metrics lines) and returns a matplotlib
``Figure``; ``svg`` and ``png`` turn one into text to inline or bytes to write.
"""

from __future__ import annotations

import io
from typing import Any

from autopar.cost_models.timeline import Event
from autopar.errors import AutoparError
from autopar.plan import Plan

COLOURS = {
    "forward": "#4c78a8",
    "backward": "#f58518",
    "recompute": "#e45756",
    "tp_comm": "#72b7b2",
    "dp_comm": "#54a24b",
    "optimizer": "#b279a2",
    "weights": "#4c78a8",
    "gradients": "#f58518",
    "activations": "#e45756",
    "loss": "#72b7b2",
    "comm_buffers": "#54a24b",
    "reserve": "#bab0ac",
    "compute": "#4c78a8",
    "p2p": "#9d755d",
    "bubble": "#d8d8d8",
}
"""One colour per term, the same in every figure (Vega's category10 order)."""

RASTER_ABOVE = 4000
"""Timeline segments beyond which the bars are rasterised (embedded in the SVG as a PNG): a
16-stage interleaved plan with 192 micro-batches has ~50 000 of them, 6 MB as vector paths."""
MEMORY_TERMS = ("weights", "gradients", "optimizer", "activations", "loss", "comm_buffers", "reserve")
TIMELINE_KINDS = ("forward", "tp_comm", "recompute", "backward", "dp_comm", "optimizer")


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend, or a one-line error naming the extra to install."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise AutoparError("autopar report draws with matplotlib: pip install 'autopar[report]'") from None
    return plt


def timeline_figure(plan: Plan, events: list[Event]) -> Any:
    """One row per pipeline rank, a bar per segment coloured by kind, pipeline sends as a thin
    bar under the row, idle time (the bubble) grey; micro-batch numbers when they fit."""
    plt = pyplot()
    p = plan.strategy.pp
    fig, ax = plt.subplots(figsize=(11, 0.6 * p + 1.6), layout="constrained")
    end = max(e.end_s for e in events)
    scale, unit = _time_unit(end)
    dense = len(events) > RASTER_ABOVE  # drawn as an image inside the SVG: megabytes of rectangles else
    for rank in range(p):
        ax.broken_barh([(0.0, end * scale)], (rank - 0.4, 0.8), facecolors=COLOURS["bubble"], linewidth=0)
    for kind in (*TIMELINE_KINDS, "p2p"):
        height, offset = (0.12, 0.42) if kind == "p2p" else (0.8, -0.4)
        for rank in range(p):
            spans = [
                (e.start_s * scale, (e.end_s - e.start_s) * scale)
                for e in events
                if e.kind == kind and e.rank == rank
            ]
            if spans:
                ax.broken_barh(
                    spans, (rank + offset, height), facecolors=COLOURS[kind], linewidth=0, rasterized=dense
                )
    if sum(1 for e in events if e.kind == "forward" and e.rank == 0) <= 16:  # room for the numbers
        for e in events:
            if e.kind in ("forward", "backward"):
                ax.text(
                    (e.start_s + e.end_s) / 2 * scale,
                    e.rank,
                    str(e.micro_batch),
                    ha="center",
                    va="center",
                    color="white",
                    fontsize=8,
                )
    ax.set_yticks(range(p), [f"stage {k}" for k in range(p)])
    ax.set_ylim(p - 0.4, -0.6)
    ax.set_xlabel(f"time in the step ({unit})")
    kinds = (*TIMELINE_KINDS, "p2p", "bubble")
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLOURS[k]) for k in kinds]
    labels = [{"p2p": "pipeline send", "bubble": "idle (bubble)"}.get(k, k.replace("_", " ")) for k in kinds]
    ax.legend(handles, labels, ncols=4, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    return fig


def memory_figure(plan: Plan) -> Any:
    """Stacked bars per stage (GiB) by term, with the device's capacity as a line."""
    plt = pyplot()
    memory = plan.predicted["memory"]
    fig, ax = plt.subplots(figsize=(11, 0.5 * len(memory) + 1.6), layout="constrained")
    left = [0.0] * len(memory)
    for term in MEMORY_TERMS:
        widths = [m[term] / 2**30 for m in memory]
        ax.barh(range(len(memory)), widths, left=left, color=COLOURS[term], label=term.replace("_", " "))
        left = [a + b for a, b in zip(left, widths, strict=True)]
    capacity = plan.predicted["memory_capacity_bytes"] / 2**30
    ax.axvline(capacity, color="black", linestyle="--", linewidth=1, label=f"capacity {capacity:.1f} GiB")
    ax.set_yticks(range(len(memory)), [f"stage {m['stage']}" for m in memory])
    ax.invert_yaxis()
    ax.set_xlabel("predicted peak memory per GPU (GiB)")
    ax.legend(ncols=4, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    return fig


def breakdown_figure(plan: Plan) -> Any:
    """The predicted step time by term, one bar each (the terms add up to the step)."""
    plt = pyplot()
    terms = plan.predicted["breakdown_s"]
    fig, ax = plt.subplots(figsize=(11, 0.35 * len(terms) + 1.2), layout="constrained")
    names = list(terms)
    scale, unit = _time_unit(max(terms.values()) or 1.0)
    ax.barh(names, [terms[n] * scale for n in names], color=[COLOURS.get(n, "#888888") for n in names])
    ax.invert_yaxis()
    ax.set_xlabel(f"predicted time ({unit}) of the step's {plan.predicted['step_time_s']:.4g} s")
    return fig


def run_figure(plan: Plan, steps: list[dict[str, Any]], ranks: list[dict[str, Any]]) -> Any:
    """Measured step time per step against the prediction, and each rank's last measured peak
    memory against its stage's predicted peak."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.4), layout="constrained")
    xs = [s["step"] for s in steps]
    left.plot(xs, [s["step_time_s"] for s in steps], marker=".", color=COLOURS["forward"], label="measured")
    left.axhline(plan.predicted["step_time_s"], color="black", linestyle="--", label="predicted")
    left.set_xlabel("step")
    left.set_ylabel("step time (s)")
    left.legend(frameon=False)
    if ranks:
        r = [x["rank"] for x in ranks]
        right.bar(
            r,
            [x["peak_memory_bytes"] / 2**30 for x in ranks],
            color=COLOURS["activations"],
            label="measured peak",
        )
        right.scatter(
            r,
            [x["predicted_peak_memory_bytes"] / 2**30 for x in ranks],
            color="black",
            marker="_",
            s=400,
            label="predicted peak",
            zorder=3,
        )
        right.set_xticks(r)
        right.legend(frameon=False)
    right.set_xlabel("rank")
    right.set_ylabel("memory (GiB)")
    return fig


def _time_unit(longest_s: float) -> tuple[float, str]:
    """(scale, unit) that shows ``longest_s`` in s, ms or µs."""
    if longest_s >= 1.0:
        return 1.0, "s"
    if longest_s >= 1e-3:
        return 1e3, "ms"
    return 1e6, "µs"


def render(fig: Any, name: str, *, with_png: bool) -> tuple[str, bytes | None]:
    """The figure as an inline ``<svg>`` element (text as text, ids salted with ``name`` so that
    several figures share a page), and as PNG bytes at 100 dpi when ``with_png``; then closed."""
    import matplotlib

    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": name}):
        buf = io.StringIO()
        fig.savefig(buf, format="svg")
    image = None
    if with_png:
        raw = io.BytesIO()
        fig.savefig(raw, format="png", dpi=100)
        image = raw.getvalue()
    pyplot().close(fig)
    text = buf.getvalue()
    return text[text.index("<svg") :], image


__all__ = ["breakdown_figure", "memory_figure", "render", "run_figure", "timeline_figure"]
