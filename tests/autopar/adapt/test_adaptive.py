"""``autopar.Adaptive`` on 2 gloo processes, in one launch:

1. described with links this machine lacks (NVLink-class loopback), the planner picks ZeRO-3;
   the first window measures the links, and the run moves in process to the plan the calibrated
   model prefers, naming the term that moved; it trains on under it, stays there (no second
   switch), leaves no process group behind, and every decision is in the metrics' JSONL and the
   HTML report;
2. a rank whose peak memory is measured at 95% of its device (``peak_bytes`` stands in for the
   allocator, which a CPU process does not have) moves the run to a plan that keeps what the
   model did not price free.

That a switch changes nothing in the training itself is ``tests/autopar/runtime/test_switch.py``
(float64 against one process)."""

from __future__ import annotations

import dataclasses
import datetime
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from autopar.cluster import Cluster, LinkSpec
from autopar.measure.launch import launch
from autopar.plan import Plan
from autopar.request import Constraints
from autopar.zoo import GPT, GPTConfig
from tests.conftest import plan_for

pytestmark = pytest.mark.slow  # 2-rank process groups

BATCH, SEQ, STEPS, RUN = 4, 32, 12, 100


def wide_gpt() -> torch.nn.Module:
    """Wide for its tokens: on gloo, ZeRO-3's gathers take longer than its compute."""
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=8, n_embd=512, n_head=8, vocab_size=512, block_size=SEQ))


def small_gpt() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_embd=64, n_head=4, vocab_size=128, block_size=SEQ))


def nvlink_cpu() -> Cluster:
    cpu = Cluster.preset("cpu")
    return dataclasses.replace(cpu, intra_node=LinkSpec(bandwidth_bytes_per_s=200e9, latency_s=1e-6))


def _train(adaptive: Any, steps: int, vocab: int) -> dict[str, Any]:
    import autopar

    data = torch.randint(0, vocab, (256, SEQ), generator=torch.Generator().manual_seed(0))
    batches = autopar.GlobalBatches(len(data), BATCH, seed=0)
    losses, plans = [], []
    for step in range(steps):
        pm = adaptive.pm
        loss = pm.train_step(data[batches.local(step, pm)])
        losses.append(loss)
        plans.append(pm.plan.strategy.to_dict())
        adaptive.step_done(step, loss)
    adaptive.close()
    return {"losses": losses, "plans": plans, "decisions": [d.event() for d in adaptive.decisions]}


def worker(rank: int, init: str, folder: str, memory_plan: str, capacity: float, out: str) -> None:
    import torch.distributed as dist

    import autopar

    dist.init_process_group(
        "gloo", init_method=init, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=300)
    )
    torch.set_num_threads(1)
    try:
        groups = len(dist.distributed_c10d._world.pg_map)
        config = autopar.AdaptConfig(every=3, warmup=2)
        adaptive = autopar.Adaptive(  # the first STEPS steps of a run of RUN steps
            wide_gpt,
            nvlink_cpu(),
            steps=RUN,
            global_batch=BATCH,
            seq=SEQ,
            config=config,
            metrics={"jsonl": f"{folder}/run.jsonl"},
        )
        first_plan = adaptive.pm.plan.to_json()
        links = _train(adaptive, STEPS, 512)
        leaked = len(dist.distributed_c10d._world.pg_map) - groups - len(adaptive.pm.groups)
        del adaptive

        peak = (0.5 if rank == 0 else 0.95) * capacity
        config = autopar.AdaptConfig(every=2, warmup=1, probe=False)
        adaptive = autopar.Adaptive(
            small_gpt,
            Plan.from_json(memory_plan),
            steps=6,
            config=config,
            constraints=Constraints(reserve_bytes=0.0),
            peak_bytes=lambda: peak,
        )
        memory = _train(adaptive, 6, 128)
        if rank == 0:
            torch.save({"links": links, "first": first_plan, "leaked": leaked, "memory": memory}, out)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("adaptive")
    priced = plan_for(small_gpt, batch=BATCH, seq=SEQ, dp=2, zero=0, reserve_bytes=0.0)
    capacity = int(priced.predicted["memory"][0]["peak_bytes"] / 0.8)
    cpu = Cluster.preset("cpu")
    small = dataclasses.replace(cpu, device=dataclasses.replace(cpu.device, memory_bytes=capacity))
    plan = dataclasses.replace(priced, cluster=small.to_dict())
    args = (f"file://{tmp}/init", str(tmp), plan.to_json(), float(capacity), str(tmp / "out.pt"))
    launch(worker, args=args, nprocs=2)
    record: dict[str, Any] = torch.load(tmp / "out.pt")
    record["folder"] = tmp
    return record


def test_links_slower_than_described_switch_the_plan_in_the_first_window(runs: dict[str, Any]) -> None:
    first = Plan.from_json(runs["first"]).strategy
    assert (first.dp, first.zero) == (2, 3)  # what NVLink-class links make the planner pick
    decisions = runs["links"]["decisions"]
    assert decisions[0]["action"] == "switch" and decisions[0]["step"] == 4, decisions[0]["text"]
    assert "dp_comm priced from the measured links" in decisions[0]["text"]
    assert decisions[0]["took_s"] > 0 and "the switch took" in decisions[0]["text"]
    assert [d["action"] for d in decisions[1:]] == ["stay"] * (len(decisions) - 1)  # no flapping
    plans = runs["links"]["plans"]
    switched = decisions[0]["step"] + 1  # the steps before it trained under the first plan
    assert plans[:switched] == [first.to_dict()] * switched and plans[switched] != plans[0]
    assert all(p == plans[switched] for p in plans[switched:])
    assert all(math.isfinite(x) for x in runs["links"]["losses"])
    assert runs["leaked"] == 0  # only the running placement's groups: the first's and the probe's are gone


def test_decisions_reach_the_metrics_and_the_report(runs: dict[str, Any]) -> None:
    from autopar.monitor import read_jsonl
    from autopar.monitor.report import report_html

    lines = read_jsonl(Path(runs["folder"]) / "run.jsonl")
    events = [line for line in lines if line.get("event") == "adapt"]
    assert [e["action"] for e in events] == [d["action"] for d in runs["links"]["decisions"]]
    steps = [line for line in lines if "loss" in line]
    assert len(steps) == STEPS
    page, _ = report_html(Plan.from_json(runs["first"]), metrics=lines)
    assert "Plan decisions during the run" in page and "switching dp2 ZeRO-3" in page


def test_a_rank_near_its_memory_moves_the_run_to_a_plan_with_room(runs: dict[str, Any]) -> None:
    decision = runs["memory"]["decisions"][0]
    assert decision["action"] == "switch" and decision["trigger"] == "memory", decision["text"]
    assert "passed 90% of its memory" in decision["text"]
    before, after = runs["memory"]["plans"][0], runs["memory"]["plans"][-1]
    assert before["zero"] == 0 and after != before
    assert all(math.isfinite(x) for x in runs["memory"]["losses"])
