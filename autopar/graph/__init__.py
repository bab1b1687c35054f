"""Capture: nn.Module + example input shapes → annotated fx GraphModule, grouped into layers.

    captured = autopar.capture(model, batch=1, seq=2048)
    captured.gm                 # fx.GraphModule of ATen ops, runs on the model's weights
    captured.layers             # embed, one per block, head — with FLOPs/params/saved bytes
    captured.layer_types()      # identical blocks share a type

Every node carries ``node.meta["autopar.<key>"]``: ``shape``, ``dtype``,
``fwd_flops``, ``bwd_flops``, ``param_bytes``, ``saved_bytes``, ``module``
(owning module FQN), ``layer`` (index into ``layers``) and ``layer_type``.
Works on meta-device models (nothing is allocated, even at 1T parameters).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autopar.lazy import lazy_attributes

if TYPE_CHECKING:
    from autopar.graph.captured import CapturedModel, LayerType, capture, example_inputs, priced
    from autopar.graph.layers import Layer

_MODULES = {
    "CapturedModel": "autopar.graph.captured",
    "LayerType": "autopar.graph.captured",
    "capture": "autopar.graph.captured",
    "example_inputs": "autopar.graph.captured",
    "priced": "autopar.graph.captured",
    "Layer": "autopar.graph.layers",
}
"""Each public name → its module, imported on first use (PEP 562): ``autopar.graph.dispatch``'s
names for operators are read by the cost models without importing torch."""


__getattr__ = lazy_attributes(__name__, _MODULES)


__all__ = ["CapturedModel", "Layer", "LayerType", "capture", "example_inputs", "priced"]
