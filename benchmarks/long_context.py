"""Long sequences under context parallelism: the cost model against published runs, and what
the planner chooses by itself.

    python benchmarks/long_context.py [--json]

1. torchtitan's Llama 3.1 8B on 8 H100s (benchmarks/runs/torchtitan.yaml, Table 2: FSDP × CP at
   32K, 64K, 128K and 256K, full activation checkpointing, compiled, Float8). autopar prices no
   Float8, so the rows are priced in bf16 and compared by their ratios to the 32K row, as the
   issue asks: the published tokens/s per GPU fall 1 : 0.65 : 0.28 : 0.14.
2. Llama 3 405B at 131,072 positions on 16,384 H100s, TP8 CP16 PP16 DP8 (Dubey et al. 2024,
   Table 4: 380 TFLOP/s per GPU; benchmarks/runs/dubey-2024-llama3.yaml), priced as the corpus
   prices it, and the plan the planner makes for the same job.
3. ``autopar plan`` for Llama 3.1 8B on one DGX-H100 at 32K–262K: the cp it chooses and its
   predicted tokens/s, and the wall time of each plan.

Every figure is priced by ``planner.Pricer`` (the path of ``autopar plan`` and ``estimate``) with
the shipped constants, which the corpus fit produced (``published_runs.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

import corpus  # benchmarks/corpus.py
import torch

from autopar import Cluster, Constraints, PlanRequest
from autopar.errors import InfeasibleError
from autopar.planner import ModelProfiles, make_plan
from autopar.zoo import Llama
from autopar.zoo.registry import ZOO

TITAN_CP = ("FSDP8 CP1 s=32768", "FSDP4 CP2 s=65536", "FSDP2 CP4 s=131072", "FSDP1 CP8 s=262144")
LLAMA3_128K = "llama3-405b 16384xH100 TP8 CP16 PP16 seq 128K"
PLANNED_SEQS = (32768, 65536, 131072, 262144)


def _titan_rows() -> list[dict[str, Any]]:
    """torchtitan's CP rows priced in bf16: predicted and published tokens/s per GPU."""
    rows = [r for r in corpus.load() if r.source == "torchtitan" and any(k in r.name for k in TITAN_CP)]
    out = []
    for published in sorted(rows, key=lambda r: r.strategy.seq):
        # the corpus names Llama 3 8B's shapes; these sequences need Llama 3.1's rotary tables, as
        # long as the sequence (torchtitan's runs set max_seq_len to it, 262,144 included)
        shape = dataclasses.asdict(ZOO["llama3.1-8b"].config) | {"max_seq_len": published.strategy.seq}
        row = dataclasses.replace(published, model=("llama", tuple(sorted(shape.items()))))
        st = row.strategy
        step = corpus.predict_step_s(row)
        out.append(
            {
                "row": row.name,
                "seq": st.seq,
                "cp": st.cp,
                "published_tps_per_gpu": row.value,
                "predicted_tps_per_gpu": st.global_batch * st.seq / step / st.world_size,
                "published_peak_gib": row.peak_memory_gib,
                "predicted_peak_gib": corpus.predict_peak_gib(row),
            }
        )
    for r in out:
        r["published_ratio"] = r["published_tps_per_gpu"] / out[0]["published_tps_per_gpu"]
        r["predicted_ratio"] = r["predicted_tps_per_gpu"] / out[0]["predicted_tps_per_gpu"]
    return out


def _llama3_405b() -> dict[str, Any]:
    """Meta's 128K row: its measured TFLOP/s against autopar's, and the free plan's prediction."""
    row = next(r for r in corpus.load() if r.name == LLAMA3_128K)
    measured_tflops = row.value
    predicted_step = corpus.predict_step_s(row)
    predicted_tflops = measured_tflops * row.measured_step_s / predicted_step
    request = PlanRequest(
        model="llama3.1-405b",
        cluster=row.cluster,
        global_batch=row.strategy.global_batch,
        seq=row.strategy.seq,
        dtype="bf16",
        time_limit_s=60,
    )
    start = time.perf_counter()
    plan = make_plan(request, ModelProfiles.of("llama3.1-405b", dtype="bf16", seq=row.strategy.seq)).plan
    st = plan.strategy
    return {
        "row": row.name,
        "measured_tflops_per_gpu": measured_tflops,
        "predicted_tflops_per_gpu": predicted_tflops,
        "error": measured_tflops / predicted_tflops - 1,
        "published_layout_step_s": predicted_step,
        "plan": f"tp {st.tp} pp {st.pp} dp {st.dp} cp {st.cp} zero {st.zero} mb {st.micro_batch} "
        f"{st.schedule} v{st.virtual_stages} recompute {'/'.join(sorted(set(plan.recompute.values())))}",
        "plan_step_s": float(plan.predicted["step_time_s"]),
        "plan_wall_s": time.perf_counter() - start,
    }


def _planned_8b() -> list[dict[str, Any]]:
    """The planner's choice for Llama 3.1 8B on one DGX-H100 at each sequence length."""
    out = []
    for seq in PLANNED_SEQS:
        # Llama 3.1 8B's shapes with rotary tables as long as the sequence (262,144 > its 131,072)
        with torch.device("meta"):
            model = Llama(dataclasses.replace(ZOO["llama3.1-8b"].config, max_seq_len=seq)).to(torch.bfloat16)
        request = PlanRequest(
            model=model,
            name="llama3.1-8b",
            cluster=Cluster.preset("dgx-h100"),
            global_batch=8,
            seq=seq,
            dtype="bf16",
            constraints=Constraints(compile="off"),
        )
        profiles = ModelProfiles.of(model, dtype="bf16", seq=seq)
        profiles.at(1), profiles.at(2)  # the captures, outside the timed plan
        start = time.perf_counter()
        try:
            plan = make_plan(request, profiles).plan
        except InfeasibleError as e:
            out.append({"seq": seq, "infeasible": str(e), "plan_wall_s": time.perf_counter() - start})
            continue
        st = plan.strategy
        out.append(
            {
                "seq": seq,
                "cp": st.cp,
                "tp": st.tp,
                "dp": st.dp,
                "pp": st.pp,
                "zero": st.zero,
                "recompute": "/".join(sorted(set(plan.recompute.values()))),
                "tokens_per_s_per_gpu": float(plan.predicted["tokens_per_s"]) / st.world_size,
                "plan_wall_s": time.perf_counter() - start,
            }
        )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = ap.parse_args(argv)
    result = {"torchtitan_cp": _titan_rows(), "llama3_405b_128k": _llama3_405b(), "planned_8b": _planned_8b()}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print("torchtitan Llama 3.1 8B, 8 H100, FSDP × CP (published Float8; priced bf16): tokens/s per GPU")
    for r in result["torchtitan_cp"]:
        print(
            f"  seq {r['seq']:>7,} cp {r['cp']}: published {r['published_tps_per_gpu']:>6,.0f} "
            f"(ratio {r['published_ratio']:.3f}), predicted {r['predicted_tps_per_gpu']:>6,.0f} "
            f"(ratio {r['predicted_ratio']:.3f}); peak published {r['published_peak_gib'] or 0:.1f} GiB, "
            f"predicted {r['predicted_peak_gib']:.1f}"
        )
    m = result["llama3_405b_128k"]
    print(
        f"Llama 3 405B, 131,072 positions, 16,384 H100, TP8 CP16 PP16 DP8: measured "
        f"{m['measured_tflops_per_gpu']:.0f} TFLOP/s per GPU, predicted {m['predicted_tflops_per_gpu']:.0f} "
        f"(throughput error {m['error']:+.1%}, at the shipped constants: the corpus fit gives the same "
        "with or without this row)"
    )
    print(
        f"  free plan: {m['plan']}: {m['plan_step_s']:.2f} s per step vs "
        f"{m['published_layout_step_s']:.2f} s for the published layout ({m['plan_wall_s']:.1f} s to plan)"
    )
    print("autopar plan llama3.1-8b on one DGX-H100, global batch 8:")
    for r in result["planned_8b"]:
        if "infeasible" in r:
            print(f"  seq {r['seq']:>7,}: {r['infeasible']}")
            continue
        print(
            f"  seq {r['seq']:>7,}: tp {r['tp']} cp {r['cp']} dp {r['dp']} pp {r['pp']} ZeRO-{r['zero']} "
            f"recompute {r['recompute']}: {r['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU "
            f"({r['plan_wall_s']:.1f} s to plan)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
