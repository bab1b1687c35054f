"""examples/train_gpt.py under torchrun: one node with 2 processes (and a worker killed and
restarted), 2 "nodes" on localhost (a PP2×TP2 plan whose TP groups stay inside a node), and an
elastic job of 2 agents (data parallel across them) that loses one."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # torchrun agents, killed and restarted

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"
ARGS = ["--steps", "3", "--global-batch", "8", "--seq", "32", "--tp", "1", "--pp", "1"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _two_nodes(per_node: int, args: list[str]) -> str:
    """Run the example as 2 "nodes" on localhost (c10d rendezvous); returns their stdout."""
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    common = [
        *TORCHRUN,
        "--nnodes",
        "2",
        "--nproc-per-node",
        str(per_node),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        "autopar-test",
        str(EXAMPLE),
        *args,
    ]
    nodes = [
        subprocess.Popen(common, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=240) for p in nodes]
    for p, (_, err) in zip(nodes, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    return "".join(out for out, _ in outs)


def test_pipeline_and_tensor_parallel_across_two_nodes() -> None:
    """4 processes as 2 nodes × 2: the pipeline axis crosses nodes, each TP group stays in one."""
    args = [*ARGS[:-4], "--tp", "2", "--pp", "2"]
    text = _two_nodes(2, args)
    assert "on 2× cpu: mesh pp2 × dp1 × tp2 (pp across nodes)" in text, text
    assert "tensor-parallel groups inside one node: True" in text
    assert "step   2  loss" in text
    assert "step   2  loss" in text


def test_a_killed_worker_resumes_from_its_checkpoint_bit_identical(tmp_path) -> None:
    """torchrun --max-restarts 1: one worker is SIGKILLed after step 5's checkpoint; the restarted
    group (a fresh gloo group: ``runtime.distributed.attempt_store``) resumes from the newest
    complete checkpoint and ends with exactly the weights of a run that was never interrupted
    (same data order: step k's batch depends on k only)."""
    import signal

    import torch

    common = ["--steps", "8", "--global-batch", "8", "--seq", "32", "--tp", "1", "--pp", "1"]
    common += ["--checkpoint-every", "2"]

    def launch(name: str, restarts: int, *extra: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [
                *TORCHRUN,
                "--nproc-per-node",
                "2",
                "--max-restarts",
                str(restarts),
                "--master-port",
                str(_free_port()),
                str(EXAMPLE),
                *common,
                "--checkpoint",
                str(tmp_path / name),
                "--save-final",
                str(tmp_path / f"{name}.pt"),
                *extra,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )

    whole = launch("whole", 0)  # also the plain single-node run: 2 processes, the planner's plan
    out, _ = whole.communicate(timeout=300)
    assert whole.returncode == 0, out[-3000:]
    assert "mesh pp1 × dp2 × tp1" in out and "step   2  loss" in out
    killed = launch("killed", 1)
    assert killed.stdout is not None
    lines, victim = [], None
    for line in killed.stdout:
        lines.append(line)
        if found := re.search(r"rank 1 pid (\d+) starts at step 0", line):  # lines may interleave
            victim = int(found.group(1))
        if "saved checkpoint step 5" in line and victim is not None:
            os.kill(victim, signal.SIGKILL)
            victim = None
    killed.wait(timeout=300)
    text = "".join(lines)
    assert killed.returncode == 0, text[-3000:]
    assert "starts at step 6" in text, text[-3000:]  # resumed after the step-5 checkpoint
    a = torch.load(tmp_path / "whole.pt", weights_only=True)
    b = torch.load(tmp_path / "killed.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    kept = sorted(p.name for p in (tmp_path / "killed").iterdir())
    assert kept == ["step-000000005", "step-000000007"]  # keep 2, nothing half-written left
    _every_checkpoint_damaged(tmp_path / "killed", launch)


def _every_checkpoint_damaged(directory: Path, launch) -> None:  # type: ignore[no-untyped-def]
    """Every checkpoint's manifest unreadable: the restart stops, one line per rank and no
    traceback of theirs, the folders set aside (not trained over); --restart-from-scratch
    trains from step 0 beside them."""
    for folder in directory.iterdir():
        (folder / "autopar.json").write_text("{ not json")
    stopped = launch("killed", 0)
    out, _ = stopped.communicate(timeout=300)
    assert stopped.returncode != 0, out[-3000:]
    for rank in (0, 1):
        assert out.count(f"rank {rank}: no checkpoint in ") == 1, out[-3000:]
    assert out.count("2 damaged, set aside (step-000000005.damaged, step-000000007.damaged)") == 2
    assert 'checkpointer.py", line' not in out, out[-3000:]  # no rank's traceback
    aside = sorted(p.name for p in directory.iterdir())
    assert aside == ["step-000000005.damaged", "step-000000007.damaged"], aside
    scratch = launch("killed", 0, "--restart-from-scratch")
    out, _ = scratch.communicate(timeout=300)
    assert scratch.returncode == 0 and "starts at step 0" in out, out[-3000:]
    assert "training from step 0 (on_no_good='start'); 2 damaged checkpoints set aside" in out
    assert sorted(p.name for p in directory.iterdir()) == sorted([*aside, "step-000000005", "step-000000007"])


def _agent(args: list[str], port: int, log: Path) -> subprocess.Popen[bytes]:
    """One torchrun agent of an elastic job (1 to 2 nodes of 2 processes) on localhost, in a
    session of its own (so it and its workers can be killed together), output to ``log``."""
    command = [*TORCHRUN, "--nnodes", "1:2", "--nproc-per-node", "2", "--max-restarts", "1"]
    command += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "elastic"]
    command += ["--rdzv-conf", "last_call_timeout=2", str(EXAMPLE), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    with open(log, "wb") as out:
        return subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )


def _kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process under it at once (a node lost: torchrun's workers run
    in sessions of their own, so killing the agent's group would leave them training)."""
    import signal

    tree, frontier = [pid], [pid]
    while frontier:
        children = subprocess.run(
            ["ps", "-o", "pid=", "--ppid", ",".join(map(str, frontier))], capture_output=True, text=True
        ).stdout.split()
        frontier = [int(c) for c in children]
        tree += frontier
    for p in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


def test_an_agent_leaves_and_the_other_continues_on_half_the_processes(tmp_path) -> None:
    """torchrun --nnodes 1:2, two agents of 2 processes training TP2 (TP groups inside a node);
    after step 3's checkpoint one agent dies with its workers; the other restarts alone,
    re-plans for 2 processes, resumes at step 4 and finishes (that a resumed run on another
    world trains like an uninterrupted one is checked in ``runtime/test_elastic.py``)."""
    import time

    args = ["--steps", "6", "--global-batch", "8", "--seq", "32", "--tp", "2", "--checkpoint-every", "2"]
    args += ["--checkpoint", str(tmp_path / "ckpt")]
    port = _free_port()
    first = _agent(args, port, tmp_path / "a.log")
    time.sleep(3)  # the first agent hosts the rendezvous: it must outlive the other
    second = _agent(args, port, tmp_path / "b.log")
    deadline = time.time() + 240
    while (
        "saved checkpoint step 3" not in (tmp_path / "a.log").read_text() + (tmp_path / "b.log").read_text()
    ):
        assert time.time() < deadline and first.poll() is None and second.poll() is None
        time.sleep(0.1)
    _kill_tree(second.pid)  # the node leaves: its agent and both its workers
    second.wait(timeout=30)
    assert first.wait(timeout=240) == 0, (tmp_path / "a.log").read_text()[-3000:]
    text = (tmp_path / "a.log").read_text()
    before, after = text.split("starts at step 4", 1)  # resumed from step 3's checkpoint
    assert "on 2× cpu: mesh pp1 × dp2 × tp2 (dp across nodes)" in before
    assert "tensor-parallel groups inside one node: True" in before
    assert "plan GPT on 1× cpu: mesh pp1 × dp1 × tp2" in before.rsplit("starts at step 0", 1)[1]
    assert "step   5  loss" in after and "saved checkpoint step 5" in after
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-000000003", "step-000000005"]
