"""Communication knobs on this machine: measured step time with and without each, next to the
cost model's predicted ratio.

    python benchmarks/comm_knobs.py [--steps 10] [--keep DIR]

Knobs measured: the gradient reduction's dtype (``--grad-reduce bf16``: DDP's bf16 compression
hook at ZeRO-0, FSDP2's ``reduce_dtype`` at ZeRO-2), PowerSGD at rank 4 on DDP, and DDP's
bucket cap (1 MiB: 17 buckets of the model's 16.8 MB of gradients, against one at 25 MiB). HSDP needs
4 ranks (2 replicas of 2-rank groups), which this 2-core machine cannot time apart from the
contention, so it is not here. Like ``closed_loop.py`` (whose model and
steps it shares): profile the model and the gloo collectives on 2 processes, plan DP2 with
each knob (``PLANS``; fp32 training, so bf16 is lossy here: ``--allow-lossy-comm``), run the
plans with ``autopar calibrate`` and print measured and predicted step times and each knob's
ratio to the plan without it (``RATIOS``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from closed_loop import GLOBAL_BATCH, SEQ, run

POWERSGD_WARMUP = 11
"""Untimed steps: past the 10 that DDP all-reduces whole before PowerSGD compresses
(``runtime.sharding.POWERSGD_START_ITER``)."""


PLANS = (
    ("zero0-fp32", ("--zero", "0", "--grad-reduce", "fp32", "--powersgd-rank", "0", "--bucket-mb", "25")),
    ("zero0-bf16", ("--zero", "0", "--grad-reduce", "bf16", "--powersgd-rank", "0", "--bucket-mb", "25")),
    ("zero2-fp32", ("--zero", "2", "--grad-reduce", "fp32")),
    ("zero2-bf16", ("--zero", "2", "--grad-reduce", "bf16")),
    (
        "zero0-powersgd4",
        ("--zero", "0", "--grad-reduce", "fp32", "--powersgd-rank", "4", "--bucket-mb", "25"),
    ),
    ("zero0-bucket1", ("--zero", "0", "--grad-reduce", "fp32", "--powersgd-rank", "0", "--bucket-mb", "1")),
)
"""(name, ``autopar plan`` flags) of each plan timed: DP2 on the benchmark GPT in fp32."""

RATIOS = {
    "ZeRO-0: bf16 / fp32 reduction": ("zero0-fp32", "zero0-bf16"),
    "ZeRO-2: bf16 / fp32 reduction": ("zero2-fp32", "zero2-bf16"),
    "ZeRO-0: PowerSGD rank 4 / fp32": ("zero0-fp32", "zero0-powersgd4"),
    "ZeRO-0: 1 MiB / 25 MiB DDP buckets": ("zero0-fp32", "zero0-bucket1"),
}
"""Each knob's ratio: (plan without it, plan with it)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per plan")
    parser.add_argument("--keep", default=None, help="write the profiles and plans here")
    args = parser.parse_args()
    work = args.keep or tempfile.mkdtemp(prefix="autopar-comm-knobs-")
    os.makedirs(work, exist_ok=True)
    spec = f"{os.path.join(os.path.dirname(os.path.abspath(__file__)), 'closed_loop.py')}:model"
    autopar = [sys.executable, "-m", "autopar"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "autopar"]
    profile, comm = os.path.join(work, "profile.json"), os.path.join(work, "comm.json")
    print(f"comm knobs: {spec} on 2 gloo processes, work in {work}", file=sys.stderr)
    run([*torchrun, "profile", spec, "--device", "cpu", "--threads", "1", "--dtype", "fp32",
         "--seq", str(SEQ), "--batch", "1,2,4", "--tp-widths", "1", "--repeat", "9",
         "--out", profile])  # fmt: skip
    run([*torchrun, "profile-comm", "--max-bytes", "64MiB", "--out", comm])
    plans = []
    for name, knobs in PLANS:
        path = os.path.join(work, f"{name}.json")
        run([*autopar, "plan", spec, "--cluster", "cpu", "--global-batch", str(GLOBAL_BATCH),
             "--seq", str(SEQ), "--dtype", "fp32", "--profile", profile, "--comm", comm,
             "--dp", "2", "--micro-batch", "2", "--allow-lossy-comm", *knobs,
             "--out", path, "--json"])  # fmt: skip
        plans.append(path)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = run([*torchrun, "calibrate", spec, *(x for p in plans for x in ("--plan", p)),
               "--steps", str(args.steps), "--warmup", str(POWERSGD_WARMUP), "--json"], env=env)  # fmt: skip
    results = json.loads(out[out.index("{") :])["plans"]
    print(f"{'plan':14} {'predicted':>10} {'measured':>10} {'error':>7}   dp comm predicted")
    for r, path in zip(results, plans, strict=True):
        dp_ms = 1e3 * r["predicted_breakdown_s"].get("dp_comm", 0.0)
        print(
            f"{os.path.basename(path)[:-5]:14} {1e3 * r['predicted_s']:>8.1f}ms "
            f"{1e3 * r['measured_s']:>8.1f}ms {100 * r['error']:>+6.1f}%   {dp_ms:.1f} ms"
        )
    by_name = dict(zip((name for name, _ in PLANS), results, strict=True))
    for knob, (base, other) in RATIOS.items():
        print(
            f"{knob}: step time ratio "
            f"measured {by_name[other]['measured_s'] / by_name[base]['measured_s']:.3f}, "
            f"predicted {by_name[other]['predicted_s'] / by_name[base]['predicted_s']:.3f}"
        )


if __name__ == "__main__":
    main()
