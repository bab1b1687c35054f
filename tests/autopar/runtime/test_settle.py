"""autopar.runtime.settle: an exiting rank waits for gloo's worker threads to fall asleep (they
free the last collective's tensors, which needs the GIL the finalizing interpreter no longer
gives), read from /proc; on 2 gloo processes after training, the workers are found and settle."""

from __future__ import annotations

import atexit
import datetime
from pathlib import Path

import pytest
import torch

from autopar.measure.launch import launch
from autopar.runtime import settle


def _task(root: Path, tid: int, comm: str, state: str) -> None:
    (root / str(tid)).mkdir(parents=True)
    (root / str(tid) / "comm").write_text(comm + "\n")
    (root / str(tid) / "stat").write_text(f"{tid} ({comm}) {state} 1 2 3 4 5\n")


def test_only_gloo_workers_that_are_not_asleep_are_busy(tmp_path) -> None:
    _task(tmp_path, 11, "pt_gloo_runloop", "R")
    _task(tmp_path, 12, "pt_gloo_runloop", "S")
    _task(tmp_path, 13, "python3", "R")  # not a gloo worker
    _task(tmp_path, 14, "gloo_tcp_loop", "R")  # gloo's socket loop holds no tensors
    assert settle.worker_states(tmp_path) == ["R", "S"]
    assert settle.busy_workers(tmp_path) == 1
    (tmp_path / "11" / "stat").write_text("11 (pt_gloo_runloop) S 1 2 3\n")
    assert settle.busy_workers(tmp_path) == 0
    assert settle.worker_states(tmp_path / "absent") == []  # no /proc: nothing to wait for


def test_waiting_ends_when_workers_sleep_or_the_time_runs_out(monkeypatch) -> None:
    looks = iter([1, 1, 0, 1, 0, 0, 1])  # asleep at two looks in a row only at the 5th and 6th
    monkeypatch.setattr(settle, "busy_workers", lambda: next(looks))
    assert settle.wait_for_workers(timeout_s=5.0, step_s=0.0)
    assert next(looks) == 1  # it stopped looking after the second quiet look
    monkeypatch.setattr(settle, "busy_workers", lambda: 1)
    assert not settle.wait_for_workers(timeout_s=0.05, step_s=0.01)


def test_the_exit_hook_is_registered_once() -> None:
    settle.settle_at_exit.cache_clear()
    atexit.unregister(settle.wait_for_workers)
    before = atexit._ncallbacks()
    settle.settle_at_exit()
    settle.settle_at_exit()
    assert atexit._ncallbacks() == before + 1


def _worker(rank: int, init: str, plan_json: str, out: str) -> None:
    import torch.distributed as dist

    import autopar
    from autopar.plan import Plan
    from autopar.zoo import GPT, GPTConfig

    dist.init_process_group(
        "gloo", init_method=init, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120)
    )
    torch.set_num_threads(1)
    torch.manual_seed(0)
    pm = autopar.parallelize(
        GPT(GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16)),
        Plan.from_json(plan_json),
    )
    pm.train_step(torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(rank)))
    pm.full_state_dict()  # collectives whose temporaries Python drops at once
    dist.destroy_process_group()
    states = settle.worker_states()
    settled = settle.wait_for_workers()
    Path(f"{out}.{rank}").write_text(f"{len(states)} {settled} {settle.busy_workers()}")


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads Linux /proc")
def test_after_training_on_gloo_the_workers_are_found_and_settle(tmp_path) -> None:
    import autopar
    from autopar import Cluster, Constraints
    from autopar.zoo import GPT, GPTConfig

    with torch.device("meta"):
        meta = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16))
    cons = Constraints(tp=2, pp=1, dp=1, micro_batch=2, recompute=("none",))
    plan = autopar.plan(
        meta,
        Cluster.preset("cpu", gpus_per_node=2),
        global_batch=2,
        seq_len=16,
        dtype="fp32",
        constraints=cons,
    )
    out = str(tmp_path / "settled")
    launch(_worker, args=(f"file://{tmp_path}/init", plan.to_json(), out), nprocs=2, join=True)
    for rank in range(2):
        workers, settled, busy = (tmp_path / f"settled.{rank}").read_text().split()
        assert int(workers) >= 2 and settled == "True" and busy == "0"  # each group has 2 workers
