"""Predicted vs measured for the corpus of measured runs (benchmarks/runs/*.yaml), in sample and
with each source held out.

    python benchmarks/published_runs.py [--json] [--write-bands] [--all]

Every row is priced through ``planner.Pricer`` (the path of ``autopar plan`` and ``autopar
estimate``; ``corpus.predictor``). Its error is the throughput error, measured step ÷ predicted
step − 1 (positive: predicted faster than measured).

The fitted constants (no others are fitted, none by hand, none per run or per source):
  matmul efficiency, one per GPU generation (``DeviceSpec.matmul_efficiency``), on the grid
      0.40, 0.42, ..., 0.90;
  the overlap slowdown (``DeviceSpec.overlap_slowdown``), on the grid 0, 0.05, ..., 0.5.
The fit is least squares on log(measured step ÷ predicted step), each source weighing the same
(each row 1 / the rows of its source), over every point of the grid (the per-operator TP layout
held at the one the planner picks at fixed reference constants that no fit produced: matmul
efficiency 0.70, no slowdown, ``corpus.REFERENCE``).

In sample: the constants fitted on every row. Held out (the figures the README quotes): each
source's rows priced with the constants fitted on the other sources only.

Exit status 1 if the held-out median is over 10% or a held-out row is over 25%.
``--write-bands`` writes the held-out bands per regime to cost_models/error_bands.py
(``cost_models.bands``); ``--all`` also prices the rows marked not_priced where autopar can.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import statistics
import sys
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import corpus  # benchmarks/corpus.py

from autopar.cluster import Cluster
from autopar.cost_models.bands import BAND_QUANTILE, layout_regime, regime

EFFICIENCIES = tuple(round(0.40 + 0.02 * i, 2) for i in range(26))
SLOWDOWNS = tuple(round(0.05 * i, 2) for i in range(11))
Point = tuple[float, float]  # (matmul efficiency, overlap slowdown)


def variant(cluster: Cluster, point: Point) -> Cluster:
    """``cluster`` with the fitted constants at ``point``."""
    eff, slow = point
    device = dataclasses.replace(cluster.device, matmul_efficiency=eff, overlap_slowdown=slow)
    return dataclasses.replace(cluster, device=device)


def grid_table(rows: Sequence[corpus.Row], progress: Callable[[str], None]) -> list[dict[Point, float]]:
    """Each row's log(measured ÷ predicted) at every grid point."""
    table = []
    for i, row in enumerate(rows):
        progress(f"pricing {i + 1}/{len(rows)}: {row.source} {row.name}")
        predict = corpus.predictor(row)
        table.append(
            {
                (e, s): math.log(row.measured_step_s / predict(variant(row.cluster, (e, s))))
                for e in EFFICIENCIES
                for s in SLOWDOWNS
            }
        )
    return table


def fit(
    rows: Sequence[corpus.Row], table: Sequence[dict[Point, float]], keep: Sequence[int]
) -> dict[str, float]:
    """The least-squares constants over rows ``keep`` (module doc): for each slowdown the best
    efficiency per generation (they price disjoint rows), then the best slowdown."""
    per_source: dict[str, int] = defaultdict(int)
    for i in keep:
        per_source[rows[i].source] += 1
    archs = sorted({rows[i].arch for i in keep})
    best: tuple[float, dict[str, float]] | None = None
    for s in SLOWDOWNS:
        total, chosen = 0.0, {"overlap_slowdown": s}
        for arch in archs:
            mine = [i for i in keep if rows[i].arch == arch]

            def loss(e: float, mine: list[int] = mine, s: float = s) -> float:
                return sum(table[i][(e, s)] ** 2 / per_source[rows[i].source] for i in mine)

            e = min(EFFICIENCIES, key=loss)
            total, chosen[arch] = total + loss(e), e
        if best is None or total < best[0]:
            best = (total, chosen)
    assert best is not None
    return best[1]


def point_for(row: corpus.Row, constants: dict[str, float]) -> Point:
    """The grid point ``constants`` price ``row`` at: its generation's efficiency, the slowdown.
    A fold whose training sources have no run of the row's generation has no held-out figure
    for it: said in one line rather than borrowed from a fit that saw the row."""
    if row.arch not in constants:
        raise SystemExit(
            f"{row.source} is the only source with {row.arch} runs: no held-out figure for them "
            "(add a second source of that GPU generation)"
        )
    return constants[row.arch], constants["overlap_slowdown"]


def summary(errors: Sequence[float]) -> dict[str, float]:
    """Median and worst |error|, and the share predicted too fast."""
    sizes = [abs(e) for e in errors]
    return {
        "n": len(errors),
        "median": statistics.median(sizes),
        "worst": max(sizes),
        "too_fast": sum(e > 0 for e in errors) / len(errors),
    }


def quantile(values: Sequence[float], q: float) -> float:
    """The q-quantile of ``values`` (linear interpolation between order statistics)."""
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (pos - lo)


def bands(rows: Sequence[corpus.Row], held: Sequence[float]) -> dict[str, dict[str, float | int]]:
    """Held-out |error| quantile per regime, per layout family and over all runs."""
    groups: dict[str, list[float]] = defaultdict(list)
    for row, err in zip(rows, held, strict=True):
        groups[regime(row.strategy, row.cluster.device.name)].append(err)
        groups[layout_regime(row.strategy)].append(err)
        groups["all runs"].append(err)
    return {
        key: {
            "rel": round(quantile([abs(e) for e in errs], BAND_QUANTILE), 4),
            "n": len(errs),
            "too_fast": round(sum(e > 0 for e in errs) / len(errs), 3),
        }
        for key, errs in sorted(groups.items())
    }


def write_bands(found: dict[str, dict[str, float | int]], constants: dict[str, float]) -> None:
    path = pathlib.Path(__file__).resolve().parents[1] / "cost_models" / "error_bands.py"
    entries = "".join(
        f'    "{key}": {{"rel": {b["rel"]}, "n": {b["n"]}, "too_fast": {b["too_fast"]}}},\n'
        for key, b in found.items()
    )
    body = "{\n" + entries + "}"
    text = (
        '"""Held-out error bands of the cost model per regime (``cost_models.bands``).\n\n'
        "Generated by ``python benchmarks/published_runs.py --write-bands``; do not edit by hand.\n"
        f'Constants fitted on every source: {json.dumps(constants)}."""\n\n'
        f"BANDS: dict[str, dict[str, float | int]] = {body}\n"
    )
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)


@dataclass(frozen=True, kw_only=True)
class Evaluation:
    """The fit and every row's errors (measured step ÷ predicted step − 1)."""

    constants: dict[str, float]
    """Fitted on every source."""
    folds: dict[str, dict[str, float]]
    """Source held out → the constants fitted without it."""
    in_sample: list[float]
    held_out: list[float]


def evaluate(rows: list[corpus.Row], progress: Callable[[str], None]) -> Evaluation:
    """In-sample and leave-one-source-out predictions of every row."""
    table = grid_table(rows, progress)
    everything = list(range(len(rows)))
    constants = fit(rows, table, everything)
    in_sample = [math.exp(table[i][point_for(r, constants)]) - 1 for i, r in enumerate(rows)]
    held, folds = [0.0] * len(rows), {}
    for source in sorted({r.source for r in rows}):
        train = [i for i in everything if rows[i].source != source]
        folds[source] = got = fit(rows, table, train)
        for i in everything:
            if rows[i].source == source:
                held[i] = math.exp(table[i][point_for(rows[i], got)]) - 1
    return Evaluation(constants=constants, folds=folds, in_sample=in_sample, held_out=held)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    ap.add_argument("--write-bands", action="store_true", help="write cost_models/error_bands.py")
    ap.add_argument("--all", action="store_true", help="also price the rows marked not_priced where possible")
    args = ap.parse_args(argv)
    everything = corpus.load()
    rows = [r for r in everything if not r.not_priced]

    def progress(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    result = evaluate(rows, progress)
    in_sample, held = result.in_sample, result.held_out
    report = {
        "constants": result.constants,
        "folds": result.folds,
        "in_sample": summary(in_sample),
        "held_out": summary(held),
        "sources": len({r.source for r in rows}),
        "rows": [
            {
                "source": r.source,
                "name": r.name,
                "regime": regime(r.strategy, r.cluster.device.name),
                "measured_step_s": r.measured_step_s,
                "in_sample_error": a,
                "held_out_error": b,
            }
            for r, a, b in zip(rows, in_sample, held, strict=True)
        ],
        "not_priced": [
            {"source": r.source, "name": r.name, "why": r.not_priced} for r in everything if r.not_priced
        ],
    }
    found = bands(rows, held)
    report["bands"] = found
    report["memory"] = peaks = memory(rows)
    if peaks:
        report["memory_summary"] = summary([float(p["error"]) for p in peaks])  # type: ignore[arg-type]
    if args.all:
        report["not_priced_predictions"] = _not_priced(everything)
    if args.write_bands:
        write_bands(found, result.constants)
    if args.json:
        print(json.dumps(report, indent=1, ensure_ascii=False))
    else:
        _print(report)
    h = report["held_out"]
    assert isinstance(h, dict)
    return 0 if h["median"] <= 0.10 and h["worst"] <= 0.25 else 1


def memory(rows: Sequence[corpus.Row]) -> list[dict[str, object]]:
    """Each published peak against the largest stage's predicted peak (no constant of the memory
    model is fitted: these are held-out figures)."""
    out: list[dict[str, object]] = []
    for r in rows:
        if r.peak_memory_gib is None:
            continue
        predicted = corpus.predict_peak_gib(r)
        out.append(
            {
                "source": r.source,
                "name": r.name,
                "measured_gib": r.peak_memory_gib,
                "predicted_gib": predicted,
                "error": predicted / r.peak_memory_gib - 1,
            }
        )
    return out


def _not_priced(everything: list[corpus.Row]) -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    for r in everything:
        if not r.not_priced:
            continue
        try:
            predicted = corpus.predict_step_s(r)
        except Exception as exc:  # a row autopar cannot express (fp8, CP): say why
            out.append({"source": r.source, "name": r.name, "error": f"{type(exc).__name__}: {exc}"})
            continue
        out.append({"source": r.source, "name": r.name, "predicted_step_s": predicted})
    return out


def _print(report: dict[str, object]) -> None:
    rows = report["rows"]
    assert isinstance(rows, list)
    print(f"{'source':22s} {'run':52s} {'measured':>10s} {'in sample':>10s} {'held out':>9s}")
    for r in rows:
        print(
            f"{r['source']:22s} {r['name'][:52]:52s} {r['measured_step_s']:9.3f}s "
            f"{100 * r['in_sample_error']:+9.1f}% {100 * r['held_out_error']:+8.1f}%"
        )
    for key in ("in_sample", "held_out"):
        s = report[key]
        assert isinstance(s, dict)
        print(
            f"{key.replace('_', ' ')}: {s['n']} runs from {report['sources']} sources, median |error| "
            f"{100 * s['median']:.1f}%, worst {100 * s['worst']:.1f}%, predicted too fast "
            f"{100 * s['too_fast']:.0f}%"
        )
    print(f"constants fitted on every source: {report['constants']}")
    print("bands (80th percentile of |held-out error|):")
    found = report["bands"]
    assert isinstance(found, dict)
    for key, b in found.items():
        print(f"  {key:28s} ± {100 * b['rel']:5.1f}%  n = {b['n']:3d}  too fast {100 * b['too_fast']:.0f}%")
    peaks = report["memory"]
    assert isinstance(peaks, list)
    for p in peaks:
        print(
            f"peak memory {p['source']:12s} {p['name'][:48]:48s} published {p['measured_gib']:6.1f} GiB, "
            f"predicted {p['predicted_gib']:6.1f} GiB, error {100 * p['error']:+6.1f}%"
        )
    if peaks:
        m = report["memory_summary"]
        assert isinstance(m, dict)
        print(
            f"peak memory: {m['n']} runs, median |error| {100 * m['median']:.1f}%, "
            f"worst {100 * m['worst']:.1f}%"
        )
    skipped = report["not_priced"]
    assert isinstance(skipped, list)
    print(f"not priced: {len(skipped)} rows (reasons in benchmarks/runs/*.yaml, --json lists them)")


if __name__ == "__main__":
    sys.exit(main())
