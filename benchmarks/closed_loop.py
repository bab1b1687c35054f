"""Profile, then compile, then check: predicted against measured step time on this machine.

    python benchmarks/closed_loop.py [--nproc 2] [--steps 8] [--target 0.25] [--keep DIR]

1. ``autopar profile`` a small GPT on this CPU (one thread, as each torchrun rank gets one),
   at every micro-batch size the plans may use and TP widths 1 and nproc;
2. ``torchrun -m autopar profile-comm`` on nproc gloo processes;
3. ``autopar plan`` for the nproc-rank ``cpu`` cluster from those measurements: the planner's
   choice, and the best plan with DP, TP and PP fixed at nproc in turn;
4. ``torchrun -m autopar calibrate`` runs the four plans and times their steps (median after
   warm-up).

Prints predicted, measured and the error per plan, a summary line last, and exits 1 when any
|error| is over the target (default 25%).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from torch import nn

SEQ = 128
GLOBAL_BATCH = 8


def model() -> nn.Module:
    """The benchmark's model: a 4-block GPT, d 256, vocabulary 4096 (5.3 M parameters)."""
    from autopar.zoo import GPT, GPTConfig

    return GPT(GPTConfig(n_layer=4, n_embd=256, n_head=4, vocab_size=4096, block_size=SEQ))


def run(cmd: list[str], **kw: object) -> str:
    """Run a command; its stdout, or exit with its stderr on failure."""
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, **kw)  # type: ignore[call-overload]
    if done.returncode != 0:
        sys.exit(f"failed ({done.returncode}): {' '.join(cmd)}\n{done.stderr[-3000:]}")
    print(f"  {time.perf_counter() - t0:5.1f} s  {' '.join(cmd[:6])} …", file=sys.stderr)
    return str(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per plan")
    parser.add_argument("--target", type=float, default=0.25, help="largest |error| allowed")
    parser.add_argument("--keep", default=None, help="write the profiles and plans here")
    args = parser.parse_args()
    n = args.nproc
    work = args.keep or tempfile.mkdtemp(prefix="autopar-closed-loop-")
    os.makedirs(work, exist_ok=True)
    spec = f"{os.path.abspath(__file__)}:model"
    autopar = [sys.executable, "-m", "autopar"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n), "-m", "autopar"]
    profile, comm = os.path.join(work, "profile.json"), os.path.join(work, "comm.json")
    batches = ",".join(str(b) for b in (1, 2, 4, 8) if b <= GLOBAL_BATCH)
    print(f"closed loop: {spec} on {n} gloo processes, work in {work}", file=sys.stderr)
    run([*torchrun, "profile", spec, "--device", "cpu", "--threads", "1", "--dtype", "fp32",
         "--seq", str(SEQ), "--batch", batches, "--tp-widths", f"1,{n}", "--repeat", "9",
         "--out", profile])  # fmt: skip
    run([*torchrun, "profile-comm", "--max-bytes", "64MiB", "--out", comm])
    plans = []
    for label, fixed in (("chosen", []), (f"dp{n}", ["--dp", str(n)]), (f"tp{n}", ["--tp", str(n)]),
                         (f"pp{n}", ["--pp", str(n)])):  # fmt: skip
        path = os.path.join(work, f"{label}.json")
        run([*autopar, "plan", spec, "--cluster", "cpu", "--global-batch", str(GLOBAL_BATCH),
             "--seq", str(SEQ), "--dtype", "fp32", "--profile", profile, "--comm", comm,
             "--out", path, "--json", *fixed])  # fmt: skip
        plans.append(path)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = run([*torchrun, "calibrate", spec, *(x for p in plans for x in ("--plan", p)),
               "--steps", str(args.steps), "--json"], env=env)  # fmt: skip
    results = json.loads(out[out.index("{") :])["plans"]
    print(f"{'plan':8} {'tp':>3} {'pp':>3} {'dp':>3} {'zero':>4} {'mb×m':>6} {'predicted':>10} "
          f"{'measured':>10} {'error':>7}")  # fmt: skip
    for r in results:
        st = r["plan"]
        m = st["global_batch"] // st["dp"] // st["micro_batch"]
        print(
            f"{r['label']:8} {st['tp']:>3} {st['pp']:>3} {st['dp']:>3} {st['zero']:>4} "
            f"{st['micro_batch']:>3}×{m:<2} {1e3 * r['predicted_s']:>8.1f}ms {1e3 * r['measured_s']:>8.1f}ms "
            f"{100 * r['error']:>+6.1f}%"
        )
        parts = ", ".join(f"{k} {1e3 * v:.1f}" for k, v in r["predicted_breakdown_s"].items() if v)
        print(f"         predicted ms: {parts}")
    worst = max(abs(r["error"]) for r in results)
    ok = worst <= args.target
    print(
        f"closed loop: {len(results)} plans, largest |error| {100 * worst:.1f}% "
        f"(target {100 * args.target:.0f}%): {'PASS' if ok else 'FAIL'}"
    )
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
