"""``autopar report``: a plan (and, optionally, a run's metrics) as one self-contained HTML page.

The page has no scripts and fetches nothing: figures are inline SVG (``monitor.figures``),
styles inline. Every number printed from the plan carries its exact value in a ``data-value``
attribute next to the key it came from (``data-key="predicted.step_time_s"``), so that a test
or a script can check the page against ``Plan.predicted``.
"""

from __future__ import annotations

import html
import statistics
from collections.abc import Callable
from typing import Any

from autopar.cost_models.bands import band_text
from autopar.cost_models.timeline import simulate, stage_times_from_dicts
from autopar.errors import AutoparError
from autopar.monitor import figures
from autopar.plan import Plan, cluster_title
from autopar.units import format_bytes

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.8em; }
table { border-collapse: collapse; margin: 0.6em 0; font-size: 0.92em; }
td, th { border-bottom: 1px solid #ddd; padding: 0.25em 0.7em; text-align: right; }
td:first-child, th:first-child { text-align: left; }
pre { background: #f6f6f6; padding: 0.7em; overflow-x: auto; }
figure { margin: 0.5em 0; } figcaption { color: #555; font-size: 0.9em; }
svg { max-width: 100%; height: auto; }
"""


def report_html(
    plan: Plan,
    *,
    metrics: list[dict[str, Any]] | None = None,
    dryrun: list[dict[str, Any]] | None = None,
    with_png: bool = False,
) -> tuple[str, dict[str, bytes]]:
    """The page, and the figures as PNG bytes by name when ``with_png``; ``dryrun``: the ranks of
    ``autopar dryrun --json`` (``DryRun.to_dict``), shown next to the predicted memory."""
    if "stage_times" not in plan.predicted:
        raise AutoparError(
            "this plan was written by an older autopar (its prediction has no per-stage times): "
            "make it again with `autopar plan … --out`"
        )
    pngs: dict[str, bytes] = {}

    def figure(name: str, fig: Any, caption: str) -> str:
        svg, image = figures.render(fig, name, with_png=with_png)
        if image is not None:
            pngs[name] = image
        return f'<figure id="{name}">{svg}<figcaption>{html.escape(caption)}</figcaption></figure>'

    events = simulate(
        plan.strategy, stage_times_from_dicts(plan.predicted["stage_times"]), plan.predicted["p2p_hop_s"]
    )
    makespan = max(e.end_s for e in events)
    body = [
        _header(plan),
        "<h2>One step, per pipeline stage</h2>",
        figure(
            "timeline",
            figures.timeline_figure(plan, events),
            f"The plan's per-stage times laid out by its {plan.strategy.schedule} schedule: "
            f"{makespan:.4g} s. The predicted step, {plan.predicted['step_time_s']:.4g} s, prices "
            "every stage at the slowest one (cost_models/timeline.py).",
        ),
        "<h2>Step time by term</h2>",
        _breakdown_table(plan),
        figure("breakdown", figures.breakdown_figure(plan), "The terms add up to the predicted step."),
        "<h2>Memory per stage</h2>",
        _memory_table(plan),
        figure("memory", figures.memory_figure(plan), "Predicted peak per GPU of each stage, by term."),
        *(
            ["<h2>Dry run: each distinct rank's program on fake tensors</h2>", _dryrun_table(dryrun)]
            if dryrun
            else []
        ),
        "<h2>Stages</h2>",
        _stages_table(plan) + _groups_table(plan),
        "<h2>Why this plan: runners-up and baselines</h2>",
        _why_table(plan),
    ]
    if metrics is not None:
        body += _run_section(plan, metrics, figure)
    title = html.escape(f"autopar plan: {plan.model}")
    page = (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{title}</title>'
        f"<style>{STYLE}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n"
    )
    return page, pngs


def _run_section(
    plan: Plan, metrics: list[dict[str, Any]], figure: Callable[[str, Any, str], str]
) -> list[str]:
    """The run against the plan: its steps' table and the measured-against-predicted figure."""
    steps = [m for m in metrics if "ranks" not in m and "event" not in m]
    ranks: list[dict[str, Any]] = next((m["ranks"] for m in reversed(metrics) if "ranks" in m), [])
    events = [m for m in metrics if "event" in m]
    if not steps:
        raise AutoparError("the metrics file has no step lines: is it a Metrics(jsonl=…) file?")
    return [
        "<h2>The run against the plan</h2>",
        _run_table(plan, steps),
        figure("run", figures.run_figure(plan, steps, ranks), "Measured against predicted."),
        *_events(events),
    ]


def _events(events: list[dict[str, Any]]) -> list[str]:
    """The run's plan decisions (``autopar.Adaptive``), one row each."""
    if not events:
        return []
    rows = [
        f"<td>{int(e['step'])}</td><td>{html.escape(str(e.get('action', e['event'])))}</td>"
        f"<td>{html.escape(str(e.get('text', '')))}</td>"
        for e in events
    ]
    return ["<h3>Plan decisions during the run</h3>", _table(["step", "decision", "why"], rows)]


def _value(key: str, value: float, text: str) -> str:
    """A table cell showing ``text`` for the plan's ``key``, its exact value in ``data-value``."""
    return f'<td data-key="{html.escape(key)}" data-value="{float(value)!r}">{html.escape(text)}</td>'


def _table(head: list[str], rows: list[str]) -> str:
    cols = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    return f"<table><tr>{cols}</tr>" + "".join(f"<tr>{r}</tr>" for r in rows) + "</table>"


def _header(plan: Plan) -> str:
    p = plan.predicted
    peak = max(m["peak_bytes"] for m in p["memory"])
    capacity = format_bytes(p["memory_capacity_bytes"])
    shown = [
        ("step time", "step_time_s", p["step_time_s"], f"{p['step_time_s']:.4g} s"),
        ("tokens/s", "tokens_per_s", p["tokens_per_s"], f"{p['tokens_per_s']:,.0f}"),
        ("model TFLOP/s per GPU", "tflops_per_gpu", p["tflops_per_gpu"], f"{p['tflops_per_gpu']:.1f}"),
        ("MFU", "mfu", p["mfu"], f"{100 * p['mfu']:.1f}%"),
        ("HFU", "hfu", p["hfu"], f"{100 * p['hfu']:.1f}%"),
        ("largest stage peak / capacity", "peak_bytes", peak, f"{format_bytes(peak)} / {capacity}"),
    ]
    rows = [f"<td>{label}</td>" + _value(f"predicted.{key}", v, text) for label, key, v, text in shown]
    rows.append(
        f"<td>solved in</td><td>{plan.solve_time_s:.2f} s (proven gap {100 * plan.optimality_gap:.2f}%)</td>"
    )
    notes = "".join(f"<li>{html.escape(n)}</li>" for n in p.get("notes", []))
    where = f"{plan.model} on {cluster_title(plan.cluster)}"
    return (
        f"<h1>{html.escape(where)}</h1>"
        f"<pre>{html.escape(plan.text())}</pre>"
        + _table(["predicted", ""], rows)
        + f"<p>Compute priced with {html.escape(p.get('compute_basis', ''))}.</p>"
        + (f"<p>Error band: step {html.escape(band_text(p['band']))}.</p>" if p.get("band") else "")
        + (f"<ul>{notes}</ul>" if notes else "")
    )


def _dryrun_table(ranks: list[dict[str, Any]]) -> str:
    """Per dry-run rank: built or the step that failed, its measured peak next to the cost model's
    (both without the reserve a dry run does not hold), and the states it keeps."""
    rows = []
    for r in ranks:
        rank = int(r["rank"])
        measured, predicted = float(r["peak_bytes"]), float(r["predicted_peak_bytes"])
        ratio = f"{measured / predicted:.2f}" if predicted > 0 and not r["failure"] else ""
        rows.append(
            f"<td>{rank}</td><td>{html.escape(str(r['role']))}</td>"
            f"<td>{html.escape(str(r['failure']) or 'built and stepped')}</td>"
            + _value(f"dryrun.{rank}.peak_bytes", measured, format_bytes(measured))
            + _value(f"dryrun.{rank}.predicted_peak_bytes", predicted, format_bytes(predicted))
            + f"<td>{ratio}</td>"
            + "<td>"
            + " / ".join(
                format_bytes(float(r[k])) for k in ("parameter_bytes", "gradient_bytes", "optimizer_bytes")
            )
            + "</td>"
        )
    head = ["rank", "role", "program", "dry-run peak", "predicted", "dry run ÷ predicted"]
    return _table([*head, "parameters / gradients / optimizer"], rows)


def _breakdown_table(plan: Plan) -> str:
    terms, step = plan.predicted["breakdown_s"], plan.predicted["step_time_s"]
    rows = [
        f"<td>{html.escape(name.replace('_', ' '))}</td>"
        + _value(f"predicted.breakdown_s.{name}", s, f"{s:.4g} s")
        + f"<td>{100 * s / step:.1f}%</td>"
        for name, s in terms.items()
    ]
    return _table(["term", "seconds", "share of step"], rows)


def _memory_table(plan: Plan) -> str:
    rows = []
    for m in plan.predicted["memory"]:
        k = m["stage"]
        cells = "".join(
            _value(f"predicted.memory.{k}.{term}", m[term], format_bytes(m[term]))
            for term in (*figures.MEMORY_TERMS, "peak_bytes")
        )
        rows.append(f"<td>stage {k}</td>{cells}")
    head = ["", *(t.replace("_", " ") for t in figures.MEMORY_TERMS), "peak"]
    return _table(head, rows)


def _groups_table(plan: Plan) -> str:
    """A mixed cluster's groups: their node ranks, what each runs, its devices' busy and idle time
    (nothing on one type of node)."""
    if not plan.node_groups:
        return ""
    rows = []
    for g in plan.predicted.get("groups", ()):
        nodes = [i for i, name in enumerate(plan.node_groups) if name == g["group"]]
        rows.append(
            f"<td>{html.escape(g['group'])}</td><td>{g['gpus']}× {html.escape(g['device'])}</td>"
            f"<td>{nodes}</td><td>{g['pipeline_ranks']}</td><td>{g['replicas']}</td>"
            f"<td>{'/'.join(map(str, g['micro_batches']))}</td>"
            f"<td>{g['busy_s']:.4g} s</td><td>{g['idle_s']:.4g} s ({100 * g['idle_share']:.0f}%)</td>"
        )
    head = ["group", "devices", "node ranks", "pipeline ranks", "replicas", "micro-batches", "busy", "idle"]
    return "<h2>Node groups</h2>" + _table(head, rows)


def _stages_table(plan: Plan) -> str:
    rows = [
        f"<td>{s.index}</td><td>{html.escape(s.layers_summary)}</td>"
        f"<td>{html.escape(s.recompute_summary)}</td>"
        + _value(
            f"stages.{s.index}.time_per_micro_batch_s",
            s.time_per_micro_batch_s,
            f"{1e3 * s.time_per_micro_batch_s:.2f} ms",
        )
        + _value(
            f"stages.{s.index}.comm_per_micro_batch_s",
            s.comm_per_micro_batch_s,
            f"{1e3 * s.comm_per_micro_batch_s:.2f} ms",
        )
        for s in plan.stages
    ]
    comm = "of which TP/CP comm" if plan.strategy.cp > 1 else "of which TP comm"  # cp's K/V gathers too
    return _table(["stage", "layers", "recompute", "time/micro-batch", comm], rows)


def _why_table(plan: Plan) -> str:
    if not plan.why:
        return "<p>This plan file holds no runners-up (it was not written by <code>autopar plan</code>).</p>"
    rows = []
    labelled = [(f"runner-up {i}", c) for i, c in enumerate(plan.why.get("alternatives", []), 1)]
    for label, c in [*labelled, *plan.why.get("baselines", {}).items()]:
        if c is None:
            rows.append(
                f"<td>{html.escape(label)}</td>" + "<td>-</td>" * 7 + "<td>does not fit</td><td></td>"
            )
            continue
        st = c["strategy"]
        sched = st["schedule"] + (f" v={st['virtual_stages']}" if st["virtual_stages"] > 1 else "")
        degrees = "".join(f"<td>{st.get(k, 1)}</td>" for k in ("tp", "pp", "dp", "cp", "zero", "micro_batch"))
        versus = "tied (within the band)" if c.get("tied") else f"{c['slower_by']:.2f}× slower"
        rows.append(
            f"<td>{html.escape(label)}</td>{degrees}<td>{html.escape(sched)}</td>"
            f"<td>{c['step_time_s']:.4g}</td><td>{versus}</td>"
        )
    return _table(
        ["", "tp", "pp", "dp", "cp", "zero", "micro-batch", "schedule", "step s", "vs chosen"], rows
    )


def _run_table(plan: Plan, steps: list[dict[str, Any]]) -> str:
    """Median measured step time and the last peak memory against the prediction."""
    measured = statistics.median(s["step_time_s"] for s in steps)
    predicted = plan.predicted["step_time_s"]
    peak, predicted_peak = steps[-1]["peak_memory_bytes"], steps[-1]["predicted_peak_memory_bytes"]
    rows = [
        f"<td>step time (median of {len(steps)})</td><td>{measured:.4g} s</td><td>{predicted:.4g} s</td>"
        f"<td>{measured / predicted:.2f}</td>",
        f"<td>peak memory, rank 0</td><td>{format_bytes(peak)}</td><td>{format_bytes(predicted_peak)}</td>"
        f"<td>{peak / predicted_peak:.2f}</td>",
    ]
    profiled = [s for s in steps if "collective_s" in s]
    if profiled:
        comm = statistics.median(s["collective_s"] for s in profiled)
        said = profiled[-1]["predicted_comm_s"]
        rows.append(
            f"<td>time in collectives (median of {len(profiled)} profiled; in flight, hidden or not)</td>"
            f"<td>{comm:.4g} s</td><td>{said:.4g} s exposed</td><td>{comm / said:.2f}</td>"
        )
    if "grad_norm" in steps[-1]:
        rows.append(
            f"<td>gradient norm, last step</td><td>{steps[-1]['grad_norm']:.4g}</td><td></td><td></td>"
        )
    return _table(["", "measured", "predicted", "measured / predicted"], rows)


__all__ = ["report_html"]
