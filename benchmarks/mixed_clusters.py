"""Mixed clusters (issue 49): each case planned on its node groups, on each group alone, and with
every GPU taken as the slowest group's type, by the same cost model; prints the ratios measured in
this run and where the mixed plan's step goes.

    python benchmarks/mixed_clusters.py [--json]

The figures are the cost model's predictions (no GPU has run them); each group is a preset.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

from autopar.cluster import Cluster
from autopar.groups import MixedCluster
from autopar.planner import make_plan
from autopar.request import PlanRequest
from autopar.zoo.registry import model_seq

CASES = [
    ("llama3-70b", 32, (("a100", "dgx-a100-80g", 2), ("h100", "dgx-h100", 2))),
    ("gpt3-175b", 1536, (("a100", "dgx-a100-80g", 16), ("h100", "dgx-h100", 16))),
]
"""(model, global batch, node groups as (name, preset, nodes)): the issue's two cases."""


def mixed_of(groups: tuple[tuple[str, str, int], ...]) -> MixedCluster:
    """Node groups of presets, joined by the slower group's network."""
    made = tuple(dataclasses.replace(Cluster.preset(p, nodes=n), name=name) for name, p, n in groups)
    slow = min((g.inter_node for g in made), key=lambda x: x.bandwidth_bytes_per_s)
    return MixedCluster(name="+".join(g.name for g in made), groups=made, between=slow)


def run_case(model: str, batch: int, groups: tuple[tuple[str, str, int], ...]) -> dict:
    """The mixed plan with its baselines (``make_mixed_plan``) and the figures of the table."""
    mixed = mixed_of(groups)
    start = time.perf_counter()
    seq = model_seq(model, None, dtype="bf16")  # the model's own, as `autopar plan` takes it
    result = make_plan(PlanRequest(model=model, cluster=mixed, global_batch=batch, seq=seq))
    plan, st = result.plan, result.plan.strategy
    return {
        "model": model,
        "cluster": mixed.describe(),
        "step_s": plan.predicted["step_time_s"],
        "plan": f"tp{st.tp} pp{st.pp} dp{st.dp} zero{st.zero} {st.schedule}",
        "blocks_per_stage": [sum(c) for c in st.layout],
        "dp_shares": list(st.dp_shares),
        "node_groups": list(plan.node_groups),
        "breakdown_s": plan.predicted["breakdown_s"],
        "groups": plan.predicted["groups"],
        "baselines": {k: (v["step_time_s"] if v else None) for k, v in plan.why["baselines"].items()},
        "slower_by": {k: (v["slower_by"] if v else None) for k, v in plan.why["baselines"].items()},
        "optimality_gap": plan.optimality_gap,
        "ilps": result.ilps_solved,
        "seconds": time.perf_counter() - start,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    rows = [run_case(*case) for case in CASES]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    for r in rows:
        print(
            f"{r['model']} on {r['cluster']}: {r['step_s']:.3f} s/step, {r['plan']}, "
            f"blocks {r['blocks_per_stage']}"
            + (f", micro-batches per replica {sorted(set(r['dp_shares']))}" if r["dp_shares"] else "")
        )
        for name, slower in r["slower_by"].items():
            got = f"{r['baselines'][name]:.3f} s ({slower:.2f}× slower)" if slower else "does not fit"
            print(f"  {name}: {got}")
        terms = ", ".join(f"{k} {v:.2f}" for k, v in r["breakdown_s"].items() if v > 0)
        print(f"  where the step goes (s): {terms}")
        for g in r["groups"]:
            print(
                f"  group {g['group']}: busy {g['busy_s']:.2f} s, idle {g['idle_s']:.2f} s "
                f"({100 * g['idle_share']:.0f}%)"
            )
        print(
            f"  planned in {r['seconds']:.1f} s ({r['ilps']} layout ILPs, "
            f"gap {100 * r['optimality_gap']:.2f}%)"
        )


if __name__ == "__main__":
    main()
