"""Glue between models and the cost model: capture once per (model, dtype, micro-batch, seq)."""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

from torch import nn

from autopar.cost_models.profile import ModelProfile, at_micro_batch
from autopar.graph import CapturedModel, capture
from autopar.models import resolve


@lru_cache(maxsize=32)
def _captured_profile(spec: str, dtype: str, micro_batch: int, seq: int) -> ModelProfile:
    resolved = resolve(spec, dtype=dtype)
    return ModelProfile.from_captured(capture(resolved.module, batch=micro_batch, seq=seq))


def profile_model(spec: str, *, dtype: str, micro_batch: int, seq: int) -> ModelProfile:
    """The cost profile of MODEL ``spec`` at (micro_batch, seq).

    Captured at micro-batch 1 and 2 (cached in-process) and extended exactly to
    any micro-batch (``at_micro_batch``): two captures serve every size.
    """
    one = _captured_profile(spec, dtype, 1, seq)
    if micro_batch == 1:
        return one
    two = _captured_profile(spec, dtype, 2, seq)
    return two if micro_batch == 2 else at_micro_batch(one, two, micro_batch)


class ProfileSource:
    """micro-batch → cost profile (derived from two captures), plus ``captured(b)``: the graph
    captured at exactly micro-batch b, for the per-operator choices of the final plan (shape
    constants in the graph depend on b)."""

    def __init__(
        self, profile: Callable[[int], ModelProfile], captured: Callable[[int], CapturedModel]
    ) -> None:
        self._profile, self._captured = profile, captured

    def __call__(self, micro_batch: int) -> ModelProfile:
        return self._profile(micro_batch)

    def captured(self, micro_batch: int) -> CapturedModel:
        return self._captured(micro_batch)


def profile_fn(model: str | nn.Module, *, dtype: str, seq: int) -> ProfileSource:
    """micro-batch → profile for a MODEL spec (cached captures) or a module (captured here)."""
    if isinstance(model, str):
        spec = model

        def graph(b: int) -> CapturedModel:
            cap = _captured_profile(spec, dtype, b, seq).captured
            assert cap is not None
            return cap

        return ProfileSource(lambda b: profile_model(spec, dtype=dtype, micro_batch=b, seq=seq), graph)
    caps = {1: capture(model, batch=1, seq=seq), 2: capture(model, batch=2, seq=seq)}
    one, two = ModelProfile.from_captured(caps[1]), ModelProfile.from_captured(caps[2])

    def graph_of_module(b: int) -> CapturedModel:
        if b not in caps:
            caps[b] = capture(model, batch=b, seq=seq)
        return caps[b]

    return ProfileSource(
        lambda b: one if b == 1 else two if b == 2 else at_micro_batch(one, two, b), graph_of_module
    )
