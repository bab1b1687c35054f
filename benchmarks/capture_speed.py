"""Capture time and peak memory for the largest zoo models (target: GPT-3 175B < 10 s, < 2 GiB).

Each model is captured in a fresh process so that its peak RSS is its own.
Prints one line per model, then a summary line; exit status 1 if GPT-3 175B
misses the target.

    python benchmarks/capture_speed.py [--models gpt3-175b:2048 llama3-405b:8192]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = """
import json, resource, sys, time
t0 = time.perf_counter()
import torch
from autopar import capture
from autopar.zoo import build
t_import = time.perf_counter() - t0
name, seq = sys.argv[1], int(sys.argv[2])
t1 = time.perf_counter()
model = build(name)
t_build = time.perf_counter() - t1
cap = capture(model, batch=1, seq=seq)
print(json.dumps({
    "model": name, "seq": seq, "import_s": t_import, "build_s": t_build,
    "capture_s": cap.capture_s, "nodes": len(cap.gm.graph.nodes),
    "traced_blocks": cap.traced_blocks, "layers": len(cap.layers),
    "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
}))
"""

TARGET_S, TARGET_GIB = 10.0, 2.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gpt3-175b:2048", "llama3-405b:8192"])
    args = parser.parse_args()
    ok = True
    for spec in args.models:
        name, seq = spec.split(":")
        out = subprocess.run(
            [sys.executable, "-c", CHILD, name, seq], capture_output=True, text=True, check=True
        )
        r = json.loads(out.stdout.strip().splitlines()[-1])
        total = r["build_s"] + r["capture_s"]
        print(
            f"{name:12s} batch 1 seq {seq:>5}: build {r['build_s']:.2f} s + capture "
            f"{r['capture_s']:.2f} s = {total:.2f} s (import {r['import_s']:.2f} s), peak RSS "
            f"{r['peak_rss_gib']:.2f} GiB, {r['nodes']} nodes, {r['traced_blocks']} of "
            f"{r['layers'] - 2} blocks traced"
        )
        if name == "gpt3-175b":
            ok = total < TARGET_S and r["peak_rss_gib"] < TARGET_GIB
    print(
        f"summary: gpt3-175b build+capture target < {TARGET_S:.0f} s and < {TARGET_GIB:.0f} GiB: "
        f"{'met' if ok else 'MISSED'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
