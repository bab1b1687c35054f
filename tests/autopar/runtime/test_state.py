"""A checkpoint saved under one ZeRO stage loads exactly under another (torchrun, 2 processes):
ZeRO-1's optimizer state is saved by name from the rank that owns it. One micro-batch per step:
ZeRO 0–1 reduce accumulated gradients once, ZeRO-3 every micro-batch's, which rounds apart."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.conftest import plan_for

pytestmark = pytest.mark.slow  # process groups and torchrun

SCRIPT = """
import datetime, sys
import torch, torch.distributed as dist
import torch.distributed.checkpoint as dcp
from autopar import Cluster, Constraints, PlanRequest
from autopar.planner import make_plan
from autopar.runtime import parallelize
from autopar.zoo import GPT, GPTConfig

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
torch.set_num_threads(1)
CFG = GPTConfig(n_layer=4, n_embd=32, n_head=4, vocab_size=64, block_size=16)

def plan(zero):
    with torch.device("meta"):
        meta = GPT(CFG)
    cons = Constraints(tp=1, pp=1, dp=2, zero=zero, micro_batch=4, recompute=("none",))
    return make_plan(PlanRequest(model=meta, name="tiny", cluster=Cluster.preset("cpu"),
                                 global_batch=8, seq=16, dtype="fp32", constraints=cons)).plan

def model():
    torch.manual_seed(0)
    return GPT(CFG)

rank = dist.get_rank()
data = torch.randint(0, 64, (4, 4, 16), generator=torch.Generator().manual_seed(rank))
source = int(sys.argv[2])
a = parallelize(model(), plan(source))
for i in range(2):
    a.train_step(data[i])
dcp.save(a.state_dict(), checkpoint_id=sys.argv[1])
expected = [a.train_step(data[2]), a.train_step(data[3])]
want = a.full_state_dict()
for zero in (0, 1, 3):
    b = parallelize(model(), plan(zero))
    state = b.state_dict()
    dcp.load(state, checkpoint_id=sys.argv[1])
    b.load_state_dict(state)
    got = [b.train_step(data[2]), b.train_step(data[3])]
    have = b.full_state_dict()
    worst = max((want[k] - have[k]).abs().max().item() for k in want)
    if rank == 0:
        print(f"zero{source}->zero{zero} losses_equal={got == expected} max_param_diff={worst:.1e}")
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_zero1_checkpoint_loads_under_zero_0_1_3(tmp_path) -> None:
    script = tmp_path / "reshard.py"
    script.write_text(SCRIPT)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-port",
            str(_free_port()),
            str(script),
            str(tmp_path / "ckpt"),
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("zero1->")]
    assert len(lines) == 3, proc.stdout
    # two more steps after loading: same losses and bit-identical weights as the run that saved
    for line in lines:
        assert "losses_equal=True" in line and "max_param_diff=0.0e+00" in line, line


def _gpt() -> torch.nn.Module:
    from autopar.zoo import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=4, n_embd=256, n_head=4, vocab_size=64, block_size=16)).double()


def _float32_gpt() -> torch.nn.Module:
    return _gpt().float()


def _plan(tp: int, pp: int, dp: int, zero: int = 0) -> str:
    return plan_for(_float32_gpt, batch=8, seq=16, tp=tp, pp=pp, dp=dp, zero=zero).to_json()


def layout_worker(
    rank: int,
    world: int,
    init: str,
    plan_json: str,
    data: torch.Tensor,
    path: str,
    load: bool,
    make: Callable[[], torch.nn.Module] | None = None,
) -> None:
    """Train ``make()`` (default the float64 GPT) under the plan: after one step save a
    checkpoint (model and AdamW state), or load one; then one more step; rank 0 writes the
    weights after it."""
    import datetime

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import autopar
    from autopar.plan import Plan

    dist.init_process_group(
        "gloo", init_method=init, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120)
    )
    torch.set_num_threads(1)
    try:
        plan = Plan.from_json(plan_json)
        pm = autopar.parallelize((make or _gpt)(), plan)
        rows = slice(pm.dp_rank * 8 // plan.strategy.dp, (pm.dp_rank + 1) * 8 // plan.strategy.dp)
        if load:
            state = pm.state_dict()
            dcp.load(state, checkpoint_id=path)
            pm.load_state_dict(state)
        else:
            pm.train_step(data[0, rows])
            dcp.save(pm.state_dict(), checkpoint_id=path)
        pm.train_step(data[1, rows])
        full = pm.full_state_dict()
        if rank == 0:
            torch.save(full, f"{path}.{'loaded' if load else 'saved'}.pt")
    finally:
        dist.destroy_process_group()


def test_a_tp2_pp2_checkpoint_resumes_under_dp2_and_loads_into_one_process(tmp_path) -> None:
    """Every plan saves the same layout (model and flattened optimizer state by parameter name),
    so a TP2×PP2 checkpoint, AdamW state included, resumes under DP2 ZeRO-3: the step after it
    gives the same weights (float64, within re-association rounding), and its weights load into
    the unmodified model in one process."""
    import torch.distributed.checkpoint as dcp

    from autopar.measure.launch import launch

    data = torch.randint(0, 64, (2, 8, 16), generator=torch.Generator().manual_seed(1))
    path = str(tmp_path / "ckpt")
    for plan, world, load in ((_plan(2, 2, 1), 4, False), (_plan(1, 1, 2, zero=3), 2, True)):
        init = f"file://{tmp_path}/init{world}"
        launch(layout_worker, args=(world, init, plan, data, path, load), nprocs=world, join=True)
    saved, loaded = torch.load(f"{path}.saved.pt"), torch.load(f"{path}.loaded.pt")
    assert set(saved) == set(loaded)
    worst = max(float((saved[k] - loaded[k]).norm() / saved[k].norm().clamp_min(1e-30)) for k in saved)
    print(f"TP2×PP2 checkpoint resumed under DP2 ZeRO-3: next step's weights within {worst:.1e} (relative)")
    assert worst <= 1e-10
    model = _gpt()
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    before = torch.load(f"{path}.saved.pt")
    assert all(not torch.equal(model.state_dict()[k], before[k]) for k in ("wte.weight",))  # one step earlier


def _tiny(n_layer: int) -> torch.nn.Module:
    from autopar.zoo import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=n_layer, n_embd=32, n_head=4, vocab_size=64, block_size=16))


def _dp2_plan(n_layer: int, zero: int = 0) -> str:
    import autopar
    from autopar import Cluster, Constraints

    with torch.device("meta"):
        meta = _tiny(n_layer)
    cons = Constraints(tp=1, pp=1, dp=2, zero=zero, micro_batch=4, recompute=("none",))
    plan = autopar.plan(
        meta, Cluster.preset("cpu", gpus_per_node=2), global_batch=8, seq_len=16, constraints=cons
    )
    return plan.to_json()


def refusal_worker(rank: int, world: int, init: str, plans: list[str], path: str, out: str) -> None:
    """Save a checkpoint; a second save that fails half-way; then load it into the same model,
    another model, the same model with another optimizer, and from a folder that is none."""
    import datetime
    from unittest import mock

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import autopar
    from autopar.errors import AutoparError
    from autopar.plan import Plan

    dist.init_process_group(
        "gloo", init_method=init, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120)
    )
    torch.set_num_threads(1)
    data = torch.randint(0, 64, (2, 4, 16), generator=torch.Generator().manual_seed(rank))
    four, two = (Plan.from_json(p) for p in plans)
    report: dict[str, object] = {}
    try:
        pm = autopar.parallelize(_tiny(4), four)
        pm.train_step(data[0])
        pm.save(path)
        saved = {k: v.clone() for k, v in pm.full_state_dict().items()}
        pm.train_step(data[1])
        with mock.patch.object(dcp, "save", side_effect=OSError("disk full")):
            try:
                pm.save(path)
            except AutoparError as e:  # one line on every rank, naming the cause
                report["failed_save"] = str(e)
        again = autopar.parallelize(_tiny(4), four)
        again.load(path)
        report["kept"] = all(torch.equal(saved[k], v) for k, v in again.full_state_dict().items())
        for name, attempt in (
            ("other_model", lambda: autopar.parallelize(_tiny(2), two).load(path)),
            (
                "other_optimizer",
                lambda: autopar.parallelize(_tiny(4), four, optimizer_cls=torch.optim.SGD).load(path),
            ),
            ("not_a_checkpoint", lambda: pm.load(str(Path(path).parent))),
        ):
            try:
                attempt()
                report[name] = "loaded"
            except AutoparError as e:
                report[name] = str(e)
        with open(f"{out}.{rank}", "w") as f:
            f.write(repr(report))
    finally:
        dist.destroy_process_group()


def test_a_failed_save_keeps_the_last_checkpoint_and_another_models_is_refused(tmp_path) -> None:
    import ast

    from autopar.measure.launch import launch

    path, out = str(tmp_path / "ckpt"), str(tmp_path / "report")
    args = (2, f"file://{tmp_path}/init", [_dp2_plan(4), _dp2_plan(2)], path, out)
    launch(refusal_worker, args=args, nprocs=2, join=True)
    reports = [ast.literal_eval(Path(f"{out}.{r}").read_text()) for r in range(2)]
    assert reports[0] == reports[1]  # every rank refuses alike
    got = reports[0]
    print(got)
    assert "(disk full); the previous checkpoint is intact" in got["failed_save"] and got["kept"] is True
    assert (
        "holds GPT" in got["other_model"]
        and "'blocks.2." in got["other_model"]
        and "weights" in got["other_model"]
    )
    assert "saved with AdamW" in got["other_optimizer"]
    assert "not a checkpoint folder" in got["not_a_checkpoint"]
    assert (Path(path) / "autopar.json").is_file() and not Path(path + ".old").exists()
