"""A mixed cluster's plan runs the same math: a planner-made plan on two node groups of CPU ranks
(``examples/clusters/cpu-two-speeds.yaml``) with pipeline stages of different lengths and uneven
data-parallel shares, checked against one process by ``autopar verify``; a rank on the wrong
group's GPU is refused."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from autopar.cli import main
from autopar.groups import MixedCluster
from autopar.planner import ModelProfiles
from autopar.planner.assemble import make_plan, to_plan
from autopar.planner.pricing import Pricer
from autopar.request import Constraints, PlanRequest
from autopar.runtime.distributed import node_group, placement_problem

EXAMPLE = Path(__file__).parents[3] / "examples" / "clusters" / "cpu-two-speeds.yaml"
SPEC = f"{__file__}:llama5"


def llama5():
    """Hugging Face Llama with 5 blocks (an odd count: two stages can't be even)."""
    from autopar.zoo import hf

    return hf.llama(layers=5)


@pytest.fixture(scope="module")
def shared_plan():
    """The fastest candidate of the planner's search that places whole replicas on each group
    with uneven shares (the search proves its 30 fastest; the fastest overall puts stages on
    groups instead)."""
    mixed = MixedCluster.from_yaml(EXAMPLE)
    profiles = ModelProfiles.of(SPEC, dtype="fp32", seq=32)
    c = Constraints(pp=2, dp=2, zero=0)
    request = PlanRequest(
        model=SPEC,
        cluster=mixed,
        global_batch=8,
        seq=32,
        dtype="fp32",
        constraints=c,
        top_k=30,
        proven_runners_up=30,
    )
    result = make_plan(request, profiles)
    assert result.plan.node_groups and result.plan.predicted["groups"]
    cand = next(
        x
        for x in result.alternatives
        if len(set(x.strategy.dp_shares)) > 1 and len({sum(n) for n in x.strategy.layout}) > 1
    )
    pricer = Pricer(profiles, mixed.ideal(), dtype="fp32")
    return to_plan(SPEC, pricer, cand, 0.0, mixed=mixed)


def test_uneven_stages_and_shares_verify(shared_plan, tmp_path, capsys) -> None:
    plan = shared_plan
    assert len(set(plan.strategy.dp_shares)) > 1
    assert sorted(len(s.layers) for s in plan.stages) != [len(plan.stages[0].layers)] * 2
    assert "per replica" in plan.text() and "group slow" in plan.text()
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    args = ["verify", SPEC, "--nproc", "4", "--plan", str(path), "--global-batch", "8", "--seq", "32"]
    assert main([*args, "--steps", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["passed"] is True and out["plan"]["node_groups"] == list(plan.node_groups)


def test_a_rank_on_another_groups_gpu_is_refused(shared_plan) -> None:
    a100 = {"name": "A100-SXM4-80GB", "memory_bytes": 80e9}
    h100 = {"name": "H100-SXM5-80GB", "memory_bytes": 80e9}
    groups = [
        {"name": "a100", "gpus_per_node": 2, "num_nodes": 1, "device": a100},
        {"name": "h100", "gpus_per_node": 2, "num_nodes": 1, "device": h100},
    ]
    plan = dataclasses.replace(
        shared_plan, cluster={"name": "m", "groups": groups}, node_groups=("a100", "h100")
    )
    assert node_group(plan, 3)["name"] == "h100"
    assert placement_problem(plan, 0, "NVIDIA A100-SXM4-80GB", 85e9) is None
    assert placement_problem(plan, 2, "NVIDIA H100 80GB HBM3", 85e9) is None
    wrong = placement_problem(plan, 1, "NVIDIA H100 80GB HBM3", 85e9)
    assert wrong is not None and "group a100" in wrong and "node ranks [0]" in wrong
    small = placement_problem(plan, 0, "NVIDIA A100-SXM4-40GB", 42e9)
    assert small is not None and "42 GB" in small
    assert placement_problem(dataclasses.replace(plan, node_groups=()), 0, "anything", 1.0) is None


def test_the_plan_shows_its_groups(shared_plan) -> None:
    """JSON round trip, the text's group lines and the HTML report's table of node groups."""
    from autopar.monitor.report import report_html
    from autopar.plan import Plan

    plan = shared_plan
    assert Plan.from_json(plan.to_json()) == plan and Plan.from_json(plan.to_json()).hash == plan.hash
    lines = [x for x in plan.text().splitlines() if x.startswith("group ")]
    assert [x.split()[1] for x in lines] == ["slow", "fast"] and all("idle" in x for x in lines)
    page, _ = report_html(plan)
    assert "<h2>Node groups</h2>" in page and "node ranks" in page
