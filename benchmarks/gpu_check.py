"""autopar's device paths and its predictions on one device, in one run of a few minutes.

    python benchmarks/gpu_check.py                       # a GPU machine: GPT-2 124M, bf16
    python benchmarks/gpu_check.py --device cpu --small  # the same code, reduced (CI runs it)

1. the device: name, memory, torch, CUDA and NCCL versions;
2. profile against the cost model: every layer type measured as `autopar profile` measures it
   (CUDA events, the cache flush, saved-tensor hooks, allocator peaks) next to the roofline
   the cluster preset prices it with;
3. world-1 plans with recompute none, selective and full, and none with each block compiled
   (``--compile block``: inductor), run by the runtime (NCCL on a GPU, gloo on the CPU):
   measured step time (median after warm-up) and peak memory (the CUDA allocator; on the CPU
   peak RSS, which only grows) against the plan's prediction, from the preset and from the
   profile of step 2 (its blocks profiled compiled too, for the compiled plan); the compiled
   plan's step over the eager one's, measured and predicted;
4. the same training as a plain eager loop (same model, tokens, AdamW, autocast): autopar's
   tokens/s over the loop's;
5. `autopar profile-comm` needs two ranks: not run on one device.

Prints a table per section and a summary line; ``--json FILE`` writes every figure. Exit
status 1 only when a step failed to run: predictions are reported, not judged.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import time
from typing import Any

import torch
from torch import nn

import autopar
from autopar.monitor import peak_memory_bytes
from autopar.strategy import Strategy
from autopar.zoo import GPT, GPTConfig

SIZES = {
    "gpu": {
        "cfg": GPTConfig(n_layer=12, n_embd=768, n_head=12, vocab_size=50304, block_size=1024),
        "global_batch": 16,
        "micro_batch": 8,
        "dtype": "bf16",
    },
    "small": {
        "cfg": GPTConfig(n_layer=2, n_embd=64, n_head=4, vocab_size=256, block_size=64),
        "global_batch": 4,
        "micro_batch": 2,
        "dtype": "fp32",
    },
}


def size() -> dict[str, Any]:
    """The size checked: ``AUTOPAR_GPU_CHECK_SIZE`` (``--small`` sets it) names one of SIZES. An
    environment variable because ``autopar profile`` builds ``model`` from this file, imported
    again by path."""
    return SIZES[os.environ.get("AUTOPAR_GPU_CHECK_SIZE", "gpu")]


def model() -> nn.Module:
    """The checked model, with its initial weights (a MODEL spec: ``gpu_check.py:model``)."""
    torch.manual_seed(0)
    return GPT(size()["cfg"])


def device_facts(device: str) -> dict[str, Any]:
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else "?"
        return {
            "device": props.name,
            "memory_bytes": props.total_memory,
            "cuda": torch.version.cuda,
            "nccl": nccl,
            "torch": torch.__version__,
        }
    return {
        "device": f"cpu ({platform.processor() or platform.machine()})",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


def cluster_for(device: str) -> autopar.Cluster:
    """The preset of the device in this machine, one GPU (dgx-h100 for an unknown GPU)."""
    if device == "cpu":
        return autopar.Cluster.preset("cpu", gpus_per_node=1)
    name = torch.cuda.get_device_name()
    preset = next(
        (
            p
            for key, p in (("H200", "dgx-h200"), ("H100", "dgx-h100"), ("A100", "dgx-a100-80g"))
            if key in name
        ),
        "dgx-h100",
    )
    return autopar.Cluster.preset(preset, gpus_per_node=1)


def join_world_of_one() -> None:
    """A process group of this process alone (NCCL on a GPU, gloo on the CPU)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
    )
    autopar.init_distributed()


def profile_vs_analytic(
    spec: str, cluster: autopar.Cluster, device: str
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Section 2: every layer type measured, eager and with its blocks compiled, next to the
    preset's roofline prices (a compiled block's: its fused kernels)."""
    from autopar.cost_models.terms import build_terms
    from autopar.measure.profile import profile_compute
    from autopar.planner import ModelProfiles

    sz = size()
    b, seq, dtype = sz["micro_batch"], sz["cfg"].block_size, sz["dtype"]
    measured = {
        compiled: profile_compute(
            spec, batches=(b,), seq=seq, dtype=dtype, device=device, compiled=compiled == "block"
        )
        for compiled in ("off", "block")
    }
    profile = ModelProfiles.of(model(), dtype=dtype, seq=seq).at(b)
    rows = []
    for compiled, name in ((c, n) for c in ("off", "block") for n in profile.layer_types):
        st = Strategy(micro_batch=b, global_batch=b, seq=seq, dtype=dtype, compile=compiled)
        terms = build_terms(profile, cluster, st)
        unit = {"embed": terms.embed, "head": terms.head}.get(name, terms.block["none"])
        kw = {"micro_batch": b, "seq": seq, "tp": 1, "sp": False, "dtype": dtype}
        got = measured[compiled].timing(name, **kw, compiled=compiled == "block")
        assert got is not None, name
        rows.append(
            {
                "layer": name if compiled == "off" else f"{name} (compiled)",
                "forward_s": got.forward_s,
                "predicted_forward_s": unit.fwd_s,
                "backward_s": got.backward_s,
                "predicted_backward_s": unit.bwd_compute_s,
                "saved_bytes": got.saved_bytes,
                "predicted_saved_bytes": unit.act_bytes,
                "peak_bytes": got.peak_bytes,
            }
        )
    return measured, rows


def tokens(steps: int) -> torch.Tensor:
    sz = size()
    shape = (steps, sz["global_batch"], sz["cfg"].block_size)
    return torch.randint(0, sz["cfg"].vocab_size, shape, generator=torch.Generator().manual_seed(1))


PLANS = (("none", "off"), ("selective", "off"), ("full", "off"), ("none", "block"))
"""(recompute, compile) of each world-1 plan run."""


def world_one_plans(
    cluster: autopar.Cluster, measured: dict[str, Any], device: str, steps: int, warmup: int
) -> list[dict[str, Any]]:
    """Section 3: each plan of ``PLANS`` planned for one device and run by the runtime;
    ``measured``: the compute profile by compile choice."""
    sz = size()
    data, rows = tokens(warmup + steps), []
    for recompute, compiled in PLANS:
        cons = autopar.Constraints(
            tp=1, pp=1, dp=1, zero=0, micro_batch=sz["micro_batch"], recompute=(recompute,), compile=compiled
        )
        kw = {"global_batch": sz["global_batch"], "seq_len": sz["cfg"].block_size, "dtype": sz["dtype"]}
        plan = autopar.plan(model(), cluster, constraints=cons, **kw)
        profiled = autopar.plan(
            model(), cluster.from_profile(compute=measured[compiled]), constraints=cons, **kw
        )
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        pm = autopar.parallelize(model(), plan)
        times = []
        for batch in data:
            pm.train_step(batch)
            times.append(pm.last_step_s)
        rows.append(
            {
                "recompute": recompute,
                "compile": compiled,
                "step_s": statistics.median(times[warmup:]),
                "predicted_step_s": plan.predicted["step_time_s"],
                "profiled_step_s": profiled.predicted["step_time_s"],
                "peak_bytes": peak_memory_bytes(),
                "predicted_peak_bytes": plan.stages[0].peak_bytes,
            }
        )
        del pm
    return rows


def eager_loop(device: str, steps: int, warmup: int) -> float:
    """Section 4: median seconds per step of the same training written by hand."""
    from autopar.runtime import lm_loss

    sz = size()
    net = model().to(device)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(sz["dtype"])
    micro = sz["micro_batch"]
    times = []
    for batch in tokens(warmup + steps).to(device):
        t0 = time.perf_counter()
        for chunk in batch.split(micro):
            with torch.autocast(device, dtype=half, enabled=half is not None):
                loss = lm_loss(net(chunk), chunk) / (len(batch) // micro)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        float(loss.detach())  # waits for the device, as train_step's loss does
        times.append(time.perf_counter() - t0)
    return statistics.median(times[warmup:])


def show(results: dict[str, Any]) -> None:
    gib = 2**30
    print("device:", ", ".join(f"{k} {v}" for k, v in results["device"].items()))
    print("\nlayer       fwd ms (predicted)    bwd ms (predicted)    saved MiB (predicted)  peak MiB")
    for r in results["layers"]:
        peak = f"{r['peak_bytes'] / 2**20:.1f}" if r["peak_bytes"] is not None else "-"
        print(
            f"{r['layer']:10s} {1e3 * r['forward_s']:8.3f} ({1e3 * r['predicted_forward_s']:8.3f})  "
            f"{1e3 * r['backward_s']:8.3f} ({1e3 * r['predicted_backward_s']:8.3f})  "
            f"{r['saved_bytes'] / 2**20:9.2f} ({r['predicted_saved_bytes'] / 2**20:9.2f})  {peak}"
        )
    print("\nrecompute  compile  step s   predicted (preset / profiled)  peak GiB (predicted)")
    for r in results["plans"]:
        print(
            f"{r['recompute']:9s}  {r['compile']:6s} {r['step_s']:7.4f}  {r['predicted_step_s']:7.4f} / "
            f"{r['profiled_step_s']:7.4f}          {r['peak_bytes'] / gib:6.2f} "
            f"({r['predicted_peak_bytes'] / gib:6.2f})"
        )
    e = results["eager"]
    print(
        f"\neager loop {e['step_s']:.4f} s/step; autopar (recompute none) {e['autopar_step_s']:.4f} s/step: "
        f"autopar tokens/s ÷ eager tokens/s = {e['ratio']:.3f}"
    )
    c = results["compiled"]
    print(
        f"compiled / eager step (recompute none): measured {c['measured']:.3f}, predicted "
        f"{c['predicted']:.3f} (preset), {c['profiled']:.3f} (profiled)"
    )
    print("profile-comm: needs two ranks, not run on one device")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu"
    )
    parser.add_argument("--small", action="store_true", help="the reduced model (CI, CPU)")
    parser.add_argument(
        "--steps", type=int, default=None, help="timed steps per plan (default 10, --small 4)"
    )
    parser.add_argument("--json", default=None, help="write every figure to this file")
    args = parser.parse_args()
    os.environ["AUTOPAR_GPU_CHECK_SIZE"] = name = "small" if args.small else "gpu"
    steps = args.steps or (4 if args.small else 10)
    warmup = 2 if args.small else 3
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device is visible; run with --device cpu", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    join_world_of_one()
    cluster = cluster_for(args.device)
    spec = f"{os.path.abspath(__file__)}:model"
    results: dict[str, Any] = {"device": device_facts(args.device), "size": name, "cluster": cluster.name}
    measured, results["layers"] = profile_vs_analytic(spec, cluster, args.device)
    results["plans"] = world_one_plans(cluster, measured, args.device, steps, warmup)
    eager = eager_loop(args.device, steps, warmup)
    mine = results["plans"][0]["step_s"]
    results["eager"] = {"step_s": eager, "autopar_step_s": mine, "ratio": eager / mine}
    plain, compiled = results["plans"][0], results["plans"][-1]
    results["compiled"] = {
        key: compiled[f"{k}step_s"] / plain[f"{k}step_s"]
        for key, k in (("measured", ""), ("predicted", "predicted_"), ("profiled", "profiled_"))
    }
    show(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    worst = max(abs(r["step_s"] / r["predicted_step_s"] - 1) for r in results["plans"])
    print(
        f"summary: {name} model on {results['device']['device']}: ran every check; step time error up to "
        f"{100 * worst:.0f}% against the preset; autopar/eager throughput {results['eager']['ratio']:.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
