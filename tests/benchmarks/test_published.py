"""The cost model against the corpus of measured runs (benchmarks/runs/, benchmarks/corpus.py,
benchmarks/published_runs.py): the fit and its held-out validation."""

from __future__ import annotations

import importlib.util
import math
import pathlib
import sys
from types import SimpleNamespace

import pytest

from autopar import cluster
from autopar.cost_models.error_bands import BANDS

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"


def _benchmark(name: str):
    """benchmarks/<name>.py (validation code, next to the data it reads)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))  # published_runs imports corpus as a sibling
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def test_the_fit_is_least_squares_per_generation_and_holds_the_source_out() -> None:
    """Rows whose step is compute-bound, predicted ∝ 1/e: log(measured ÷ predicted) = log(e / e_true).
    Source a ran at 0.60, b and c at 0.70 (ampere), d at 0.50 (hopper). The fit over all sources
    weighs each source once (a's 4 rows count as b's one); holding a out fits 0.70 on ampere."""
    pr = _benchmark("published_runs")
    truth = {"a": 0.60, "b": 0.70, "c": 0.70, "d": 0.50}
    rows = [SimpleNamespace(source=s, arch="hopper" if s == "d" else "ampere") for s in "aaaabcd"]
    table = [
        {(e, s): math.log(e / truth[r.source]) for e in pr.EFFICIENCIES for s in pr.SLOWDOWNS} for r in rows
    ]
    everything = pr.fit(rows, table, range(len(rows)))
    assert everything["hopper"] == pytest.approx(0.50)
    assert 0.64 <= everything["ampere"] <= 0.68  # between a's 0.60 and b, c's 0.70, each source once
    held = pr.fit(rows, table, [i for i, r in enumerate(rows) if r.source != "a"])
    assert held["ampere"] == pytest.approx(0.70)
    # a slowdown that only fits at 0.10: measured = predicted when s = 0.10, more or less otherwise
    slowed = [{(e, s): math.log(e / 0.7 * (1 + abs(s - 0.10))) for e, s in t} for t in table[4:6]]
    got = pr.fit(rows[4:6], slowed, range(2))
    assert (got["ampere"], got["overlap_slowdown"]) == pytest.approx((0.70, 0.10))
    assert pr.quantile([0.1, 0.2, 0.3, 0.4, 0.5], 0.8) == pytest.approx(0.42)


def test_corpus_rows_convert_their_metric_to_a_step() -> None:
    """Narayanan et al. Table 1's 1.7B row: 137 TFLOP/s by Eq. 3 on 32 GPUs at batch 512 is
    96·B·s·l·h²(1 + s/6h + V/16lh) / (137e12 · 32) seconds per step."""
    corpus = _benchmark("corpus")
    row = next(r for r in corpus.load() if r.name == "gpt 1.7B 32×A100 TP1 PP1 DP32")
    b, s, l, h, v = 512, 2048, 24, 2304, 51200  # noqa: E741
    flops = 96 * b * s * l * h**2 * (1 + s / (6 * h) + v / (16 * l * h))
    assert row.measured_step_s == pytest.approx(flops / (137e12 * 32))
    assert row.strategy.world_size == row.cluster.world_size == 32
    assert all(r.not_priced or r.strategy.world_size == r.cluster.world_size for r in corpus.load())


@pytest.mark.slow
def test_presets_and_bands_are_the_corpus_fit_and_held_out_errors_stay_put() -> None:
    """The presets' efficiencies and slowdown are the least-squares fit on every source, the
    shipped bands are the leave-one-source-out ones (``published_runs.py --write-bands`` after a
    cost-model change), the held-out median does not get worse than 12% (11.3% at this commit over
    12 sources; the issue's target is 6%), and torchtitan's published peaks within 10% (the
    nanotron sweep's reserved-pool peaks are predicted up to 29% low: reported, not asserted)."""
    pr = _benchmark("published_runs")
    rows = [r for r in pr.corpus.load() if not r.not_priced]
    result = pr.evaluate(rows, lambda _: None)
    constants = result.constants
    assert constants["overlap_slowdown"] == cluster.OVERLAP_SLOWDOWN
    assert {k: constants[k] for k in ("ampere", "hopper")} == cluster.MATMUL_EFFICIENCY
    assert pr.bands(rows, result.held_out) == BANDS
    assert pr.summary(result.held_out)["median"] <= 0.12
    for peak in pr.memory(rows):
        assert peak["source"] != "torchtitan" or abs(peak["error"]) <= 0.10, peak
