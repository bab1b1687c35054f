"""Planning time: ``autopar plan`` as a user runs it (wall, a fresh process each time), then the
search alone with the capture cached, and how it grows with the number of layers.

    python benchmarks/plan_speed.py [--runs 3]

Wall targets (issue 23), medians of ``--runs`` fresh processes: the README's ``autopar plan
gpt3-175b --cluster dgx-a100-80g --nodes 128 --global-batch 1536`` ≤ 3 s and Llama-3 405B on
2048× dgx-h100 (16384 GPUs), global batch 2048, seq 8192 ≤ 5 s with the capture cache warm
(``autopar.cache``: one run before, in a folder of its own), and each ≤ 6 s cold (every run
with an empty cache folder: torch imported, the model captured; the floor printed beside them is
a bare ``import torch, torch._dynamo``). Search targets, in one
process with the capture cached: 175B ≤ 2 s, 405B ≤ 5 s. Then the same 12288-wide GPT with 24,
96 and 192 identical layers on 1024 A100s, to show the solve time follows the number of
distinct layer types, not of layers. Exit status 1 if a target is missed.

    python benchmarks/plan_speed.py --moe [--runs 3]

Mixtures of experts (issue 20), wall ≤ 5 s each with the capture cache warm: the zoo's
``mixtral-8x7b`` on 4× dgx-h100 and ``deepseek-v3-671b`` on 256× dgx-h100 (2048 GPUs), expert
parallelism searched with the other knobs; cold-cache walls beside them (target ``COLD_S``). Then
the same shapes as Hugging Face ships them (``benchmarks/hf_moe.py``), reported: a model in a
file is never cached on disk, every run captures (a 2-block copy, ``planner.profiles.shallow_copy``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from autopar import Cluster, PlanRequest
from autopar.cache import CACHE_ENV
from autopar.planner import ModelProfiles, make_plan
from autopar.zoo import GPT, GPTConfig


def timed(name: str, model, cluster: Cluster, batch: int, seq: int, runs: int = 3) -> float:
    t0 = time.perf_counter()
    profiles = ModelProfiles.of(model, dtype="bf16", seq=seq)
    profiles.at(1), profiles.at(2)
    capture_s = time.perf_counter() - t0
    times, result = [], None
    for _ in range(runs):
        t0 = time.perf_counter()
        request = PlanRequest(model=model, name=name, cluster=cluster, global_batch=batch, seq=seq)
        result = make_plan(request, profiles)
        times.append(time.perf_counter() - t0)
    assert result is not None
    st, pred = result.plan.strategy, result.plan.predicted
    med = statistics.median(times)
    print(
        f"{name:28s} {cluster.world_size:6d} GPUs: plan {med:.2f} s median of {runs} "
        f"(capture {capture_s:.1f} s, cached); {result.ilps_solved} ILPs / {result.outer_candidates} outer "
        f"choices, proven gap {100 * result.plan.optimality_gap:.2f}%; chosen tp {st.tp} "
        f"pp {st.pp} dp {st.dp} ZeRO-{st.zero} b {st.micro_batch} {st.schedule}"
        f"{f' v={st.virtual_stages}' if st.virtual_stages > 1 else ''}"
        f"{f' HSDP {st.dp_replicate}×{st.dp_shard}' if st.dp_replicate > 1 else ''}"
        f", {st.grad_reduce} reduce: {pred['step_time_s']:.2f} s/step, "
        f"{pred['tflops_per_gpu']:.0f} TFLOP/s/GPU"
    )
    return med


WALL = (
    ("gpt3-175b", ["--cluster", "dgx-a100-80g", "--nodes", "128", "--global-batch", "1536"], 3.0),
    (
        "llama3-405b",
        ["--cluster", "dgx-h100", "--nodes", "2048", "--global-batch", "2048", "--seq", "8192"],
        5.0,
    ),
)
"""(model, ``autopar plan`` flags, warm wall target in seconds)."""

MOE = (
    (
        "mixtral-8x7b",
        "mixtral_8x7b",
        ["--cluster", "dgx-h100", "--nodes", "4", "--global-batch", "512", "--seq", "4096"],
    ),
    (
        "deepseek-v3-671b",
        "deepseek_v3",
        ["--cluster", "dgx-h100", "--nodes", "256", "--global-batch", "15360", "--seq", "4096"],
    ),
)
"""(zoo model, its factory in ``benchmarks/hf_moe.py``, ``autopar plan`` flags): warm wall target
``MOE_S`` each."""
MOE_S = 5.0

COLD_S = 6.0
"""Wall target of a run whose capture cache is empty."""


def wall(model: str, flags: list[str], runs: int, *, warm: bool) -> float:
    """Median wall seconds of ``autopar plan MODEL FLAGS --json`` in a fresh process, with the
    solve time it reports: each run with an empty cache folder, or (``warm``) all in one folder
    a first, untimed run filled."""
    walls, solves = [], []
    with tempfile.TemporaryDirectory(prefix="autopar-cache-") as shared:
        cmd = [sys.executable, "-m", "autopar", "plan", model, *flags, "--json"]
        if warm:
            subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, CACHE_ENV: shared})
        for i in range(runs):
            folder = shared if warm else os.path.join(shared, str(i))
            t0 = time.perf_counter()
            out = subprocess.run(
                cmd, check=True, capture_output=True, text=True, env={**os.environ, CACHE_ENV: folder}
            ).stdout
            walls.append(time.perf_counter() - t0)
            solves.append(json.loads(out)["plan"]["solve_time_s"])
    med = statistics.median(walls)
    print(
        f"autopar plan {model} {' '.join(flags)} ({'warm' if warm else 'cold'} cache): wall {med:.2f} s "
        f"median of {runs} ({', '.join(f'{w:.2f}' for w in walls)}), solve {statistics.median(solves):.2f} s"
    )
    return med


def import_floor(runs: int) -> float:
    """Median wall seconds of a fresh process that only imports torch and ``torch._dynamo``: what
    every cold run pays before its first capture (``torch.export`` imports ``torch._dynamo``)."""
    walls = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import torch, torch._dynamo"], check=True)
        walls.append(time.perf_counter() - t0)
    med = statistics.median(walls)
    print(f"floor of a cold run: python + import torch, torch._dynamo: {med:.2f} s median of {runs}")
    return med


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="processes / plans timed per case")
    parser.add_argument("--moe", action="store_true", help="the mixture-of-experts cases only")
    args = parser.parse_args()
    if args.moe:
        here = os.path.dirname(os.path.abspath(__file__))
        warm = [wall(zoo, flags, args.runs, warm=True) for zoo, _, flags in MOE]
        import_floor(args.runs)
        cold = [wall(zoo, flags, args.runs, warm=False) for zoo, _, flags in MOE]
        for _, factory, flags in MOE:
            wall(f"{here}/hf_moe.py:{factory}", flags, args.runs, warm=False)
        met = max(warm) <= MOE_S
        print(
            f"summary: MoE wall ≤ {MOE_S:g} s each (warm cache): {'met' if met else 'MISSED'}; "
            f"cold ≤ {COLD_S:g} s: {'met' if max(cold) <= COLD_S else 'MISSED'}"
        )
        return 0 if met else 1
    import_floor(args.runs)
    ok = True
    for model, flags, target in WALL:
        ok &= wall(model, flags, args.runs, warm=True) <= target
        ok &= wall(model, flags, args.runs, warm=False) <= COLD_S
    ok &= timed("gpt3-175b", "gpt3-175b", Cluster.preset("dgx-a100-80g", nodes=128), 1536, 2048) <= 2.0
    ok &= timed("llama3-405b", "llama3-405b", Cluster.preset("dgx-h100", nodes=2048), 2048, 8192) <= 5.0
    for layers in (24, 96, 192):
        with torch.device("meta"):
            gpt = GPT(GPTConfig(n_layer=layers, n_embd=12288, n_head=96)).to(torch.bfloat16)
        timed(f"gpt h=12288, {layers} layers", gpt, Cluster.preset("dgx-a100-80g", nodes=128), 1536, 2048)
    print(
        "summary: targets (wall, warm cache: 175B ≤ 3 s, 405B ≤ 5 s; cold ≤ 6 s; search: 175B ≤ 2 s, "
        "405B ≤ 5 s): "
        f"{'met' if ok else 'MISSED'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
