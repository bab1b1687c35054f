"""A model's cost profiles at every micro-batch size, from two captures.

``ModelProfiles.of(model, dtype=, seq=)`` captures the model on fake tensors at micro-batch 1
and 2 and extends them exactly to any other size (``cost_models.profile.at_micro_batch``:
every quantity is affine in the micro-batch). ``captured(b)`` is the graph captured at exactly
b, for the per-operator TP table of the final plan (shape constants in the graph depend on b).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

from torch import nn

from autopar.cost_models.profile import ModelProfile, at_micro_batch
from autopar.graph import CapturedModel, capture
from autopar.zoo import ZOO, build
from autopar.zoo.spec import DTYPES, resolve

CAPTURED_BLOCKS = 2
"""Blocks of a built-in model's shallow copy that the planner captures (``_spec_profile``): the
first block may save what every block reads (rope tables, masks), the last is every other's
twin (``ModelProfile.from_captured`` prices a type by its last layer)."""


@lru_cache(maxsize=32)
def _spec_profile(spec: str, dtype: str, micro_batch: int, seq: int) -> ModelProfile:
    """A MODEL spec always builds the same model: its captures are kept for the process (a
    what-if loop or a test suite plans the same zoo model many times). A built-in model's
    blocks are identical, so a copy with ``CAPTURED_BLOCKS`` of them is captured and deepened
    (``ModelProfile.deepened``): GPT-3 175B's 96 blocks took 4.3 s to build and capture, two
    0.4 s (measured on this 2-core machine under load), and the plans are the same
    (``tests/autopar/planner/test_shallow_capture.py``)."""
    entry = ZOO.get(spec)
    if entry is not None and entry.config.n_layer > CAPTURED_BLOCKS and dtype in DTYPES:
        shallow = build(spec, dtype=DTYPES[dtype], blocks=CAPTURED_BLOCKS)
        deep = ModelProfile.from_captured(capture(shallow, batch=micro_batch, seq=seq)).deepened(
            entry.config.n_layer
        )
        if deep is not None:
            return deep
    return ModelProfile.from_captured(capture(resolve(spec, dtype=dtype).module, batch=micro_batch, seq=seq))


class ModelProfiles:
    """micro-batch → ``ModelProfile``, and micro-batch → the graph captured at exactly it."""

    def __init__(self, profile_at: Callable[[int], ModelProfile]) -> None:
        """``profile_at(b)``: the profile captured at micro-batch b (called for 1, 2 and the
        sizes a plan's TP table needs; each at most once)."""
        self._captured: dict[int, ModelProfile] = {}
        self._derived: dict[int, ModelProfile] = {}
        self._profile_at = profile_at

    @classmethod
    def of(cls, model: str | nn.Module, *, dtype: str, seq: int) -> ModelProfiles:
        """Profiles of a MODEL spec (captures cached per process) or of a module (captured here,
        on fake tensors: its weights are never read)."""
        if isinstance(model, str):
            return cls(lambda b: _spec_profile(model, dtype, b, seq))
        return cls(lambda b: ModelProfile.from_captured(capture(model, batch=b, seq=seq)))

    def _exactly(self, micro_batch: int) -> ModelProfile:
        if micro_batch not in self._captured:
            self._captured[micro_batch] = self._profile_at(micro_batch)
        return self._captured[micro_batch]

    def at(self, micro_batch: int) -> ModelProfile:
        """The profile at ``micro_batch``: captured at 1 and 2, derived exactly for the others."""
        if micro_batch <= 2:
            return self._exactly(micro_batch)
        if micro_batch not in self._derived:
            self._derived[micro_batch] = at_micro_batch(self._exactly(1), self._exactly(2), micro_batch)
        return self._derived[micro_batch]

    def captured(self, micro_batch: int) -> CapturedModel:
        """The graph captured at exactly ``micro_batch``."""
        cap = self._exactly(micro_batch).captured
        assert cap is not None, "profiles made by ModelProfile.from_captured keep their graph"
        return cap

    @property
    def base(self) -> ModelProfile:
        """The profile at micro-batch 1 (layer names, blocks, heads, vocabulary)."""
        return self.at(1)


__all__ = ["ModelProfiles"]
