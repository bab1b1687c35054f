"""autopar.Checkpointer on 2 gloo processes: saves every N steps keeping the newest K, a SIGTERM
on one rank makes every rank save at the end of the step and exit 0, and a fresh start resumes
after the newest checkpoint with the random state each rank had."""

from __future__ import annotations

import datetime
import json
import os
import signal

import pytest
import torch
from torch.multiprocessing import ProcessExitedException

from autopar.measure.launch import launch
from autopar.zoo import GPT, GPTConfig
from tests.conftest import plan_for

pytestmark = pytest.mark.slow  # 2-rank process groups, one killed


def _gpt() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16))


def _plan() -> str:
    return plan_for(_gpt, batch=4, seq=16, tp=1, pp=1, dp=2, zero=0).to_json()


def worker(rank: int, init: str, plan_json: str, directory: str, term_at: int | None, out: str) -> None:
    """Train up to 8 steps with a Checkpointer (every 2, keep 2); rank 1 sends itself SIGTERM
    during step ``term_at``. Writes where it started, and each rank's random state after
    resuming."""
    import torch.distributed as dist

    import autopar
    from autopar.plan import Plan

    dist.init_process_group(
        "gloo", init_method=init, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60)
    )
    torch.set_num_threads(1)
    pm = autopar.parallelize(_gpt(), Plan.from_json(plan_json))
    torch.manual_seed(100 + rank)  # each rank its own random state (a loop that seeds by rank)
    ckpt = autopar.Checkpointer(directory, every=2, keep=2)
    start = ckpt.resume(pm)
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"start": start, "rng": torch.get_rng_state()[:64].tolist()}, f)
    for step in range(start, 8):
        batch = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(step))
        pm.train_step(batch[rank * 2 : rank * 2 + 2])
        if step == term_at and rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # a preemption notice mid-step
        torch.rand(1)  # the loop draws random numbers: the checkpoint keeps each rank's state
        ckpt.step_done(pm, step)
    dist.destroy_process_group()


def test_sigterm_saves_then_resume_continues_after_it(tmp_path) -> None:
    plan = _plan()
    directory, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    # every 2 steps: step-1 and step-3 saved; SIGTERM in step 4 → step-4 saved, step-1 pruned
    launch(worker, args=(f"file://{tmp_path}/i1", plan, directory, 4, out), nprocs=2, join=True)
    assert sorted(os.listdir(directory)) == ["step-000000003", "step-000000004"]
    saved = json.loads((tmp_path / "ckpt" / "step-000000004" / "autopar.json").read_text())["trainer"]
    assert saved["step"] == 4 and len(saved["rng"]) == 2 and saved["rng"][0] != saved["rng"][1]
    # a fresh start resumes at step 5 with each rank's random state as it was saved
    launch(worker, args=(f"file://{tmp_path}/i2", plan, directory, None, out + "r"), nprocs=2, join=True)
    import base64

    for rank in (0, 1):
        resumed = json.loads((tmp_path / f"outr.{rank}").read_text())
        assert resumed["start"] == 5
        state = torch.frombuffer(bytearray(base64.b64decode(saved["rng"][rank])), dtype=torch.uint8)
        assert resumed["rng"] == state[:64].tolist()
    assert sorted(os.listdir(directory)) == ["step-000000005", "step-000000007"]


def async_worker(rank: int, init: str, plan_json: str, directory: str, kill_at: int | None, out: str) -> None:
    """Train 8 steps (AdamW, its LR halved every 3 steps) with an asynchronous Checkpointer (every
    2, keeping the LR scheduler's state too); rank 1 SIGKILLs itself right
    after step ``kill_at``'s save started (its write in flight, not yet committed). Rank 0 writes
    where it started and the final weights."""
    import torch.distributed as dist

    import autopar
    from autopar.plan import Plan

    dist.init_process_group(
        "gloo", init_method=init, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60)
    )
    torch.set_num_threads(1)
    pm = autopar.parallelize(_gpt(), Plan.from_json(plan_json))
    (optimizer,) = pm.optimizer.optimizers
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)  # saved with the rest
    ckpt = autopar.Checkpointer(directory, every=2, keep=2, async_save=True, scheduler=schedule)
    start = ckpt.resume(pm)
    for step in range(start, 8):
        batch = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(step))
        pm.train_step(batch[rank * 2 : rank * 2 + 2])  # trains on while the last save is written
        schedule.step()
        ckpt.step_done(pm, step)
        if step == kill_at and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
    ckpt.close()  # the last save committed
    final = pm.full_state_dict()
    if rank == 0:
        torch.save({"start": start, "final": final}, out)
    dist.destroy_process_group()


def test_a_kill_during_an_async_save_resumes_from_the_previous_checkpoint_bit_identical(tmp_path) -> None:
    """The step-5 save is in flight when a rank dies: it never becomes visible, the restart resumes
    from step 3's (written while steps 4 and 5 trained: the copy was taken at the save) and ends
    with exactly the weights of an uninterrupted run."""
    plan = _plan()
    whole, killed = str(tmp_path / "whole"), str(tmp_path / "killed")
    launch(async_worker, args=(f"file://{tmp_path}/i1", plan, whole, None, str(tmp_path / "w.pt")), nprocs=2)
    assert sorted(os.listdir(whole)) == ["step-000000005", "step-000000007"]
    try:
        launch(
            async_worker, args=(f"file://{tmp_path}/i2", plan, killed, 5, str(tmp_path / "k.pt")), nprocs=2
        )
        raise AssertionError("rank 1 was killed: the launch must fail")
    except ProcessExitedException:
        pass
    assert [n for n in sorted(os.listdir(killed)) if not n.endswith(".tmp")] == [
        "step-000000001",
        "step-000000003",
    ]
    launch(async_worker, args=(f"file://{tmp_path}/i3", plan, killed, None, str(tmp_path / "r.pt")), nprocs=2)
    a = torch.load(tmp_path / "w.pt", weights_only=True)
    b = torch.load(tmp_path / "r.pt", weights_only=True)
    assert a["start"] == 0 and b["start"] == 4
    assert a["final"].keys() == b["final"].keys() and all(
        torch.equal(a["final"][k], b["final"][k]) for k in a["final"]
    )
    assert sorted(os.listdir(killed)) == ["step-000000005", "step-000000007"]  # the leftover .tmp removed
