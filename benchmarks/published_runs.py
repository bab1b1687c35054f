"""Predicted vs published for the measured runs in benchmarks/published.py.

    python benchmarks/published_runs.py

Prints one line per run (predicted, published, error) and a summary line with
the median and worst absolute error; exit status 1 if the median is over 10%
or any run is over 25% (the cost-model issue's targets).
"""

from __future__ import annotations

import statistics
import sys

from published import RUNS, predict  # benchmarks/published.py


def main() -> int:
    errors = []
    for run in RUNS:
        predicted, _ = predict(run)
        err = (predicted - run.measured) / run.measured
        errors.append(abs(err))
        unit = "s/step" if run.metric == "step_time_s" else "TFLOP/s/GPU (hardware)"
        print(
            f"{run.name:40s} predicted {predicted:8.2f}  published {run.measured:8.2f} {unit:24s} "
            f"error {100 * err:+6.1f}%   [{run.source}]"
        )
    median, worst = statistics.median(errors), max(errors)
    ok = median <= 0.10 and worst <= 0.25
    print(
        f"summary: {len(errors)} runs, median |error| {100 * median:.1f}%, worst {100 * worst:.1f}% "
        f"(targets 10% / 25%): {'met' if ok else 'MISSED'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
