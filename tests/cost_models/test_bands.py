"""Error bands (cost_models/bands.py): regimes, the lookup's fallbacks, and where they show."""

from __future__ import annotations

from dataclasses import replace

import pytest

from autopar import Cluster
from autopar.cost_models import bands
from autopar.cost_models.estimate import estimate
from autopar.planner import ModelProfiles
from autopar.planner.search import Candidate
from autopar.strategy import Strategy

FAKE = {
    "FSDP on hopper": {"rel": 0.2, "n": 9, "too_fast": 0.7},
    "3-D on hopper": {"rel": 0.5, "n": 2, "too_fast": 0.5},  # too few: the layout's band instead
    "3-D": {"rel": 0.12, "n": 40, "too_fast": 0.4},
    "all runs": {"rel": 0.3, "n": 100, "too_fast": 0.5},
}


def test_regimes_by_layout_and_generation() -> None:
    assert bands.regime(Strategy(dp=8, zero=3, global_batch=8), "H100-SXM5-80GB") == "FSDP on hopper"
    assert bands.regime(Strategy(tp=8, dp=2, zero=3, global_batch=8), "A100-SXM4-80GB") == "FSDP×TP on ampere"
    assert bands.regime(Strategy(tp=8, dp=2, global_batch=8), "A100-SXM4-80GB") == "TP×DP on ampere"
    assert bands.regime(Strategy(tp=2, pp=2, dp=2, global_batch=8), "cpu-rank") == "3-D on other"
    assert bands.layout_regime(Strategy(dp=8, zero=1, global_batch=8)) == "DP"


def test_lookup_falls_back_to_the_layout_then_to_every_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bands, "BANDS", FAKE)
    got = bands.band(Strategy(dp=8, zero=3, global_batch=8), "H100-SXM5-80GB")
    assert got is not None and (got.regime, got.rel, got.n) == ("FSDP on hopper", 0.2, 9)
    assert got.text() == "± 20% (held out: FSDP on hopper, n = 9)"
    got = bands.band(Strategy(tp=2, pp=2, dp=2, global_batch=8), "H100-SXM5-80GB")
    assert got is not None and got.regime == "3-D"  # 2 hopper runs are too few
    got = bands.band(Strategy(tp=8, dp=1, global_batch=8), "A100-SXM4-80GB")
    assert got is not None and got.regime == "all runs"
    assert bands.band_text(got.to_dict()) == got.text()
    monkeypatch.setattr(bands, "BANDS", {})
    assert bands.band(Strategy(dp=8, global_batch=8), "A100-SXM4-80GB") is None


def test_estimates_carry_the_band_and_runners_up_within_it_are_tied(monkeypatch: pytest.MonkeyPatch) -> None:
    """``Estimate.band`` from the shipped bands (none under a measured compute profile); a
    runner-up slower by less than the chosen plan's band is tied, not beaten."""
    import autopar.cost_models.estimate as est_mod

    monkeypatch.setattr(bands, "BANDS", FAKE)
    monkeypatch.setattr(est_mod, "band", bands.band)
    profile = ModelProfiles.of("gpt2", dtype="bf16", seq=1024).at(1)
    st = Strategy(dp=8, zero=3, global_batch=8, seq=1024)
    est = estimate(profile, Cluster.preset("dgx-h100"), st)
    assert est.band is not None and est.band.regime == "FSDP on hopper"
    assert est.to_dict()["band"] == est.band.to_dict()
    best = est.step_time_s
    close = Candidate(strategy=st, estimate=replace(est, step_time_s=1.15 * best), gap=0.0)
    far = Candidate(strategy=st, estimate=replace(est, step_time_s=1.25 * best), gap=0.0)
    assert close.to_dict(best, est.band.rel)["tied"] and not far.to_dict(best, est.band.rel)["tied"]
    assert not close.to_dict(best)["tied"]  # no band: only an equal step ties
