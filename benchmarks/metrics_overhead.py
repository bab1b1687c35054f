"""Step time with ``autopar.Metrics`` on (JSONL + Prometheus) against off (world 2, gloo, CPU).

    python benchmarks/metrics_overhead.py [--steps 20]

The same ParallelModel trains the benchmark GPT; the two variants take turns step by step
(``timing.alternate``), the median after the warm-up compared in one run. Target (monitoring
issue): on / off ≤ 1.02. Prints the ratio; exit status 1 above it.
"""

from __future__ import annotations

import argparse
import socket
import sys
import tempfile

import torch
from timing import alternate, dp2_plan, join, report, run_two  # benchmarks/timing.py

from autopar import Metrics
from autopar.runtime import parallelize
from autopar.zoo import GPT, GPTConfig

CFG = GPTConfig(n_layer=4, n_embd=256, n_head=8, vocab_size=1024, block_size=128)
BATCH, SEQ = 8, 128


def worker(rank: int, init: str, plan: str, steps: int, port: int, out: str) -> None:
    join(rank, init)
    from autopar.plan import Plan

    torch.manual_seed(0)
    pm = parallelize(GPT(CFG), Plan.from_json(plan))
    data = torch.randint(
        0, CFG.vocab_size, (steps, BATCH // 2, SEQ), generator=torch.Generator().manual_seed(rank)
    )
    with tempfile.TemporaryDirectory() as folder:
        metrics = Metrics(pm, jsonl=f"{folder}/run.jsonl", prometheus_port=port, memory_every=10)
        counter = iter(range(10**9))

        def with_metrics(batch: torch.Tensor) -> None:
            metrics.step_done(next(counter), pm.train_step(batch))

        times = alternate({"off": pm.train_step, "on": with_metrics}, data)
        metrics.close()
    report(rank, times, out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    with torch.device("meta"):
        meta = GPT(CFG)
    plan = dp2_plan(meta, batch=BATCH, seq=SEQ, zero=0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    t = run_two(worker, plan, args.steps, port)
    ratio = t["on"] / t["off"]
    print(f"median of {args.steps - 3} steps: metrics off {t['off'] * 1e3:.1f} ms, on {t['on'] * 1e3:.1f} ms")
    print(f"on / off = {ratio:.3f} (target ≤ 1.02): {'ok' if ratio <= 1.02 else 'ABOVE TARGET'}")
    return 0 if ratio <= 1.02 else 1


if __name__ == "__main__":
    sys.exit(main())
