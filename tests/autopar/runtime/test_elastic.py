"""Elastic training: 4 processes train a TP2×DP2 plan and checkpoint at step 3; 2 processes
resume from that checkpoint under the plan the planner makes for 2 (``autopar replan`` prints the
same one) and train to step 6. Compared with an uninterrupted 4-process run in float64 as
``autopar verify`` compares (losses, and each parameter against its own last update); then the
checkpoint is exported as a torch state dict and as a Hugging Face folder."""

from __future__ import annotations

import datetime
import json
import shutil
from pathlib import Path

import pytest
import torch

from autopar.cluster import Cluster
from autopar.measure.launch import launch
from autopar.measure.verdict import BOUNDS, relative
from autopar.plan import Plan
from autopar.planner import ModelProfiles, make_plan
from autopar.request import Constraints, PlanRequest
from autopar.zoo import hf

pytestmark = pytest.mark.slow  # 4- then 2-rank process groups

BATCH, SEQ, STEPS = 8, 16, 6
SPEC = f"{__file__}:tiny_gpt2"


def tiny_gpt2() -> torch.nn.Module:
    """Hugging Face GPT-2, 2 layers, width 64, float64 (seeded: the same weights every call)."""
    return hf.family("gpt2", layers=2, seq=SEQ).double()


def _plan(world: int, profiles: ModelProfiles, **knobs: object) -> Plan:
    request = PlanRequest(
        model=SPEC,
        cluster=Cluster.preset("cpu", gpus_per_node=world),
        global_batch=BATCH,
        seq=SEQ,
        dtype="fp32",
        constraints=Constraints(**knobs),  # type: ignore[arg-type]
    )
    return make_plan(request, profiles).plan


def worker(rank: int, world: int, init: str, plan_json: str, directory: str, stop: int, out: str) -> None:
    """Resume from ``directory`` (if it holds a checkpoint), train to step ``stop`` checkpointing
    every 2 steps; rank 0 writes where it started, the losses and the weights after each step."""
    import torch.distributed as dist

    import autopar

    dist.init_process_group(
        "gloo", init_method=init, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120)
    )
    torch.set_num_threads(1)
    try:
        pm = autopar.parallelize(tiny_gpt2(), Plan.from_json(plan_json))
        ckpt = autopar.Checkpointer(directory, every=2, keep=4)
        start = ckpt.resume(pm)
        local = BATCH // pm.plan.strategy.dp
        record: dict[str, object] = {"start": start, "losses": [], "params": []}
        for step in range(start, stop):  # the global batch of step k depends on k only
            batch = torch.randint(0, 64, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))
            record["losses"].append(pm.train_step(batch[pm.dp_rank * local : (pm.dp_rank + 1) * local]))  # type: ignore[attr-defined]
            ckpt.step_done(pm, step)
            params = pm.full_state_dict()
            record["params"].append(params)  # type: ignore[attr-defined]
        if rank == 0:
            torch.save(record, out)
    finally:
        dist.destroy_process_group()


def _launch(world: int, plan: Plan, directory: Path, stop: int, out: Path, tag: str) -> dict:
    args = (world, f"file://{directory.parent}/init-{tag}", plan.to_json(), str(directory), stop, str(out))
    launch(worker, args=args, nprocs=world, join=True)
    return torch.load(out, weights_only=True)


def test_four_processes_then_two_resume_under_a_new_plan_like_an_uninterrupted_run(tmp_path, capsys) -> None:
    from autopar.cli import main

    profiles = ModelProfiles.of(SPEC, dtype="fp32", seq=SEQ)  # as `autopar replan` captures it
    four = _plan(4, profiles, tp=2, pp=1, dp=2, micro_batch=2, recompute=("none",))
    two = _plan(2, profiles)  # what rank 0 plans when the job restarts on 2 processes
    print(f"4 processes: {four.text().splitlines()[0]}\n2 processes: {two.text().splitlines()[0]}")
    assert four.mesh != two.mesh
    whole = _launch(4, four, tmp_path / "whole", STEPS, tmp_path / "whole.pt", "w")
    # the job stops after step 3's checkpoint: its directory as it was then
    (tmp_path / "ckpt").mkdir()
    shutil.copytree(tmp_path / "whole" / "step-000000003", tmp_path / "ckpt" / "step-000000003")
    # what a restart would take, from the checkpoint alone
    capsys.readouterr()
    assert main(["replan", SPEC, "--checkpoint", str(tmp_path / "ckpt"), "--cluster", "cpu",
                 "--gpus-per-node", "2", "--json"]) == 0  # fmt: skip
    replan = json.loads(capsys.readouterr().out)
    assert replan["step"] == 3 and replan["old"]["strategy"] == four.to_dict()["strategy"]
    assert replan["new"]["strategy"] == two.to_dict()["strategy"] and replan["changes"]
    second = _launch(2, two, tmp_path / "ckpt", STEPS, tmp_path / "second.pt", "b")
    assert second["start"] == 4
    losses = whole["losses"][:4] + second["losses"]
    gap = max(abs(a - b) for a, b in zip(losses, whole["losses"], strict=True))
    assert gap <= 1e-5, (losses, whole["losses"])
    # each parameter after the last step, against its own last update (verify's parameter check)
    after, before, got = whole["params"][-1], whole["params"][-2], second["params"][-1]
    worst = max(relative(got[k] - after[k], after[k] - before[k]) for k in after)
    print(f"loss difference {gap:.1e}, parameter error {worst:.1e} (relative to the last update)")
    assert worst <= BOUNDS["float64"][2], worst
    _exports(tmp_path, got)


def _exports(tmp_path: Path, final: dict[str, torch.Tensor]) -> None:
    """The final checkpoint (step 5, saved by 2 processes) as a torch state dict and as a HF
    folder: both hold exactly the weights the run ended with."""
    import transformers

    from autopar.cli import main

    assert main(["export", str(tmp_path / "ckpt"), "--to", "torch", str(tmp_path / "w.pt")]) == 0
    weights = torch.load(tmp_path / "w.pt", weights_only=True)
    assert weights.keys() == final.keys() and all(torch.equal(weights[k], final[k]) for k in final)
    assert main(["export", str(tmp_path / "ckpt"), "--to", "hf", str(tmp_path / "hf"), "--model", SPEC]) == 0
    back = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf"), torch_dtype=torch.float64)
    assert all(torch.equal(p, final[k]) for k, p in back.state_dict().items() if k in final)
    assert (
        main(
            ["export", str(tmp_path / "ckpt"), "--to", "hf", str(tmp_path / "x"), "--model", "gpt2"]
        )  # not a HF model
        == 2
    )
