"""Planning time with the capture cached, and how it grows with the number of layers.

    python benchmarks/plan_speed.py

Targets (the planner issue): GPT-3 175B on 128× dgx-a100-80g (1024 GPUs), global
batch 1536, seq 2048: median ≤ 2 s; Llama-3 405B on 2048× dgx-h100 (16384 GPUs),
global batch 2048, seq 8192: ≤ 5 s. Then the same 12288-wide GPT with 24, 96 and
192 identical layers on 1024 A100s, to show the solve time follows the number of
distinct layer types, not of layers. Exit status 1 if a target is missed.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from autopar import Cluster, PlanRequest
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


def main() -> int:
    ok = timed("gpt3-175b", "gpt3-175b", Cluster.preset("dgx-a100-80g", nodes=128), 1536, 2048) <= 2.0
    ok &= timed("llama3-405b", "llama3-405b", Cluster.preset("dgx-h100", nodes=2048), 2048, 8192) <= 5.0
    for layers in (24, 96, 192):
        with torch.device("meta"):
            model = GPT(GPTConfig(n_layer=layers, n_embd=12288, n_head=96)).to(torch.bfloat16)
        timed(f"gpt h=12288, {layers} layers", model, Cluster.preset("dgx-a100-80g", nodes=128), 1536, 2048)
    print(f"summary: planning targets (175B ≤ 2 s, 405B ≤ 5 s): {'met' if ok else 'MISSED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
