"""Each MoE layer's expert load over a training step, summed over the whole world.

``passes.expert_load`` counts, per layer and rank, the rows the router sends to each expert and
the rows each expert computes. ``train_step`` zeroes the counts before its micro-batches and
adds them, after its last, to the all-reduce that already averages the loss (no collective of
its own). A layer runs on the ranks of one pipeline stage; each of its tokens is seen by one
data-parallel rank, and by every TP rank of it when the experts' rows are replicated over TP:
the world's sum is r times the step's own counts, r = sum / (global batch · seq · top-k).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from autopar.passes.expert_load import CountedLayer


@dataclass(frozen=True)
class ExpertLoad:
    """One MoE layer's rows in the last step (all micro-batches, all data-parallel ranks)."""

    routed: tuple[int, ...]
    """(token, choice) pairs the router sent to each expert."""
    kept: tuple[int, ...]
    """Rows each expert computed: ``routed`` dropless; at most its capacity under one."""

    @property
    def dropped(self) -> tuple[int, ...]:
        """Rows over each expert's capacity (zero dropless)."""
        return tuple(r - k for r, k in zip(self.routed, self.kept, strict=True))

    @property
    def imbalance(self) -> float:
        """The busiest expert's rows over the mean (1 when balanced; the cost model's
        ``--expert-skew`` at ep = E)."""
        mean = sum(self.routed) / max(1, len(self.routed))
        return max(self.routed) / mean if mean else 1.0


def count_buffers(stages: list[nn.Module], counted: list[CountedLayer]) -> list[torch.Tensor | None]:
    """Each counted layer's (2, E) buffer on this rank's stages, None where another rank runs it."""
    found = {
        name.split(".")[-2]: buf for stage in stages for name, buf in stage.named_buffers() if "." in name
    }
    return [found.get(layer.counter) for layer in counted]


def zero_counts(buffers: list[torch.Tensor | None]) -> None:
    """Before a step's first micro-batch."""
    for buf in buffers:
        if buf is not None:
            buf.zero_()


def packed_counts(
    buffers: list[torch.Tensor | None], counted: list[CountedLayer], device: torch.device
) -> torch.Tensor:
    """This rank's counts as one float64 vector, layer by layer (routed E, then kept E; zeros for
    layers another rank runs): exact up to 2⁵³ rows."""
    parts = [torch.zeros(0, dtype=torch.float64, device=device)]
    for buf, layer in zip(buffers, counted, strict=True):
        mine = buf if buf is not None else torch.zeros(2, layer.experts)
        parts.append(mine.to(device=device, dtype=torch.float64).reshape(-1))
    return torch.cat(parts)


def unpack_loads(total: torch.Tensor, counted: list[CountedLayer], *, tokens: int) -> dict[str, ExpertLoad]:
    """The world's sum (``packed_counts`` all-reduced) as each layer's load in the step, divided
    by the ranks that saw each token (module doc); ``tokens``: global batch · seq."""
    loads, at = {}, 0
    values = [round(float(x)) for x in total.cpu()]
    for layer in counted:
        routed, kept = values[at : at + layer.experts], values[at + layer.experts : at + 2 * layer.experts]
        at += 2 * layer.experts
        seen, rest = divmod(sum(routed), tokens * layer.top_k)
        if seen < 1 or rest:  # not every token routed once per rank that saw it: no figure, not a wrong one
            continue
        loads[layer.path] = ExpertLoad(
            routed=tuple(x // seen for x in routed), kept=tuple(x // seen for x in kept)
        )
    return loads


def overflow_warning(loads: dict[str, ExpertLoad]) -> str | None:
    """One line naming the experts that dropped rows over their capacity, per layer (at most
    three layers named); None when nothing was dropped."""
    full = {path: load for path, load in loads.items() if any(load.dropped)}
    if not full:
        return None
    parts = []
    for path, load in list(full.items())[:3]:
        over = [
            f"{e} ({d} of {r})" for e, (d, r) in enumerate(zip(load.dropped, load.routed, strict=True)) if d
        ]
        parts.append(f"{path}: experts {', '.join(over)}")
    more = f" and {len(full) - 3} more layers" if len(full) > 3 else ""
    dropped = sum(sum(load.dropped) for load in full.values())
    routed = sum(sum(load.routed) for load in loads.values())
    return (
        f"{dropped} of {routed} routed rows were dropped over expert capacity this step — "
        f"{'; '.join(parts)}{more}; "
        "raise the model's capacity factor or strengthen its load-balancing loss"
    )


__all__ = ["ExpertLoad", "count_buffers", "overflow_warning", "packed_counts", "unpack_loads", "zero_counts"]
