"""Every world a job may be restarted on plans or says in one line that nothing fits: 1–64 GPUs
in nodes of 1–8 (what torchrun's elastic restart and ``autopar replan`` hand the planner), for
the GPT ``examples/train_gpt.py`` trains. World 3 crashed the planner (a V schedule over 3 ranks
priced on 4 blocks, whose even split left a rank with one block for its two chunks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from autopar import Cluster, PlanRequest
from autopar.cli import main
from autopar.errors import InfeasibleError
from autopar.plan import validate_plan
from autopar.planner import ModelProfiles, make_plan
from autopar.strategy import Strategy, even_split, fewest_blocks
from autopar.zoo import GPT, GPTConfig

BATCH, SEQ = 16, 64


def example_gpt() -> torch.nn.Module:
    """``examples/train_gpt.py``'s model."""
    return GPT(GPTConfig(n_layer=4, n_embd=128, n_head=4, vocab_size=512, block_size=SEQ))


@pytest.fixture(scope="module")
def profiles() -> ModelProfiles:
    with torch.device("meta"):
        return ModelProfiles.of(example_gpt(), dtype="bf16", seq=SEQ)


@pytest.mark.parametrize("gpus_per_node", range(1, 9))
def test_every_world_plans_or_says_nothing_fits(profiles, gpus_per_node: int) -> None:
    with torch.device("meta"):
        meta = example_gpt()
    planned = []
    for nodes in range(1, 64 // gpus_per_node + 1):
        cluster = Cluster.preset("cpu", nodes=nodes, gpus_per_node=gpus_per_node)
        request = PlanRequest(model=meta, cluster=cluster, global_batch=BATCH, seq=SEQ)
        try:
            plan = make_plan(request, profiles).plan
        except InfeasibleError as e:
            assert str(e).startswith("no strategy fits") and "\n" not in str(e), (nodes, str(e))
            continue
        validate_plan(
            plan,
            world_size=cluster.world_size,
            layer_names=profiles.base.layer_names,
            capacity_bytes=request.capacity_bytes,
        )
        planned.append(cluster.world_size)
    if gpus_per_node == 1:  # 3 and 6 GPUs run 3-stage pipelines (they crashed the planner)
        assert {1, 2, 3, 4, 6, 8, 16} <= set(planned), planned
    # on nodes of 5 or 7 nothing fits: tp divides the node and the 4 heads (1), pp ≤ 4 blocks and
    # dp the batch of 16, so no degrees multiply to a multiple of 5 or 7 (said in one line above)


def test_a_v_schedule_needs_a_block_on_its_first_rank_too() -> None:
    """Rank 0 of a V holds the embedding's and the head's chunks and one block: 2p − 1 blocks in
    all, and the default split gives every rank its least."""
    assert fewest_blocks(pp=3, virtual_stages=2, schedule="zbv") == 5
    assert fewest_blocks(pp=4, virtual_stages=2, schedule="interleaved") == 6
    assert fewest_blocks(pp=3, virtual_stages=1, schedule="1f1b") == 3
    st = Strategy(tp=1, pp=3, dp=1, global_batch=16, seq=SEQ, micro_batch=1, schedule="zbv", virtual_stages=2)
    assert even_split(5, 3) == [2, 2, 1]  # the plain split: rank 2's two chunks get one block
    assert [sum(c) for c in st.blocks_per_rank(5)] == [1, 2, 2]


@pytest.mark.parametrize("gpus_per_node", range(1, 9))
def test_replan_for_every_node_size(tmp_path, capsys, gpus_per_node: int) -> None:
    """``autopar replan`` of a checkpoint of the example's plan (its manifest: what replan reads)."""
    spec = f"{Path(__file__).resolve()}:example_gpt"
    with torch.device("meta"):
        old = make_plan(
            PlanRequest(model=example_gpt(), cluster=Cluster.preset("cpu"), global_batch=BATCH, seq=SEQ)
        ).plan
    folder = tmp_path / "step-000000003"
    folder.mkdir()
    (folder / ".metadata").write_bytes(b"")
    (folder / "autopar.json").write_text(json.dumps({"plan": old.to_dict(), "trainer": {"step": 3}}))
    argv = ["replan", spec, "--checkpoint", str(tmp_path), "--cluster", "cpu"]
    code = main([*argv, "--gpus-per-node", str(gpus_per_node), "--json"])
    out, err = capsys.readouterr()
    if code == 0:
        assert json.loads(out)["new"]["strategy"]["tp"] * json.loads(out)["new"]["strategy"]["pp"] >= 1
    else:
        assert code == 2 and "error: no strategy fits" in err and len(err.strip().splitlines()) == 1, err


def test_validate_plan_checks_stage_order_with_real_errors(profiles) -> None:
    """A plan whose stages hold the model's layers out of order, or a block twice, is refused
    with ``PlanInvariantError`` (``python -O`` keeps it; the old check let any order through)."""
    from dataclasses import replace

    from autopar.errors import PlanInvariantError

    with torch.device("meta"):
        request = PlanRequest(
            model=example_gpt(),
            cluster=Cluster.preset("cpu", nodes=3, gpus_per_node=1),
            global_batch=BATCH,
            seq=SEQ,
        )
    plan = make_plan(request, profiles).plan
    names, cap = profiles.base.layer_names, request.capacity_bytes
    assert plan.strategy.pp == 3
    validate_plan(plan, world_size=3, layer_names=names, capacity_bytes=cap)
    first, second = plan.stages[0], plan.stages[1]
    swapped = (replace(first, layers=second.layers), replace(second, layers=first.layers), *plan.stages[2:])
    reversed_first = (replace(first, layers=first.layers[::-1]), *plan.stages[1:])
    for stages, why in ((swapped, "in model order"), (reversed_first, "in model order")):
        with pytest.raises(PlanInvariantError, match=why):
            validate_plan(replace(plan, stages=stages), world_size=3, layer_names=names, capacity_bytes=cap)
    with pytest.raises(PlanInvariantError, match="not the cluster's 4 GPUs"):
        validate_plan(plan, world_size=4, layer_names=names, capacity_bytes=cap)
