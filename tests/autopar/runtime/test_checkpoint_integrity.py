"""Broken checkpoints on 2 gloo processes, each case ending with the previous checkpoint intact:
a truncated shard, a corrupted byte, a missing file, an unreadable manifest, a half-written save
(killed mid-write; a kill during an asynchronous save is in ``test_checkpointer.py``) and a write
that fails on one rank (a full disk) — detected before any tensor is read;
``Checkpointer.resume`` skips a damaged checkpoint for the one before it."""

from __future__ import annotations

import ast
import datetime
import errno
import os
from pathlib import Path

import pytest
import torch

from autopar.measure.launch import launch
from autopar.zoo import GPT, GPTConfig
from tests.conftest import plan_for

pytestmark = pytest.mark.slow  # a 2-rank process group


def _gpt() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16))


def _plan(tp: int) -> str:
    return plan_for(_gpt, batch=4, seq=16, tp=tp, pp=1, dp=2 // tp, zero=1 if tp == 1 else 0).to_json()


def _damage(folder: Path, how: str) -> None:
    """Rank 0 breaks ``folder`` the way ``how`` says."""
    shard = sorted(folder.glob("*.distcp"))[-1]
    if how == "truncated":
        os.truncate(shard, shard.stat().st_size // 2)
    elif how == "corrupted":  # one byte flipped in the middle of the tensor data
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    elif how == "missing":
        shard.unlink()
    elif how == "manifest":
        (folder / "autopar.json").write_text("{ not json")


def worker(rank: int, init: str, plan_json: str, directory: str, out: str) -> None:
    import torch.distributed as dist

    import autopar
    from autopar.plan import Plan

    dist.init_process_group(
        "gloo", init_method=init, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60)
    )
    torch.set_num_threads(1)
    try:
        pm = autopar.parallelize(_gpt(), Plan.from_json(plan_json))
        ckpt = autopar.Checkpointer(directory, every=1, keep=9)
        local, snapshots = 4 // pm.plan.strategy.dp, []
        for step in range(5):  # step-0 … step-4 saved, each step's weights kept
            batch = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(step))
            pm.train_step(batch[pm.dp_rank * local : (pm.dp_rank + 1) * local])
            ckpt.step_done(pm, step)
            snapshots.append({k: v.clone() for k, v in pm.full_state_dict().items()})

        def same_as(step: int) -> bool:
            return all(torch.equal(snapshots[step][k], v) for k, v in pm.full_state_dict().items())

        report = _damaged(pm, ckpt, same_as)
        report |= _full_disk(pm, ckpt, same_as)
        report["left"] = sorted(p.name for p in Path(directory).iterdir())
        report |= _async_copy(pm, f"{directory}-async", same_as)
        with open(f"{out}.{rank}", "w") as f:
            f.write(repr(report))
    finally:
        dist.destroy_process_group()


def _damaged(pm, ckpt, same_as) -> dict[str, object]:  # type: ignore[no-untyped-def]
    """step-4 … step-1 damaged one way each: each refused, the one before it loads intact; then
    resume (with a half-written save lying there) falls back to step-0."""
    import torch.distributed as dist

    from autopar.errors import AutoparError

    report: dict[str, object] = {}
    folders = [path for _, path in ckpt.checkpoints()]
    for step, how in zip((4, 3, 2, 1), ("truncated", "corrupted", "missing", "manifest"), strict=True):
        if dist.get_rank() == 0:
            _damage(folders[step], how)
        dist.barrier()
        try:
            pm.load(str(folders[step]))
            report[how] = "loaded"
        except AutoparError as e:
            report[how] = f"{type(e).__name__}: {e}"
        pm.load(str(folders[step - 1]))  # the previous checkpoint: intact
        report[f"{how}: previous intact"] = same_as(step - 1)
    # a save killed mid-write leaves step-5.tmp (no manifest): never listed, removed on resume
    half = ckpt.directory / "step-000000005.tmp"
    if dist.get_rank() == 0:
        half.mkdir()
        (half / "__0_0.distcp").write_bytes(b"partial")
    dist.barrier()
    report["resumed at"] = ckpt.resume(pm)  # step-4 … step-1 damaged: step-0, next step 1
    report["resumed weights"] = same_as(0)
    report["half-written left"] = half.exists()
    return report


def _full_disk(pm, ckpt, same_as) -> dict[str, object]:  # type: ignore[no-untyped-def]
    """A write that fails on rank 1 only: an error on both ranks, nothing replaced or changed."""
    import torch.distributed as dist
    from torch.distributed.checkpoint import filesystem

    from autopar.errors import AutoparError

    report: dict[str, object] = {}
    original = filesystem.FileSystemWriter.write_data

    def full_disk(self, plan, planner):  # type: ignore[no-untyped-def]
        if dist.get_rank() == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(self, plan, planner)

    before = {k: v.clone() for k, v in pm.full_state_dict().items()}
    filesystem.FileSystemWriter.write_data = full_disk  # type: ignore[method-assign]
    try:
        ckpt.save(pm, 0)  # over step-0, the only intact checkpoint
        report["full disk"] = "saved"
    except AutoparError as e:
        report["full disk"] = str(e)
    finally:
        filesystem.FileSystemWriter.write_data = original  # type: ignore[method-assign]
    report["state intact"] = all(torch.equal(before[k], v) for k, v in pm.full_state_dict().items())
    pm.load(str(ckpt.checkpoints()[0][1]))
    report["step-0 intact"] = same_as(0)
    return report


def _async_copy(pm, directory: str, same_as) -> dict[str, object]:  # type: ignore[no-untyped-def]
    """An asynchronous save writes the state as it was when the save began, whatever training
    does to the weights while the write is in flight."""
    import autopar

    later = autopar.Checkpointer(directory, every=1, keep=1, async_save=True)
    path = later.save(pm, 0)
    with torch.no_grad():
        for stage in pm.stages:
            for p in stage.parameters():
                (p.to_local() if hasattr(p, "to_local") else p).add_(1.0)
    later.close()
    pm.load(str(path))
    return {"async copy": same_as(0)}


def _run(tmp_path: Path, tp: int) -> dict[str, object]:
    directory, out = str(tmp_path / "ckpt"), str(tmp_path / "report")
    launch(worker, args=(f"file://{tmp_path}/init", _plan(tp), directory, out), nprocs=2, join=True)
    reports = [ast.literal_eval(Path(f"{out}.{r}").read_text()) for r in range(2)]
    assert reports[0] == reports[1]  # every rank decides alike
    print(reports[0])
    return reports[0]


def test_each_damaged_checkpoint_is_refused_and_resume_falls_back(tmp_path) -> None:
    got = _run(tmp_path, tp=2)  # TP2: each rank writes its own shard of every weight
    for how, says in (
        ("truncated", "were written (truncated"),
        ("corrupted", "do not match the CRC-32"),
        ("missing", "is missing"),
        ("manifest", "its manifest autopar.json can't be read"),
    ):
        assert str(got[how]).startswith("BrokenCheckpointError"), (how, got[how])
        assert says in str(got[how]), (how, got[how])
        assert got[f"{how}: previous intact"] is True, how
    assert got["resumed at"] == 1 and got["resumed weights"] is True
    assert got["half-written left"] is False
    assert "No space left on device" in str(got["full disk"]) and "previous checkpoint is intact" in str(
        got["full disk"]
    )
    assert got["state intact"] is True and got["step-0 intact"] is True
    assert got["async copy"] is True
    assert "step-000000000.tmp" not in got["left"]  # type: ignore[operator]
