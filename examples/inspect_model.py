"""Capture a model and read the per-layer annotations the planner will use.

python examples/inspect_model.py            # Llama-3 70B on the meta device
"""

from __future__ import annotations

import autopar
from autopar.units import format_bytes, format_si
from autopar.zoo import build


def main() -> None:
    model = build("llama3-70b")  # meta device: no memory for 70B parameters
    captured = autopar.capture(model, batch=1, seq=8192)
    step = format_si(captured.step_flops, "FLOP")
    print(f"captured in {captured.capture_s:.1f} s; one step = {step}")
    for t in captured.layer_types().values():
        print(
            f"{t.name:18s} ×{t.count:<3d} fwd {format_si(t.fwd_flops, 'FLOP'):>12s}  "
            f"saved {format_bytes(t.saved_bytes):>10s}"
        )
    # Per-node annotations live in node.meta["autopar.*"]:
    biggest = max(captured.gm.graph.nodes, key=lambda n: n.meta.get("autopar.fwd_flops", 0))
    print(
        f"largest op: {biggest.target} in {biggest.meta['autopar.module']} "
        f"({format_si(biggest.meta['autopar.fwd_flops'], 'FLOP')})"
    )
    cluster = autopar.Cluster.preset("dgx-h100", nodes=8)
    ideal_s = captured.step_flops / (cluster.world_size * cluster.device.achievable_flops("bf16"))
    print(f"on {cluster.world_size}× H100, compute alone: {ideal_s * 1e3:.0f} ms/step")


if __name__ == "__main__":
    main()
