"""A model's cost profiles at every micro-batch size, from two captures.

``ModelProfiles.of(model, dtype=, seq=)`` captures the model on fake tensors at micro-batch 1
and 2 and extends them exactly to any other size (``cost_models.micro_batch.at_micro_batch``:
every quantity is affine in the micro-batch). ``captured(b)`` is the graph captured at exactly
b, for the per-operator TP table of the final plan (shape constants in the graph depend on b).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from autopar import cache
from autopar.cost_models.micro_batch import at_micro_batch
from autopar.cost_models.profile import ModelProfile

if TYPE_CHECKING:
    from torch import nn

    from autopar.graph import CapturedModel

CAPTURED_BLOCKS = 2
"""Blocks of a built-in model's shallow copy that the planner captures (``_spec_profile``): the
first block may save what every block reads (rope tables, masks), the last is every other's
twin (``ModelProfile.from_captured`` prices a type by its last layer)."""


@lru_cache(maxsize=32)
def _captured_profile(spec: str, dtype: str, micro_batch: int, seq: int) -> ModelProfile:
    """A MODEL spec always builds the same model: its captures are kept for the process (a
    what-if loop or a test suite plans the same zoo model many times), and their profiles on
    disk (``autopar.cache``). A built-in model's
    blocks are identical, so a copy with ``CAPTURED_BLOCKS`` of them is captured and deepened
    (``ModelProfile.deepened``): GPT-3 175B's 96 blocks took 4.3 s to build and capture, two
    0.4 s (measured on this 2-core machine under load), and the plans are the same
    (``tests/autopar/planner/test_shallow_capture.py``)."""
    from autopar.graph import capture
    from autopar.zoo import ZOO, build
    from autopar.zoo.configs import block_runs
    from autopar.zoo.spec import DTYPES, resolve

    entry = ZOO.get(spec)
    profile = None
    runs = block_runs(entry.config) if entry is not None else ()
    if any(n > CAPTURED_BLOCKS for n in runs) and dtype in DTYPES:  # each run of alike blocks as 2
        shallow = build(spec, dtype=DTYPES[dtype], runs=tuple(min(n, CAPTURED_BLOCKS) for n in runs))
        profile = ModelProfile.from_captured(capture(shallow, batch=micro_batch, seq=seq)).deepened(runs)
    if profile is None:
        module = resolve(spec, dtype=dtype).module
        copied = shallow_copy(module)  # a Hugging Face model: as a 2-block copy too
        if copied is not None:
            small, n = copied
            profile = ModelProfile.from_captured(capture(small, batch=micro_batch, seq=seq)).deepened(n)
        if profile is None:
            profile = ModelProfile.from_captured(capture(module, batch=micro_batch, seq=seq))
    key = spec_key(spec, dtype, seq)
    if key is not None:
        cache.store("profile", {**key, "micro_batch": micro_batch}, profile.to_dict())
    return profile


def shallow_copy(module: nn.Module) -> tuple[nn.Module, int] | None:
    """A Hugging Face-style model (a ``config`` with ``num_hidden_layers``) rebuilt on meta with
    ``CAPTURED_BLOCKS`` blocks, and its own block count; None where its blocks are not all alike
    (one class, one parameter count: DeepSeek-V3's first dense layers are not) or the config
    does not rebuild it so. Per-layer config lists (``layer_types``) are cut to the copy's."""
    import copy

    import torch
    from torch import nn

    config: Any = getattr(module, "config", None)
    n = getattr(config, "num_hidden_layers", None)
    if not isinstance(n, int) or n <= CAPTURED_BLOCKS:
        return None
    small = copy.deepcopy(config)
    small.num_hidden_layers = CAPTURED_BLOCKS
    for key, value in vars(small).items():
        if isinstance(value, list) and len(value) == n:
            setattr(small, key, value[:CAPTURED_BLOCKS])
    try:
        with torch.device("meta"):
            copied = type(module)(small).to(next(module.parameters()).dtype)
    except (TypeError, ValueError, AttributeError, KeyError):  # a config that rebuilds otherwise
        return None

    def blocks(m: nn.Module, count: int) -> list[nn.Module]:
        lists = [x for x in m.modules() if isinstance(x, nn.ModuleList) and len(x) == count]
        return list(lists[0]) if lists else []

    few = blocks(copied, CAPTURED_BLOCKS)
    kinds = {(type(b), sum(p.numel() for p in b.parameters())) for b in blocks(module, n) + few}
    return (copied, n) if few and len(kinds) == 1 else None


def _spec_profile(spec: str, dtype: str, micro_batch: int, seq: int) -> ModelProfile:
    """The profile of a MODEL spec: from the disk cache where a capture of the same code left it
    (no graph: ``ModelProfiles.captured`` captures again if a graph is asked for), else
    captured."""
    key = spec_key(spec, dtype, seq)
    hit = cache.load("profile", {**key, "micro_batch": micro_batch}) if key is not None else None
    if hit is not None:
        return ModelProfile.from_dict(hit)
    return _captured_profile(spec, dtype, micro_batch, seq)


def spec_key(spec: str, dtype: str, seq: int) -> dict[str, Any] | None:
    """What names a MODEL spec's captures in the disk cache: a built-in model's name (a file or
    module the user may edit is captured every time), None otherwise."""
    from autopar.zoo.registry import ZOO

    if spec not in ZOO:
        return None
    return {"model": spec, "dtype": dtype, "seq": seq, "blocks": CAPTURED_BLOCKS}


class ModelProfiles:
    """micro-batch → ``ModelProfile``, and micro-batch → the graph captured at exactly it."""

    def __init__(
        self,
        profile_at: Callable[[int], ModelProfile],
        *,
        capture_at: Callable[[int], ModelProfile] | None = None,
        key: dict[str, Any] | None = None,
    ) -> None:
        """``profile_at(b)``: the profile at micro-batch b (called for 1, 2 and the sizes a
        plan's TP table needs; each at most once); ``capture_at(b)``: one with its graph, where
        ``profile_at``'s came from the disk cache without it; ``key``: what names this model's
        captures in the disk cache (``spec_key``), None for a module (never cached)."""
        self._captured: dict[int, ModelProfile] = {}
        self._derived: dict[float, ModelProfile] = {}
        self._profile_at = profile_at
        self._capture_at = capture_at or profile_at
        self.key = key

    @classmethod
    def of(cls, model: str | nn.Module, *, dtype: str, seq: int) -> ModelProfiles:
        """Profiles of a MODEL spec (captures cached per process) or of a module (captured here,
        on fake tensors: its weights are never read)."""
        if isinstance(model, str):
            return cls(
                lambda b: _spec_profile(model, dtype, b, seq),
                capture_at=lambda b: _captured_profile(model, dtype, b, seq),
                key=spec_key(model, dtype, seq),
            )
        from autopar.graph import capture

        return cls(lambda b: ModelProfile.from_captured(capture(model, batch=b, seq=seq)))

    def _exactly(self, micro_batch: int) -> ModelProfile:
        if micro_batch not in self._captured:
            self._captured[micro_batch] = self._profile_at(micro_batch)
        return self._captured[micro_batch]

    def at(self, micro_batch: float) -> ModelProfile:
        """The profile at ``micro_batch``: captured at 1 and 2, derived exactly for the others
        (a fraction too: a context-parallel rank's share, ``Strategy.rank_sequences``)."""
        if micro_batch in (1, 2):
            return self._exactly(int(micro_batch))
        if micro_batch not in self._derived:
            self._derived[micro_batch] = at_micro_batch(self._exactly(1), self._exactly(2), micro_batch)
        return self._derived[micro_batch]

    def captured(self, micro_batch: int) -> CapturedModel:
        """The graph captured at exactly ``micro_batch`` (captured now where the profile came
        from the disk cache)."""
        cap = self._exactly(micro_batch).captured or self._capture_at(micro_batch).captured
        assert cap is not None, "profiles made by ModelProfile.from_captured keep their graph"
        return cap

    @property
    def base(self) -> ModelProfile:
        """The profile at micro-batch 1 (layer names, blocks, heads, vocabulary)."""
        return self.at(1)


__all__ = ["CAPTURED_BLOCKS", "ModelProfiles", "shallow_copy", "spec_key"]
