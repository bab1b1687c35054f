"""Plan Llama-3 70B on 16 DGX H100 nodes, then the same with a fixed TP degree, and compare.

python examples/plan_model.py
"""

from __future__ import annotations

import autopar


def main() -> None:
    cluster = autopar.Cluster.preset("dgx-h100", nodes=16)
    free = autopar.plan("llama3-70b", cluster, global_batch=512, seq_len=8192)
    print(free.text())
    print(f"predicted {free.predicted['step_time_s']:.2f} s/step, MFU {100 * free.predicted['mfu']:.1f}%\n")
    fixed = autopar.plan(
        "llama3-70b", cluster, global_batch=512, seq_len=8192, constraints=autopar.Constraints(tp=8, pp=1)
    )
    print(fixed.text())
    ratio = fixed.predicted["step_time_s"] / free.predicted["step_time_s"]
    print(f"predicted {fixed.predicted['step_time_s']:.2f} s/step: {ratio:.2f}× the free plan's time")
    assert autopar.Plan.from_json(free.to_json()) == free  # plans are data


if __name__ == "__main__":
    main()
