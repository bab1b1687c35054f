"""Routed experts as grouped matmuls: ``autopar::grouped_mm`` and the experts module that uses it.

A mixture-of-experts layer sorts its token rows by expert and multiplies each expert's rows by
that expert's weights: ``grouped_mm(rows, weight, offs)`` with ``weight`` stacked (E, K, N) and
``offs`` the cumulative rows per expert, (E,) int32 — the contract of ``torch._grouped_mm``
(torchtitan's and Hugging Face's experts). ``torch._grouped_mm`` itself has no float32 meta
kernel and no float64 kernel, so the zoo runs its own operator: one matmul per expert on any
device and dtype, a shape-only fake for capture on meta, and its own backward. The capture
records it as one node, which ``graph.experts`` recognises like ``aten._grouped_mm``: its
FLOPs are counted (2·rows·K·N) and expert parallelism moves its rows. Rows past ``offs[-1]``
(none in a dropless layer) give zeros.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@torch.library.custom_op("autopar::grouped_mm", mutates_args=())
def grouped_mm(rows: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """(R, K) rows sorted by expert × (E, K, N) weights → (R, N): rows offs[e-1]:offs[e] by weight[e]."""
    out = rows.new_zeros(rows.shape[0], weight.shape[-1])
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = rows[start:end] @ weight[e]
        start = end
    return out


@grouped_mm.register_fake
def _grouped_mm_fake(rows: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return rows.new_empty(rows.shape[0], weight.shape[-1])


@torch.library.custom_op("autopar::grouped_mm_weight_grad", mutates_args=())
def grouped_mm_weight_grad(rows: torch.Tensor, grad: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The weights' gradient of ``grouped_mm``: (E, K, N), expert e's rowsᵀ · grad over its rows."""
    out = rows.new_zeros(offs.shape[0], rows.shape[1], grad.shape[1])
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            out[e] = rows[start:end].t() @ grad[start:end]
        start = end
    return out


@grouped_mm_weight_grad.register_fake
def _weight_grad_fake(rows: torch.Tensor, grad: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return rows.new_empty(offs.shape[0], rows.shape[1], grad.shape[1])


def _setup(ctx: Any, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    rows, weight, offs = ctx.saved_tensors
    grad = grad.contiguous()
    wt = weight.transpose(-2, -1).contiguous()
    d_rows = grouped_mm(grad, wt, offs) if ctx.needs_input_grad[0] else None
    d_weight = grouped_mm_weight_grad(rows, grad, offs) if ctx.needs_input_grad[1] else None
    return d_rows, d_weight, None


grouped_mm.register_autograd(_backward, setup_context=_setup)


class GroupedExperts(nn.Module):
    """E SwiGLU experts with stacked weights (torchtitan's layout): w1, w3 (E, dim, ffn), w2 (E, ffn, dim)."""

    def __init__(self, n_experts: int, dim: int, ffn_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, dim, ffn_dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, dim, ffn_dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, ffn_dim, dim))
        for w in (self.w1, self.w3, self.w2):
            if not w.is_meta:  # N(0, 0.02), as the zoo's linear layers
                nn.init.normal_(w, mean=0.0, std=0.02)

    def forward(self, rows: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        h = F.silu(grouped_mm(rows, self.w1, offs)) * grouped_mm(rows, self.w3, offs)
        return grouped_mm(h, self.w2, offs)


def route(
    xs: torch.Tensor, chosen: torch.Tensor, n_experts: int, capacity_factor: float | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The experts' input rows, their ``offs``, and for each (token, choice) the row its output
    is read from (row ``len(rows)`` reads zero: a token dropped over capacity).

    Dropless (``capacity_factor`` None): every (token, choice) gets a row, sorted by expert, so
    the layer computes exactly what a per-token loop over its experts would. With a capacity
    (GShard, Lepikhin et al. 2020; Switch, Fedus et al. 2021): C = ceil(k·S/E · factor) rows per
    expert, filled in token order; later tokens of a full expert are dropped."""
    S, k = chosen.shape
    E = n_experts
    flat = chosen.reshape(-1)  # (S·k,) expert of each (token, choice)
    token = torch.arange(S, device=xs.device).repeat_interleave(k)
    onehot = F.one_hot(flat, E)  # (S·k, E)
    if capacity_factor is None:
        order = torch.argsort(flat, stable=True)
        offs = onehot.sum(0).cumsum(0).to(torch.int32)
        where = torch.empty_like(order).index_copy(0, order, torch.arange(S * k, device=xs.device))
        return xs[token[order]], offs, where
    C = math.ceil(k * S / E * capacity_factor)
    rank = ((onehot.cumsum(0) - 1) * onehot).sum(-1)  # position within its expert
    where = torch.where(rank < C, flat * C + rank, torch.full_like(flat, E * C))
    rows = xs.new_zeros(E * C + 1, xs.shape[1]).index_add(0, where, xs[token])[: E * C]
    offs = (torch.arange(1, E + 1, device=xs.device) * C).to(torch.int32)
    return rows, offs, where


def routed(
    experts: GroupedExperts,
    xs: torch.Tensor,
    weights: torch.Tensor,
    chosen: torch.Tensor,
    capacity_factor: float | None,
) -> torch.Tensor:
    """(S, H) tokens through their k ``chosen`` experts (S, k), summed by their ``weights``."""
    S, k = chosen.shape
    rows, offs, where = route(xs, chosen, experts.w1.shape[0], capacity_factor)
    out = torch.cat([experts(rows, offs), xs.new_zeros(1, xs.shape[1])])  # the last row: dropped
    return (out[where] * weights.reshape(-1, 1)).view(S, k, -1).sum(1)


__all__ = ["GroupedExperts", "grouped_mm", "grouped_mm_weight_grad", "route", "routed"]
