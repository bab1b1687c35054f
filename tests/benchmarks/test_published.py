"""The cost model against the published measured runs kept in benchmarks/published.py."""

from __future__ import annotations

import importlib.util
import pathlib
import statistics
import sys

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"


def _published():
    """benchmarks/published.py (validation data, next to the benchmark that prints it)."""
    spec = importlib.util.spec_from_file_location("autopar_benchmarks_published", BENCHMARKS / "published.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def test_published_runs_within_targets() -> None:
    published = _published()
    errors = []
    for run in published.RUNS:
        predicted, est = published.predict(run)
        errors.append(abs(predicted - run.measured) / run.measured)
        assert est.fits, run.name
    assert statistics.median(errors) <= 0.10
    assert max(errors) <= 0.10  # calibrated on these: each must stay close
