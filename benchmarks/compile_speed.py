"""Regional compilation on this machine: measured step time of a plan that compiles each block
(``--compile block``: inductor, C++ kernels on the CPU) over the same plan eager, next to the
cost model's predicted ratio.

    python benchmarks/compile_speed.py [--steps 10] [--profiled] [--keep DIR]

The benchmark GPT of ``closed_loop.py`` (4 blocks, width 256, seq 128, fp32) as DP2 on 2 gloo
processes (``autopar calibrate``: steps after warm-up, the first of which compiles). Predicted
from the ``cpu`` preset, whose roofline prices a compiled block's fused kernels
(``cost_models.kernels.fusion_groups``); with ``--profiled`` also from measured profiles, eager
and ``autopar profile --compile`` (a compiled plan priced on its compiled blocks' timings).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from closed_loop import GLOBAL_BATCH, SEQ, run

WARMUP = 3
"""Untimed steps (compilation happens in the first)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per plan")
    parser.add_argument("--profiled", action="store_true", help="also predict from measured profiles")
    parser.add_argument("--keep", default=None, help="write the profiles and plans here")
    args = parser.parse_args()
    work = args.keep or tempfile.mkdtemp(prefix="autopar-compile-")
    os.makedirs(work, exist_ok=True)
    spec = f"{os.path.join(os.path.dirname(os.path.abspath(__file__)), 'closed_loop.py')}:model"
    autopar = [sys.executable, "-m", "autopar"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "autopar"]
    print(f"compile: {spec} on 2 gloo processes, work in {work}", file=sys.stderr)
    profiles: dict[str, list[str]] = {"off": [], "block": []}
    if args.profiled:
        for compiled in ("off", "block"):
            path = os.path.join(work, f"profile-{compiled}.json")
            run([*torchrun, "profile", spec, "--device", "cpu", "--threads", "1", "--dtype", "fp32",
                 "--seq", str(SEQ), "--batch", "2", "--tp-widths", "1", "--repeat", "9",
                 *(["--compile"] if compiled == "block" else []), "--out", path])  # fmt: skip
            profiles[compiled] = ["--profile", path]
    plans, predicted = {}, {}
    for compiled in ("off", "block"):
        base = [*autopar, "plan", spec, "--cluster", "cpu", "--global-batch", str(GLOBAL_BATCH),
                "--seq", str(SEQ), "--dtype", "fp32", "--dp", "2", "--zero", "0", "--micro-batch", "2",
                "--recompute", "none", "--compile", compiled]  # fmt: skip
        path = os.path.join(work, f"{compiled}.json")
        preset = json.loads(run([*base, "--out", path, "--json"]))["plan"]
        predicted[compiled] = {"preset": preset["predicted"]["step_time_s"]}
        if args.profiled:
            got = json.loads(run([*base, *profiles[compiled], "--json"]))["plan"]
            predicted[compiled]["profiled"] = got["predicted"]["step_time_s"]
        plans[compiled] = path
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = run([*torchrun, "calibrate", spec, *(x for p in plans.values() for x in ("--plan", p)),
               "--steps", str(args.steps), "--warmup", str(WARMUP), "--json"], env=env)  # fmt: skip
    measured = {
        k: r["measured_s"] for k, r in zip(plans, json.loads(out[out.index("{") :])["plans"], strict=True)
    }
    print(
        f"{'plan':8} {'measured':>10} {'predicted (preset)':>19}"
        + ("  predicted (profiled)" if args.profiled else "")
    )
    for k in plans:
        row = f"{k:8} {1e3 * measured[k]:>8.1f}ms {1e3 * predicted[k]['preset']:>17.1f}ms"
        if args.profiled:
            row += f"  {1e3 * predicted[k]['profiled']:>18.1f}ms"
        print(row)
    ratios = {src: predicted["block"][src] / predicted["off"][src] for src in predicted["off"]}
    print(
        f"compiled / eager step time: measured {measured['block'] / measured['off']:.3f}, "
        + ", ".join(f"predicted {v:.3f} ({src})" for src, v in ratios.items())
    )


if __name__ == "__main__":
    main()
