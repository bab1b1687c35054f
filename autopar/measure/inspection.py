"""The ``autopar inspect`` report: per layer type, totals and closed-form cross-checks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autopar.cost_models import closed_forms
from autopar.graph import CapturedModel
from autopar.zoo.gpt import GPTConfig


@dataclass(frozen=True, kw_only=True)
class Check:
    """A captured figure next to the published closed form for it."""

    name: str
    """What is compared."""
    formula: str
    """The closed form and its source."""
    expected: float
    """Closed-form value."""
    captured: float
    """Value measured on the captured graph."""
    note: str = ""
    """Why the two may differ."""

    @property
    def rel_error(self) -> float:
        """(captured − expected) / expected."""
        return (self.captured - self.expected) / self.expected


def gpt_checks(cap: CapturedModel, cfg: GPTConfig) -> list[Check]:
    """Parameters, step FLOPs and saved bytes per layer against Narayanan/Korthikanti."""
    n_layer, h, a, V = cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.vocab_size
    s, b = cap.seq, cap.batch
    block = next(t for t in cap.layer_types().values() if t.name not in ("embed", "head"))
    return [
        Check(
            name="parameters",
            formula="12lh²(1 + 13/12h + (V+s)/12lh)  [Narayanan SC'21 Eq. 2]",
            expected=closed_forms.gpt_param_count(l=n_layer, h=h, V=V, s=cfg.block_size),
            captured=cap.total_params,
            note="+2h for the final LayerNorm",
        ),
        Check(
            name="step FLOPs",
            formula="72Bslh²(1 + s/6h + V/12lh)  [Korthikanti 2022 Eq. 7]",
            expected=closed_forms.gpt_model_flops(B=b, s=s, l=n_layer, h=h, V=V),
            captured=cap.step_flops,
        ),
        Check(
            name="saved bytes / layer",
            formula="sbh(34 + 5as/h)  [Korthikanti 2022 Eq. 1, 16-bit]",
            expected=closed_forms.layer_activation_bytes(s=s, b=b, h=h, a=a),
            captured=block.saved_bytes,
            note="Eq. 1 counts dropout masks and the s² attention scores; this model has "
            "no dropout and uses flash attention (next line)",
        ),
        Check(
            name="saved bytes / layer, flash, no dropout",
            formula="32sbh + 4asb  [Eq. 1 − dropout masks, s² terms → log-sum-exp]",
            expected=closed_forms.layer_activation_bytes_flash_no_dropout(s=s, b=b, h=h, a=a),
            captured=block.saved_bytes,
        ),
    ]


def report(cap: CapturedModel, *, model: str, dtype: str, gpt: GPTConfig | None) -> dict[str, Any]:
    """The inspect result as a JSON-ready dict."""
    types = cap.layer_types()
    checks = gpt_checks(cap, gpt) if gpt is not None else []
    return {
        "model": model,
        "batch": cap.batch,
        "seq": cap.seq,
        "dtype": dtype,
        "total_params": cap.total_params,
        "total_flops": cap.step_flops,
        "forward_flops": cap.fwd_flops,
        "saved_bytes": sum(layer.saved_bytes for layer in cap.layers),
        "num_layers": len(cap.layers),
        "nodes": len(cap.gm.graph.nodes),
        "traced_blocks": cap.traced_blocks,
        "capture_s": round(cap.capture_s, 3),
        "layer_types": [
            {
                "name": t.name,
                "count": t.count,
                "params": t.params,
                "fwd_flops": t.fwd_flops,
                "bwd_flops": t.bwd_flops,
                "saved_bytes": t.saved_bytes,
            }
            for t in types.values()
        ],
        "checks": [
            {
                "name": c.name,
                "formula": c.formula,
                "expected": c.expected,
                "captured": c.captured,
                "rel_error": c.rel_error,
                "note": c.note,
            }
            for c in checks
        ],
    }
