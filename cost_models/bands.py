"""Error bands: how far the cost model's step time has been from measured runs of the same regime
that it never saw, to state next to each prediction ("step 17.8 s ± 8%, held out: FSDP×TP on
hopper, n = 9").

The figures come from ``benchmarks/published_runs.py --write-bands``: every run of the corpus
(benchmarks/runs/) priced with the constants fitted on the other sources only (leave one source
out), its throughput error measured step ÷ predicted step − 1. A regime's band is the 80th
percentile of those errors' sizes over the regime's runs (``BAND_QUANTILE``) where it has at
least ``MIN_RUNS`` of them; else the band of its layout on any GPU; else of every run.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.cost_models.error_bands import BANDS
from autopar.gpus import arch_of
from autopar.strategy import Strategy

BAND_QUANTILE = 0.8
MIN_RUNS = 5


@dataclass(frozen=True, kw_only=True)
class Band:
    """The held-out error of a regime."""

    regime: str
    """What the band was measured on, e.g. ``FSDP×TP on hopper`` or ``all runs``."""
    rel: float
    """The band: the 80th percentile of |held-out error| (a fraction)."""
    n: int
    """Measured runs behind it."""
    too_fast_share: float
    """Share of those runs predicted faster than measured."""

    def text(self) -> str:
        """``± 8% (held out: FSDP×TP on hopper, n = 9)``."""
        return f"± {100 * self.rel:.0f}% (held out: {self.regime}, n = {self.n})"

    def to_dict(self) -> dict[str, float | int | str]:
        return {"regime": self.regime, "rel": self.rel, "n": self.n, "too_fast_share": self.too_fast_share}


def band_text(band: dict[str, float | int | str]) -> str:
    """``Band.text`` of a band as ``Band.to_dict`` wrote it (a plan's JSON)."""
    return Band(
        regime=str(band["regime"]),
        rel=float(band["rel"]),
        n=int(band["n"]),
        too_fast_share=float(band["too_fast_share"]),
    ).text()


def layout_regime(st: Strategy) -> str:
    """The layout family a strategy belongs to: ``3-D`` (a pipeline), ``FSDP×TP`` or ``TP×DP``
    (tensor parallel with or without ZeRO-2/3), ``FSDP`` or ``DP``."""
    if st.pp > 1:
        return "3-D"
    if st.tp > 1:
        return "FSDP×TP" if st.zero >= 2 else "TP×DP"
    return "FSDP" if st.zero >= 2 else "DP"


def regime(st: Strategy, device_name: str) -> str:
    """The regime a prediction's band is looked up by: layout family on GPU generation."""
    return f"{layout_regime(st)} on {arch_of(device_name) or 'other'}"


def band(st: Strategy, device_name: str) -> Band | None:
    """The held-out error band for ``st`` on ``device_name`` (module doc); None without bands."""
    for key in (regime(st, device_name), layout_regime(st), "all runs"):
        got = BANDS.get(key)
        if got is not None and int(got["n"]) >= MIN_RUNS:
            return Band(
                regime=key, rel=float(got["rel"]), n=int(got["n"]), too_fast_share=float(got["too_fast"])
            )
    return None


__all__ = ["BAND_QUANTILE", "MIN_RUNS", "Band", "band", "band_text", "layout_regime", "regime"]
