"""benchmarks/gpu_check.py runs on the CPU at its reduced size (the same code a lent GPU runs)
and reports every section: layers profiled (eager and compiled) against the roofline, the four
world-1 plans (three recompute choices, one compiled) run against their predictions, the eager
loop."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # the benchmark script in a subprocess

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


def test_gpu_check_runs_on_the_cpu_and_reports_every_section(tmp_path) -> None:
    out = tmp_path / "check.json"
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--small", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "summary: small model" in run.stdout
    got = json.loads(out.read_text())
    assert got["cluster"] == "cpu" and got["device"]["torch"]
    names = {"embed", "Block", "head"}
    assert {r["layer"] for r in got["layers"]} == names | {f"{n} (compiled)" for n in names}
    for r in got["layers"]:
        assert r["forward_s"] > 0 and r["backward_s"] > 0 and r["predicted_forward_s"] > 0
    assert [(r["recompute"], r["compile"]) for r in got["plans"]] == [
        ("none", "off"),
        ("selective", "off"),
        ("full", "off"),
        ("none", "block"),
    ]
    for r in got["plans"]:
        assert r["step_s"] > 0 and r["predicted_step_s"] > 0 and r["profiled_step_s"] > 0
        assert r["peak_bytes"] > 0 and r["predicted_peak_bytes"] > 0
    full, none = got["plans"][2], got["plans"][0]
    assert full["profiled_step_s"] > none["profiled_step_s"]  # recompute costs time, as measured
    assert got["eager"]["step_s"] > 0 and got["eager"]["ratio"] > 0
    # the compiled plan's predicted step is the preset's fused kernels: faster than eager's
    assert 0 < got["compiled"]["predicted"] < 1 and got["compiled"]["measured"] > 0
