"""Dry runs at full scale (issue 46): the planner's top plans for the named models, every distinct
rank role simulated on this CPU (``autopar dryrun``), its peak next to the cost model's.

    python benchmarks/dryrun_zoo.py [--top 5] [--case NAME ...] [--json FILE]

Cases: GPT-3 175B on 1,024 A100s; Llama-3 405B on 16,384 H100s under the interleaved zero-bubble
and the interleaved 1F1B schedules; DeepSeek-V3 on 2,048 H100s (expert parallel); Llama-3 8B on
8 H100s with per-operator recompute policies only; GPT-2 large (tied embedding and head) under PP2 ×
HSDP (2 replicas × 2 shards) × TP2. Each plan's runners-up are planned again with their knobs
pinned (``request.pinned``) and dry-run the same way.

Per plan, one fresh process (``python -m autopar dryrun MODEL --plan FILE --json``): per rank
role its dry-run peak, the predicted peak (without the reserve), their ratio and the seconds it
took; per process its peak resident memory (``os.wait4``). Targets: every role built and stepped,
≤ 60 s each, ≤ 24 GiB resident, peak within 5% of the prediction (the ratio is printed; a miss is
reported, not hidden). Exit status 1 if a role failed or a time or memory target is missed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from autopar import Cluster, PlanRequest
from autopar.planner import ModelProfiles, make_plan
from autopar.request import Constraints, pinned
from autopar.zoo.registry import model_seq

ROLE_S, RSS_GIB, RATIO = 60.0, 24.0, 0.05


@dataclass(frozen=True)
class Case:
    name: str
    model: str
    cluster: str
    nodes: int
    global_batch: int
    seq: int | None = None
    fixed: dict[str, Any] = field(default_factory=dict)


CASES = (
    Case("gpt3-175b", "gpt3-175b", "dgx-a100-80g", 128, 1536),
    Case("llama3-405b-zb", "llama3-405b", "dgx-h100", 2048, 2048, 8192, {"schedule": "interleaved-zb"}),
    Case("llama3-405b-interleaved", "llama3-405b", "dgx-h100", 2048, 2048, 8192, {"schedule": "interleaved"}),
    Case("deepseek-v3", "deepseek-v3-671b", "dgx-h100", 256, 15360, 4096),
    Case("llama3-8b-sac", "llama3-8b", "dgx-h100", 1, 32, 8192, {"recompute": ("sac",)}),
    Case(
        "gpt2-large-tied",
        "gpt2-large",
        "dgx-a100-80g",
        2,
        64,
        1024,
        {"tp": 2, "pp": 2, "dp": 4, "dp_replicate": 2, "zero": 3},
    ),
)


def plans_of(case: Case, top: int) -> list[Any]:
    """The chosen plan and up to ``top`` − 1 runners-up, each a whole Plan (knobs pinned)."""
    cluster = Cluster.preset(case.cluster, nodes=case.nodes)
    request = PlanRequest(
        model=case.model,
        cluster=cluster,
        global_batch=case.global_batch,
        seq=model_seq(case.model, case.seq),
        constraints=Constraints(**case.fixed),
        top_k=max(top - 1, 1),
        proven_runners_up=top - 1,  # the next fastest, proven, as ``autopar plan --check`` tries them
    )
    profiles = ModelProfiles.of(case.model, dtype=request.dtype, seq=request.seq)
    result = make_plan(request, profiles)
    plans = [result.plan]
    for alt in result.alternatives[: top - 1]:
        plans.append(make_plan(pinned(request, alt.strategy), profiles).plan)
    return plans


def dry_run_process(model: str, plan: Any) -> tuple[dict[str, Any], float, float]:
    """``autopar dryrun`` of every distinct rank of ``plan`` in a fresh process: its JSON, wall
    seconds and peak resident GiB (``ru_maxrss`` of that child, KiB on Linux)."""
    with tempfile.TemporaryDirectory() as tmp:
        path, out, err = (os.path.join(tmp, n) for n in ("plan.json", "out.json", "err.txt"))
        with open(path, "w") as f:
            f.write(plan.to_json())
        start = time.perf_counter()
        cmd = [sys.executable, "-m", "autopar", "dryrun", model, "--plan", path, "--json"]
        with open(out, "w") as fo, open(err, "w") as fe:
            proc = subprocess.Popen(cmd, stdout=fo, stderr=fe)
            _, status, usage = os.wait4(proc.pid, 0)
        wall, rss_gib = time.perf_counter() - start, usage.ru_maxrss / 2**20
        with open(out) as fo, open(err) as fe:
            text, why = fo.read(), fe.read().strip().splitlines()
    code = os.waitstatus_to_exitcode(status)
    if code not in (0, 2) or not text.strip():
        return {"ranks": [], "error": why[-1] if why else f"exit status {code}"}, wall, rss_gib
    return json.loads(text), wall, rss_gib


def describe(plan: Any) -> str:
    st = plan.strategy
    sched = st.schedule + (f" v{st.virtual_stages}" if st.virtual_stages > 1 else "")
    ep = f" ep{st.ep}" if st.ep > 1 else ""
    hsdp = f" hsdp{st.dp_replicate}" if st.dp_replicate > 1 else ""
    return f"tp{st.tp} pp{st.pp} dp{st.dp}{ep}{hsdp} zero{st.zero} mb{st.micro_batch} {sched}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--top", type=int, default=5, help="plans per case: the chosen and runners-up")
    ap.add_argument("--case", action="append", choices=[c.name for c in CASES], help="only these cases")
    ap.add_argument("--json", default=None, help="write every row as JSON to this file")
    args = ap.parse_args()
    rows, ok = [], True
    for case in CASES:
        if args.case and case.name not in args.case:
            continue
        for i, plan in enumerate(plans_of(case, args.top)):
            found, wall, rss = dry_run_process(case.model, plan)
            print(f"{case.name} #{i + 1} {describe(plan)}: {wall:.0f} s, {rss:.1f} GiB resident", flush=True)
            if "error" in found:
                print(f"  FAILED: {found['error']}")
                ok = False
            for r in found["ranks"]:
                row = {"case": case.name, "plan": i + 1, "layout": describe(plan), "rss_gib": rss, **r}
                rows.append(row)
                ok &= _report(row)
            ok &= rss <= RSS_GIB
            if args.json:  # after every plan: a long run interrupted keeps what it measured
                with open(args.json, "w") as f:
                    json.dump(rows, f, indent=1)
    return 0 if ok else 1


def _report(row: dict[str, Any]) -> bool:
    """One rank role's line; whether it met the build and time targets."""
    if row.get("failure"):
        print(f"  rank {row['rank']} ({row['role']}): FAILED {row['failure']}")
        return False
    predicted = row["predicted"].get("peak_bytes", 0.0) - row["predicted"].get("reserve", 0.0)
    ratio = row["peak_bytes"] / predicted if predicted > 0 else float("nan")
    flag = "" if abs(ratio - 1) <= RATIO else "  (off by more than 5%)"
    print(
        f"  rank {row['rank']:>6} ({row['role']}): peak {row['peak_bytes'] / 2**30:.1f} GiB, "
        f"predicted {predicted / 2**30:.1f} GiB, ratio {ratio:.3f}, {row['seconds']:.0f} s{flag}"
    )
    return bool(row["seconds"] <= ROLE_S)


if __name__ == "__main__":
    sys.exit(main())
