"""A run started from a wrong cluster description switches plans by itself (world 2, gloo, CPU).

    python benchmarks/adaptive.py [--steps 40] [--every 4]

The description is this machine with links it does not have: the ``cpu`` preset's loopback
replaced by NVLink-class numbers (200 GB/s, 1 µs). On it the planner prices communication at
almost nothing and picks a plan that communicates a lot. ``autopar.Adaptive`` times the first
window of steps, measures the links (the collectives on this world's groups), calibrates the
cluster, re-plans and, when the switch pays for itself, moves the run to the new plan in
process. Printed, all measured in this one run:

- the first plan, its step measured before the switch and the decision's line;
- the plan switched to: its step as the calibrated model predicted it, and as measured after;
- measured after / before against predicted new / now (the model's own ratio);
- the switch's measured time, its estimate, and the bound it must stay under: what the switch
  saves over the steps left at the measured rates (it pays for itself);
- a second run started from the plan switched to, on the cluster it was planned on: it should
  never switch (no flapping).

Exit status 1 when the first run does not switch in its first window, the step after is not
lower than before, the switch costs more than the bound, or the second run switches.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
from typing import Any

import torch
from timing import join  # benchmarks/timing.py

import autopar
from autopar.adapt import describe
from autopar.cluster import Cluster, LinkSpec
from autopar.measure.launch import launch
from autopar.zoo import GPT, GPTConfig

CFG = GPTConfig(n_layer=8, n_embd=512, n_head=8, vocab_size=512, block_size=32)
BATCH, SEQ = 4, 32
NVLINK = LinkSpec(bandwidth_bytes_per_s=200e9, latency_s=1e-6)


def build() -> torch.nn.Module:
    """The benchmark GPT, seeded: the same weights on every rank and at every call."""
    torch.manual_seed(0)
    return GPT(CFG)


def wrong_cluster() -> Cluster:
    """This machine, described with links it does not have."""
    cpu = Cluster.preset("cpu")
    return dataclasses.replace(cpu, name="cpu-with-nvlink", intra_node=NVLINK)


def worker(rank: int, init: str, start: str, steps: int, every: int, out: str) -> None:
    join(rank, init)
    begin = autopar.Plan.from_json(start) if start.startswith("{") else wrong_cluster()
    config = autopar.AdaptConfig(every=every, warmup=2)
    adaptive = autopar.Adaptive(build, begin, steps=steps, global_batch=BATCH, seq=SEQ, config=config)
    data = torch.randint(0, CFG.vocab_size, (512, SEQ), generator=torch.Generator().manual_seed(0))
    batches = autopar.GlobalBatches(len(data), BATCH, seed=0)
    record: dict[str, Any] = {"first": adaptive.pm.plan.to_json(), "steps": [], "losses": []}
    for step in range(steps):
        pm = adaptive.pm
        loss = pm.train_step(data[batches.local(step, pm)])
        record["steps"].append((step, pm.plan.hash, pm.last_step_s))
        record["losses"].append(loss)
        adaptive.step_done(step, loss)
    record["last"] = adaptive.pm.plan.to_json()
    record["decisions"] = [d.event() for d in adaptive.decisions]
    if rank == 0:
        torch.save(record, out)


def run(start: str, steps: int, every: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/record.pt"
        launch(worker, args=(f"file://{tmp}/init", start, steps, every, out), nprocs=2)
        record: dict[str, Any] = torch.load(out)
    return record


def median_of(record: dict[str, Any], plan_hash: str, skip: int) -> float:
    """The median step of ``plan_hash``'s steps after its first ``skip``."""
    times = [t for _, h, t in record["steps"] if h == plan_hash]
    return statistics.median(times[skip:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=4)
    args = parser.parse_args()
    first = run("wrong", args.steps, args.every)
    switches = [d for d in first["decisions"] if d["action"] == "switch"]
    before_plan, after_plan = autopar.Plan.from_json(first["first"]), autopar.Plan.from_json(first["last"])
    print(f"described: {wrong_cluster().name} (intra-node 200 GB/s, 1 µs)")
    print(f"first plan: {describe(before_plan.strategy)}")
    for d in first["decisions"]:
        print(f"  {d['text']}")
    if not switches:
        print("no switch: FAIL")
        return 1
    switch = switches[0]
    before = median_of(first, before_plan.hash, 2)
    after = median_of(first, after_plan.hash, 2)
    remaining = args.steps - switch["step"] - 1
    bound = (before - after) * remaining
    print(
        f"step before: {before:.3f} s measured ({before_plan.predicted['step_time_s']:.3f} s as first priced)"
    )
    print(f"step after:  {after:.3f} s measured ({switch['new_s']:.3f} s predicted by the calibrated model)")
    print(
        f"after / before: {after / before:.2f} measured, {switch['new_s'] / switch['now_s']:.2f} predicted "
        f"(calibrated model error on the new plan: {switch['new_s'] / after - 1:+.1%})"
    )
    print(
        f"switch: {switch['took_s']:.2f} s measured, {switch['switch_s']:.2f} s estimated; bound "
        f"{bound:.2f} s (what it saves over the {remaining} steps left at the measured rates)"
    )
    second = run(first["last"], args.steps // 2, args.every)
    again = [d for d in second["decisions"] if d["action"] == "switch"]
    print(f"started from {describe(after_plan.strategy)}: {len(again)} switches in {args.steps // 2} steps")
    ok = (
        switch["step"] == args.every + 1  # the first window: warm-up 2, then `every` timed steps
        and after < before
        and switch["took_s"] < bound
        and not again
    )
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
