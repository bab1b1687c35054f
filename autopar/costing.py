"""Glue between models and the cost model: capture once per (model, dtype, micro-batch, seq)."""

from __future__ import annotations

from functools import lru_cache

from autopar.cost_models.profile import ModelProfile
from autopar.graph import capture
from autopar.models import resolve


@lru_cache(maxsize=32)
def profile_model(spec: str, *, dtype: str, micro_batch: int, seq: int) -> ModelProfile:
    """The cost profile of MODEL ``spec`` captured at (micro_batch, seq); cached in-process."""
    resolved = resolve(spec, dtype=dtype)
    return ModelProfile.from_captured(capture(resolved.module, batch=micro_batch, seq=seq))
