"""Time of one cost-model estimate after capture (target < 50 ms).

    python benchmarks/estimate_speed.py

Captures each model once (cached), then times 200 estimates of a 3D strategy
and prints the median per estimate, then a summary line; exit status 1 if any
median is over 50 ms.
"""

from __future__ import annotations

import statistics
import sys
import time

from autopar.cluster import Cluster
from autopar.cost_models.estimate import estimate
from autopar.planner import ModelProfiles
from autopar.strategy import Strategy

CASES = [
    (
        "gpt3-175b",
        "dgx-a100-80g",
        128,
        dict(
            tp=8,
            pp=16,
            dp=8,
            global_batch=1536,
            seq=2048,
            recompute="full",
            schedule="interleaved",
            virtual_stages=2,
        ),
    ),
    (
        "llama3-405b",
        "dgx-h100",
        256,
        dict(tp=8, pp=16, dp=16, global_batch=2048, seq=8192, recompute="full"),
    ),
    ("llama3-8b", "dgx-h200", 1, dict(tp=1, pp=1, dp=8, zero=3, global_batch=64, seq=8192)),
]


def main() -> int:
    worst = 0.0
    for model, preset, nodes, kw in CASES:
        strategy = Strategy(micro_batch=1, **kw)  # type: ignore[arg-type]
        profile = ModelProfiles.of(model, dtype="bf16", seq=strategy.seq).base
        cluster = Cluster.preset(preset, nodes=nodes)
        times = []
        for _ in range(200):
            t0 = time.perf_counter()
            estimate(profile, cluster, strategy)
            times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        worst = max(worst, med)
        print(f"{model:12s} on {nodes:3d}× {preset:12s}: {1e3 * med:.2f} ms per estimate (median of 200)")
    ok = worst < 0.050
    print(
        f"summary: slowest median {1e3 * worst:.2f} ms per estimate (target < 50 ms): "
        f"{'met' if ok else 'MISSED'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
