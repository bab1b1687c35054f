"""Communication knobs on this machine: measured step time with and without each, next to the
cost model's predicted ratio.

    python benchmarks/comm_knobs.py [--steps 10] [--keep DIR]

Knobs measured: the gradient reduction's dtype (``--grad-reduce bf16``: DDP's bf16 compression
hook at ZeRO-0, FSDP2's ``reduce_dtype`` at ZeRO-2) and PowerSGD at rank 4 on DDP. HSDP needs
4 ranks (2 replicas of 2-rank groups), which this 2-core machine cannot time apart from the
contention, so it is not here. Like ``closed_loop.py`` (whose model and
steps it shares): profile the model and the gloo collectives on 2 processes, plan DP2 at ZeRO 0
and 2 with fp32 and with bf16 reduction (fp32 training, so bf16 is lossy here:
``--allow-lossy-comm``), and DDP with PowerSGD rank 4, run the five plans with ``autopar
calibrate`` and print measured and predicted step times and each knob's ratio to fp32.
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
    for zero in (0, 2):
        for reduce in ("fp32", "bf16"):
            path = os.path.join(work, f"zero{zero}-{reduce}.json")
            run([*autopar, "plan", spec, "--cluster", "cpu", "--global-batch", str(GLOBAL_BATCH),
                 "--seq", str(SEQ), "--dtype", "fp32", "--profile", profile, "--comm", comm,
                 "--dp", "2", "--zero", str(zero), "--micro-batch", "2", "--grad-reduce", reduce,
                 "--allow-lossy-comm", "--out", path, "--json"])  # fmt: skip
            plans.append(path)
    path = os.path.join(work, "zero0-powersgd4.json")  # DDP with PowerSGD at rank 4 (lossy)
    run([*autopar, "plan", spec, "--cluster", "cpu", "--global-batch", str(GLOBAL_BATCH),
         "--seq", str(SEQ), "--dtype", "fp32", "--profile", profile, "--comm", comm,
         "--dp", "2", "--zero", "0", "--micro-batch", "2", "--grad-reduce", "fp32",
         "--powersgd-rank", "4", "--allow-lossy-comm", "--out", path, "--json"])  # fmt: skip
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
    fp32, powersgd = results[0], results[4]
    print(
        "ZeRO-0: PowerSGD rank 4 / fp32 step time: "
        f"measured {powersgd['measured_s'] / fp32['measured_s']:.3f}, "
        f"predicted {powersgd['predicted_s'] / fp32['predicted_s']:.3f}"
    )
    for zero, (fp32, bf16) in zip((0, 2), (results[0:2], results[2:4]), strict=True):
        measured, predicted = (
            bf16["measured_s"] / fp32["measured_s"],
            bf16["predicted_s"] / fp32["predicted_s"],
        )
        print(
            f"ZeRO-{zero}: bf16 / fp32 reduction step time: "
            f"measured {measured:.3f}, predicted {predicted:.3f}"
        )


if __name__ == "__main__":
    main()
