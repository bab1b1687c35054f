"""A peer that dies, or stops answering, makes the other ranks fail within the process group's
timeout with one line saying so (no hang), so torchrun can restart the group."""

from __future__ import annotations

import datetime
import os
import signal
import time

import pytest
import torch

from autopar.measure.launch import launch
from autopar.zoo import GPT, GPTConfig
from tests.conftest import plan_for

pytestmark = pytest.mark.slow  # 2-rank process groups waiting out a timeout

TIMEOUT_S = 5.0
"""What ``parallelize(timeout_s=)`` asks for."""
GROUP_TIMEOUT_S = 300.0
"""What the group is made with, by the caller: a collective waiting this long fails the test."""


def _gpt() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=1, n_embd=32, n_head=4, vocab_size=64, block_size=16))


def _plan_json(tp: int = 1) -> str:
    """DP2 (or TP2 × DP2) for ``_gpt``, planned here: planning inside the workers would spend the
    short timeout of the group on one rank planning while the other waits for its plan."""
    return plan_for(_gpt, batch=4, seq=16, dtype="bf16", tp=tp, pp=1, dp=2).to_json()


def worker(rank: int, world: int, init: str, how: str, out: str, plan_json: str) -> None:
    """Rank 1 dies (``how="dies"``) or stops (SIGSTOP) after step 1; rank 0 writes what its next
    step raised and how long it took to raise it. The group is made with a long timeout;
    ``parallelize`` is asked for a short one."""
    import torch.distributed as dist

    import autopar

    dist.init_process_group(
        "gloo",
        init_method=init,
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S),
    )
    torch.set_num_threads(1)
    pm = autopar.parallelize(_gpt(), autopar.Plan.from_json(plan_json), timeout_s=TIMEOUT_S)
    local = 4 // pm.plan.strategy.dp
    batch = torch.randint(0, 64, (local, 16), generator=torch.Generator().manual_seed(pm.dp_rank))
    for step in range(3):
        if step == 2 and rank == 1:
            os._exit(1) if how == "dies" else os.kill(os.getpid(), signal.SIGSTOP)
        start = time.perf_counter()
        try:
            pm.train_step(batch)
        except autopar.AutoparError as e:
            if rank == 0:
                with open(out, "w") as f:
                    f.write(f"{time.perf_counter() - start:.1f}\n{e}")
            os._exit(3)


@pytest.mark.parametrize(("how", "tp"), [("dies", 1), ("stops", 1), ("stops", 2)])
def test_a_dead_or_stopped_peer_is_an_error_within_the_timeout(tmp_path, how: str, tp: int) -> None:
    """DP2 on 2 ranks (the default group), and TP2 × DP2 on 4 ranks, where rank 0 waits for its TP
    peer on a group of the plan's mesh (torch makes those with gloo's 30-minute default)."""
    world = 2 * tp
    out = tmp_path / f"{how}.txt"
    args = (world, f"file://{tmp_path}/init-{how}", how, str(out), _plan_json(tp))
    ctx = launch(worker, args=args, nprocs=world, join=False)
    survivor = ctx.processes[0]
    survivor.join(timeout=120)
    assert survivor.exitcode == 3, (how, survivor.exitcode)
    for process in ctx.processes[1:]:
        if process.is_alive():  # the stopped peer (a dead one was reaped by the forkserver)
            os.kill(process.pid, signal.SIGKILL)
        process.join(timeout=30)
    waited, message = out.read_text().split("\n", 1)
    print(how, tp, waited, message)
    assert float(waited) <= TIMEOUT_S + 10, (how, waited)
    assert message.startswith("rank 0: another process died or stopped answering during a training step")
    assert len(message.splitlines()) == 1
