"""examples/train_adaptive.py under torchrun: 2 "nodes" without a shared --folder are refused in
one line per rank before any step. (What the example runs on one node — Adaptive's windows,
decisions and switches — is ``tests/autopar/adapt/``'s and ``benchmarks/adaptive.py``'s.)"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.examples.test_train_gpt import TORCHRUN, _free_port

pytestmark = pytest.mark.slow  # torchrun

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_adaptive.py"
CLUSTER = Path(__file__).resolve().parents[2] / "examples" / "clusters" / "cpu-with-nvlink.yaml"
ARGS = [str(EXAMPLE), "--cluster", str(CLUSTER), "--steps", "5", "--every", "2"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def test_two_nodes_without_a_shared_folder_are_refused_in_one_line() -> None:
    common = [*TORCHRUN, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d"]
    common += ["--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "--rdzv-id", "adaptive-test", *ARGS]
    nodes = [
        subprocess.Popen(common, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
        for _ in range(2)
    ]
    for node in nodes:
        _, err = node.communicate(timeout=240)
        assert node.returncode != 0
        lines = [line for line in err.splitlines() if line.startswith("rank ")]
        assert len(lines) == 1 and "give AdaptConfig(folder=...)" in lines[0], err[-2000:]
