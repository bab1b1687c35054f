"""Capture itself (``autopar.graph.capture``): the model exported, annotated and grouped into
layers; see the package's doc."""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from autopar.errors import AutoparError, CaptureError
from autopar.graph.annotate import annotate_costs
from autopar.graph.attention import kv_width
from autopar.graph.layers import Layer, find_layer_container, group_layers
from autopar.graph.objective import objective_of, without_cache
from autopar.graph.trace import (
    CONSTANT_PREFIX,
    MIN_BLOCKS_TO_DEDUPE,
    NotPeriodic,
    _ConstantHolder,
    expand_repeated,
    export_graph,
    find_repeated_blocks,
    quiet_export_logs,
    truncated,
)

TRACED_BLOCKS = 3
"""Blocks traced when a model's blocks are identical (the rest are spliced copies)."""


@dataclass(frozen=True, kw_only=True)
class LayerType:
    """Identical layers, summarised once."""

    name: str
    """Type name (``embed``, ``head``, or the block class, e.g. ``Block``)."""
    count: int
    """How many layers have this type."""
    layers: tuple[str, ...]
    """Their names, in order."""
    params: int
    """Parameters of one layer."""
    fwd_flops: int
    """Forward FLOPs of one layer."""
    bwd_flops: int
    """Backward FLOPs of one layer."""
    saved_bytes: int
    """Activation bytes one layer saves for backward."""


@dataclass(frozen=True, kw_only=True)
class CapturedModel:
    """The result of ``capture``: an annotated graph and its layers."""

    gm: fx.GraphModule
    """ATen-level graph; parameters are get_attr nodes naming the model's FQNs."""
    layers: tuple[Layer, ...]
    """embed, blocks in order, head."""
    batch: int
    """Batch size of the example inputs."""
    seq: int
    """Sequence length of the example inputs."""
    total_params: int
    """Unique parameters of the model (tied weights once)."""
    traced_blocks: int
    """Blocks traced op by op; the others were spliced copies of an identical block."""
    hidden_size: int | None = None
    """Width of the residual stream (last dim of what the first block reads), if found."""
    attention_heads: int | None = None
    """Query heads of the first attention op, if the model has one."""
    kv_width: int | None = None
    """Key/value heads × head dim the first attention reads before a grouped-query repeat
    (``graph.attention.kv_width``), if the model has one."""
    capture_s: float = field(default=0.0, compare=False)
    """Wall time of the capture in seconds."""

    @property
    def fwd_flops(self) -> int:
        """Forward FLOPs of one step (sum over layers)."""
        return sum(layer.fwd_flops for layer in self.layers)

    @property
    def step_flops(self) -> int:
        """Model FLOPs of one training step: forward + backward, no recomputation."""
        return sum(layer.fwd_flops + layer.bwd_flops for layer in self.layers)

    def layer_types(self) -> dict[str, LayerType]:
        """Layer types in order of first appearance."""
        groups: dict[str, list[Layer]] = {}
        for layer in self.layers:
            groups.setdefault(layer.type, []).append(layer)
        out = {}
        for name, members in groups.items():
            first = members[0]
            for other in members[1:]:
                assert (other.fwd_flops, other.params) == (first.fwd_flops, first.params), name
            out[name] = LayerType(
                name=name,
                count=len(members),
                layers=tuple(m.name for m in members),
                params=first.params,
                fwd_flops=first.fwd_flops,
                bwd_flops=first.bwd_flops,
                saved_bytes=first.saved_bytes,
            )
        return out


def example_inputs(model: nn.Module, batch: int, seq: int) -> tuple[tuple[torch.Tensor, ...], dict[str, Any]]:
    """Token ids (batch, seq) on the model's device as the model reads them (with its targets where
    it computes its own loss: ``objective.objective_of``); ``use_cache=False`` where accepted."""
    objective = without_cache(model, objective_of(model))
    if batch < 1 or seq < 1:
        raise AutoparError(f"batch and seq must be positive, got batch={batch}, seq={seq}")
    if seq < 2 and objective.shifted:
        raise AutoparError(f"a model that takes {objective.target}= reads seq − 1 tokens: seq must be ≥ 2")
    device = next(iter(model.parameters()), torch.empty(0)).device
    return objective.inputs(torch.zeros(batch, seq, dtype=torch.long, device=device))


def capture(
    model: nn.Module,
    *,
    batch: int = 1,
    seq: int = 1024,
    args: tuple[Any, ...] | None = None,
    kwargs: Mapping[str, Any] | None = None,
) -> CapturedModel:
    """Capture ``model`` into an annotated graph for inputs of shape (batch, seq).

    ``args``/``kwargs`` replace the default token-id input for models that take
    something else (their shapes are used; ``batch``/``seq`` then only label).
    Raises ``CaptureError`` naming the module and line when tracing fails.
    """
    start = time.perf_counter()
    if next(model.parameters(), None) is None:
        raise CaptureError(
            f"{type(model).__name__} has no parameters: there is nothing to train or parallelize "
            "(is the model empty?)"
        )
    if args is None:
        args, default_kwargs = example_inputs(model, batch, seq)
        kwargs = {**default_kwargs, **(kwargs or {})}
    kwargs = dict(kwargs or {})
    gm: fx.GraphModule | None = None
    rb = find_repeated_blocks(model)
    if rb is not None and rb.count >= MIN_BLOCKS_TO_DEDUPE:
        try:
            with truncated(rb, TRACED_BLOCKS):
                small = export_graph(model, args, kwargs)
            priced(small)
            constants = {
                str(n.target): getattr(small, str(n.target))
                for n in small.graph.nodes
                if n.op == "get_attr" and str(n.target).startswith(CONSTANT_PREFIX)
            }
            gm = expand_repeated(small, rb, _ConstantHolder(model, constants))
        except (NotPeriodic, CaptureError):
            gm = None  # trace the whole model: it reports its own error if it fails too
    spliced = gm is not None
    if gm is None:
        gm = priced(export_graph(model, args, kwargs))
    layers = group_layers(gm, rb.fqn if rb is not None else find_layer_container(model))
    blocks = sum(1 for layer in layers if layer.name not in ("embed", "head"))
    return CapturedModel(
        hidden_size=_hidden_size(gm),
        attention_heads=_attention_heads(gm, seq),
        kv_width=kv_width(gm),
        gm=gm,
        layers=layers,
        batch=batch,
        seq=seq,
        total_params=sum(p.numel() for p in model.parameters()),
        traced_blocks=TRACED_BLOCKS if spliced else blocks,
        capture_s=time.perf_counter() - start,
    )


def priced(gm: fx.GraphModule) -> fx.GraphModule:
    """``annotate_costs(gm)``; an operator that fails on the fake CPU tensors it runs on is one
    ``CaptureError`` line naming the node, not a traceback."""
    try:
        with quiet_export_logs():
            return annotate_costs(gm)
    except Exception as e:
        text = str(e).strip()
        node = re.search(r"While executing (%\S+)", text)
        first = (text.splitlines() or [type(e).__name__])[0]
        raise CaptureError(
            f"the model traced, but pricing its graph failed at {node.group(1) if node else 'a node'}: "
            f"{first} (an operator the CPU's fake kernels refuse for these inputs)"
        ) from e


def _hidden_size(gm: fx.GraphModule) -> int | None:
    """Last dim of the residual stream: the first tensor layer 1 reads from layer 0 (the
    embeddings) shaped like one layer 1 hands on (a mask or position table the first block
    also reads is not the stream); else the first one it reads with ≥ 2 dims."""

    def handed(src: int, dst: int) -> list[fx.Node]:
        return [
            n
            for n in gm.graph.nodes
            if n.meta.get("autopar.layer") == src
            and n.op == "call_function"
            and len(n.meta.get("autopar.shape", ())) >= 2
            and any(u.meta.get("autopar.layer") == dst for u in n.users)
        ]

    into = handed(0, 1)
    onward = {tuple(n.meta["autopar.shape"]) for n in handed(1, 2)}
    stream = [n for n in into if tuple(n.meta["autopar.shape"]) in onward] or into
    return int(stream[0].meta["autopar.shape"][-1]) if stream else None


def _attention_heads(gm: fx.GraphModule, seq: int) -> int | None:
    """Heads of the first attention: the query of an SDPA op (b, heads, s, d), or else the first
    explicit score tensor (b, heads, s, s) (a mask broadcast over heads, (b, 1, s, s), is not one)."""
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    for n in nodes:
        if "scaled_dot_product" in str(n.target) and isinstance(n.args[0], fx.Node):
            q: tuple[int, ...] = tuple(n.args[0].meta.get("autopar.shape", ()))
            return q[1] if len(q) == 4 else None
    for n in nodes:
        shape: tuple[int, ...] = tuple(n.meta.get("autopar.shape", ()))
        if len(shape) == 4 and shape[-2:] == (seq, seq) and shape[1] > 1:
            return shape[1]
    return None


__all__ = ["CaptureError", "CapturedModel", "Layer", "LayerType", "capture", "example_inputs"]
