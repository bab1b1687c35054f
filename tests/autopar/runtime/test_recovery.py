"""Recovery that never misleads, on one process (a gloo group of 1: the checkpointer's decisions,
no launch): damage of any kind is skipped with one line and set aside, nothing loadable left is a
stop (never a silent start over the damaged folders), ``keep`` counts loadable checkpoints, and
a failed save says what happened. The same paths across 2 ranks: ``test_checkpoint_integrity``."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import autopar
from autopar.errors import AutoparError
from autopar.runtime import checkpoint
from autopar.zoo import GPT, GPTConfig
from tests.conftest import plan_for

BATCH, SEQ = 4, 16


def _gpt() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=SEQ))


@pytest.fixture
def group(tmp_path):
    """A gloo process group of one rank in this process, and the plan for it."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield plan_for(_gpt, batch=BATCH, seq=SEQ, tp=1, pp=1, dp=1)
    finally:
        dist.destroy_process_group()


def _batch(step: int) -> torch.Tensor:
    return torch.randint(0, 64, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))


def _train(plan, directory: Path, steps: range, **ckpt_args) -> tuple[int, autopar.Checkpointer]:
    """A fresh run: resume from ``directory``, train ``steps`` (those at or after the resumed
    step), saving as ``ckpt_args`` say; where it resumed and the checkpointer."""
    pm = autopar.parallelize(_gpt(), plan)
    ckpt = autopar.Checkpointer(directory, **{"every": 1, "keep": 5, **ckpt_args})
    start = ckpt.resume(pm)
    for step in steps:
        if step >= start:
            pm.train_step(_batch(step))
            ckpt.step_done(pm, step)
    ckpt.close()
    return start, ckpt


def _names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


@pytest.mark.parametrize("how", ["no .metadata", "no manifest", "unreadable manifest", "renamed"])
def test_damage_of_any_kind_is_one_line_then_the_previous(group, tmp_path, capsys, how: str) -> None:
    directory = tmp_path / "ckpt"
    _train(group, directory, range(3))  # step-0, step-1, step-2
    newest = directory / "step-000000002"
    if how == "no .metadata":
        (newest / ".metadata").unlink()
    elif how == "no manifest":
        (newest / "autopar.json").unlink()
    elif how == "unreadable manifest":
        (newest / "autopar.json").write_text("{ not json")
    else:  # step 1's folder renamed as a later step: its name lies
        os.replace(directory / "step-000000001", directory / "step-000000007")
    capsys.readouterr()
    start, _ = _train(group, directory, range(0))
    err = capsys.readouterr().err.strip().splitlines()
    lied = "step-000000007" if how == "renamed" else "step-000000002"
    says = {
        "no .metadata": ".metadata is missing",
        "no manifest": "it has no autopar.json",
        "unreadable manifest": "its manifest autopar.json can't be read",
        "renamed": "its manifest records step 1, its name step 7",
    }[how]
    assert len(err) == 1 and lied in err[0] and says in err[0] and "set aside" in err[0], err
    assert start == (3 if how == "renamed" else 2)  # step-2 holds step 2; else step-1 loaded
    assert f"{lied}.damaged" in _names(directory)


def test_nothing_loadable_stops_and_overwrites_nothing(group, tmp_path, capsys) -> None:
    directory = tmp_path / "ckpt"
    _train(group, directory, range(2))
    for folder in directory.iterdir():
        (folder / "autopar.json").write_text("{ not json")
    with pytest.raises(AutoparError) as stopped:
        _train(group, directory, range(3))
    message = str(stopped.value)
    assert len(message.splitlines()) == 1 and "can be resumed from: 2 damaged" in message
    assert "on_no_good='start'" in message and "--restart-from-scratch" in message
    left = _names(directory)
    assert left == ["step-000000000.damaged", "step-000000001.damaged"], left
    with pytest.raises(AutoparError, match="2 damaged, set aside"):  # a restart stops again
        _train(group, directory, range(3))
    start, _ = _train(group, directory, range(1), on_no_good="start")  # deliberately
    assert start == 0 and "training from step 0" in capsys.readouterr().err
    assert _names(directory) == sorted([*left, "step-000000000"])  # the damaged ones untouched
    with pytest.raises(AutoparError, match="on_no_good must be"):
        autopar.Checkpointer(directory, every=1, on_no_good="ignore")


def test_keep_counts_loadable_checkpoints(group, tmp_path) -> None:
    """keep=2, every step: step-1 and step-2 kept; step-2 damaged; the restart saves every 2
    steps (step-3): step-1 and step-3 remain loadable (the damaged step-2 was counted and step-1
    pruned, leaving one)."""
    directory = tmp_path / "ckpt"
    _train(group, directory, range(3), keep=2)
    shard = next((directory / "step-000000002").glob("*.distcp"))
    os.truncate(shard, shard.stat().st_size // 2)
    start, ckpt = _train(group, directory, range(5), keep=2, every=2)
    assert start == 2
    assert [s for s, _ in ckpt.checkpoints()] == [1, 3], _names(directory)
    pm = autopar.parallelize(_gpt(), group)
    for _, path in ckpt.checkpoints():
        pm.load(str(path))  # each loads
    assert [p.name for p in ckpt.set_aside()] == ["step-000000002.damaged"]


WRAPPED = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
"""What torch raised for a write that ran out of space (its errno lost)."""


@pytest.mark.parametrize(
    ("error", "free_mib", "says"),
    [
        (WRAPPED, 1, "no space left on the device (1.0 MiB free)"),
        (OSError(errno.ENOSPC, "No space left on device"), 10_000, "no space left on the device"),
        (OSError(errno.EROFS, "Read-only file system"), 10_000, "can't be written (read-only"),
        (
            RuntimeError("[pair.cc:534] Connection closed by peer [127.0.0.1]:4242"),
            10_000,
            "another process died",
        ),
        (RuntimeError("something else"), 10_000, "failed (something else)"),
    ],
)
def test_a_failed_save_says_why_and_what_is_intact(
    group, tmp_path, monkeypatch, error, free_mib, says
) -> None:
    import torch.distributed.checkpoint as dcp

    usage = shutil.disk_usage(tmp_path)
    pm = autopar.parallelize(_gpt(), group)
    ckpt = autopar.Checkpointer(tmp_path / "ckpt", every=1)

    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(dcp, "save", fail)
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda p: usage._replace(free=free_mib * 2**20))
    with pytest.raises(AutoparError) as first:
        ckpt.save(pm, 0)  # nothing saved before it
    message = str(first.value)
    assert len(message.splitlines()) == 1 and says in message, message
    assert "there is no earlier checkpoint; the training state is intact" in message
    assert "previous checkpoint is intact" not in message
    monkeypatch.undo()
    ckpt.save(pm, 0)
    monkeypatch.setattr(dcp, "save", fail)
    with pytest.raises(AutoparError, match=r"the previous checkpoint is intact \(step-000000000\)"):
        ckpt.save(pm, 1)
    assert [s for s, _ in ckpt.checkpoints()] == [0] and not (
        tmp_path / "ckpt" / "step-000000001.tmp"
    ).exists()
    json.loads((tmp_path / "ckpt" / "step-000000000" / "autopar.json").read_text())  # untouched
