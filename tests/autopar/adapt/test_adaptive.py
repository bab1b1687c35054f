"""``autopar.Adaptive`` on 2 gloo processes, in one launch:

1. described with links this machine lacks (NVLink-class loopback): the first window times its
   steps, probes the links and a checkpoint's save/load, and decides exactly what rank 0's
   ``Replanner`` decides on those measurements (recomputed here, in this process: what the
   decision *should* be on real timings is ``test_policy.py``'s and ``benchmarks/adaptive.py``'s);
2. a rank whose peak memory is measured at 95% of its device (``peak_bytes`` stands in for the
   allocator a CPU process does not have) moves the run in process to a plan that keeps what
   the model did not price free: it trains on under it, stays there, leaves no process group
   behind, and the decision is in the metrics' JSONL and the HTML report.

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

from autopar.adapt.policy import AdaptConfig, Replanner
from autopar.cluster import Cluster, LinkSpec
from autopar.measure.launch import launch
from autopar.plan import Plan
from autopar.request import Constraints
from autopar.zoo import GPT, GPTConfig
from tests.conftest import plan_for, profiles_of

pytestmark = pytest.mark.slow  # 2-rank process groups

BATCH, SEQ, STEPS, RUN = 4, 32, 6, 100
LINKS = AdaptConfig(every=2, warmup=1)
MEMORY = AdaptConfig(every=2, warmup=1, probe=False)


def small_gpt() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_embd=64, n_head=4, vocab_size=128, block_size=SEQ))


def nvlink_cpu() -> Cluster:
    cpu = Cluster.preset("cpu")
    return dataclasses.replace(cpu, intra_node=LinkSpec(bandwidth_bytes_per_s=200e9, latency_s=1e-6))


def _train(adaptive: Any, steps: int) -> dict[str, Any]:
    import autopar

    data = torch.randint(0, 128, (256, SEQ), generator=torch.Generator().manual_seed(0))
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
        adaptive = autopar.Adaptive(  # the first STEPS steps of a run of RUN steps
            small_gpt, nvlink_cpu(), steps=RUN, global_batch=BATCH, seq=SEQ, config=LINKS
        )
        first = adaptive.pm.plan.to_json()
        links = _train(adaptive, STEPS)
        links |= {"first": first, "window": adaptive.windows[0]}
        del adaptive

        groups = len(dist.distributed_c10d._world.pg_map)
        peak = (0.5 if rank == 0 else 0.95) * capacity
        adaptive = autopar.Adaptive(
            small_gpt,
            Plan.from_json(memory_plan),
            steps=RUN,
            config=MEMORY,
            constraints=Constraints(reserve_bytes=0.0),
            peak_bytes=lambda: peak,
            metrics={"jsonl": f"{folder}/run.jsonl"},
        )
        memory = _train(adaptive, STEPS)
        memory["leaked"] = len(dist.distributed_c10d._world.pg_map) - groups - len(adaptive.pm.groups)
        if rank == 0:
            torch.save({"links": links, "memory": memory}, out)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("adaptive")
    priced = plan_for(small_gpt, batch=BATCH, seq=SEQ, dp=2, zero=0, reserve_bytes=0.0)
    capacity = int(priced.predicted["memory"][0]["peak_bytes"] / 0.8)  # the plan fills 80% of it
    cpu = Cluster.preset("cpu")
    small = dataclasses.replace(cpu, device=dataclasses.replace(cpu.device, memory_bytes=capacity))
    plan = dataclasses.replace(priced, cluster=small.to_dict())
    args = (f"file://{tmp}/init", str(tmp), plan.to_json(), float(capacity), str(tmp / "out.pt"))
    launch(worker, args=args, nprocs=2)
    record: dict[str, Any] = torch.load(tmp / "out.pt", weights_only=False)
    record["folder"] = tmp
    return record


def test_the_first_window_measures_and_decides_as_the_policy_does(runs: dict[str, Any]) -> None:
    links = runs["links"]
    window, decision = links["window"], links["decisions"][0]
    assert decision["step"] == LINKS.warmup + LINKS.every - 1 and len(window.steps_s) == LINKS.every
    assert window.comm is not None and window.comm.fit("all_reduce", group_size=2, crosses_nodes=False)
    assert window.remaining == RUN - decision["step"] - 1 and window.switch_s > 0
    with torch.device("meta"):
        meta = small_gpt()
    replanner = Replanner(
        meta,
        nvlink_cpu(),
        global_batch=BATCH,
        seq=SEQ,
        dtype="fp32",
        constraints=Constraints(),
        config=LINKS,
        profiles=profiles_of(small_gpt, dtype="fp32", seq=SEQ),
    )
    again = replanner.decide(Plan.from_json(links["first"]), window)
    assert (again.action, again.text.split(";")[0]) == (decision["action"], decision["text"].split(";")[0])
    assert again.now_s == pytest.approx(decision["now_s"]) and again.new_s == pytest.approx(decision["new_s"])
    assert all(math.isfinite(x) for x in links["losses"])


def test_a_rank_near_its_memory_moves_the_run_to_a_plan_with_room(runs: dict[str, Any]) -> None:
    memory = runs["memory"]
    decision = memory["decisions"][0]
    assert decision["action"] == "switch" and decision["trigger"] == "memory", decision["text"]
    assert "passed 90% of its memory" in decision["text"] and decision["took_s"] > 0
    switched = decision["step"] + 1  # the steps up to it trained under the first plan
    plans = memory["plans"]
    assert plans[0]["zero"] == 0 and plans[:switched] == [plans[0]] * switched
    assert plans[switched] != plans[0] and all(p == plans[switched] for p in plans[switched:])
    assert [d["action"] for d in memory["decisions"][1:]] == ["stay"] * (len(memory["decisions"]) - 1)
    assert all(math.isfinite(x) for x in memory["losses"])
    assert memory["leaked"] == 0  # only the running placement's groups: the first one's are gone


def test_decisions_reach_the_metrics_and_the_report(runs: dict[str, Any]) -> None:
    from autopar.monitor import read_jsonl
    from autopar.monitor.report import report_html

    lines = read_jsonl(Path(runs["folder"]) / "run.jsonl")
    events = [line for line in lines if line.get("event") == "adapt"]
    assert [e["action"] for e in events] == [d["action"] for d in runs["memory"]["decisions"]]
    assert len([line for line in lines if "loss" in line]) == STEPS
    plan = plan_for(small_gpt, batch=BATCH, seq=SEQ, dp=2, zero=0, reserve_bytes=0.0)
    page, _ = report_html(plan, metrics=lines)
    assert "Plan decisions during the run" in page and "a rank&#x27;s peak passed 90%" in page
