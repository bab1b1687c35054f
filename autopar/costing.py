"""Glue between models and the cost model: capture once per (model, dtype, micro-batch, seq)."""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

from torch import nn

from autopar.cost_models.profile import ModelProfile, at_micro_batch
from autopar.graph import capture
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


def profile_fn(model: str | nn.Module, *, dtype: str, seq: int) -> Callable[[int], ModelProfile]:
    """micro-batch → profile for a MODEL spec (cached captures) or a module (captured here)."""
    if isinstance(model, str):
        return lambda b: profile_model(model, dtype=dtype, micro_batch=b, seq=seq)
    one = ModelProfile.from_captured(capture(model, batch=1, seq=seq))
    two = ModelProfile.from_captured(capture(model, batch=2, seq=seq))
    return lambda b: one if b == 1 else two if b == 2 else at_micro_batch(one, two, b)
