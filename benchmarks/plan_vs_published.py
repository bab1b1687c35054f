"""autopar's plan against each hand layout of the corpus (benchmarks/runs/), with error bands.

    python benchmarks/plan_vs_published.py [--source ID ...] [--json]

For every distinct job of the priced rows (model, cluster, nodes, global batch, sequence length;
the first row of each), ``autopar plan``'s choice (``planner.make_plan``) against the hand layout
the source ran, both priced by the same cost model (``autopar estimate`` of the hand layout), and
the measured step. A predicted win is only a win when it exceeds the chosen plan's held-out error
band (``cost_models.bands``): within it the two are tied. A hand layout that does not fit as priced
is said so.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

import corpus  # benchmarks/corpus.py

from autopar.planner import Pricer
from autopar.planner.assemble import make_plan
from autopar.request import PlanRequest
from autopar.strategy import Strategy


def _brief(st: Strategy) -> str:
    sched = (
        f" {st.schedule}" + (f" v{st.virtual_stages}" if st.virtual_stages > 1 else "") if st.pp > 1 else ""
    )
    return f"tp{st.tp} pp{st.pp} dp{st.dp} z{st.zero} mb{st.micro_batch}{sched} rc {st.recompute}"


def compare(row: corpus.Row) -> dict[str, Any]:
    """The plan and the hand layout of ``row``'s job, priced alike."""
    profs = corpus.profiles(row.model, row.strategy.seq)
    hand = Pricer(profs, row.cluster, dtype="bf16").estimate(corpus.priced_strategy(row))
    family, fields = row.model
    request = PlanRequest(  # the profiles are passed in: the name only labels the plan
        model=dict(fields)["name"] if family == "zoo" else "corpus-model",
        cluster=row.cluster,
        global_batch=row.strategy.global_batch,
        seq=row.strategy.seq,
    )
    plan = make_plan(request, profs).plan
    best = float(plan.predicted["step_time_s"])
    band = plan.predicted.get("band") or {}
    rel = float(band.get("rel", 0.0))
    gain = hand.step_time_s / best
    return {
        "source": row.source,
        "job": row.name,
        "measured_step_s": row.measured_step_s,
        "hand": _brief(row.strategy),
        "hand_predicted_s": hand.step_time_s,
        "hand_fits": hand.fits,
        "plan": _brief(plan.strategy),
        "plan_predicted_s": best,
        "predicted_gain": gain,
        "band": rel,
        "verdict": "plan faster" if gain > 1 + rel else "hand faster" if gain * (1 + rel) < 1 else "tied",
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--source", action="append", help="only these sources' rows")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    seen: set[tuple[Any, ...]] = set()
    out: list[dict[str, Any]] = []
    for row in corpus.load():
        if row.not_priced or (args.source and row.source not in args.source):
            continue
        key = (
            row.model,
            row.cluster.name,
            row.cluster.num_nodes,
            row.strategy.global_batch,
            row.strategy.seq,
        )
        if key in seen:
            continue
        seen.add(key)
        print(f"planning {row.source}: {row.name}", file=sys.stderr, flush=True)
        try:
            out.append(compare(row))
        except Exception as exc:  # a job the planner finds infeasible: say so, go on
            out.append({"source": row.source, "job": row.name, "error": f"{type(exc).__name__}: {exc}"})
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    for r in out:
        if "error" in r:
            print(f"{r['source']:22s} {str(r['job'])[:44]:44s} plan: {r['error']}")
            continue
        fits = "" if r["hand_fits"] else ", does not fit"
        print(
            f"{r['source']:22s} {str(r['job'])[:44]:44s} measured {r['measured_step_s']:8.2f} s | "
            f"hand {r['hand_predicted_s']:8.2f} s ({r['hand']}{fits}) | "
            f"plan {r['plan_predicted_s']:8.2f} s ({r['plan']}) "
            f"| {r['predicted_gain']:.2f}× ± {100 * r['band']:.0f}%: {r['verdict']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
